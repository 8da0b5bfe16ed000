"""The emulator's fault knobs, set at run time through ``POST /emulator/faults`` on the pooled
3-stage emulator with real process workers (``omni_emulator``: 0 LLM + torch, 1 LLM without a
profiler, 2 diffusion + torch), reset before and after each test: a dead stage worker as 0.30 shows
it (SUCCESS, no trace, /health 503), a worker dying mid-window, a stop held or hung, start/stop
500 — and the reset that lets one emulator serve a whole session.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.emulator.launcher import EmulatorProcess
from tests.fixtures.emulator import emulator_state, log_offset, log_since, make_deploy
from tests.fixtures.waits import poll

TIMEOUT = 60


@pytest.fixture
def emu(omni_emulator: EmulatorProcess) -> EmulatorProcess:
    return omni_emulator


def post(emu: EmulatorProcess, path: str, body: Any = None, timeout: float = TIMEOUT) -> httpx.Response:
    return emu.http.post(path, json=body, timeout=timeout)


def sessions(emu: EmulatorProcess) -> dict[str, list[str]]:
    return {sid: s["sessions"] for sid, s in emulator_state(emu)["stages"].items()}


def files(folder: str) -> list[str]:
    return sorted(p.name.removesuffix(".gz") for p in Path(folder).iterdir())


# --- a dead worker, as 0.30 shows it ---------------------------------------------------------


def test_dead_stage_start_and_stop_answer_success(emu: EmulatorProcess) -> None:
    emu.set_faults(dead_stage=2)
    replies = [post(emu, "/start_profile"), post(emu, "/stop_profile")]
    assert [(r.status_code, r.json()) for r in replies] == [(200, {"status": "SUCCESS"})] * 2


def test_dead_stage_writes_no_trace_while_the_others_do(emu: EmulatorProcess, tmp_path: Path) -> None:
    emu.set_faults(dead_stage=2)
    post(emu, "/start_profile")
    post(emu, "/stop_profile")
    got = sessions(emu)
    written = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert (got["2"], files(got["0"][0]), written) == ([], ["profiler_out_0.txt", "trace_rank0.json"], ["stage0"])


def test_dead_stage_failure_is_logged_as_the_stage_pool_does(emu: EmulatorProcess) -> None:
    emu.set_faults(dead_stage=2)
    offset = log_offset(emu)
    post(emu, "/start_profile", {"stages": [2]})
    log = log_since(emu, offset)
    assert "[StagePool] collective_rpc failed: stage=2 replica=0 method=profile: EngineDeadError" in log


def test_health_is_503_unhealthy_with_a_dead_stage_and_ready_stays_200(emu: EmulatorProcess) -> None:
    before = emu.http.get("/health", timeout=TIMEOUT)
    emu.set_faults(dead_stage=2)
    health = emu.http.get("/health", timeout=TIMEOUT)
    ready = emu.http.get("/emulator/ready", timeout=TIMEOUT)
    assert [(r.status_code, r.json().get("status")) for r in (before, health)] == [(200, "healthy"), (503, "unhealthy")]
    assert ready.status_code == 200


def test_dead_stage_from_the_command_line(tmp_path: Path, emulator_factory: Any) -> None:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: {"profiler": "torch"}})
    e = emulator_factory(deploy, extra_args=["--fault-dead-stage", "1", "--workers", "thread"])
    alive = {sid: s["alive"] for sid, s in emulator_state(e)["stages"].items()}
    r = post(e, "/start_profile", {"stages": [1]})
    assert (alive, e.http.get("/health", timeout=TIMEOUT).status_code, r.status_code) == (
        {"0": True, "1": False},
        503,
        200,
    )


# --- a worker that dies during the window ----------------------------------------------------


def test_die_after_start_acknowledges_then_leaves_an_empty_folder(emu: EmulatorProcess) -> None:
    emu.set_faults(die_after_start=0)
    started = post(emu, "/start_profile", {"stages": [0, 2]})
    assert poll(lambda: not emulator_state(emu)["stages"]["0"]["alive"])
    stopped = post(emu, "/stop_profile", {"stages": [0, 2]})
    got = sessions(emu)
    assert [(r.status_code, r.json()) for r in (started, stopped)] == [(200, {"status": "SUCCESS"})] * 2
    assert (files(got["0"][0]), files(got["2"][0])) == ([], ["profiler_out_0.txt", "trace_rank0.json"])


# --- knobs that still give a 500 -------------------------------------------------------------


def test_start_500_reaches_no_worker(emu: EmulatorProcess) -> None:
    emu.set_faults(start_500=True)
    r = post(emu, "/start_profile", {"stages": [0]})
    state = emulator_state(emu)
    assert (r.status_code, r.json()["error"]["message"], state["stages"]["0"]["active"]) == (
        500,
        "Failed to start profiler: injected fault (--fault-start-500)",
        False,
    )


def test_stop_500_reaches_no_worker(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    emu.set_faults(stop_500=True)
    r = post(emu, "/stop_profile", {"stages": [0]})
    assert (r.status_code, r.json()["error"]["message"], emulator_state(emu)["stages"]["0"]["profiling"]) == (
        500,
        "Failed to stop profiler: injected fault (--fault-stop-500)",
        True,
    )


# --- held and hung stops -----------------------------------------------------------------------


def _stop_in_background(emu: EmulatorProcess) -> tuple[threading.Thread, list[httpx.Response]]:
    replies: list[httpx.Response] = []
    # its own client: this thread's request is in flight while the test polls on emu.http
    t = threading.Thread(
        target=lambda: replies.append(httpx.post(f"{emu.url}/stop_profile", json={"stages": [0]}, timeout=120))
    )
    t.start()
    return t, replies


def _pending_stop_with_workers_done(emu: EmulatorProcess) -> bool:
    state = emulator_state(emu)
    pending = [c for c in state["calls"] if c["path"] == "/stop_profile" and c["status"] is None]
    return bool(pending) and not state["stages"]["0"]["profiling"]


def test_stop_delay_holds_the_reply_after_workers_are_done(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    emu.set_faults(stop_delay_s=3)  # long enough to be seen under load
    t, replies = _stop_in_background(emu)
    seen = poll(lambda: _pending_stop_with_workers_done(emu))
    t.join(120)
    assert (seen, replies[0].json()) == (True, {"status": "SUCCESS"})


def test_hang_stop_replies_only_after_a_reset(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    emu.set_faults(hang_stop=True)
    t, replies = _stop_in_background(emu)
    # delivered (the worker stopped recording), not answered
    assert poll(lambda: _pending_stop_with_workers_done(emu))
    waiting = (t.is_alive(), list(replies))
    emu.reset()
    t.join(120)
    assert (waiting, [r.status_code for r in replies]) == ((True, []), [200])


# --- the test routes themselves ------------------------------------------------------------------


def test_faults_route_changes_only_the_knobs_given(emu: EmulatorProcess) -> None:
    emu.set_faults(start_500=True)
    now = emu.set_faults(stop_delay_s=1.5)
    got = emu.http.get("/emulator/faults", timeout=TIMEOUT).json()
    assert (now, got["start_500"], got["stop_delay_s"]) == (got, True, 1.5)


@pytest.mark.parametrize("body", [{"no_such_knob": 1}, {"stop_delay_s": -1}], ids=["unknown", "negative"])
def test_bad_fault_settings_are_400(emu: EmulatorProcess, body: dict[str, Any]) -> None:
    r = post(emu, "/emulator/faults", body)
    assert (r.status_code, r.json()["error"]["message"].startswith("bad fault settings")) == (400, True)


def test_reset_replaces_dead_workers_and_clears_faults_calls_and_sessions(emu: EmulatorProcess, tmp_path: Path) -> None:
    emu.set_faults(dead_stage=0, start_500=True)
    post(emu, "/start_profile", {"stages": [0]})
    state = emu.reset(profiler_dirs={0: tmp_path / "traces" / "stage0"})
    r = post(emu, "/start_profile", {"stages": [0]})
    assert (
        [s["alive"] for s in state["stages"].values()],
        any(state["faults"].values()),
        state["calls"],
        [s["sessions"] for s in state["stages"].values()],
        r.status_code,
        emulator_state(emu)["stages"]["0"]["profiling"],
    ) == ([True] * 3, False, [], [[]] * 3, 200, True)


def test_reset_leaves_the_profiler_idle_without_writing(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    folder = sessions(emu)["0"][0]
    state = emu.reset()
    assert (state["stages"]["0"]["profiling"], state["stages"]["0"]["active"], files(folder)) == (False, False, [])


def test_reset_points_stages_at_new_trace_dirs(emu: EmulatorProcess, tmp_path: Path) -> None:
    emu.reset(profiler_dirs={0: tmp_path / "fresh0"})
    post(emu, "/start_profile", {"stages": [0]})
    post(emu, "/stop_profile", {"stages": [0]})
    (folder,) = sessions(emu)["0"]
    assert Path(folder).parent == tmp_path / "fresh0" and files(folder) == ["profiler_out_0.txt", "trace_rank0.json"]
