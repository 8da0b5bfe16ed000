"""The emulator's fault knobs (test aids for the controller): a dead stage worker, a stop that
is held or never replies, a start that answers 500 — each the way the real server shows it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.emulator.launcher import EmulatorProcess
from tests.fixtures.emulator import emulator_state, make_deploy


@pytest.fixture(scope="module")
def dead(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorProcess]:
    deploy = make_deploy(tmp_path_factory.mktemp("dead"), {0: {"profiler": "torch"}, 1: {"profiler": "torch"}})
    args = ["--fault-dead-stage", "1", "--fault-stop-delay", "3", "--gzip-delay", "0"]
    with EmulatorProcess(deploy, extra_args=args) as e:
        yield e


@pytest.fixture(autouse=True)
def _stage0_stopped(dead: EmulatorProcess) -> Iterator[None]:
    yield
    httpx.post(f"{dead.url}/stop_profile", json={"stages": [0]}, timeout=60)


def post(emu: EmulatorProcess, path: str, body: Any = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{emu.url}{path}", json=body, timeout=timeout)


def test_dead_stage_is_reported_not_alive(dead: EmulatorProcess) -> None:
    stages = emulator_state(dead)["stages"]
    assert (stages["0"]["alive"], stages["1"]["alive"]) == (True, False)


def test_start_targeting_a_dead_stage_is_500(dead: EmulatorProcess) -> None:
    r = post(dead, "/start_profile", {"stages": [1]})
    assert (r.status_code, r.json()["error"]["message"].startswith("Failed to start profiler: ")) == (500, True)


def test_stop_targeting_a_dead_stage_is_500(dead: EmulatorProcess) -> None:
    r = post(dead, "/stop_profile", {"stages": [1]})
    assert (r.status_code, r.json()["error"]["message"].startswith("Failed to stop profiler: ")) == (500, True)


def test_start_all_has_started_the_stages_before_the_dead_one(dead: EmulatorProcess) -> None:
    r = post(dead, "/start_profile")
    assert (r.status_code, emulator_state(dead)["stages"]["0"]["profiling"]) == (500, True)


def test_stop_delay_holds_the_reply_after_workers_are_done(dead: EmulatorProcess) -> None:
    post(dead, "/start_profile", {"stages": [0]})
    n = len(emulator_state(dead)["calls"])
    replies: list[httpx.Response] = []
    t = threading.Thread(target=lambda: replies.append(post(dead, "/stop_profile", {"stages": [0]})))
    t.start()
    seen_pending = False
    deadline = time.monotonic() + 30
    while t.is_alive() and time.monotonic() < deadline:
        state = emulator_state(dead)
        calls = state["calls"][n:]
        if calls and calls[0]["status"] is None and not state["stages"]["0"]["profiling"]:
            seen_pending = True  # the worker has stopped; the reply is still held
            break
        time.sleep(0.05)
    t.join(60)
    assert (seen_pending, replies[0].json()) == (True, {"status": "SUCCESS"})


# --- start 500 / hanging stop ----------------------------------------------------------------


@pytest.fixture
def broken(tmp_path: Path, emulator_factory: Any) -> EmulatorProcess:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    return emulator_factory(deploy, extra_args=["--fault-start-500", "--fault-hang-stop"])


def test_start_500_fault_and_hanging_stop(broken: EmulatorProcess) -> None:
    r = post(broken, "/start_profile", {"stages": [0]})
    with pytest.raises(httpx.ReadTimeout):
        post(broken, "/stop_profile", {"stages": [0]}, timeout=2)
    last = emulator_state(broken)["calls"][-1]
    assert (r.status_code, r.json()["error"]["message"], last["path"], last["status"]) == (
        500,
        "Failed to start profiler: injected fault (--fault-start-500)",
        "/stop_profile",
        None,
    )


# --- a worker that dies during the window ----------------------------------------------------


@pytest.fixture(scope="module")
def died(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Response, httpx.Response, dict[str, Any]]]:
    """Stages 0 and 1, stage 0's worker exits after acknowledging its start; start [0, 1] and
    stop [0, 1]: (start reply, stop reply, state after the stop)."""
    deploy = make_deploy(tmp_path_factory.mktemp("died"), {0: {"profiler": "torch"}, 1: {"profiler": "torch"}})
    with EmulatorProcess(deploy, extra_args=["--fault-die-after-start", "0", "--gzip-delay", "0"]) as emu:
        started = post(emu, "/start_profile", {"stages": [0, 1]})
        deadline = time.monotonic() + 30
        while emulator_state(emu)["stages"]["0"]["alive"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped = post(emu, "/stop_profile", {"stages": [0, 1]})
        yield started, stopped, emulator_state(emu)


def test_die_after_start_acknowledges_the_start(died: tuple[httpx.Response, httpx.Response, dict[str, Any]]) -> None:
    started, _, _ = died
    assert (started.status_code, started.json()) == (200, {"status": "SUCCESS"})


def test_die_after_start_makes_the_later_stop_500(died: tuple[httpx.Response, httpx.Response, dict[str, Any]]) -> None:
    _, stopped, _ = died
    assert (stopped.status_code, stopped.json()["error"]["message"].startswith("Failed to stop profiler: ")) == (
        500, True)


def test_die_after_start_still_stops_the_stages_after_the_dead_one(
    died: tuple[httpx.Response, httpx.Response, dict[str, Any]],
) -> None:
    _, _, state = died
    stage1 = state["stages"]["1"]
    assert (state["stages"]["0"]["alive"], stage1["profiling"], len(stage1["sessions"])) == (False, False, 1)
