"""Fleet at scale over stub replicas (tests/fixtures/stubs.py): a few hundred targets with 5%
faults, cancellation mid-start and mid-window, and the one-screen roll-up. No time assertions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sidecar.errors import FleetError
from sidecar.fleet import Fleet, Target, TargetOutcome
from tests.fixtures.stubs import StubFleet

N = 300
FAULTS = 15  # 5%


def _faults(kind: str) -> dict[int, str]:
    return {i: kind for i in range(7, N, N // FAULTS)}


def _targets(stubs: StubFleet) -> list[Target]:
    return [Target.sidecar(u) for u in stubs.urls]


def _fleet(stubs: StubFleet, **kw) -> Fleet:
    return Fleet(_targets(stubs), stop_budget_s=3, client_timeout_s=60, poll_s=0.05, **kw)


def _started_never_stopped(stubs: StubFleet) -> list[int]:
    return [i for i, r in stubs.log().items() if r["recording"] and not r["dead"]]


async def test_five_percent_refusing_start_rolls_back_every_started_target(tmp_path: Path):
    with StubFleet(N, mode="sidecar", root=tmp_path, faults=_faults("refuse_start")) as stubs:
        async with _fleet(stubs) as fleet:
            with pytest.raises(FleetError) as info:
                await fleet.start()
        outcomes = [t["outcome"] for t in info.value.details["targets"]]
        assert outcomes.count("start_failed") == FAULTS and outcomes.count("rolled_back") == N - FAULTS
        assert _started_never_stopped(stubs) == []


async def test_hung_and_dead_targets_do_not_hold_the_others_stop(tmp_path: Path):
    faults = {**_faults("hang_stop"), **{i + 1: "die_after_start" for i in _faults("hang_stop")}}
    with StubFleet(N, mode="sidecar", root=tmp_path, faults=faults) as stubs:
        async with _fleet(stubs) as fleet:
            fc = await fleet.start()
            fc = await fleet.stop(fc)
        by_outcome: dict[str, set[int]] = {}
        for i, r in enumerate(fc.targets.values()):
            by_outcome.setdefault(r.outcome.value, set()).add(i)
        hung = {i for i, f in faults.items() if f == "hang_stop"}
        dead = {i for i, f in faults.items() if f == "die_after_start"}
        assert by_outcome["stop_timeout"] == hung and by_outcome["stop_failed"] == dead
        assert len(by_outcome["stopped"]) == N - len(faults)
        assert all(r.ok for r in fc.targets.values() if r.outcome is TargetOutcome.stopped)
        assert _started_never_stopped(stubs) == sorted(hung)  # still stopping: their own budget ran out


def test_the_rollup_counts_instead_of_listing(tmp_path: Path):
    with StubFleet(N, mode="sidecar", root=tmp_path, faults=_faults("hang_stop")) as stubs:
        async def run():
            async with _fleet(stubs) as fleet:
                return await fleet.stop(await fleet.start())

        roll = asyncio.run(run()).rollup(slowest=3, failures=5)
    assert roll["outcomes"] == {"stop_timeout": FAULTS, "stopped": N - FAULTS}
    assert roll["verdicts"] == {"stage 0: ok": N - FAULTS}
    assert roll["failures_total"] == FAULTS and len(roll["failures"]) == 5
    assert all(f["reason"].startswith("stop_timeout") for f in roll["failures"])
    assert len(roll["slowest_stop"]) == 3


@pytest.mark.parametrize("when", ["mid_start", "mid_window"])
async def test_a_cancelled_capture_stops_every_started_target(tmp_path: Path, when: str):
    latency = 1.5 if when == "mid_start" else 0.0
    with StubFleet(40, mode="sidecar", root=tmp_path, latency=latency) as stubs:
        async with _fleet(stubs) as fleet:
            task = asyncio.ensure_future(fleet.capture(3600))
            path = "/v1/captures"
            for _ in range(600):  # until every stub received its start (and, mid-window, answered it)
                await asyncio.sleep(0.05)
                got = await asyncio.to_thread(stubs.received, path)
                if all(got.values()) and (when == "mid_start" or all(r["recording"] for r in stubs.log().values())):
                    break
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        log = stubs.log()
        assert all(r["calls"] for r in log.values())
        assert [i for i, r in log.items() if r["recording"]] == []


def test_the_cli_prints_one_rollup_table_for_a_large_fleet(tmp_path: Path):
    from typer.testing import CliRunner

    from sidecar.cli import app

    with StubFleet(40, mode="sidecar", root=tmp_path, faults={3: "hang_stop"}) as stubs:
        targets = ",".join(stubs.urls)
        out = CliRunner().invoke(app, ["fleet", "capture", "--targets", targets, "--duration", "0.2",
                                       "--state-dir", str(tmp_path / "st"), "--kind", "torch", "--stop-budget", "2"])
    assert out.exit_code == 1, out.output
    assert "39 of 40 ok" in out.output and "outcome stop_timeout" in out.output.replace("│", " ").replace("  ", " ")
    assert out.output.count("127.0.0.1") < 20  # counts and the worst few, not a row per target
