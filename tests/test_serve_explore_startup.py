"""``omni-sidecar serve`` start-up as users run it, a real process each: bad settings (flags and
``OMNI_SIDECAR_*``), a port in use, ``--port 0``, a bad ``--fd``. Each refusal exits 1 before
anything starts, names what to change and prints no traceback; an accepted start serves where
its banner says. The upstream is a dead port (start-up does not need it).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar._child import child_env
from sidecar._process import listening_socket
from tests.fixtures.emulator import make_deploy
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow

DEAD = "http://127.0.0.1:9"
TIMEOUT = 60  # a start that is not refused runs until this: the test fails instead of hanging


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    return make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None})


def serve(deploy: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--upstream", DEAD, "--deploy-config", str(deploy),
         "--state-dir", str(tmp_path / "state"), *args],
        capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
        env=child_env({"COLUMNS": "400", **(env or {})}),
    )  # fmt: skip


def refused(proc: subprocess.CompletedProcess[str]) -> str:
    """The one-line refusal of a start that exited 1 before serving."""
    out = proc.stdout + proc.stderr
    assert (proc.returncode, "Traceback" in out, "Application startup" in out) == (1, False, False), out[-3000:]
    return " ".join(proc.stderr.split())


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process listens on."""
    with listening_socket() as sock:
        yield int(sock.getsockname()[1])


def test_a_port_in_use_is_refused_before_anything_starts(deploy: Path, tmp_path: Path, held_port: int) -> None:
    # uvicorn found it after the app's start-up (the journal's recovery included): exit 3 with
    # "[Errno 98] ... address already in use", and no word of what to do
    err = refused(serve(deploy, tmp_path, "--port", str(held_port)))
    assert f"--port {held_port} on 127.0.0.1 is in use" in err and "--port 0" in err, err


@pytest.mark.parametrize(("args", "env", "words"), [
    # inf in a float setting from the environment (the flags refuse it): a traceback (OverflowError)
    # when the journal computed its cutoff, exit 3
    ((), {"OMNI_SIDECAR_KEEP_DAYS": "inf"}, "invalid setting keep_days (--keep-days or OMNI_SIDECAR_KEEP_DAYS): "
                                            "Input should be a finite number"),
    # finite, past what a date can hold: the same traceback
    (("--keep-days", "1e10"), {}, "leave it unset to keep finished captures whatever their age"),
    # a URL never equals a request's Host name: it started, and every client by that name got 403
    (("--allowed-host", "http://sidecar:8092"), {}, "--allowed-host 'http://sidecar:8092' is not a host name"),
    # a descriptor that is no socket: a traceback (OSError: Bad file descriptor)
    (("--fd", "987"), {}, "--fd 987 is not an open socket"),
    # one server path mapped to two local ones: the last silently won
    (("--artifact-root", "/srv/t=/mnt/a", "--artifact-root", "/srv/t=/mnt/b"), {},
     "--artifact-root /srv/t is given twice, as /mnt/a and as /mnt/b"),
], ids=["env-inf", "keep-days-past-a-date", "allowed-host-url", "fd-not-a-socket", "artifact-root-twice"])  # fmt: skip
def test_a_bad_setting_is_refused_naming_it(deploy: Path, tmp_path: Path, args: tuple[str, ...],
                                            env: dict[str, str], words: str) -> None:  # fmt: skip
    err = refused(serve(deploy, tmp_path, "--port", "0", *args, env=env))
    assert words in err, err


def test_port_0_serves_on_the_port_the_banner_names_with_a_state_dir_of_that_port(deploy: Path, tmp_path: Path) -> None:
    # The banner said http://127.0.0.1:0, the state dir was `<upstream>-0` (every --port 0 sidecar of
    # one upstream in one journal, the second refused as its owner) and the lock recorded port 0.
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--upstream", DEAD, "--deploy-config", str(deploy), "--port", "0"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=child_env({"COLUMNS": "400", "XDG_STATE_HOME": str(tmp_path / "xdg")}),
        )  # fmt: skip
    try:
        banner = re.compile(r"http://127\.0\.0\.1:(\d+) \(docs at /docs\), state (\S+)")
        assert poll(lambda: banner.search(log.read_text()) or proc.poll() is not None, TIMEOUT), log.read_text()
        found = banner.search(log.read_text())
        assert found is not None, log.read_text()
        port, state = int(found.group(1)), Path(found.group(2))
        assert port != 0 and state.name == f"127.0.0.1_9-{port}", found.group(0)
        assert poll(lambda: _healthy(port), TIMEOUT)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5, trust_env=False).status_code == 200
    except (httpx.HTTPError, socket.error):
        return False
