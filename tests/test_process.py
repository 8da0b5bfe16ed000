"""``ManagedProcess`` (the launcher under ``omni-sidecar serve`` / ``emulate`` children): a port it
picks is held, listening, from the pick to the child's exit (the child gets the socket), so no
other process can take it; a port the caller chose is never swapped, and taken it fails the start."""

from __future__ import annotations

import errno
import sys
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar import _process
from sidecar.api.launcher import SidecarProcess, SidecarStartError
from sidecar.emulator.launcher import EmulatorProcess
from tests.fixtures.emulator import make_deploy


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port held by another process's listening socket (it accepts, never answers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("kind", ["sidecar", "emulator"])
def test_a_picked_port_is_held_from_the_pick_and_the_child_serves_on_it(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A default-group run had one test's emulator answered by another test's: the port was picked,
    released, and taken by the other emulator before this one's child bound it, and the other one
    answered the health check. Now the launcher holds the port, listening, from the pick, and hands
    the socket to the child: another process cannot bind it at any moment."""
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    proc: _process.ManagedProcess = (
        SidecarProcess(request.getfixturevalue("fake_omni").url, deploy, state_dir=tmp_path / "st")
        if kind == "sidecar" else EmulatorProcess(deploy, extra_args=["--workers", "thread"]))
    try:
        picked = _bindable(proc.port)  # picked, not started
        proc.start()
        serving = _bindable(proc.port)  # the child holds it; the launcher's copy is closed
        assert "--fd" in _cmdline(proc.pid) and proc.returncode is None
        assert httpx.get(f"{proc.url}{proc.health_path}", timeout=30, trust_env=False).status_code == 200
    finally:
        proc.stop(grace=10)
    assert (picked, serving, _bindable(proc.port)) == (False, False, True)  # the child gone, free again


def test_a_process_never_started_frees_its_picked_port_on_stop(tmp_path: Path) -> None:
    proc = EmulatorProcess(make_deploy(tmp_path, {0: {"profiler": "torch"}}))
    held = _bindable(proc.port)
    assert proc.stop() is None  # nothing was started: no exit code
    assert (held, _bindable(proc.port)) == (False, True)


def _bindable(port: int) -> bool:
    """Whether another socket can bind ``port`` now (False: in use; any other error fails the test)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            return False
        return True


def _cmdline(pid: int | None) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_a_chosen_port_that_is_taken_fails_the_start_naming_it(taken_port: int, tmp_path: Path, fake_omni) -> None:
    proc = SidecarProcess(fake_omni.url, make_deploy(tmp_path, {0: {"profiler": "torch"}}), port=taken_port,
                          state_dir=tmp_path / "st")
    try:
        with pytest.raises(SidecarStartError) as err:
            proc.start()
    finally:
        proc.stop(grace=10)
    assert proc.port == taken_port and "address already in use" in err.value.message.lower()


class _HttpServer(_process.ManagedProcess):
    """A child that binds its port itself (as vLLM does): Python's http.server."""

    name = "http.server"
    health_path = "/"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "http.server", str(self.port), "--bind", self.host]


def test_a_server_that_binds_itself_gets_a_fresh_port_when_its_pick_was_taken(tmp_path: Path) -> None:
    proc = _HttpServer(host="127.0.0.1", port=None, log_path=tmp_path / "http.log", env=None, startup_timeout=60,
                       stop_grace=5)
    picked = proc.port
    proc._close_listener()  # released as it is just before such a child is spawned, and taken meanwhile
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", picked))
        thief.listen()
        try:
            proc.start()
            assert proc.port != picked and proc.returncode is None and "--fd" not in _cmdline(proc.pid)
            assert "address already in use" in proc.log_path.read_text().lower()  # the first child lost it
        finally:
            proc.stop(grace=10)
