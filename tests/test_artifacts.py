"""Artifact finder/checker on real folders: session-folder naming (both kinds, exact stage ids),
baseline snapshots, the capture window, claims, completeness read from the files (gzip done, JSON
closed), the content check, expected counts, verdicts and their reasons, path mapping, downloads."""

from __future__ import annotations

import asyncio
import gzip
import os
import time
from pathlib import Path

import pytest

from sidecar.config.models import StageKind
from sidecar.control import artifacts
from sidecar.control.artifacts import (
    StageWatch,
    Window,
    map_server_path,
    resolve_artifact,
    session_stage,
    snapshot,
)
from sidecar.control.claims import ClaimRegistry
from sidecar.control.collect import TraceState, collect, trace_has_work
from sidecar.control.models import Verdict

BUSY = b'{"traceEvents": [{"name": "aten::mm", "cat": "cpu_op", "ph": "X", "ts": 0, "dur": 3}]}'
IDLE = b'{"traceEvents": [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1}]}'

LLM = "20261130-120000_stage{sid}_rank0_1796000000"
DIFF = "20261130-120000_stage_{sid}_rep_0_diffusion_1796000000"


def _watch(d: Path, sid: int = 1, kind: StageKind = StageKind.unknown, gzip_on: bool = True) -> StageWatch:
    return snapshot(StageWatch(stage_id=sid, kind=kind, server_dir=str(d), local_dir=d, use_gzip=gzip_on))


def _session(d: Path, name: str, trace: bytes | None = BUSY, gz: bool = True) -> Path:
    folder = d / name
    folder.mkdir(parents=True)
    if trace is not None:
        if gz:
            (folder / "trace_rank0.json.gz").write_bytes(gzip.compress(trace))
        else:
            (folder / "trace_rank0.json").write_bytes(trace)
    return folder


async def _collect(*watches: StageWatch, **kw):
    kw = {"collect_timeout_s": 5, "poll_s": 0.02} | kw
    return await collect(list(watches), **kw)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("20261130-120000_stage1_rank0_1796000000", 1),
        ("20261130-120000_stage10_rank3_1796000000", 10),
        ("20261130-120000_stage_1_rep_2_diffusion_1796000000", 1),
        ("20261130-120000_stage_12_rep_0_diffusion_1796000000", 12),
        ("stage1_rank0_1796000000", None),  # no timestamp: not a session folder
        ("20261130-120000_diffusion_rank0_1796000000", None),  # a worker without stage prefix
        ("20261130-120000_stage1_rank0_1796000000.tmp", None),
    ],
)
def test_session_folder_names(name, expected):
    assert session_stage(name) == expected


def test_kind_restricts_the_naming():
    assert (session_stage(DIFF.format(sid=1), StageKind.llm), session_stage(LLM.format(sid=1), StageKind.diffusion)) == (
        None, None)


async def test_stage1_does_not_take_stage10_folders(tmp_path):
    w = _watch(tmp_path, sid=1)
    _session(tmp_path, LLM.format(sid=10))
    [v] = await _collect(w)
    assert v.verdict is Verdict.missing


async def test_folders_from_before_start_are_ignored(tmp_path):
    _session(tmp_path, LLM.format(sid=1))
    w = _watch(tmp_path)
    [v] = await _collect(w)
    assert (v.verdict, v.sessions) == (Verdict.missing, [])


async def test_new_llm_and_diffusion_folders_are_both_found(tmp_path):
    w = snapshot(StageWatch(stage_id=1, kind=StageKind.unknown, server_dir=str(tmp_path), local_dir=tmp_path,
                            replicas=2))
    _session(tmp_path, LLM.format(sid=1))
    _session(tmp_path, DIFF.format(sid=1).replace("rep_0", "rep_1"))
    [v] = await _collect(w)
    assert (v.verdict, len(v.sessions), v.found_traces) == (Verdict.ok, 2, 2)


async def test_more_traces_than_the_stage_writes_is_ambiguous_naming_them(tmp_path):
    w = _watch(tmp_path)  # one replica, one rank: one trace per window
    _session(tmp_path, LLM.format(sid=1))
    _session(tmp_path, LLM.format(sid=1).replace("1796000000", "1796000001"))
    [v] = await _collect(w)
    assert (v.verdict, v.found_traces, "expects 1 trace(s) in one window and 2 arrived" in v.reason) == (
        Verdict.ambiguous, 2, True)


async def test_folder_without_trace_is_missing(tmp_path):
    w = _watch(tmp_path)
    _session(tmp_path, LLM.format(sid=1), trace=None)
    [v] = await _collect(w)
    assert (v.verdict, "hold no trace" in v.reason) == (Verdict.missing, True)


async def test_zero_byte_trace_is_not_counted(tmp_path):
    w = _watch(tmp_path, gzip_on=False)
    _session(tmp_path, LLM.format(sid=1), trace=b"", gz=False)
    [v] = await _collect(w)
    assert (v.verdict, "0 bytes" in v.reason) == (Verdict.missing, True)


async def test_trace_with_no_op_is_empty_no_request_ran(tmp_path):
    w = _watch(tmp_path)
    _session(tmp_path, LLM.format(sid=1), trace=IDLE)
    [v] = await _collect(w)
    assert (v.verdict, v.reason.startswith("no request ran in the window"), len(v.sessions[0].files)) == (
        Verdict.empty, True, 1)


async def test_a_kernel_alone_counts_as_work(tmp_path):
    w = _watch(tmp_path)
    _session(tmp_path, LLM.format(sid=1), trace=b'{"traceEvents": [{"name": "k", "cat": "kernel", "ph": "X"}]}')
    [v] = await _collect(w)
    assert v.verdict is Verdict.ok


def test_content_check_stops_at_the_first_op(tmp_path):
    # Everything after the first op is garbage: a check that read the whole trace would fail.
    path = tmp_path / "t.json"
    path.write_bytes(BUSY[:-2] + b", " + b'{"name": "pad", "ph": "X"}, ' * 200_000 + b"\x00garbage")
    assert trace_has_work(path) == (TraceState.work, None)


async def test_unclosed_json_is_not_counted(tmp_path):
    w = _watch(tmp_path, gzip_on=False)
    _session(tmp_path, LLM.format(sid=1), trace=BUSY[:-3], gz=False)
    [v] = await _collect(w)
    assert (v.verdict, "not closed" in v.reason) == (Verdict.missing, True)


async def test_lost_diffusion_replica_makes_the_stage_partial(tmp_path):
    w = snapshot(StageWatch(stage_id=1, kind=StageKind.diffusion, server_dir=str(tmp_path), local_dir=tmp_path,
                            replicas=2))
    _session(tmp_path, DIFF.format(sid=1))
    _session(tmp_path, DIFF.format(sid=1).replace("rep_0", "rep_1"), trace=None)
    [v] = await _collect(w)
    assert (v.verdict, v.expected_traces, v.found_traces, "replica(s) [1]" in v.reason) == (
        Verdict.partial, 2, 1, True)


async def test_lost_tensor_parallel_rank_is_named(tmp_path):
    w = snapshot(StageWatch(stage_id=1, kind=StageKind.llm, server_dir=str(tmp_path), local_dir=tmp_path, ranks=2))
    _session(tmp_path, LLM.format(sid=1))
    [v] = await _collect(w)
    assert (v.verdict, "rank(s) [1]" in v.reason) == (Verdict.partial, True)


async def test_every_rank_present_is_ok(tmp_path):
    w = snapshot(StageWatch(stage_id=1, kind=StageKind.llm, server_dir=str(tmp_path), local_dir=tmp_path, ranks=2))
    _session(tmp_path, LLM.format(sid=1))
    _session(tmp_path, LLM.format(sid=1).replace("rank0", "rank1"))
    [v] = await _collect(w)
    assert (v.verdict, v.found_traces) == (Verdict.ok, 2)


async def test_a_stage_whose_dir_is_shared_is_ambiguous(tmp_path):
    w = snapshot(StageWatch(stage_id=1, kind=StageKind.llm, server_dir=str(tmp_path), local_dir=tmp_path,
                            shared_with="http://other:8000"))
    _session(tmp_path, LLM.format(sid=1))
    [v] = await _collect(w)
    assert (v.verdict, "http://other:8000" in v.reason) == (Verdict.ambiguous, True)


# --- the capture window and claims --------------------------------------------------------

START = 1796000000.0  # the epoch in LLM / DIFF


async def test_a_folder_stamped_inside_the_start_is_this_captures(tmp_path):
    w = _watch(tmp_path)
    _session(tmp_path, LLM.format(sid=1))
    [v] = await _collect(w, window=Window(opened=START - 0.4, started=START + 0.2))
    assert v.verdict is Verdict.ok


@pytest.mark.parametrize("epoch", [int(START) - 60, int(START) + 60])
async def test_a_folder_stamped_outside_the_start_is_not_counted(tmp_path, epoch):
    w = _watch(tmp_path)
    _session(tmp_path, f"20261130-120000_stage1_rank0_{epoch}")
    [v] = await _collect(w, window=Window(opened=START - 0.4, started=START + 0.2))
    assert (v.verdict, "outside this capture's start" in v.reason) == (Verdict.missing, True)


async def test_a_plain_vllm_trace_written_after_the_stop_answered_is_not_counted(tmp_path):
    w = snapshot(StageWatch(stage_id=0, kind=StageKind.llm, server_dir=str(tmp_path), local_dir=tmp_path, flat=True))
    (tmp_path / f"w-rank-0.{int((START + 100) * 1e9)}.pt.trace.json.gz").write_bytes(gzip.compress(BUSY))
    [v] = await _collect(w, window=Window(opened=START, started=START + 1, closed=START + 10))
    assert (v.verdict, "outside this capture's window" in v.reason) == (Verdict.missing, True)


async def test_a_claimed_folder_is_left_to_its_owner(tmp_path):
    claims = ClaimRegistry()
    w = _watch(tmp_path)
    folder = _session(tmp_path, LLM.format(sid=1))
    claims.claim("first", [str(folder)])
    [v] = await _collect(w, claims=claims, capture_id="second")
    assert (v.verdict, "claimed by capture first" in v.reason) == (Verdict.missing, True)


async def test_collect_claims_what_it_lists(tmp_path):
    claims = ClaimRegistry()
    w = _watch(tmp_path)
    folder = _session(tmp_path, LLM.format(sid=1))
    await _collect(w, claims=claims, capture_id="first")
    assert claims.owner(folder) == "first"


def test_overlapping_windows_of_two_servers_on_one_dir_are_sharers(tmp_path):
    claims = ClaimRegistry()
    claims.open_window("a", "http://a", [str(tmp_path)], 100.0)
    claims.open_window("b", "http://b", [str(tmp_path)], 101.0)
    claims.close_window("a", 102.0)
    claims.open_window("c", "http://c", [str(tmp_path)], 200.0)
    assert (claims.sharers("a", str(tmp_path)), claims.sharers("c", str(tmp_path))) == (["http://b"], ["http://b"])


def test_sharers_come_from_the_folders_watchers_and_leave_with_the_trimmed_captures(tmp_path, monkeypatch):
    from sidecar.control import claims as claims_mod

    monkeypatch.setattr(claims_mod, "_MAX_CAPTURES", 3)
    claims = ClaimRegistry()
    shared, own = tmp_path / "shared", tmp_path / "own"
    claims.open_window("a", "http://a", [str(shared)], 100.0)
    claims.open_window("b", "http://b", [str(own)], 100.0)  # another folder: never a sharer of a's
    claims.open_window("c", "http://c", [str(shared), str(own)], 100.0)
    assert claims.sharers("a", str(shared)) == ["http://c"] and claims.sharers("b", str(own)) == ["http://c"]
    claims.open_window("d", "http://d", [str(shared)], 100.0)  # the 4th: "a", the oldest, is let go
    assert claims.sharers("d", str(shared)) == ["http://c"] and claims.sharers("a", str(shared)) == []
    assert {k: list(v) for k, v in claims._watchers.items()} == {
        os.path.realpath(shared): ["c", "d"], os.path.realpath(own): ["b", "c"]}


async def test_a_rewritten_table_is_copied_at_collect_time(tmp_path):
    d, copies = tmp_path / "d", tmp_path / "copies"
    d.mkdir()
    w = snapshot(StageWatch(stage_id=0, kind=StageKind.llm, server_dir=str(d), local_dir=d, flat=True))
    (d / "w-rank-0.1800000000000.pt.trace.json.gz").write_bytes(gzip.compress(BUSY))
    (d / "profiler_out_0.txt").write_text("mine")
    verdicts = await _collect(w, copy_dir=copies)
    (d / "profiler_out_0.txt").write_text("a later stop's")
    assert resolve_artifact(verdicts, "d/profiler_out_0.txt", copies).read_text() == "mine"


async def test_collect_waits_until_gzip_is_done(tmp_path, monkeypatch):
    import sidecar.control.collect as collect_mod

    w = _watch(tmp_path)
    folder = _session(tmp_path, LLM.format(sid=1), gz=False)
    real_closed, looks = collect_mod._json_closed, []
    monkeypatch.setattr(collect_mod, "_json_closed", lambda path: looks.append(path) or real_closed(path))

    async def gzip_later() -> None:
        while len(looks) < 3:  # the collect has seen the .json waiting for its gzip, several times
            await asyncio.sleep(0.01)
        raw = (folder / "trace_rank0.json").read_bytes()
        (folder / "trace_rank0.json.gz").write_bytes(gzip.compress(raw))
        os.unlink(folder / "trace_rank0.json")

    task = asyncio.create_task(gzip_later())
    [v] = await _collect(w)
    await task
    assert [f.name for f in v.sessions[0].files] == ["trace_rank0.json.gz"]


async def test_gzip_that_never_finishes_is_bounded_and_explained(tmp_path):
    w = _watch(tmp_path)
    _session(tmp_path, LLM.format(sid=1), gz=False)
    [v] = await _collect(w, collect_timeout_s=0.3)
    assert (v.verdict, "gzip had not finished" in v.reason) == (Verdict.ok, True)


async def test_plain_json_is_final_when_gzip_is_off(tmp_path):
    w = _watch(tmp_path, gzip_on=False)
    _session(tmp_path, LLM.format(sid=1), gz=False)
    [v] = await _collect(w, collect_timeout_s=30)
    assert (v.verdict, v.reason) == (Verdict.ok, None)


async def test_missing_folder_with_visible_parent_is_missing(tmp_path):
    w = _watch(tmp_path / "never-created")
    [v] = await _collect(w)
    assert (v.verdict, "does not even exist" in v.reason) == (Verdict.missing, True)


async def test_invisible_folder_is_unverified_and_names_the_flag(tmp_path):
    w = _watch(tmp_path / "not" / "mounted")
    [v] = await _collect(w)
    assert (v.verdict, "--artifact-root" in v.reason) == (Verdict.unverified, True)


async def test_uri_profiler_dir_is_unverified(tmp_path):
    w = StageWatch(stage_id=1, kind=StageKind.llm, server_dir="gs://bucket/traces",
                   local_dir=map_server_path("gs://bucket/traces", {}))
    [v] = await _collect(snapshot(w))
    assert v.verdict is Verdict.unverified


def test_artifact_root_maps_longest_prefix():
    roots = {"/srv": "/mnt/a", "/srv/traces": "/mnt/b"}
    assert map_server_path("/srv/traces/stage0", roots) == Path("/mnt/b/stage0")


def test_artifact_root_matches_whole_components_only():
    assert map_server_path("/srv2/x", {"/srv": "/mnt/a"}) == Path("/srv2/x")


async def test_verdicts_keep_the_stage_order(tmp_path):
    a, b = _watch(tmp_path / "a", sid=2), _watch(tmp_path / "b", sid=0)
    _session(tmp_path / "a", LLM.format(sid=2))
    _session(tmp_path / "b", LLM.format(sid=0))
    verdicts = await _collect(a, b)
    assert [v.stage_id for v in verdicts] == [2, 0]


async def test_watch_round_trips_through_json(tmp_path):
    _session(tmp_path, LLM.format(sid=1))
    w = _watch(tmp_path)
    assert StageWatch.from_json(w.to_json()) == w


async def test_resolve_artifact_finds_a_file_and_refuses_others(tmp_path):
    w = _watch(tmp_path)
    folder = _session(tmp_path, LLM.format(sid=1))
    (tmp_path / "outside.txt").write_text("x")
    verdicts = await _collect(w)
    ok = resolve_artifact(verdicts, f"{folder.name}/trace_rank0.json.gz")
    refused = [resolve_artifact(verdicts, r) for r in (f"{folder.name}/../outside.txt", "outside.txt",
                                                          f"{folder.name}/nope", folder.name, "")]
    assert (ok, refused) == (folder / "trace_rank0.json.gz", [None] * 5)


async def test_trace_paths_follow_a_late_gzip(tmp_path):
    w = _watch(tmp_path)
    folder = _session(tmp_path, LLM.format(sid=1), gz=False)
    verdicts = await _collect(w, collect_timeout_s=0.2)  # listed as .json
    (folder / "trace_rank0.json.gz").write_bytes(gzip.compress(BUSY))
    os.unlink(folder / "trace_rank0.json")
    assert artifacts.trace_files(verdicts)[0] == [folder / "trace_rank0.json.gz"]


async def test_folder_reused_by_a_start_in_the_same_second_counts_as_new(tmp_path):
    # Session names have second resolution: a start in the same second reuses the old folder.
    folder = _session(tmp_path, f"20261130-120000_stage1_rank0_{int(time.time())}", gz=False)
    w = _watch(tmp_path, gzip_on=False)
    (folder / "trace_rank0.json").write_bytes(BUSY)
    [v] = await _collect(w)
    assert (v.verdict, len(v.sessions)) == (Verdict.ok, 1)


# --- plain vLLM layout (flavor vllm): trace files straight in the dir --------------------


async def test_flat_layout_finds_only_new_trace_files(tmp_path):
    (tmp_path / "dp0_rank0.1700000000000.pt.trace.json.gz").write_bytes(b"old")
    w = snapshot(StageWatch(stage_id=0, kind=StageKind.llm, server_dir=str(tmp_path), local_dir=tmp_path, flat=True))
    (tmp_path / "dp0_rank0.1800000000000.pt.trace.json.gz").write_bytes(gzip.compress(BUSY))
    (tmp_path / "profiler_out_0.txt").write_text("table")
    [v] = await _collect(w)
    assert (v.verdict, [f.name for f in v.sessions[0].files]) == (
        Verdict.ok, ["dp0_rank0.1800000000000.pt.trace.json.gz", "profiler_out_0.txt"])


async def test_flat_layout_without_new_trace_is_missing(tmp_path):
    w = snapshot(StageWatch(stage_id=0, kind=StageKind.llm, server_dir=str(tmp_path), local_dir=tmp_path, flat=True))
    [v] = await _collect(w)
    assert (v.verdict, "pt.trace.json" in v.reason) == (Verdict.missing, True)


async def test_flat_layout_downloads_only_this_captures_files(tmp_path):
    (tmp_path / "old.1.pt.trace.json.gz").write_bytes(b"old")
    w = snapshot(StageWatch(stage_id=0, kind=StageKind.llm, server_dir=str(tmp_path), local_dir=tmp_path, flat=True))
    (tmp_path / "new.2.pt.trace.json.gz").write_bytes(b"new")
    verdicts = await _collect(w)
    got = [resolve_artifact(verdicts, f"{tmp_path.name}/{n}") for n in ("new.2.pt.trace.json.gz", "old.1.pt.trace.json.gz")]
    assert got == [tmp_path / "new.2.pt.trace.json.gz", None]


async def test_an_old_folder_is_not_taken_for_a_reused_one(tmp_path):
    folder = _session(tmp_path, LLM.format(sid=1), gz=False)  # epoch long past
    w = _watch(tmp_path, gzip_on=False)
    (folder / "stray.txt").write_text("x")
    [v] = await _collect(w)
    assert v.verdict is Verdict.missing


def _finished(claims: ClaimRegistry, cid: str, folder: Path, *, at: float) -> None:
    claims.open_window(cid, "http://a", [str(folder.parent)], at)
    claims.mark_started(cid, at + 0.1)
    claims.claim(cid, [str(folder)])
    claims.close_window(cid, at + 1)


def test_a_late_file_of_an_earlier_capture_stays_its_own(tmp_path):
    claims = ClaimRegistry()
    folder = tmp_path / "f"
    _finished(claims, "first", folder, at=100.0)
    claims.open_window("second", "http://a", [str(tmp_path)], 103.0)  # seconds after: no name reuse
    assert claims.held_by_other(folder, "second") == "first"


def test_a_folder_reused_in_the_same_second_passes_to_the_next_capture(tmp_path):
    claims = ClaimRegistry()
    folder = tmp_path / "f"
    _finished(claims, "first", folder, at=100.0)
    claims.open_window("second", "http://a", [str(tmp_path)], 100.6)
    assert (claims.held_by_other(folder, "second"), claims.claim("second", [str(folder)]),
            claims.owner(folder)) == (None, [], "second")


def test_another_servers_folder_never_passes(tmp_path):
    claims = ClaimRegistry()
    folder = tmp_path / "f"
    _finished(claims, "first", folder, at=100.0)
    claims.open_window("second", "http://b", [str(tmp_path)], 100.6)
    assert claims.held_by_other(folder, "second") == "first"



async def test_a_trace_gzipped_while_its_folder_is_listed_is_still_found(tmp_path, monkeypatch):
    # The gzip writes trace.json.gz and removes trace.json between the folder's listing (which saw
    # only trace.json) and the stat of that name: the folder is listed again, not left looking empty.
    import sidecar.control.artifacts as artifacts_mod

    w = _watch(tmp_path)
    folder = _session(tmp_path, LLM.format(sid=1), trace=BUSY, gz=False)
    plain = folder / "trace_rank0.json"
    real_lstat, swapped = artifacts_mod.os.lstat, []

    def lstat_racing_the_gzip(path, *args, **kwargs):
        if str(path) == str(plain) and not swapped:
            (folder / "trace_rank0.json.gz").write_bytes(gzip.compress(plain.read_bytes()))
            plain.unlink()
            swapped.append(path)
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(artifacts_mod.os, "lstat", lstat_racing_the_gzip)
    [v] = await _collect(w)
    assert (v.verdict, [f.name for s in v.sessions for f in s.files], len(swapped)) == (
        Verdict.ok, ["trace_rank0.json.gz"], 1)


# --- verdict edges (issue 20): each reproduces the file or the race exactly ------------------


@pytest.mark.parametrize("trace", [b"", BUSY[:-3]], ids=["0-byte", "cut-off"])
async def test_a_trace_never_gzipped_and_unreadable_is_never_ok(tmp_path, trace):
    # The export failed (a full disk): vLLM-Omni logs it and never starts the gzip, so the .json
    # stays, 0 bytes or cut off, until the collect bound runs out.
    w = _watch(tmp_path)  # gzip on
    _session(tmp_path, LLM.format(sid=1), trace=trace, gz=False)
    [v] = await _collect(w, collect_timeout_s=0.5, trace_quiet_s=0.1)
    assert (v.verdict, v.found_traces, "never compressed within 0.5s" in v.reason) == (Verdict.missing, 0, True)


async def test_a_trace_still_growing_at_the_bound_is_unverified(tmp_path):
    w = _watch(tmp_path)
    folder = _session(tmp_path, LLM.format(sid=1), trace=b'{"traceEvents": [', gz=False)
    done = asyncio.Event()

    async def keep_writing() -> None:
        with open(folder / "trace_rank0.json", "ab") as f:
            while not done.is_set():
                f.write(b'{"name": "aten::mm", "cat": "cpu_op", "ph": "X", "ts": 0, "dur": 3}, ')
                f.flush()
                await asyncio.sleep(0.01)

    writer = asyncio.create_task(keep_writing())
    try:
        [v] = await _collect(w, collect_timeout_s=0.5, trace_quiet_s=60)
    finally:
        done.set()
        await writer
    assert (v.verdict, "still being written when the 0.5s collect bound ran out" in v.reason) == (
        Verdict.unverified, True)


async def test_a_json_and_its_half_written_gz_are_one_trace_and_the_lost_rank_shows(tmp_path):
    # Rank 0's gzip is half done (both names on disk), rank 1 wrote nothing: one trace of two.
    w = snapshot(StageWatch(stage_id=1, kind=StageKind.llm, server_dir=str(tmp_path), local_dir=tmp_path, ranks=2))
    big = BUSY[:-2] + b", " + b'{"name": "pad", "ph": "X", "ts": 1, "dur": 1}, ' * 20_000 + b"{}]}"
    folder = _session(tmp_path, LLM.format(sid=1), trace=big, gz=False)
    (folder / "trace_rank0.json.gz").write_bytes(gzip.compress(big)[: len(gzip.compress(big)) // 2])
    [v] = await _collect(w, collect_timeout_s=0.3)
    assert (v.verdict, v.expected_traces, v.found_traces, "rank(s) [1]" in v.reason) == (
        Verdict.partial, 2, 1, True)


async def test_a_gzip_right_after_the_stat_of_its_json_keeps_the_trace(tmp_path, monkeypatch):
    # The gzip finishes between the lstat of trace.json and any second look at that name: the
    # listing decides from the one lstat, and the trace is read from the .json.gz.
    import sidecar.control.artifacts as artifacts_mod

    w = _watch(tmp_path)
    folder = _session(tmp_path, LLM.format(sid=1), trace=BUSY, gz=False)
    plain = folder / "trace_rank0.json"
    real_lstat, swapped = artifacts_mod.os.lstat, []

    def gzip_after_the_lstat(path, *args, **kwargs):
        st = real_lstat(path, *args, **kwargs)
        if str(path) == str(plain) and not swapped:
            (folder / "trace_rank0.json.gz").write_bytes(gzip.compress(plain.read_bytes()))
            plain.unlink()
            swapped.append(path)
        return st

    monkeypatch.setattr(artifacts_mod.os, "lstat", gzip_after_the_lstat)
    [v] = await _collect(w, collect_timeout_s=0.3)
    assert (v.verdict, v.found_traces, len(swapped)) == (Verdict.ok, 1, 1)


async def test_a_gzip_mode_folder_listed_without_its_trace_is_listed_again(tmp_path, monkeypatch):
    # The listing passed trace.json's slot after the gzip unlinked it and before it saw the .gz:
    # the folder looks empty once; it is listed again before it is called missing.
    import sidecar.control.artifacts as artifacts_mod

    w = _watch(tmp_path)
    folder = _session(tmp_path, LLM.format(sid=1))
    real_walk, blind = artifacts_mod.os.walk, []

    def walk_that_missed_both(top, *args, **kwargs):
        if str(top) == str(folder) and not blind:
            blind.append(top)
            return iter([(str(folder), [], [])])
        return real_walk(top, *args, **kwargs)

    monkeypatch.setattr(artifacts_mod.os, "walk", walk_that_missed_both)
    [v] = await _collect(w)
    assert (v.verdict, v.found_traces, len(blind)) == (Verdict.ok, 1, 1)


async def test_an_uncompressed_trace_whose_writes_pause_is_waited_for(tmp_path, monkeypatch):
    # The writer pauses for several polls (a slow export), then closes the JSON: the trace is
    # still being written until it has been quiet for trace_quiet_s, so it counts.
    import sidecar.control.collect as collect_mod

    w = _watch(tmp_path, gzip_on=False)
    folder = _session(tmp_path, LLM.format(sid=1), trace=BUSY[:-3], gz=False)  # cut before its closing "}]}"
    real_closed, looks, closed = collect_mod._json_closed, [], []

    def counting(path):
        looks.append(path)
        return real_closed(path)

    monkeypatch.setattr(collect_mod, "_json_closed", counting)

    async def finish_after_some_looks() -> None:
        while len(looks) < 5:  # the pause: several looks at the unchanged, unclosed file
            await asyncio.sleep(0.01)
        with open(folder / "trace_rank0.json", "ab") as f:
            f.write(BUSY[-3:])
        closed.append(True)

    writer = asyncio.create_task(finish_after_some_looks())
    try:
        [v] = await _collect(w, collect_timeout_s=120, trace_quiet_s=60)
    finally:
        writer.cancel()
    assert (v.verdict, v.found_traces, closed) == (Verdict.ok, 1, [True])


async def test_a_content_check_that_cannot_run_is_unverified(tmp_path, monkeypatch, caplog):
    import sys

    w = _watch(tmp_path)
    _session(tmp_path, LLM.format(sid=1))
    monkeypatch.setitem(sys.modules, "sidecar.analysis", None)  # `import sidecar.analysis` fails
    [v] = await _collect(w)
    assert (v.verdict, v.found_traces, "the content check cannot run" in v.reason,
            "verdicts are unverified" in caplog.text) == (Verdict.unverified, 0, True, True)


async def test_two_traces_in_one_rank_folder_do_not_stand_for_the_lost_rank(tmp_path):
    # Two traces arrived for a stage of two ranks, both in rank 0's folder: rank 1 is still lost.
    w = snapshot(StageWatch(stage_id=1, kind=StageKind.llm, server_dir=str(tmp_path), local_dir=tmp_path, ranks=2))
    folder = _session(tmp_path, LLM.format(sid=1))
    (folder / "trace_rank1.json.gz").write_bytes(gzip.compress(BUSY))
    [v] = await _collect(w)
    assert (v.verdict, v.found_traces, "rank(s) [1]" in v.reason) == (Verdict.partial, 2, True)
