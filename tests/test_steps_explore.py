"""Steps windows and plans as a user runs them (CLI subprocess and HTTP against a real ``serve``
over the emulator): a plan interrupted, a delayed start whose server's /metrics goes unreadable.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.client import SidecarClient
from sidecar.errors import SidecarError
from tests.fixtures.emulator import EmulatorPool, emulator_state, make_deploy
from tests.fixtures.sidecar import start_in_background
from tests.fixtures.terminal import ctrl_c_as_in_a_terminal
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow
STAGES = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}  # no cap: probes are counted
THREAD = ["--workers", "thread"]
# no load in these tests: a probe's counter stands still, and its window would end by this bound
# only, long after each test's conditions are met
STALL = {"OMNI_SIDECAR_STEPS_STALL_S": "120"}


@pytest.fixture
def emulator(tmp_path: Path, emulator_pool: EmulatorPool) -> Iterator[Any]:
    emu = emulator_pool.get(make_deploy(tmp_path, STAGES), extra_args=THREAD, startup_timeout=120)
    yield emu
    emu.set_faults(metrics_delay_s=0)


def _probes(client: SidecarClient) -> list[Any]:
    return [c for c in client.list_captures() if (c.label or "").startswith("plan-probe-")]


def _starts(emu: Any) -> int:
    return sum(c["path"] == "/start_profile" for c in emulator_state(emu)["calls"])


def test_ctrl_c_during_a_plan_stops_its_probe_and_ends_the_plan(tmp_path: Path, emulator: Any,
                                                               sidecar_factory: Any) -> None:
    # Before: the CLI said "interrupted" and exited 130 at once, while the sidecar's plan went on
    # (the probe recording until its stall bound, then the next probes), holding the capture slot.
    sc = sidecar_factory(emulator.url, tmp_path / "deploy.yaml", env=STALL)
    env = {**os.environ, "OMNI_SIDECAR_URL": sc.url, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "sidecar", "plan", "--stages", "0,2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        with SidecarClient(sc.url, timeout=60) as client:
            assert poll(lambda: [c.state.value for c in _probes(client)] == ["active"], timeout=60)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=90)
            text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))
            # the sidecar's plan is over with the CLI: its one probe ended, stopped, and the slot is free
            assert poll(lambda: all(c.terminal for c in client.list_captures()), timeout=30), client.list_captures()
            probes = _probes(client)
            again = client.start_capture(stages=[0], duration_s=30)
            client.stop_capture(again.id, wait=True, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, text
    assert [(p.stop_reason.value if p.stop_reason else None) for p in probes] == ["explicit"], probes
    assert f"plan cancelled by Ctrl-C: its probe {probes[0].id} was stopped" in text, text
    assert "Traceback" not in text, text


def test_a_plan_whose_client_is_killed_stops_its_probe_and_frees_the_slot(tmp_path: Path, emulator: Any,
                                                                         sidecar_factory: Any) -> None:
    # Before: a killed CLI (kill -9, a second Ctrl-C, a dropped curl) left the plan running on the
    # sidecar, its probe recording until its stall bound, then the next probes, the slot held.
    sc = sidecar_factory(emulator.url, tmp_path / "deploy.yaml", env=STALL)
    env = {**os.environ, "OMNI_SIDECAR_URL": sc.url, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "sidecar", "plan", "--stages", "0,2"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with SidecarClient(sc.url, timeout=60) as client:
            assert poll(lambda: [c.state.value for c in _probes(client)] == ["active"], timeout=60)
            proc.kill()
            proc.wait(timeout=60)
            assert poll(lambda: all(c.terminal for c in client.list_captures()), timeout=60), client.list_captures()
            probes = _probes(client)
            again = client.start_capture(stages=[0], duration_s=30)  # the slot is free
            client.stop_capture(again.id, wait=True, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [(p.stop_reason.value if p.stop_reason else None) for p in probes] == ["explicit"], probes


def test_a_plan_whose_probe_is_stopped_over_http_ends_at_once_and_plans_nothing(tmp_path: Path, emulator: Any,
                                                                               sidecar_factory: Any) -> None:
    # Before: the plan took the stopped probe as skipped and went on probing (2 more probes).
    sc = sidecar_factory(emulator.url, tmp_path / "deploy.yaml", env=STALL)
    outcome: dict[str, Any] = {}

    def plan() -> None:
        with SidecarClient(sc.url, timeout=600) as planner:
            try:
                outcome["plan"] = planner.plan([0, 2])
            except SidecarError as exc:
                outcome["error"] = exc

    thread = threading.Thread(target=plan, daemon=True)
    thread.start()
    with SidecarClient(sc.url, timeout=60) as client:
        assert poll(lambda: [c.state.value for c in _probes(client)] == ["active"], timeout=60)
        client.stop_capture(_probes(client)[0].id)
        thread.join(timeout=120)
        probes = _probes(client)
    last = httpx.get(f"{sc.url}/v1/plan", timeout=60, trust_env=False).json()  # nothing kept for later starts
    err = outcome.get("error")
    assert (thread.is_alive(), getattr(err, "code", None), len(probes)) == (False, "plan_unmeasurable", 1), outcome
    assert err.details["cancelled"] is True and err.details["capture_id"] == probes[0].id, err.details
    assert "was stopped (explicit)" in err.message and last["plan"] is None, (err.message, last)


def test_a_delay_whose_metrics_go_unreadable_says_so_not_that_the_server_ran_none(
    tmp_path: Path, emulator: Any, sidecar_factory: Any
) -> None:
    # Before: "the server ran 0 of the 5 delay_steps within 3s; send load to it", where the counter
    # could not be read at all (a /metrics slower than the sidecar's probe timeout).
    sc = sidecar_factory(emulator.url, tmp_path / "deploy.yaml",
                         env={"OMNI_SIDECAR_STEPS_WAIT_S": "3", "OMNI_SIDECAR_PROBE_TIMEOUT_S": "0.5"})
    starts = _starts(emulator)
    thread, outcome = start_in_background(sc.url, timeout=120, stages=[0, 2], steps=5, delay_steps=5,
                                          steps_bound="count")
    with SidecarClient(sc.url, timeout=60) as client:
        # the counter was read before the capture was made (a start without one is refused): from
        # here on /metrics answers later than the sidecar waits
        assert poll(lambda: [c.state.value for c in client.list_captures()] == ["starting"], timeout=60)
        emulator.set_faults(metrics_delay_s=2)
        thread.join(timeout=120)
    err = outcome.get("error")
    assert (thread.is_alive(), getattr(err, "code", None)) == (False, "steps_not_reached"), outcome
    assert "could not be read" in err.message and "send load" not in err.message, err.message
    assert err.details["why"] and err.details["unreadable_s"] > 0, err.details
    assert _starts(emulator) == starts  # nothing was started
