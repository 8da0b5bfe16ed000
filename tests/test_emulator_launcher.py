"""``EmulatorProcess``: start waits for health, stop reaps the server and its stage workers,
workers die with a SIGKILLed server, start-up failures carry the log, no torch in the API process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.emulator.launcher import EmulatorProcess, EmulatorStartError, free_port
from tests.fixtures.emulator import make_deploy

psutil = pytest.importorskip("psutil")


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    return make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None})


@pytest.fixture
def one_stage(tmp_path: Path) -> Path:
    # one worker is enough to see who outlives whom (each costs a torch import with spawn), and
    # without a profiler the forkserver preloads no more than torch
    return make_deploy(tmp_path, {0: None}, name="one_stage.yaml")


def test_healthy_after_start_with_url_and_port(deploy: Path, emulator_factory: Any) -> None:
    emu = emulator_factory(deploy, extra_args=["--workers", "thread"])
    assert (emu.url, httpx.get(f"{emu.url}/health", timeout=60).status_code) == (f"http://127.0.0.1:{emu.port}", 200)


def test_stop_reaps_server_and_workers(one_stage: Path) -> None:
    emu = EmulatorProcess(one_stage).start()
    pids = [emu.pid] + [c.pid for c in psutil.Process(emu.pid).children(recursive=True)]
    emu.stop()
    assert len(pids) >= 3 and _gone(pids)  # the server, the forkserver, the worker


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_workers_die_with_a_sigkilled_server(one_stage: Path, start: str) -> None:
    emu = EmulatorProcess(one_stage, extra_args=["--worker-start", start]).start()
    try:
        workers = [int(p) for p in emu.state()["stages"]["0"]["pids"]]
        others = [c.pid for c in psutil.Process(emu.pid).children(recursive=True)]  # the forkserver too
        os.kill(emu.pid, signal.SIGKILL)
        assert workers and _gone(workers + others)
    finally:
        emu.stop()


def loads_torch(proc: Any) -> bool:
    return any("libtorch" in m.path for m in proc.memory_maps())


def test_api_process_never_loads_torch(omni_emulator: EmulatorProcess) -> None:
    server = psutil.Process(omni_emulator.pid)
    workers = [psutil.Process(p) for s in omni_emulator.state()["stages"].values() for p in s["pids"]]
    # the workers do load it, which shows the check can see it
    assert (loads_torch(server), all(loads_torch(w) for w in workers)) == (False, True)


def test_thread_workers_run_in_the_server_without_torch(deploy: Path, shared_emulator_factory: Any) -> None:
    emu = shared_emulator_factory(deploy, extra_args=["--workers", "thread"])
    server = psutil.Process(emu.pid)
    state = emu.state()
    assert (state["workers"], state["stages"]["0"]["pids"], loads_torch(server), server.children(recursive=True)) == (
        "thread", [emu.pid], False, [])  # fmt: skip


def test_start_failure_raises_with_the_log_tail(tmp_path: Path) -> None:
    # an invalid deploy: the server exits 1 with the loader's message and no traceback
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - stage_id: 0\n    profiler_config: {profiler: torch}\n")
    with pytest.raises(EmulatorStartError, match="torch_profiler_dir must be set") as err:
        EmulatorProcess(bad).start()
    log = Path(err.value.details["log"]).read_text(errors="replace")
    assert (err.value.details["exit_code"], "Traceback" in log) == (1, False)


def test_a_clean_stop_deletes_the_log_it_made_and_a_given_log_is_kept(deploy: Path, tmp_path: Path) -> None:
    made = EmulatorProcess(deploy, extra_args=["--workers", "thread"]).start()
    given = EmulatorProcess(deploy, extra_args=["--workers", "thread"], log_path=tmp_path / "emu.log").start()
    for emu in (made, given):
        emu.stop()
    assert (made.log_path.exists(), given.log_path.exists()) == (False, True)


def test_a_failed_start_keeps_its_log(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - stage_id: 0\n    profiler_config: {profiler: torch}\n")
    emu = EmulatorProcess(bad)
    with pytest.raises(EmulatorStartError):
        emu.start()
    emu.stop()
    assert emu.log_path.exists()
    emu.log_path.unlink()


def test_launcher_imports_neither_torch_nor_fastapi() -> None:
    code = "import sys, sidecar.emulator.launcher; print('torch' in sys.modules, 'fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.split() == ["False", "False"]


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port
