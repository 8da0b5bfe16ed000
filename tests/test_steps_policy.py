"""The steps-window policy (sidecar/control/steps.py) on its own: fed counter reads and the clock,
no server. Hand-made edge sequences (no traffic, a stalled stage, late and failed reads, a counter
that resets, a window too long) and the reads recorded on the real servers (tests/data/steps/,
written by the live and omni groups' windows with OMNI_SIDECAR_STEPS_RECORD_DIR) replayed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar.control.notes import note, word
from sidecar.control.steps import Bound, EndedBy, Read, StepsWindow
from sidecar.control.window import load_recorded

RECORDED = sorted((Path(__file__).parent / "data" / "steps").glob("*.json"))
S0, S1 = (("stage", "0"),), (("stage", "1"),)
ENGINE = (("engine", "0"),)  # plain vLLM's one engine: no stage label


def _window(bound: Bound = Bound.server_cap, *, steps: int = 10, stages: tuple[int, ...] = (0, 1),
            ends: dict[int, int] | None = None, base: dict[Any, int] | None = None, stall_s: float = 5.0,
            max_s: float = 600.0) -> StepsWindow:
    ends = ends if ends is not None else {s: steps + 2 for s in stages} if bound is Bound.server_cap else None
    return StepsWindow(steps, list(stages), bound=bound, ends=ends,
                       base=Read(-0.1, base if base is not None else {S0: 100, S1: 50}),
                       answered_at=0.0, stall_s=stall_s, max_s=max_s)


def _feed(window: StepsWindow, reads: list[tuple[float, dict[Any, int] | None]]) -> list[Any]:
    out = []
    for at, counts in reads:
        d = window.feed(Read(at, counts))
        out.append(d)
        if d.stop:
            break
    return out


def test_a_capped_window_stops_once_every_stage_counted_its_end_and_the_margin_past_its_head() -> None:
    w = _window(steps=10)  # each stage's server ends its window after 12 iterations
    reads = [(0.1, {S0: 103, S1: 51})] + [(0.1 * i, {S0: 103 + i, S1: 51 + i}) for i in range(2, 40)]
    decisions = _feed(w, reads)
    last = decisions[-1]
    # heads at the start's answer: 3 and 1; each must reach head + 12 + 2
    assert (last.ended_by, dict(last.heads), dict(last.per_stage)) == (
        EndedBy.server, {"0": 3, "1": 1}, {"0": 17, "1": 15}), last
    assert not any(d.stop for d in decisions[:-1])


def test_a_capped_window_goes_on_without_a_stage_that_stands_still_once_it_stood_still_stall_s() -> None:
    w = _window(steps=10, stall_s=2.0)
    reads = [(0.1 * i, {S0: 100 + i, S1: 50}) for i in range(1, 60)]  # stage 1 never moves
    last = _feed(w, reads)[-1]
    assert (last.ended_by, last.behind, last.per_stage["1"]) == (EndedBy.stage_stalled, ("1",), 0), last
    assert last.still_s >= 2.0


def test_a_window_on_an_idle_server_ends_by_itself_after_stall_s() -> None:
    for bound in (Bound.server_cap, Bound.count):
        w = _window(bound, stall_s=3.0)
        decisions = _feed(w, [(0.5 * i, {S0: 100, S1: 50}) for i in range(1, 20)])
        last = decisions[-1]
        assert (last.stop, last.ended_by, last.counted) == (True, EndedBy.stalled, 0), (bound, last)
        assert last.still_s == pytest.approx(3.0), last
        assert len(decisions) == 6  # at 3.0 s, not before


def test_a_window_whose_counter_stops_moving_midway_ends_stall_s_after_its_last_move() -> None:
    w = _window(Bound.count, steps=100, stall_s=2.0)
    reads = [(0.1 * i, {S0: 100 + i, S1: 50 + i}) for i in range(1, 11)]
    reads += [(1.0 + 0.25 * i, {S0: 110, S1: 60}) for i in range(1, 20)]
    last = _feed(w, reads)[-1]
    assert (last.ended_by, last.counted, last.still_s) == (EndedBy.stalled, 10, pytest.approx(2.0)), last


def test_reads_that_fail_or_never_come_back_end_the_window_as_unreadable() -> None:
    w = _window(Bound.count, steps=100, stall_s=2.0)
    decisions = _feed(w, [(0.1, {S0: 101, S1: 51})] + [(0.1 + 0.5 * i, None) for i in range(1, 10)])
    assert (decisions[-1].ended_by, decisions[-1].counted) == (EndedBy.unreadable, 1), decisions[-1]
    # no read at all came back: the clock alone decides (window.count_window feeds check(now))
    silent = _window(Bound.count, steps=100, stall_s=2.0)
    assert not silent.check(1.9).stop and silent.check(2.0).ended_by is EndedBy.unreadable


def test_a_late_read_older_than_the_last_one_changes_nothing() -> None:
    w = _window(Bound.count, steps=5)
    _feed(w, [(0.2, {S0: 103, S1: 50})])
    stale = w.feed(Read(0.1, {S0: 999, S1: 999}))  # counted before the read already taken
    assert (stale.stop, stale.counted) == (False, 3), stale
    assert w.feed(Read(0.3, {S0: 105, S1: 50})).ended_by is EndedBy.steps


def test_a_counter_that_goes_back_ends_the_window_the_server_restarted() -> None:
    w = _window(Bound.count, steps=50)
    last = _feed(w, [(0.1, {S0: 110, S1: 55}), (0.2, {S0: 3, S1: 1})])[-1]
    assert (last.ended_by, last.counted) == (EndedBy.counter_reset, 10), last


def test_a_window_ends_at_its_longest_whatever_its_counter_does() -> None:
    w = _window(Bound.count, steps=10_000, max_s=5.0, stall_s=100.0)
    last = _feed(w, [(0.5 * i, {S0: 100 + i, S1: 50 + i}) for i in range(1, 30)])[-1]
    assert (last.ended_by, last.counted) == (EndedBy.time_bound, 10), last


def test_a_counted_window_stops_at_its_count_on_the_most_advanced_stage() -> None:
    w = _window(Bound.count, steps=5)
    last = _feed(w, [(0.1 * i, {S0: 100 + 2 * i, S1: 50 + i}) for i in range(1, 10)])[-1]
    assert (last.ended_by, dict(last.per_stage)) == (EndedBy.steps, {"0": 6, "1": 3}), last


def test_plain_vllms_one_engine_and_stages_outside_the_window() -> None:
    # plain vLLM's counter has no stage label: its one engine is the window's; a stage not in the
    # window never holds it open
    w = _window(Bound.server_cap, steps=3, stages=(0,), ends={0: 5}, base={ENGINE: 7})
    last = _feed(w, [(0.1 * i, {ENGINE: 7 + i, S1: 0}) for i in range(1, 20)])[-1]
    assert (last.ended_by, dict(last.per_stage)) == (EndedBy.server, {"": 8}), last  # head 1 + 5 + 2


def test_a_failed_base_read_takes_the_first_good_read_as_the_base() -> None:
    w = StepsWindow(3, [0], bound=Bound.count, base=Read(-0.1, None), answered_at=0.0, stall_s=5.0, max_s=60.0)
    last = _feed(w, [(0.1, {S0: 40}), (0.2, {S0: 41}), (0.3, {S0: 43})])[-1]
    assert (last.ended_by, last.counted) == (EndedBy.steps, 3), last


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_a_window_recorded_on_a_real_server_ends_as_it_did_there(path: Path) -> None:
    rec = load_recorded(path)
    w = StepsWindow(rec["steps"], rec["stages"], bound=Bound(rec["bound"]),
                    ends={int(s): n for s, n in rec["ends"].items()} if rec["bound"] == "server_cap" else None,
                    base=rec["reads"][0], answered_at=0.0, stall_s=rec["stall_s"], max_s=rec["max_s"],
                    margin=rec["margin"])
    decisions = [w.feed(r) for r in rec["reads"][1:]]
    assert decisions and decisions[-1].stop and not any(d.stop for d in decisions[:-1]), (path.name, decisions[-3:])
    last = decisions[-1]
    assert (last.ended_by.value, last.counted, dict(last.per_stage)) == (
        rec["ended_by"], rec["counted"], rec["per_stage"]), path.name
    if last.ended_by is EndedBy.server:  # every stage past its own end and the margin, from its head
        assert all(n >= last.heads[s] + max(rec["steps"], rec["ends"].get(s, 0)) + rec["margin"]
                   for s, n in last.per_stage.items()), last
    if last.ended_by is EndedBy.steps:
        assert last.counted >= rec["steps"]


def test_recorded_windows_cover_both_servers_and_both_bounds() -> None:
    kinds = {(("stage" if any(k for k in r["per_stage"] if k) else "engine"), r["bound"])
             for r in map(load_recorded, RECORDED)}
    assert {("engine", "server_cap"), ("stage", "server_cap"), ("engine", "count")} <= kinds, kinds


def test_a_counted_windows_note_says_when_its_reads_were_slow() -> None:
    # the real two-stage server beside another server's start: reads up to 4.7 s apart, 931 counted of 20
    figures = dict(ended_by="steps", steps_asked=20, bound="count", per_stage={}, heads={}, behind=[], still_s=0.0,
                   ends={}, margin=2, max_s=600.0, start_s=0.04)
    slow = word(note("steps_ended", **figures, counted=931, read_gap_s=4.72))
    assert "answered slowly (up to 4.7s between two reads" in slow, slow
    # reads as they come alone (13 ms), or a count that did not run past: no such sentence
    for counted, gap in ((21, 0.06), (20, 4.72)):
        assert "slowly" not in word(note("steps_ended", **figures, counted=counted, read_gap_s=gap))
