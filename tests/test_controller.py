"""CaptureController against FakeOmni (a real HTTP server on a free port): lifecycle, validation
before any upstream call, overlap, rollback, background stop, watchdogs, journal and recovery."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sidecar.control.claims import ClaimRegistry
from sidecar.control.controller import CaptureController, ControlSettings
from sidecar.fleet._pacing import FLEET_PACING
from sidecar.control.models import CaptureState, StopReason, Verdict
from sidecar.errors import (
    ArtifactNotFound,
    CaptureActive,
    CaptureError,
    CaptureNotFound,
    CaptureStateError,
    SidecarClosing,
    StageSelectionError,
    UpstreamError,
    UpstreamTimeout,
)
from sidecar.upstream.server import UpstreamServer
from tests.fixtures.control import FakeOmni, make_deploy
from tests.fixtures.waits import apoll

FAST = ControlSettings(collect_timeout_s=10, poll_s=0.02, gone_poll_s=0.05, gone_after_s=0.5, close_timeout_s=5)


@pytest.fixture
async def upstream(fake_omni):
    up = UpstreamServer(fake_omni.url, stop_budget_s=5, retry_wait_max_s=0.05)
    yield up
    await up.aclose()


@pytest.fixture
async def ctl(upstream, control_deploy, tmp_path):
    c = CaptureController(upstream, control_deploy, state_dir=tmp_path / "state", settings=FAST)
    await c.open()
    yield c
    await c.close()


async def _run(ctl, **kw):
    cap = await ctl.start(**kw)
    await ctl.stop(cap.id)
    return await ctl.wait(cap.id, timeout=20)


async def test_a_start_that_waited_while_the_controller_closed_sends_nothing(ctl, fake_omni):
    # start() checked closing on entry only: a start still waiting for the server's version when
    # close() ran (a fleet closes its controllers in process) was then sent, after the shutdown
    asked, release = asyncio.Event(), asyncio.Event()
    version = ctl._version

    async def slow_version():
        asked.set()
        await release.wait()
        return await version()

    ctl._version = slow_version
    start = asyncio.create_task(ctl.start(stages=[0]))
    await asked.wait()
    await ctl.close()
    release.set()
    with pytest.raises(SidecarClosing):
        await start
    assert (fake_omni.starts(), ctl.list()) == ([], [])


async def test_a_start_waiting_for_its_steps_when_the_controller_closes_ends_for_the_shutdown(ctl, fake_omni):
    # a stop asked for while the start waited is why it ended: it read `rollback`, as if the start failed
    ctl._measures.step_counter = _never_counting  # type: ignore[method-assign]
    start = asyncio.create_task(ctl.start(stages=[0], delay_steps=5))
    assert await apoll(lambda: ctl.list(), timeout=10)
    await ctl.close()
    with pytest.raises(CaptureError):
        await start
    (cap,) = ctl.list()
    assert (cap.state, cap.stop_reason, fake_omni.starts()) == (CaptureState.failed, StopReason.shutdown, [])


async def _never_counting(_stages):
    return object()


# --- happy path ---------------------------------------------------------------------------


async def test_start_returns_active_capture(ctl):
    cap = await ctl.start([0, 2], label="step-3")
    assert (cap.state, cap.stages, cap.label) == (CaptureState.active, [0, 2], "step-3")


async def test_default_stages_are_every_torch_stage_sent_explicitly(ctl, fake_omni):
    await ctl.start()
    assert fake_omni.starts()[0]["stages"] == [0, 2]


async def test_stop_sends_the_same_stage_set(ctl, fake_omni):
    await _run(ctl, stages=[2])
    assert [c["stages"] for c in fake_omni.calls] == [[2], [2]]


async def test_full_capture_completes_with_ok_verdicts(ctl):
    done = await _run(ctl, stages=[0, 2])
    assert (done.state, [v.verdict for v in done.verdicts]) == (CaptureState.completed, [Verdict.ok, Verdict.ok])


async def test_completed_capture_lists_gzipped_trace(ctl):
    done = await _run(ctl, stages=[0])
    names = [f.name for f in done.verdicts[0].sessions[0].files]
    assert names == ["profiler_out_0.txt", "trace_rank0.json.gz"]


async def test_session_folder_named_like_the_llm_worker(ctl):
    done = await _run(ctl, stages=[0])
    assert Path(done.verdicts[0].sessions[0].path).name.split("_", 1)[1].startswith("stage0_rank0_")


async def test_collect_waits_for_slow_gzip(ctl, fake_omni):
    fake_omni.gzip_delay = 0.6
    done = await _run(ctl, stages=[0])
    assert [f.name for f in done.verdicts[0].sessions[0].files][-1] == "trace_rank0.json.gz"


async def test_stop_returns_at_once_while_upstream_flushes(ctl, fake_omni):
    fake_omni.stop_delay = 1.0
    cap = await ctl.start([0])
    stopping = await ctl.stop(cap.id)
    assert stopping.state is CaptureState.stopping


async def test_controller_stays_responsive_during_slow_stop(ctl, fake_omni):
    fake_omni.stop_delay = 1.0
    cap = await ctl.start([0])
    await ctl.stop(cap.id)
    still = await ctl.wait(cap.id, timeout=0.2)
    during = (still.state, ctl.get(cap.id).state, [c.id for c in ctl.list()], ctl.active.id)
    done = await ctl.wait(cap.id, timeout=20)
    assert (during, done.state) == (
        (CaptureState.stopping, CaptureState.stopping, [cap.id], cap.id), CaptureState.completed)


async def test_timings_are_recorded(ctl):
    done = await _run(ctl, stages=[0])
    assert done.created_at <= done.started_at <= done.stop_requested_at <= done.stopped_at <= done.finished_at


# --- validation before any upstream call --------------------------------------------------


@pytest.mark.parametrize(
    ("stages", "code"),
    [([], "stages_empty"), ([0, 0], "stage_duplicate"), ([7], "stage_unknown"), ([1], "stage_not_profiled")],
)
async def test_bad_stage_list_is_refused_without_upstream_call(ctl, fake_omni, stages, code):
    with pytest.raises(StageSelectionError) as err:
        await ctl.start(stages)
    assert (err.value.code, fake_omni.calls, ctl.active) == (code, [], None)


@pytest.mark.parametrize("duration", [0, -1, float("inf"), float("nan")])
async def test_bad_duration_is_refused(ctl, fake_omni, duration):
    with pytest.raises(CaptureError) as err:
        await ctl.start([0], duration_s=duration)
    assert (err.value.code, fake_omni.calls) == ("duration_invalid", [])


async def test_duration_above_the_limit_is_refused(fake_omni, upstream, control_deploy):
    settings = FAST.model_copy(update={"max_duration_s": 10})
    async with CaptureController(upstream, control_deploy, settings=settings) as c:
        with pytest.raises(CaptureError) as err:
            await c.start([0], duration_s=11)
    assert (err.value.details["max_duration_s"], fake_omni.calls) == (10, [])


# --- one at a time ------------------------------------------------------------------------


async def test_overlapping_start_names_the_active_capture(ctl):
    first = await ctl.start([0])
    with pytest.raises(CaptureActive) as err:
        await ctl.start([2])
    assert err.value.details["active_id"] == first.id


async def test_a_bad_stage_list_is_refused_as_such_even_while_a_capture_is_active(ctl):
    await ctl.start([0])
    with pytest.raises(StageSelectionError) as err:
        await ctl.start([])
    assert err.value.code == "stages_empty"


async def test_overlapping_start_is_refused_while_the_first_is_still_starting(ctl, fake_omni):
    fake_omni.start_delay = 60  # held until released below
    first = asyncio.create_task(ctl.start([0]))
    assert await apoll(lambda: fake_omni.starts())  # the first start is at the server, unanswered
    with pytest.raises(CaptureActive):
        await ctl.start([0])
    refused_while_starting = not first.done()
    fake_omni.start_delay = 0
    await first
    assert refused_while_starting


async def test_fifty_concurrent_starts_make_one_upstream_start(ctl, fake_omni):
    fake_omni.start_delay = 0.2
    results = await asyncio.gather(*(ctl.start([0]) for _ in range(50)), return_exceptions=True)
    won = [r for r in results if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, CaptureActive)]
    assert (len(won), len(lost), len(fake_omni.starts())) == (1, 49, 1)


async def test_new_capture_can_start_after_the_last_one_finished(ctl):
    await _run(ctl, stages=[0])
    second = await ctl.start([0])
    assert second.state is CaptureState.active


# --- start failures -----------------------------------------------------------------------


async def test_start_500_rolls_back_and_fails(ctl, fake_omni):
    fake_omni.start_status = 500
    with pytest.raises(UpstreamError) as err:
        await ctl.start([0, 2])
    cap = ctl.get(err.value.details["capture_id"])
    assert (cap.state, cap.stop_reason, [c["stages"] for c in fake_omni.stops()]) == (
        CaptureState.failed, StopReason.rollback, [[0, 2]])


async def test_start_failure_records_upstream_reason(ctl, fake_omni):
    fake_omni.start_status = 500
    with pytest.raises(UpstreamError) as err:
        await ctl.start([0])
    assert "boom" in ctl.get(err.value.details["capture_id"]).errors[0].message


async def test_ambiguous_start_rolls_back(fake_omni, control_deploy, tmp_path):
    from sidecar.upstream.server import UpstreamTimeouts

    fake_omni.start_delay = 1.0
    up = UpstreamServer(fake_omni.url, timeouts=UpstreamTimeouts(start=0.2), stop_budget_s=5)
    async with up, CaptureController(up, control_deploy, settings=FAST) as c:
        with pytest.raises(UpstreamTimeout) as err:
            await c.start([0])
        cap = c.get(err.value.details["capture_id"])
    assert (cap.state, cap.stop_reason, len(fake_omni.stops())) == (CaptureState.failed, StopReason.rollback, 1)


async def test_failed_start_frees_the_slot(ctl, fake_omni):
    fake_omni.start_status = 500
    with pytest.raises(UpstreamError):
        await ctl.start([0])
    fake_omni.start_status = 200
    assert (await ctl.start([0])).state is CaptureState.active


async def test_a_rollback_whose_stop_times_out_holds_the_slot_until_the_server_answers(fake_omni, control_deploy):
    # The start 500s, and the rollback's stop is not answered within its budget: the server may
    # still be recording, so the capture stays stopping and the next start is refused, until the
    # stop is answered at last.
    from sidecar.errors import CaptureStopPending

    fake_omni.start_status = 500
    fake_omni.stop_delay = 60
    settings = FAST.model_copy(update={"rollback_budget_s": 0.3})
    async with _hung(fake_omni, budget=0.3) as up, CaptureController(up, control_deploy, settings=settings) as c:
        with pytest.raises(UpstreamError) as err:
            await c.start([0])
        cid = err.value.details["capture_id"]
        held = c.get(cid)
        with pytest.raises(CaptureStopPending) as again:
            await c.start([0])
        fake_omni.stop_delay = 0  # the server answers the (repeated) stop
        done = await c.wait(cid, timeout=30)
    assert (held.state, [e.code for e in held.errors], again.value.details["active_id"], done.state) == (
        CaptureState.stopping, ["upstream_failed", "rollback_upstream_timeout"], cid, CaptureState.failed)


# --- two captures, one folder name (session folders are named to the second) -------------


def _folders(cap) -> list[str]:
    return [Path(s.path).name for v in cap.verdicts for s in v.sessions]


async def test_back_to_back_captures_within_one_second_get_their_own_folders(ctl):
    import time

    await apoll(lambda: time.time() % 1 < 0.2)  # early in a second: the second capture starts in it
    first = await _run(ctl, stages=[0])
    second = await _run(ctl, stages=[0])
    first_epoch = int(_folders(first)[0].rsplit("_", 1)[1])
    assert (_folders(first) != _folders(second), [first.state, second.state], ctl.get(first.id).notes,
            int(_folders(second)[0].rsplit("_", 1)[1]) > first_epoch) == (
        True, [CaptureState.completed, CaptureState.completed], [], True)


async def test_a_start_in_the_second_of_the_previous_folder_waits_and_says_so(ctl, control_deploy):
    import time

    await apoll(lambda: time.time() % 1 < 0.5)
    now = int(time.time())
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    (Path(control_deploy.stage(0).profiler_dir) / f"{stamp}_stage0_rank0_{now}").mkdir(parents=True)
    cap = await ctl.start([0])
    await ctl.stop(cap.id)
    done = await ctl.wait(cap.id, timeout=20)
    (waited,) = done.fact("folder_second_wait")
    assert (done.state, waited.figures["second"], 0 < waited.figures["wait_s"] <= 1 + 2.0,
            _folders(done)[0].endswith(f"_{now}")) == (CaptureState.completed, now, True, False)


async def test_a_capture_whose_trace_was_replaced_after_its_verdict_says_so(ctl):
    done = await _run(ctl, stages=[0])
    session = done.verdicts[0].sessions[0]
    trace = Path(session.local_path) / "trace_rank0.json.gz"
    replacement = trace.with_name("replacement")
    replacement.write_bytes(trace.read_bytes() + b"\0")
    replacement.replace(trace)  # a later window's trace, written over this one
    (changed,) = ctl.get(done.id).facts
    assert (changed.code, changed.figures["files"]) == (
        "files_changed", [f"{Path(session.path).name}/trace_rank0.json.gz"]), changed


# --- stop faults --------------------------------------------------------------------------


def _hung(fake_omni, budget: float = 0.5, read: float = 60):
    from sidecar.upstream.server import UpstreamTimeouts

    return UpstreamServer(fake_omni.url, stop_budget_s=budget, timeouts=UpstreamTimeouts(stop=read),
                          retry_wait_max_s=0.05)


async def test_stop_past_its_budget_stays_stopping_with_what_was_found(fake_omni, control_deploy):
    fake_omni.stop_delay = 30
    async with _hung(fake_omni) as up, CaptureController(up, control_deploy, settings=FAST) as c:
        cap = await c.start([0])
        await c.stop(cap.id)
        await apoll(lambda: c.get(cap.id).verdicts)
        held = c.get(cap.id)
        fake_omni.stop_delay = 0  # let close() end it
    assert (held.state, held.errors[-1].code, held.verdict(0).reason.startswith(
        "stop timed out after 0.5s; found so far: no trace")) == (CaptureState.stopping, "upstream_timeout", True)


async def test_a_stop_timeout_is_published_with_its_found_so_far_verdicts(fake_omni, control_deploy, monkeypatch):
    # Whatever a reader sees while the found-so-far look runs: never the timeout without verdicts.
    import sidecar.control.controller as controller_mod

    fake_omni.stop_delay = 30
    seen: list[tuple[list[str], int]] = []
    real_collect = controller_mod.collect
    async with _hung(fake_omni) as up, CaptureController(up, control_deploy, settings=FAST) as c:
        async def looking(*args, **kwargs):
            cap = c.active
            seen.append(([e.code for e in cap.errors], len(cap.verdicts)))
            return await real_collect(*args, **kwargs)

        monkeypatch.setattr(controller_mod, "collect", looking)
        cap = await c.start([0])
        await c.stop(cap.id)
        await apoll(lambda: c.get(cap.id).errors)
        held = c.get(cap.id)
        fake_omni.stop_delay = 0
    assert (seen[:1], [e.code for e in held.errors], len(held.verdicts)) == ([([], 0)], ["upstream_timeout"], 1)


async def test_start_while_a_stop_is_unanswered_is_refused_naming_why(fake_omni, control_deploy):
    from sidecar.errors import CaptureStopPending

    fake_omni.stop_delay = 30
    async with _hung(fake_omni) as up, CaptureController(up, control_deploy, settings=FAST) as c:
        cap = await c.start([0])
        await c.stop(cap.id)
        await apoll(lambda: c.get(cap.id).verdicts)
        with pytest.raises(CaptureStopPending) as err:
            await c.start([0])
        fake_omni.stop_delay = 0
    assert (err.value.details["active_id"], err.value.details["stop_timed_out"], err.value.http_status,
            "outlived the stop budget" in err.value.message) == (cap.id, True, 409, True)


async def test_a_late_answer_ends_the_held_stop_with_the_real_verdicts(fake_omni, control_deploy):
    fake_omni.stop_delay = 1.5
    async with _hung(fake_omni, read=10) as up, CaptureController(up, control_deploy, settings=FAST) as c:
        cap = await c.start([0])
        await c.stop(cap.id)
        done = await c.wait(cap.id, timeout=30)
    assert (done.state, done.verdict(0).verdict, [e.code for e in done.errors]) == (
        CaptureState.completed, Verdict.ok, ["upstream_timeout"])


async def test_server_gone_during_stop_fails_with_the_reason_and_frees_the_slot(fake_omni, control_deploy):
    fake_omni.stop_delay = 30
    async with _hung(fake_omni, budget=600) as up, CaptureController(up, control_deploy, settings=FAST) as c:
        cap = await c.start([0])
        await c.stop(cap.id)
        await asyncio.to_thread(fake_omni.crash)  # the port refuses connections now, like a crashed server
        done = await c.wait(cap.id, timeout=30)
        with pytest.raises(UpstreamError) as again:
            await c.start([0])  # the slot is free: the next start reaches for the (dead) server
    assert (done.state, done.errors[-1].code, "not reachable" in done.errors[-1].message,
            type(again.value).__name__) == (CaptureState.failed, "upstream_gone", True, "UpstreamUnreachable")


async def test_server_gone_during_stop_still_checks_the_traces(fake_omni, control_deploy):
    fake_omni.stop_delay = 30
    async with _hung(fake_omni, budget=600) as up, CaptureController(up, control_deploy, settings=FAST) as c:
        cap = await c.start([0])
        await c.stop(cap.id)
        await asyncio.to_thread(fake_omni.crash)
        done = await c.wait(cap.id, timeout=30)
    assert (done.verdict(0).verdict, done.verdict(0).reason.startswith("the server went away during the stop")) == (
        Verdict.missing, True)


async def test_start_cancelled_during_its_rollback_frees_the_slot(ctl, fake_omni):
    fake_omni.start_status = 500
    fake_omni.stop_delay = 1.0
    task = asyncio.create_task(ctl.start([0]))
    await apoll(lambda: bool(fake_omni.stops()))
    cid = ctl.active.id
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await apoll(lambda: ctl.active is None)
    assert (ctl.active, ctl.get(cid).state) == (None, CaptureState.failed)


async def test_transient_stop_errors_are_retried(ctl, fake_omni):
    fake_omni.stop_fail_times = 2
    done = await _run(ctl, stages=[0])
    assert (done.state, len(fake_omni.stops())) == (CaptureState.completed, 3)


async def test_dead_stage_is_missing_and_capture_degraded(ctl, fake_omni):
    # 0.30 answers 200 to start and stop with a dead stage: nothing is rolled back, no stop error
    fake_omni.dead_stages = {2}
    done = await _run(ctl, stages=[0, 2])
    assert (done.state, done.stop_reason, done.verdict(0).verdict, done.verdict(2).verdict, done.errors) == (
        CaptureState.degraded, StopReason.explicit, Verdict.ok, Verdict.missing, [])


async def test_folder_without_trace_after_a_200_stop_is_missing(ctl, fake_omni):
    fake_omni.empty_stages = {0}
    done = await _run(ctl, stages=[0])
    assert (done.state, done.verdict(0).verdict, "died or failed during the window" in done.verdict(0).reason) == (
        CaptureState.degraded, Verdict.missing, True)


async def test_dead_worker_with_a_200_stop_is_missing_naming_the_worker(ctl, fake_omni, control_deploy):
    Path(control_deploy.stage(0).profiler_dir).parent.mkdir(parents=True)
    fake_omni.dead_stages = {0}
    done = await _run(ctl, stages=[0])
    assert (done.errors, done.verdict(0).verdict, "dead or restarted worker" in done.verdict(0).reason) == (
        [], Verdict.missing, True)


async def test_stop_500_still_collects_and_blames_the_stage(ctl, fake_omni):
    fake_omni.dead_stages = {2}
    fake_omni.stop_status = 500
    done = await _run(ctl, stages=[0, 2])
    reason = done.verdict(2).reason or ""
    assert (done.state, done.verdict(2).verdict, "the stop failed on the server" in reason,
            "Failed to stop profiler" in reason, "server log for stage 2" in reason, done.errors[-1].code) == (
        CaptureState.degraded, Verdict.missing, True, True, True, "stop_server_error")


async def test_stages_a_stop_left_unconfirmed_are_stopped_before_the_next_start_also_after_a_restart(
        ctl, upstream, fake_omni, control_deploy, tmp_path):
    """The journal keeps what the stop could not confirm: a sidecar restarted between the failed
    stop and the next start still stops those stages first, and a later confirmed stop clears it."""
    fake_omni.stop_status = 500
    failed = await _run(ctl, stages=[0, 2])
    await ctl.close()
    fake_omni.stop_status = 200
    again = CaptureController(upstream, control_deploy, state_dir=tmp_path / "state", settings=FAST)
    await again.open()
    try:
        before = len(fake_omni.stops())
        first = await _run(again, stages=[0])
        sweep = fake_omni.stops()[before]
        second = await _run(again, stages=[0])
    finally:
        await again.close()
    assert [n.code for n in failed.facts].count("stop_unconfirmed") == 1
    assert (sweep["stages"], [n.figures for n in first.facts if n.code == "stopped_first"]) == (
        [0, 2], [{"stages": [0, 2], "after": failed.id}])
    assert [n.code for n in second.facts if n.code == "stopped_first"] == []  # confirmed by then: no second sweep
    assert len(fake_omni.stops()) == before + 3  # the sweep, then each capture's own stop


async def test_a_start_whose_journal_record_cannot_be_written_is_not_sent(ctl, fake_omni, tmp_path):
    """The state dir broke while the sidecar ran (its captures folder is a file now): the start is
    refused before the server is asked, since a crash would leave it recording with no record."""
    from sidecar.errors import JournalUnwritable

    captures = tmp_path / "state" / "captures"
    if captures.exists():
        captures.rename(tmp_path / "captures.moved")
    captures.parent.mkdir(parents=True, exist_ok=True)
    captures.write_text("")
    with pytest.raises(JournalUnwritable) as err:
        await ctl.start(stages=[0])
    cap = ctl.get(err.value.details["capture_id"])
    assert (fake_omni.starts(), fake_omni.stops(), cap.state, err.value.http_status, str(captures) in err.value.message) == (
        [], [], CaptureState.failed, 503, True), err.value.message


async def test_idle_window_is_empty_and_still_listed(ctl, fake_omni):
    fake_omni.idle_stages = {0}
    done = await _run(ctl, stages=[0])
    v = done.verdict(0)
    assert (done.state, v.verdict, v.reason.startswith("no request ran in the window"),
            [f.name for f in v.sessions[0].files][-1]) == (
        CaptureState.degraded, Verdict.empty, True, "trace_rank0.json.gz")


async def test_idle_trace_is_downloadable(ctl, fake_omni):
    fake_omni.idle_stages = {0}
    done = await _run(ctl, stages=[0])
    folder = Path(done.verdict(0).sessions[0].path).name
    assert ctl.artifact_path(done.id, f"{folder}/trace_rank0.json.gz").is_file()


async def test_stop_during_start_takes_effect_once_started(ctl, fake_omni):
    fake_omni.start_delay = 60  # held until released below
    starting = asyncio.create_task(ctl.start([0]))
    assert await apoll(lambda: fake_omni.starts())
    await ctl.stop(ctl.active.id)
    fake_omni.start_delay = 0
    cap = await starting
    done = await ctl.wait(cap.id, timeout=20)
    assert (done.state, done.stop_reason, len(fake_omni.stops())) == (CaptureState.completed, StopReason.explicit, 1)


async def test_stop_twice_is_idempotent(ctl, fake_omni):
    cap = await ctl.start([0])
    await ctl.stop(cap.id)
    await ctl.stop(cap.id)
    await ctl.wait(cap.id, timeout=20)
    assert len(fake_omni.stops()) == 1


async def test_unknown_capture_is_not_found(ctl):
    with pytest.raises(CaptureNotFound):
        await ctl.stop("nope")


async def test_folder_the_sidecar_cannot_see_is_unverified(fake_omni, upstream, control_deploy, tmp_path):
    root = str(Path(control_deploy.stage(0).profiler_dir).parent)
    settings = FAST.model_copy(update={"artifact_roots": {root: str(tmp_path / "not-mounted" / "x")}})
    async with CaptureController(upstream, control_deploy, settings=settings) as c:
        done = await _run(c, stages=[0])
    assert (done.state, done.verdict(0).verdict) == (CaptureState.degraded, Verdict.unverified)


async def test_artifact_root_mapping_reads_the_mounted_copy(fake_omni, upstream, control_deploy, tmp_path):
    root = Path(control_deploy.stage(0).profiler_dir).parent
    root.mkdir(parents=True)
    mount = tmp_path / "mnt"  # the same folder seen under another path, as a container mount would
    mount.symlink_to(root, target_is_directory=True)
    settings = FAST.model_copy(update={"artifact_roots": {str(root): str(mount)}})
    async with CaptureController(upstream, control_deploy, settings=settings) as c:
        done = await _run(c, stages=[0])
    assert (done.verdict(0).verdict, done.verdict(0).sessions[0].local_path.startswith(str(mount))) == (
        Verdict.ok, True)


# --- watchdogs ----------------------------------------------------------------------------


async def test_duration_elapsed_stops_the_capture(ctl, fake_omni):
    cap = await ctl.start([0], duration_s=0.3)
    done = await ctl.wait(cap.id, timeout=20)
    assert (done.state, done.stop_reason, [c["stages"] for c in fake_omni.stops()]) == (
        CaptureState.completed, StopReason.duration, [[0]])


async def test_lease_without_heartbeat_expires(ctl, fake_omni):
    cap = await ctl.start([0], lease_s=0.3)
    done = await ctl.wait(cap.id, timeout=20)
    assert (done.stop_reason, done.state, [c["stages"] for c in fake_omni.stops()]) == (
        StopReason.lease_expired, CaptureState.completed, [[0]])


async def test_heartbeats_keep_a_lease_alive(ctl):
    import time

    lease = 1.0
    cap = await ctl.start([0], lease_s=lease)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2 * lease:  # twice the lease: without the heartbeats it expires
        await asyncio.sleep(0.05)
        await ctl.heartbeat(cap.id)
    assert ctl.get(cap.id).state is CaptureState.active


async def test_heartbeat_on_finished_capture_is_a_state_error(ctl):
    done = await _run(ctl, stages=[0])
    with pytest.raises(CaptureStateError):
        await ctl.heartbeat(done.id)


async def test_default_lease_applies(fake_omni, upstream, control_deploy):
    settings = FAST.model_copy(update={"default_lease_s": 0.2})
    async with CaptureController(upstream, control_deploy, settings=settings) as c:
        cap = await c.start([0])
        done = await c.wait(cap.id, timeout=20)
    assert done.stop_reason is StopReason.lease_expired


async def test_max_duration_bounds_open_windows(fake_omni, upstream, control_deploy):
    settings = FAST.model_copy(update={"max_duration_s": 0.2})
    async with CaptureController(upstream, control_deploy, settings=settings) as c:
        cap = await c.start([0])
        done = await c.wait(cap.id, timeout=20)
    assert done.stop_reason is StopReason.duration


# --- shutdown, journal, recovery ----------------------------------------------------------


async def test_close_stops_the_active_capture(fake_omni, upstream, control_deploy):
    c = CaptureController(upstream, control_deploy, settings=FAST)
    await c.open()
    cap = await c.start([0])
    await c.close()
    assert (c.get(cap.id).stop_reason, fake_omni.stops()[0]["stages"]) == (StopReason.shutdown, [0])


async def test_history_survives_restart(fake_omni, upstream, control_deploy, tmp_path):
    async with CaptureController(upstream, control_deploy, state_dir=tmp_path / "s", settings=FAST) as c:
        done = await _run(c, stages=[0])
    async with CaptureController(upstream, control_deploy, state_dir=tmp_path / "s", settings=FAST) as c2:
        again = c2.get(done.id)
    assert (again.state, again.verdicts) == (done.state, done.verdicts)


async def test_list_is_newest_first(ctl):
    a = await _run(ctl, stages=[0])
    b = await _run(ctl, stages=[2])
    assert [c.id for c in ctl.list()] == [b.id, a.id]


async def test_journal_file_is_json_per_capture(ctl, tmp_path):
    done = await _run(ctl, stages=[0])
    await ctl.flush()
    data = json.loads((tmp_path / "state" / "captures" / f"{done.id}.json").read_text())
    assert (data["id"], data["state"]) == (done.id, "completed")


async def test_journal_never_holds_secrets(ctl, fake_omni, tmp_path):
    await ctl.start([0], label="run HF_TOKEN=hf_abcdefghijklmnopqrstuvwx")
    await ctl.flush()
    text = "".join(p.read_text() for p in (tmp_path / "state" / "captures").glob("*.json"))
    assert "hf_abcdefghijklmnopqrstuvwx" not in text


async def _crash_mid_capture(fake_omni, control_deploy, state_dir) -> str:
    """Start a capture and drop the controller without close(), as a kill -9 would."""
    up = UpstreamServer(fake_omni.url)
    c = CaptureController(up, control_deploy, state_dir=state_dir, settings=FAST)
    await c.open()
    cap = await c.start([0, 2])
    await up.aclose()
    return cap.id


async def test_recovery_stops_capture_left_active(fake_omni, upstream, control_deploy, tmp_path):
    cid = await _crash_mid_capture(fake_omni, control_deploy, tmp_path / "s")
    async with CaptureController(upstream, control_deploy, state_dir=tmp_path / "s", settings=FAST) as c:
        done = await c.wait(cid, timeout=20)
    assert (done.stop_reason, fake_omni.stops()[-1]["stages"]) == (StopReason.stopped_on_recovery, [0, 2])


async def test_recovered_capture_checks_its_artifacts(fake_omni, upstream, control_deploy, tmp_path):
    cid = await _crash_mid_capture(fake_omni, control_deploy, tmp_path / "s")
    async with CaptureController(upstream, control_deploy, state_dir=tmp_path / "s", settings=FAST) as c:
        done = await c.wait(cid, timeout=20)
    assert (done.state, [v.verdict for v in done.verdicts]) == (CaptureState.completed, [Verdict.ok, Verdict.ok])


async def test_recovery_counts_only_folders_made_after_the_journaled_start(fake_omni, upstream, control_deploy,
                                                                          tmp_path):
    old = Path(control_deploy.stage(0).profiler_dir) / "20200101-000000_stage0_rank0_1577836800"
    old.mkdir(parents=True)
    (old / "trace_rank0.json.gz").write_bytes(b"old")
    cid = await _crash_mid_capture(fake_omni, control_deploy, tmp_path / "s")
    async with CaptureController(upstream, control_deploy, state_dir=tmp_path / "s", settings=FAST) as c:
        done = await c.wait(cid, timeout=20)
    names = [Path(s.path).name for s in done.verdict(0).sessions]
    assert (len(names), old.name in names) == (1, False)


async def test_recovery_returns_the_recovered_captures(fake_omni, upstream, control_deploy, tmp_path):
    cid = await _crash_mid_capture(fake_omni, control_deploy, tmp_path / "s")
    c = CaptureController(upstream, control_deploy, state_dir=tmp_path / "s", settings=FAST)
    recovered = await c.open()
    await c.close()
    assert [(r.id, r.stop_reason) for r in recovered] == [(cid, StopReason.stopped_on_recovery)]


async def test_recovery_blocks_new_starts_until_stopped(fake_omni, upstream, control_deploy, tmp_path):
    cid = await _crash_mid_capture(fake_omni, control_deploy, tmp_path / "s")
    fake_omni.stop_delay = 0.5
    async with CaptureController(upstream, control_deploy, state_dir=tmp_path / "s", settings=FAST) as c:
        with pytest.raises(CaptureActive) as err:
            await c.start([0])
    assert err.value.details["active_id"] == cid


async def test_corrupt_journal_file_is_set_aside(upstream, control_deploy, tmp_path):
    d = tmp_path / "s" / "captures"
    d.mkdir(parents=True)
    (d / "bad.json").write_text("{not json")
    async with CaptureController(upstream, control_deploy, state_dir=tmp_path / "s", settings=FAST) as c:
        listed = c.list()
    assert (listed, (d / "bad.json.bad").exists()) == ([], True)


async def test_the_baseline_is_journaled_before_the_server_is_asked_to_start(ctl, fake_omni, tmp_path):
    fake_omni.start_delay = 1.0
    task = asyncio.create_task(ctl.start([0]))
    await apoll(lambda: bool(fake_omni.starts()))
    files = list((tmp_path / "state" / "captures").glob("*.json"))
    data = json.loads(files[0].read_text())
    await task
    assert (data["state"], [w["stage_id"] for w in data["_recovery"]["watches"]]) == ("starting", [0])


# --- artifact downloads -------------------------------------------------------------------


async def test_artifact_path_serves_a_capture_file(ctl):
    done = await _run(ctl, stages=[0])
    folder = Path(done.verdicts[0].sessions[0].path).name
    assert ctl.artifact_path(done.id, f"{folder}/trace_rank0.json.gz").read_bytes()[:2] == b"\x1f\x8b"


@pytest.mark.parametrize("rel", ["../../etc/passwd", "/etc/passwd", "{folder}/../../x", "{folder}", "other/f"])
async def test_artifact_path_refuses_escapes(ctl, rel):
    done = await _run(ctl, stages=[0])
    folder = Path(done.verdicts[0].sessions[0].path).name
    with pytest.raises(ArtifactNotFound):
        ctl.artifact_path(done.id, rel.format(folder=folder))


async def test_artifact_path_refuses_symlink_escape(ctl, tmp_path):
    done = await _run(ctl, stages=[0])
    session = Path(done.verdicts[0].sessions[0].local_path)
    (tmp_path / "secret.txt").write_text("s")
    (session / "link.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ArtifactNotFound):
        ctl.artifact_path(done.id, f"{session.name}/link.txt")


# --- listeners ----------------------------------------------------------------------------


async def test_subscribers_see_every_state(ctl):
    seen: list[str] = []
    ctl.subscribe(lambda cap: seen.append(cap.state.value))
    await _run(ctl, stages=[0])
    assert seen == ["starting", "active", "stopping", "collecting", "completed"]


async def test_diffusion_stage_folders_are_found(tmp_path):
    from sidecar.config.models import StageKind
    from tests.fixtures.control import make_deploy

    deploy = make_deploy(tmp_path / "t", {0: "torch"}, kinds={0: StageKind.diffusion})
    with FakeOmni(deploy) as fake:
        async with UpstreamServer(fake.url) as up, CaptureController(up, deploy, settings=FAST) as c:
            done = await _run(c, stages=[0])
    assert ("_rep_0_diffusion_" in done.verdicts[0].sessions[0].path, done.state) == (True, CaptureState.completed)


# --- summaries ----------------------------------------------------------------------------


async def _summary(ctl, cid):
    for _ in range(200):
        data = ctl.summary(cid)
        if data is not None:
            return data
        await asyncio.sleep(0.05)
    return None


async def test_summary_is_cached_after_completion(ctl, tmp_path):
    done = await _run(ctl, stages=[0, 2])
    data = await _summary(ctl, done.id)
    assert (data is not None, (tmp_path / "state" / "summaries" / f"{done.id}.json").is_file()) == (True, True)


async def test_summary_failure_leaves_the_verdict_alone(ctl, monkeypatch, caplog):
    # The broken summariser must have run (and failed) for this to mean anything: wait for its
    # warning (its text comes only from the broken function, run in the analysis worker), then
    # the capture is still completed with its ok verdict, and no summary is cached.
    import sidecar.analysis
    from tests.fixtures.analysis import summarizer_bug

    monkeypatch.setattr(sidecar.analysis, "summarize_paths", summarizer_bug)
    done = await _run(ctl, stages=[0])
    assert await apoll(lambda: "summary failed: summarizer bug (1 trace(s))" in caplog.text)
    after = ctl.get(done.id)
    failed = [r for r in caplog.records if "summary failed" in r.getMessage()]
    assert (len(failed), after.state, after.verdict(0).verdict, ctl.summary(done.id)) == (
        1, CaptureState.completed, Verdict.ok, None)


# --- expected counts ----------------------------------------------------------------------


async def _one(deploy, stages, *, fake_setup=None, **start):
    with FakeOmni(deploy) as fake:
        if fake_setup:
            fake_setup(fake)
        async with UpstreamServer(fake.url) as up, CaptureController(up, deploy, settings=FAST,
                                                                     claims=ClaimRegistry()) as c:
            return await _run(c, stages=stages, **start)


async def test_llm_stage_with_two_replicas_is_partial_naming_the_overwritten_replica(tmp_path):
    from tests.fixtures.control import make_deploy

    deploy = make_deploy(tmp_path / "t", {0: "torch"}, replicas={0: 2})
    done = await _one(deploy, [0], fake_setup=lambda f: f.replicas.update({0: 2}))
    v = done.verdict(0)
    assert (done.state, v.verdict, v.expected_traces, v.found_traces,
            "replica 1's trace was overwritten by replica 0's" in v.reason) == (
        CaptureState.degraded, Verdict.partial, 2, 1, True)


async def test_diffusion_replicas_each_write_their_folder_and_are_ok(tmp_path):
    from sidecar.config.models import StageKind
    from tests.fixtures.control import make_deploy

    deploy = make_deploy(tmp_path / "t", {0: "torch"}, kinds={0: StageKind.diffusion}, replicas={0: 2})
    done = await _one(deploy, [0], fake_setup=lambda f: f.replicas.update({0: 2}))
    assert (done.verdict(0).verdict, done.verdict(0).found_traces, len(done.verdict(0).sessions)) == (Verdict.ok, 2, 2)


async def test_a_lost_diffusion_replica_is_named(tmp_path):
    from sidecar.config.models import StageKind
    from tests.fixtures.control import make_deploy

    deploy = make_deploy(tmp_path / "t", {0: "torch"}, kinds={0: StageKind.diffusion}, replicas={0: 2})

    def setup(f):
        f.replicas[0] = 2
        f.lost_replicas[0] = {1}

    done = await _one(deploy, [0], fake_setup=setup)
    assert (done.verdict(0).verdict, "replica(s) [1] wrote no trace" in done.verdict(0).reason) == (
        Verdict.partial, True), done.model_dump_json(indent=1)


# --- identity -----------------------------------------------------------------------------


async def test_a_stage_told_shared_is_ambiguous_never_ok(ctl):
    done = await _run(ctl, stages=[0, 2], shared_stages={0: "http://10.0.0.9:8000"})
    assert (done.verdict(0).verdict, "http://10.0.0.9:8000" in done.verdict(0).reason, done.verdict(2).verdict) == (
        Verdict.ambiguous, True, Verdict.ok)


async def test_a_shared_dir_from_settings_is_ambiguous(fake_omni, upstream, control_deploy):
    d = control_deploy.stage(0).profiler_dir
    settings = FAST.model_copy(update={"shared_profiler_dirs": {d: "replica 1"}})
    async with CaptureController(upstream, control_deploy, settings=settings, claims=ClaimRegistry()) as c:
        done = await _run(c, stages=[0])
    assert done.verdict(0).verdict is Verdict.ambiguous


async def test_two_servers_writing_one_dir_at_once_are_both_ambiguous(tmp_path, control_deploy):
    claims = ClaimRegistry()  # what the controllers of one process (a fleet) share
    with FakeOmni(control_deploy) as a, FakeOmni(control_deploy) as b:
        async with UpstreamServer(a.url) as ua, UpstreamServer(b.url) as ub, \
                CaptureController(ua, control_deploy, settings=FAST, claims=claims) as ca, \
                CaptureController(ub, control_deploy, settings=FAST, claims=claims) as cb:  # fmt: skip
            xa, xb = await ca.start([0]), await cb.start([0])
            await ca.stop(xa.id)
            await cb.stop(xb.id)
            da, db = await ca.wait(xa.id, timeout=20), await cb.wait(xb.id, timeout=20)
    assert (da.verdict(0).verdict, db.verdict(0).verdict) == (Verdict.ambiguous, Verdict.ambiguous)


async def test_a_folder_opened_by_someone_elses_later_start_is_not_claimed(ctl, control_deploy):
    import time as _time

    cap = await ctl.start([0])
    later = int(_time.time()) + 60  # another client's start, a minute into our window
    foreign = Path(control_deploy.stage(0).profiler_dir) / f"20991231-000000_stage0_rank0_{later}"
    foreign.mkdir(parents=True)
    (foreign / "trace_rank0.json.gz").write_bytes(b"x")
    await ctl.stop(cap.id)
    done = await ctl.wait(cap.id, timeout=20)
    names = [Path(s.path).name for s in done.verdict(0).sessions]
    assert (done.verdict(0).verdict, foreign.name in names) == (Verdict.ok, False)


async def test_a_folder_the_server_reuses_in_the_same_second_goes_to_the_new_capture(ctl, fake_omni):
    import time as _time

    # The server's clock is 0.5 s behind ours: the sidecar's wait for the next second (by its own
    # clock) ends while the server is still in the second of the first folder, so the server names
    # the second start's folder the same. A real server reuses a name only for starts less than a
    # second apart (the claims pass the folder on only then); a loaded machine can take longer
    # between the two starts, so the server names a new folder: the pair runs again, each time from
    # the start of a server second.
    fake_omni.clock_lag = 0.5
    for _ in range(5):
        await asyncio.sleep(1.01 - (_time.time() - fake_omni.clock_lag) % 1)  # a server second begins
        reused = len(fake_omni.reused)
        first = await _run(ctl, stages=[0])
        second = await _run(ctl, stages=[0])
        if len(fake_omni.reused) > reused:
            break
    assert (first.verdict(0).verdict, second.verdict(0).verdict, [s.path for s in second.verdict(0).sessions]) == (
        Verdict.ok, Verdict.ok, [first.verdict(0).sessions[0].path])


async def test_a_folder_claimed_by_another_capture_is_not_taken(fake_omni, upstream, control_deploy):
    claims = ClaimRegistry()
    async with CaptureController(upstream, control_deploy, settings=FAST, claims=claims) as c:
        cap = await c.start([0])
        d = Path(control_deploy.stage(0).profiler_dir)
        ours = next(d.iterdir())
        claims.claim("someone-else", [str(ours)])
        await c.stop(cap.id)
        done = await c.wait(cap.id, timeout=20)
    assert (done.verdict(0).verdict, "claimed by capture someone-else" in done.verdict(0).reason) == (
        Verdict.missing, True)


# --- plain vLLM (flat dir) ----------------------------------------------------------------


async def test_plain_vllm_table_download_returns_what_this_capture_saw(control_deploy, tmp_path):
    from sidecar.upstream.server import Flavor

    with FakeOmni(control_deploy) as fake:
        fake.flat = True
        async with UpstreamServer(fake.url, flavor=Flavor.vllm) as up, \
                CaptureController(up, control_deploy, state_dir=tmp_path / "s", settings=FAST,
                                  claims=ClaimRegistry()) as c:  # fmt: skip
            first = await _run(c, stages=[0])
            await _run(c, stages=[0])  # rewrites profiler_out_0.txt in place
            folder = Path(first.verdict(0).sessions[0].path).name
            text = c.artifact_path(first.id, f"{folder}/profiler_out_0.txt").read_text()
    assert (first.verdict(0).verdict, text) == (Verdict.ok, "table of stop 1\n")


async def test_plain_vllm_second_capture_lists_only_its_own_trace(control_deploy, tmp_path):
    from sidecar.upstream.server import Flavor

    with FakeOmni(control_deploy) as fake:
        fake.flat = True
        async with UpstreamServer(fake.url, flavor=Flavor.vllm) as up, \
                CaptureController(up, control_deploy, settings=FAST, claims=ClaimRegistry()) as c:  # fmt: skip
            first = await _run(c, stages=[0])
            second = await _run(c, stages=[0])
    traces = [[f.name for f in v.sessions[0].files if f.name.endswith(".gz")] for v in (first.verdict(0),
                                                                                        second.verdict(0))]
    assert (len(traces[0]), len(traces[1]), traces[0] != traces[1]) == (1, 1, True)


async def test_plain_vllm_idle_window_is_empty(control_deploy):
    from sidecar.upstream.server import Flavor

    with FakeOmni(control_deploy) as fake:
        fake.flat = True
        fake.idle_stages = {0}
        async with UpstreamServer(fake.url, flavor=Flavor.vllm) as up, \
                CaptureController(up, control_deploy, settings=FAST, claims=ClaimRegistry()) as c:  # fmt: skip
            done = await _run(c, stages=[0])
    assert (done.verdict(0).verdict, done.verdict(0).reason.startswith("no request ran in the window")) == (
        Verdict.empty, True)


# --- nsys ---------------------------------------------------------------------------------


async def test_nsys_capture_targets_cuda_stages_and_says_how_to_wrap_the_server(tmp_path):
    from tests.fixtures.control import make_deploy

    deploy = make_deploy(tmp_path / "t", {0: "torch", 1: "cuda"})
    done = await _one(deploy, None, kind="nsys")
    v = done.verdict(1)
    assert (done.kind.value, done.stages, v.verdict, "nsys profile" in v.reason, ".nsys-rep" in v.reason) == (
        "nsys", [1], Verdict.unverified, True, True)


async def test_torch_capture_refuses_cuda_stages(tmp_path):
    from tests.fixtures.control import make_deploy

    deploy = make_deploy(tmp_path / "t", {0: "torch", 1: "cuda"})
    with FakeOmni(deploy) as fake:
        async with UpstreamServer(fake.url) as up, CaptureController(up, deploy, settings=FAST) as c:
            with pytest.raises(StageSelectionError) as err:
                await c.start([1])
    assert (err.value.code, fake.calls) == ("stage_not_torch", [])


async def test_nsys_capture_refuses_torch_stages(tmp_path):
    from tests.fixtures.control import make_deploy

    deploy = make_deploy(tmp_path / "t", {0: "torch", 1: "cuda"})
    with FakeOmni(deploy) as fake:
        async with UpstreamServer(fake.url) as up, CaptureController(up, deploy, settings=FAST) as c:
            with pytest.raises(StageSelectionError) as err:
                await c.start([0], kind="nsys")
    assert (err.value.code, fake.calls) == ("stage_not_cuda", [])


async def test_capture_kind_is_journaled(ctl, tmp_path):
    done = await _run(ctl, stages=[0])
    await ctl.flush()
    data = json.loads((tmp_path / "state" / "captures" / f"{done.id}.json").read_text())
    assert data["kind"] == "torch"


# --- many controllers in one process (a fleet's worker) -------------------------------------------


@pytest.mark.parametrize("other_stop_s, waits", [(0.5, True), (5.0, False)])
async def test_a_stops_follow_up_waits_a_bounded_while_for_the_other_stops_in_flight(
        fake_omni, control_deploy, tmp_path, other_stop_s, waits):
    # Two controllers on one event loop, as a fleet's worker drives 128: A's stop is answered at
    # once, B's after `other_stop_s`. A's follow-up (its artifact check, its /metrics scrape) waits
    # for B's answer, so it does not run between the other stops' answers and delay them; a while
    # only (FOLLOW_UP_WAIT_S, 1 s): B holding its stop for 5 s does not hold A's verdicts.
    other_deploy = make_deploy(tmp_path / "other-traces")
    with FakeOmni(other_deploy) as other:
        other.stop_delay = other_stop_s
        ctls = []
        for i, (fake, deploy) in enumerate(((fake_omni, control_deploy), (other, other_deploy))):
            up = UpstreamServer(fake.url, stop_budget_s=10, retry_wait_max_s=0.05)
            ctls.append(CaptureController(up, deploy, state_dir=tmp_path / f"state{i}", settings=FAST,
                                          pacing=FLEET_PACING))  # the fleet's pacing; a sidecar's has none
        try:
            for c in ctls:
                await c.open()
            caps = [await c.start() for c in ctls]
            for c, cap in zip(ctls, caps):
                await c.stop(cap.id)
            a = await ctls[0].wait(caps[0].id, timeout=20)
            assert a.state is CaptureState.completed, a
            b = await ctls[1].wait(caps[1].id, timeout=20)
            assert b.state is CaptureState.completed, b
        finally:
            for c in ctls:
                await c.close()
                await c.upstream.aclose()
    assert a.stopped_at is not None and b.stopped_at is not None and a.finished_at is not None
    assert a.stopped_at < b.stopped_at, (a.stopped_at, b.stopped_at)  # A's stop was answered first
    # A finished after B's stop was answered (it waited), or, B held past the bound, before it
    assert (a.finished_at >= b.stopped_at) is waits, (a.finished_at, b.stopped_at)


async def test_the_last_stops_answer_reaches_its_waiter_before_any_follow_up_starts(fake_omni, control_deploy, tmp_path):
    # A fleet's worker sends each stop's answer on as its driver's stop returns (UpstreamDriver,
    # the real one). The follow-ups of the worker's captures (artifact looks in threads, scrapes)
    # start once its last stop is answered; started before that answer was sent on, they held it
    # back 40 to 145 ms on the device (1,024 targets, docs/fleet-clocks.md). Three controllers on
    # one loop, their stops answered 0, 0.1 and 0.2 s after they arrive.
    from sidecar.fleet import Target
    from sidecar.fleet._drivers import UpstreamDriver

    events: list[tuple[str, int]] = []
    with FakeOmni(make_deploy(tmp_path / "b")) as b, FakeOmni(make_deploy(tmp_path / "c")) as c:
        fakes = [fake_omni, b, c]
        drivers = []
        for i, fake in enumerate(fakes):
            fake.stop_delay = 0.1 * i
            d = UpstreamDriver(Target.upstream(fake.url, tmp_path / f"deploy{i}.yaml"), fake.deploy, stop_budget_s=10,
                               settings=FAST, state_dir=tmp_path / f"state{i}")
            look = d.controller._collect

            async def logged(*args, _i=i, _look=look, **kwargs):  # type: ignore[no-untyped-def]
                events.append(("look", _i))
                return await _look(*args, **kwargs)

            d.controller._collect = logged  # type: ignore[method-assign]
            drivers.append(d)
        try:
            for d in drivers:
                await d.open()
            caps = [await d.start([0], "t", None, None) for d in drivers]

            async def stop(i: int) -> None:
                await drivers[i].stop(caps[i].id, StopReason.explicit)
                events.append(("answer", i))

            await asyncio.gather(*(stop(i) for i in range(3)))
            done = [await d.wait(cap.id, timeout=20) for d, cap in zip(drivers, caps)]
        finally:
            for d in drivers:
                await d.close()
    assert [cap.state for cap in done] == [CaptureState.completed] * 3, done
    answers = [n for n, (what, _) in enumerate(events) if what == "answer"]
    looks = [n for n, (what, _) in enumerate(events) if what == "look"]
    assert len(answers) == 3 and len(looks) >= 3 and max(answers) < min(looks), events
