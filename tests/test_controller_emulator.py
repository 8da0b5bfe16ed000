"""CaptureController driving the real emulator (a vLLM-Omni stand-in in child processes, torch
profilers in its stage workers) on free ports, for what only real processes show: real torch trace
files and their names, an idle real trace, a worker that really dies mid-window, plain vLLM's
file layout, and recovery after a kill -9 of the controller's process. The rules themselves
(validation, overlap, rollback, held and failed stops, watchdogs) are tests/test_controller.py's,
in process against FakeOmni."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from sidecar.config.deploy import load_deploy_config
from sidecar.control.controller import CaptureController, ControlSettings
from sidecar.control.models import CaptureState, StopReason, Verdict
from sidecar.emulator.launcher import EmulatorProcess
from sidecar.upstream.server import Flavor, UpstreamServer
from tests.fixtures.emulator import _pool_key, emulator_state, make_deploy
from tests.fixtures.waits import apoll

pytestmark = pytest.mark.slow

SETTINGS = ControlSettings(collect_timeout_s=30, poll_s=0.05, rollback_budget_s=5, close_timeout_s=5,
                           gone_poll_s=0.2, gone_after_s=2)
WAIT = 120  # generous: the shared CI box runs torch profilers on CPU


def _deploy(root: Path) -> Path:
    # stage 0: LLM, torch; stage 1: no profiler; stage 2: diffusion, torch.
    return make_deploy(root, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}, diffusion=[2])


@pytest.fixture(scope="module")
def emulator(tmp_path_factory, emulator_pool) -> EmulatorProcess:
    """One emulator (process workers, real torch profilers) for the module, from the session pool;
    a test that sets a fault resets it before it ends."""
    return emulator_pool.get(_deploy(tmp_path_factory.mktemp("emu")), startup_timeout=120)


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



async def test_a_steps_window_whose_summary_fails_still_completes_and_says_why(ctl, monkeypatch):
    # The steps a trace holds come from its summary; a summary that raised anything but a
    # SidecarError (a real one: a process pool in the daemonic analysis worker) failed the stop
    # itself ("internal_error"). A summary never changes the capture's outcome.
    import sidecar.analysis
    from tests.fixtures.analysis import summarizer_bug
    from tests.fixtures.load import steady_load

    monkeypatch.setattr(sidecar.analysis, "summarize_paths", summarizer_bug)
    with steady_load(ctl.upstream.base_url, max_tokens=1, chat=True):
        cap = await ctl.start([0], steps=5, steps_bound="count")
        done = await ctl.wait(cap.id, timeout=WAIT)
    assert (done.state, done.stop_reason, done.verdict(0).verdict, done.verdict(0).steps_traced) == (
        CaptureState.completed, StopReason.steps, Verdict.ok, None), done
    (why,) = done.fact("steps_not_counted")
    assert why.figures["why"].startswith("the summary failed (RuntimeError: summarizer bug"), done.facts

async def test_idle_window_is_empty_no_request_ran(ctl):
    done = await _capture(ctl, [0], busy=False)
    assert (done.state, done.verdict(0).verdict, done.verdict(0).reason.startswith("no request ran")) == (
        CaptureState.degraded, Verdict.empty, True)
    # the trace is named as it is on disk (a gzipped one was named without its .gz)
    (session,) = done.verdict(0).sessions
    traces = [f.name for f in session.files if f.name.endswith((".json", ".json.gz"))]
    assert traces and all(f"/{name} records no op" in done.verdict(0).reason for name in traces), (
        traces, done.verdict(0).reason)


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


# --- a worker that really dies ------------------------------------------------------------


@pytest.fixture(scope="module")
def died_mid_window(emulator):
    """A capture of [0, 2] whose stage 2 worker exits right after acknowledging the start:
    (the finished capture, the emulator's state after it). The emulator is reset after it (the
    worker respawned, the fault cleared, the stages still on this module's trace dirs)."""

    async def run(emu: EmulatorProcess):
        up, ctl = await _controller(emu)
        try:
            cap = await ctl.start([0, 2])
            await _request(emu.url)  # stage 0 works; stage 2's worker is gone by the time it is asked
            # the worker exits 0.2 s after its start reply: stop once the emulator shows it gone
            assert await apoll(lambda: not emulator_state(emu)["stages"]["2"]["alive"], timeout=WAIT)
            await ctl.stop(cap.id)
            return await ctl.wait(cap.id, timeout=WAIT), emulator_state(emu)
        finally:
            await ctl.close()
            await up.aclose()

    emulator.set_faults(die_after_start=2)
    try:
        return asyncio.run(run(emulator))
    finally:
        emulator.reset(profiler_dirs=_pool_key(emulator.deploy_config)[1])


async def test_stage_dead_mid_window_degrades_with_that_stage_missing(died_mid_window):
    done, _ = died_mid_window
    assert (done.state, done.verdict(0).verdict, done.verdict(2).verdict) == (
        CaptureState.degraded, Verdict.ok, Verdict.missing)


async def test_stage_dead_mid_window_reason_says_the_worker_died_and_no_stop_error(died_mid_window):
    # The stop answered SUCCESS (0.30 swallows the dead worker): no stop error, the reason blames the worker.
    done, _ = died_mid_window
    reason = done.verdict(2).reason or ""
    assert ("died" in reason, "check the server log for this stage" in reason, done.errors) == (True, True, [])


async def test_stage_dead_mid_window_leaves_no_profiler_running(died_mid_window):
    _, state = died_mid_window
    assert (state["stages"]["0"]["profiling"], state["stages"]["2"]["alive"]) == (False, False)


async def test_plain_vllm_flavor_finds_trace_files_in_the_dir(tmp_path, shared_emulator_factory):
    # the file layout is what counts here, not the ops in the traces: thread workers
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    emu = shared_emulator_factory(deploy, flavor="vllm", extra_args=["--workers", "thread"], startup_timeout=120)
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
