"""CaptureController driving the real emulator (a vLLM-Omni stand-in in child processes, torch
profilers in its stage workers) on free ports: the capture lifecycle, validation with no upstream
call, the fault knobs, watchdogs, 50 concurrent starts, and recovery after a kill -9."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar.config.deploy import load_deploy_config
from sidecar.control.controller import CaptureController, ControlSettings
from sidecar.control.models import CaptureState, StopReason, Verdict
from sidecar.emulator.launcher import EmulatorProcess
from sidecar.errors import CaptureActive, StageSelectionError, UpstreamError
from sidecar.upstream.server import Flavor, UpstreamServer
from tests.fixtures.emulator import emulator_state, make_deploy

pytestmark = pytest.mark.slow

SETTINGS = ControlSettings(collect_timeout_s=30, poll_s=0.05, rollback_budget_s=5, close_timeout_s=5,
                           gone_poll_s=0.2, gone_after_s=2)
WAIT = 120  # generous: the shared CI box runs torch profilers on CPU


def _deploy(root: Path) -> Path:
    # stage 0: LLM, torch; stage 1: no profiler; stage 2: diffusion, torch.
    return make_deploy(root, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}, diffusion=[2])


def _emulator(root: Path, *faults: str) -> EmulatorProcess:
    """Not started yet: use it as a context manager, so it is stopped even when a test fails."""
    return EmulatorProcess(_deploy(root), extra_args=list(faults), startup_timeout=120)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Iterator[EmulatorProcess]:
    with _emulator(tmp_path_factory.mktemp("emu")) as emu:
        yield emu


def _posts(emu: EmulatorProcess, path: str) -> list[dict]:
    return [c for c in emulator_state(emu)["calls"] if c["method"] == "POST" and c["path"] == path]


async def _controller(emu: EmulatorProcess, *, state_dir: Path | None = None, stop_budget_s: float = 60,
                      settings: ControlSettings = SETTINGS) -> tuple[UpstreamServer, CaptureController]:
    up = UpstreamServer(emu.url, stop_budget_s=stop_budget_s, retry_wait_max_s=0.5)
    ctl = CaptureController(up, load_deploy_config(emu.deploy_config), state_dir=state_dir, settings=settings)
    await ctl.open()
    return up, ctl


@pytest.fixture
async def ctl(emulator, tmp_path):
    up, c = await _controller(emulator, state_dir=tmp_path / "state")
    yield c
    await c.close()
    await up.aclose()


async def _request(url: str) -> None:
    """One chat request through every stage: the window records work (an idle one is ``empty``)."""
    async with httpx.AsyncClient(timeout=WAIT, trust_env=False) as client:
        await client.post(f"{url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


async def _capture(ctl: CaptureController, stages: list[int], *, busy: bool = True):
    cap = await ctl.start(stages)
    if busy:
        await _request(ctl.upstream.base_url)
    await ctl.stop(cap.id)
    return await ctl.wait(cap.id, timeout=WAIT)


# --- the normal path ----------------------------------------------------------------------


async def test_capture_completes_with_ok_verdicts_and_worker_file_names(ctl):
    done = await _capture(ctl, [0, 2])
    names = [(Path(v.sessions[0].path).name.split("_", 1)[1].rsplit("_", 1)[0], [f.name for f in v.sessions[0].files
              if f.name.startswith("trace")]) for v in done.verdicts]
    assert (done.state, [v.verdict for v in done.verdicts], names) == (
        CaptureState.completed,
        [Verdict.ok, Verdict.ok],
        [("stage0_rank0", ["trace_rank0.json.gz"]), ("stage_2_rep_0_diffusion", ["trace_rank0.json.gz"])],
    )


async def test_idle_window_is_empty_no_request_ran(ctl):
    done = await _capture(ctl, [0], busy=False)
    assert (done.state, done.verdict(0).verdict, done.verdict(0).reason.startswith("no request ran")) == (
        CaptureState.degraded, Verdict.empty, True)


async def test_upstream_got_the_same_explicit_set_for_start_and_stop(ctl, emulator):
    before = len(_posts(emulator, "/start_profile"))
    await _capture(ctl, [2])
    starts, stops = _posts(emulator, "/start_profile")[before:], _posts(emulator, "/stop_profile")[-1:]
    assert [c["stages"] for c in starts + stops] == [[2], [2]]


@pytest.mark.parametrize(("stages", "code"), [([], "stages_empty"), ([9], "stage_unknown"), ([1], "stage_not_profiled")])
async def test_bad_stages_make_no_upstream_call(ctl, emulator, stages, code):
    before = len(emulator_state(emulator)["calls"])
    with pytest.raises(StageSelectionError) as err:
        await ctl.start(stages)
    assert (err.value.code, emulator_state(emulator)["calls"][before:]) == (code, [])


async def test_fifty_concurrent_starts_one_wins_one_upstream_start(ctl, emulator):
    before = len(_posts(emulator, "/start_profile"))
    results = await asyncio.gather(*(ctl.start([0]) for _ in range(50)), return_exceptions=True)
    won = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, CaptureActive)]
    await ctl.stop(won[0].id)
    await ctl.wait(won[0].id, timeout=WAIT)
    assert (len(won), len(refused), len(_posts(emulator, "/start_profile")) - before) == (1, 49, 1)


async def test_duration_auto_stops_and_upstream_stops_profiling(ctl, emulator):
    cap = await ctl.start([0], duration_s=1)
    await _request(ctl.upstream.base_url)
    done = await ctl.wait(cap.id, timeout=WAIT)
    assert (done.stop_reason, done.state, emulator_state(emulator)["stages"]["0"]["profiling"]) == (
        StopReason.duration, CaptureState.completed, False), done.verdicts


async def test_lease_expiry_stops_the_capture(ctl):
    cap = await ctl.start([0], lease_s=1)
    await _request(ctl.upstream.base_url)
    done = await ctl.wait(cap.id, timeout=WAIT)
    assert (done.stop_reason, done.state) == (StopReason.lease_expired, CaptureState.completed)


_CRASHER = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from sidecar.config.deploy import load_deploy_config
    from sidecar.control.controller import CaptureController
    from sidecar.upstream.server import UpstreamServer

    async def main():
        up = UpstreamServer(sys.argv[1])
        ctl = CaptureController(up, load_deploy_config(sys.argv[2]), state_dir=Path(sys.argv[3]))
        await ctl.open()
        cap = await ctl.start([0, 2])
        print(cap.id, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_kill_9_mid_capture_is_recovered_and_upstream_stopped(emulator, tmp_path):
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHER, emulator.url, str(emulator.deploy_config), str(state)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
    )
    try:
        cid = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT)
        cid = cid.strip()
        await _request(emulator.url)
        assert emulator_state(emulator)["stages"]["0"]["profiling"], "precondition: capture is recording"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    up, ctl = await _controller(emulator, state_dir=state)
    try:
        done = await ctl.wait(cid, timeout=WAIT)
    finally:
        await ctl.close()
        await up.aclose()
    profiling = [emulator_state(emulator)["stages"][s]["profiling"] for s in ("0", "2")]
    assert (done.stop_reason, done.state, profiling) == (
        StopReason.stopped_on_recovery, CaptureState.completed, [False, False])


# --- faults (one emulator per knob) -------------------------------------------------------


@pytest.fixture(scope="module")
def slow_stop_emulator(tmp_path_factory) -> Iterator[EmulatorProcess]:
    with _emulator(tmp_path_factory.mktemp("slow"), "--fault-stop-delay", "4") as emu:
        yield emu


async def test_slow_stop_stays_stopping_and_controller_answers(slow_stop_emulator):
    up, ctl = await _controller(slow_stop_emulator)
    try:
        cap = await ctl.start([0])
        await _request(slow_stop_emulator.url)
        await ctl.stop(cap.id)
        await asyncio.sleep(1.0)
        during = (ctl.get(cap.id).state, [c.id for c in ctl.list()], ctl.active.id)
        done = await ctl.wait(cap.id, timeout=WAIT)
    finally:
        await ctl.close()
        await up.aclose()
    assert (during, done.state) == ((CaptureState.stopping, [cap.id], cap.id), CaptureState.completed)


async def test_hung_stop_is_held_with_what_was_found_so_far(tmp_path_factory):
    with _emulator(tmp_path_factory.mktemp("hang"), "--fault-hang-stop") as emu:
        up, ctl = await _controller(emu, stop_budget_s=3)
        try:
            cap = await ctl.start([0])
            await ctl.stop(cap.id)
            for _ in range(int(WAIT / 0.2)):
                if ctl.get(cap.id).verdicts:
                    break
                await asyncio.sleep(0.2)
            held = ctl.get(cap.id)
            with pytest.raises(CaptureActive) as refused:
                await ctl.start([0])
        finally:
            await ctl.close()
            await up.aclose()
    assert (held.state, held.errors[-1].code, held.verdict(0).reason.startswith("stop timed out after 3s"),
            refused.value.code) == (CaptureState.stopping, "upstream_timeout", True, "capture_stop_pending")


async def test_dead_stage_before_start_is_missing_and_the_start_is_not_rolled_back(tmp_path_factory):
    # vLLM-Omni 0.30's StagePool swallows the dead stage's EngineDeadError and start/stop answer 200
    # SUCCESS (DESIGN.md §3), as the emulator does: so a stage dead before the start is a capture that
    # runs (nothing rolled back) and ends degraded, that stage `missing` as a dead worker. A 500 start
    # is `test_start_500_rolls_back_and_fails`; a stage that dies during the window is the next test.
    with _emulator(tmp_path_factory.mktemp("dead"), "--fault-dead-stage", "2") as emu:
        up, ctl = await _controller(emu)
        try:
            cap = await ctl.start([0, 2])
            await _request(emu.url)  # stage 0 works; the request then fails at the dead stage 2
            await ctl.stop(cap.id)
            done = await ctl.wait(cap.id, timeout=WAIT)
            stage0 = emulator_state(emu)["stages"]["0"]["profiling"]
        finally:
            await ctl.close()
            await up.aclose()
    assert (done.state, done.stop_reason, done.verdict(0).verdict, done.verdict(2).verdict,
            "dead or restarted worker" in (done.verdict(2).reason or ""), done.errors, stage0) == (
        CaptureState.degraded, StopReason.explicit, Verdict.ok, Verdict.missing, True, [], False)


@pytest.fixture(scope="module")
def died_mid_window(tmp_path_factory):
    """A capture of [0, 2] whose stage 2 worker exits right after acknowledging the start:
    (the finished capture, the emulator's state after it)."""

    async def run(emu: EmulatorProcess):
        up, ctl = await _controller(emu)
        try:
            cap = await ctl.start([0, 2])
            await _request(emu.url)  # stage 0 works; stage 2's worker is gone by the time it is asked
            await asyncio.sleep(1.0)  # the worker exits 0.2 s after its start reply
            await ctl.stop(cap.id)
            return await ctl.wait(cap.id, timeout=WAIT), emulator_state(emu)
        finally:
            await ctl.close()
            await up.aclose()

    with _emulator(tmp_path_factory.mktemp("midwin"), "--fault-die-after-start", "2", "--gzip-delay", "0") as emu:
        return asyncio.run(run(emu))


async def test_stage_dead_mid_window_degrades_with_that_stage_missing(died_mid_window):
    done, _ = died_mid_window
    assert (done.state, done.verdict(0).verdict, done.verdict(2).verdict) == (
        CaptureState.degraded, Verdict.ok, Verdict.missing)


async def test_stage_dead_mid_window_reason_says_the_worker_died_and_no_stop_error(died_mid_window):
    # The stop answered SUCCESS (0.30 swallows the dead worker): no stop error, the reason blames the worker.
    done, _ = died_mid_window
    reason = done.verdict(2).reason or ""
    assert ("died" in reason, "check the server log for this stage" in reason, done.errors) == (True, True, [])


async def test_stop_500_degrades_and_the_reason_names_the_stop_error(tmp_path_factory):
    # A stop the server answers 500 (only when an exception escapes; the emulator's knob, which reaches
    # no worker) on every retry: `stop_server_error`, and a stage without a trace quotes it.
    with _emulator(tmp_path_factory.mktemp("stop500"), "--fault-stop-500") as emu:
        up, ctl = await _controller(emu)
        try:
            cap = await ctl.start([0, 2])
            await _request(emu.url)
            await ctl.stop(cap.id)
            done = await ctl.wait(cap.id, timeout=WAIT)
        finally:
            await ctl.close()
            await up.aclose()
    reason = done.verdict(2).reason or ""
    assert (done.state, done.verdict(2).verdict, "Failed to stop profiler" in reason, "server log for stage 2" in reason,
            done.errors[-1].code) == (CaptureState.degraded, Verdict.missing, True, True, "stop_server_error")


async def test_stage_dead_mid_window_leaves_no_profiler_running(died_mid_window):
    _, state = died_mid_window
    assert (state["stages"]["0"]["profiling"], state["stages"]["2"]["alive"]) == (False, False)


async def test_start_500_rolls_back_and_fails(tmp_path_factory):
    with _emulator(tmp_path_factory.mktemp("s500"), "--fault-start-500") as emu:
        up, ctl = await _controller(emu)
        try:
            with pytest.raises(UpstreamError) as err:
                await ctl.start([0, 2])
            cap = ctl.get(err.value.details["capture_id"])
            stops = [c["stages"] for c in _posts(emu, "/stop_profile")]
        finally:
            await ctl.close()
            await up.aclose()
    assert (cap.state, cap.stop_reason, stops, "injected fault" in cap.errors[0].message) == (
        CaptureState.failed, StopReason.rollback, [[0, 2]], True)


async def test_plain_vllm_flavor_finds_trace_files_in_the_dir(tmp_path):
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    with EmulatorProcess(deploy, flavor="vllm", startup_timeout=120) as emu:
        up = UpstreamServer(emu.url, flavor=Flavor.vllm, stop_budget_s=60)
        ctl = CaptureController(up, load_deploy_config(deploy), settings=SETTINGS)
        try:
            await ctl.open()
            done = await _capture(ctl, [0])
        finally:
            await ctl.close()
            await up.aclose()
    # Plain vLLM writes a worker trace and a front-end (`*.async_llm.*`) trace per stop; the expected
    # count is the worker traces.
    traces = [f.name for f in done.verdict(0).sessions[0].files if ".pt.trace.json" in f.name]
    frontend = [t for t in traces if ".async_llm." in t]
    assert (done.state, len(traces) - len(frontend), len(frontend), done.verdict(0).expected_traces,
            done.verdict(0).found_traces) == (CaptureState.completed, 1, 1, 1, 1)
