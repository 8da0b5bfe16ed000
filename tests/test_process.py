"""``ManagedProcess`` (the launcher under ``omni-sidecar serve`` / ``emulate`` children): a port it
picked and that another process took before the child bound it is picked again, not a failed
start; a port the caller chose is never swapped."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

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
def test_a_picked_port_taken_before_the_child_binds_it_is_picked_again(
    kind: str, taken_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The emulator case: a default-group run lost 17 web tests at once when the emulator picked
    its own port, outside this retry, and another process took it first."""
    picks = [taken_port]
    real = _process.free_port
    monkeypatch.setattr(_process, "free_port", lambda host="127.0.0.1": picks.pop() if picks else real(host))
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    proc: _process.ManagedProcess = (
        SidecarProcess(request.getfixturevalue("fake_omni").url, deploy, state_dir=tmp_path / "st")
        if kind == "sidecar" else EmulatorProcess(deploy))
    assert proc.port == taken_port
    try:
        proc.start()
        assert proc.port != taken_port and proc.returncode is None
        assert "address already in use" in proc.log_path.read_text().lower()  # the first child lost it
    finally:
        proc.stop(grace=10)


def test_a_chosen_port_that_is_taken_fails_the_start_naming_it(taken_port: int, tmp_path: Path, fake_omni) -> None:
    proc = SidecarProcess(fake_omni.url, make_deploy(tmp_path, {0: {"profiler": "torch"}}), port=taken_port,
                          state_dir=tmp_path / "st")
    try:
        with pytest.raises(SidecarStartError) as err:
            proc.start()
    finally:
        proc.stop(grace=10)
    assert proc.port == taken_port and "address already in use" in err.value.message.lower()
