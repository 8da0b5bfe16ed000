"""One state dir per live sidecar, with real ``omni-sidecar serve`` processes: the default dir is
per upstream and port (two sidecars on one host never share a journal), a second sidecar on an
owned dir refuses naming the owner's pid, and after a kill -9 the next sidecar takes the dir over
and recovers the capture left active."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.api.launcher import SidecarProcess, free_port
from sidecar.client import SidecarClient
from tests.fixtures.emulator import EmulatorPool, emulator_state, make_deploy

pytestmark = pytest.mark.slow


class DefaultStateSidecar(SidecarProcess):
    """``omni-sidecar serve`` as a user starts it: no ``--state-dir``, so the default applies."""

    def argv(self) -> list[str]:
        cmd = super().argv()
        i = cmd.index("--state-dir")
        return cmd[:i] + cmd[i + 2 :]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[tuple[Any, Path]]:
    root = tmp_path_factory.mktemp("state")
    deploy = make_deploy(root, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})
    yield emulator_pool.get(deploy, extra_args=["--workers", "thread"], startup_timeout=120), deploy


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    """HOME and XDG_STATE_HOME of a fresh user, for the sidecar processes."""
    return {"HOME": str(tmp_path / "home"), "XDG_STATE_HOME": str(tmp_path / "xdg")}


def _request(emu_url: str) -> None:
    reply = httpx.post(f"{emu_url}/v1/chat/completions", timeout=60, trust_env=False,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    reply.raise_for_status()


def _journaled(path: Path) -> str:
    return json.loads(path.read_text())["state"]


def test_two_default_sidecars_on_one_host_never_touch_each_others_captures(setup, home, tmp_path):
    emu, deploy = setup
    logs = tmp_path / "logs"
    with DefaultStateSidecar(emu.url, deploy, env=home, log_path=logs / "a.log") as a, SidecarClient(a.url) as ca:
        cap = ca.start_capture([0, 2])
        try:
            with DefaultStateSidecar(emu.url, deploy, env=home, log_path=logs / "b.log") as b, \
                    SidecarClient(b.url) as cb:
                others = cb.list_captures()
            journal_a = Path(home["XDG_STATE_HOME"]) / "omni-sidecar" / f"127.0.0.1_{emu.port}-{a.port}"
            dirs = sorted(p.name for p in (Path(home["XDG_STATE_HOME"]) / "omni-sidecar").iterdir())
            still = ca.get_capture(cap.id).state.value
            on_disk = _journaled(journal_a / "captures" / f"{cap.id}.json")
        finally:
            _request(emu.url)
            done = ca.stop_capture(cap.id, wait=True, timeout=120)
    assert (others, dirs, still, on_disk, done.state.value) == (
        [], sorted([f"127.0.0.1_{emu.port}-{a.port}", f"127.0.0.1_{emu.port}-{b.port}"]), "active", "active",
        "completed")


def test_a_second_sidecar_on_an_owned_state_dir_refuses_naming_the_owner(setup, home, tmp_path):
    emu, deploy = setup
    state = tmp_path / "shared-state"
    with SidecarProcess(emu.url, deploy, state_dir=state, env=home) as owner:
        second = subprocess.run(
            [sys.executable, "-m", "sidecar", "serve", "--upstream", emu.url, "--deploy-config", str(deploy),
             "--port", str(free_port()), "--state-dir", str(state)],
            capture_output=True, text=True, timeout=120, env={**os.environ, **home},
        )  # fmt: skip
        err = " ".join(second.stderr.split())  # rich may wrap the message
    assert (second.returncode, "state_dir_locked" in err, f"pid {owner.pid}" in err, "Traceback" in err) == (
        1, True, True, False), second.stderr


def test_after_the_owner_is_killed_a_new_sidecar_takes_the_dir_over_and_recovers(setup, home, tmp_path):
    emu, deploy = setup
    state = tmp_path / "state"
    first = SidecarProcess(emu.url, deploy, state_dir=state, env=home, log_path=tmp_path / "first.log").start()
    try:
        with SidecarClient(first.url) as client:
            cid = client.start_capture([0, 2]).id
        _request(emu.url)
    finally:
        first.kill()
    with SidecarProcess(emu.url, deploy, state_dir=state, env=home, log_path=tmp_path / "second.log") as second, \
            SidecarClient(second.url, timeout=120) as client:
        done = client.wait_capture(cid, timeout=120)
        owner = json.loads((state / "lock").read_text())["pid"]
        pid = second.pid
    recording = [emulator_state(emu)["stages"][s]["profiling"] for s in ("0", "2")]
    assert (done.stop_reason.value, done.state.value, recording, owner) == (
        "stopped_on_recovery", "completed", [False, False], pid)


_HOLD = ("import sys; from sidecar.control.journal import StateDirLock\n"
         "StateDirLock(sys.argv[1]).acquire(command='omni-sidecar fleet'); print('held', flush=True); sys.stdin.read()\n")


def test_a_fleet_command_with_upstream_targets_refuses_a_state_dir_another_one_holds(tmp_path):
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "fleet")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        done = subprocess.run(
            [sys.executable, "-m", "sidecar", "fleet", "capture", "--targets", "upstream=http://127.0.0.1:9",
             "--deploy-config", str(deploy), "--state-dir", str(tmp_path / "fleet"), "--duration", "1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    err = " ".join(done.stderr.split())
    assert (done.returncode, "state_dir_locked" in err, f"pid {holder.pid}" in err) == (1, True, True), err
