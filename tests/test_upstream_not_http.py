"""An upstream address where another service answers (an SSH daemon, a TLS port given as
``http://``, an HTTP server that is not vLLM), through a real ``omni-sidecar serve`` and the CLI:
``/readyz`` says what answered and what to fix, a start fails at once as ``upstream_not_http`` with nothing rolled back (no profiler
runs there), and a stop is not retried for its budget. Before, each was a dropped connection
"with its effect unknown": the start's rollback stop was sent again for the whole stop budget.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar._child import child_env
from sidecar.api.launcher import SidecarProcess
from tests.fixtures.emulator import make_deploy
from tests.fixtures.http import serving

pytestmark = pytest.mark.slow

BANNER = b"SSH-2.0-OpenSSH_9.6\r\n"
TIMEOUT = 120  # far below the stop budget set below: a reply that waited it out fails the test


class NotHttpServer:
    """A TCP service on 127.0.0.1 that answers every connection with an SSH banner and records
    the first line of what it was sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(None)
        self.received: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        # As sshd: the banner first, then it reads until the client hangs up. Closed with the
        # request unread, the socket would answer with a reset that can overtake the banner.
        with conn:
            conn.settimeout(30)
            try:
                conn.sendall(BANNER)
                first = conn.recv(4096)
                self.received.append(first.split(b"\r\n", 1)[0])
                while first and conn.recv(4096):
                    pass
            except OSError:
                pass

    def __enter__(self) -> NotHttpServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not, on Linux)
        self.sock.close()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the service's accept loop did not end"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NotHttpServer, SidecarProcess]]:
    root = tmp_path_factory.mktemp("not-http")
    deploy = make_deploy(root, {0: {"profiler": "torch"}})
    env = {"OMNI_SIDECAR_STOP_BUDGET_S": "1800", "OMNI_SIDECAR_ROLLBACK_BUDGET_S": "1800"}
    with NotHttpServer() as upstream, SidecarProcess(upstream.url, deploy, state_dir=root / "state", env=env) as sc:
        yield upstream, sc


def test_readyz_names_what_answered_and_what_to_fix(served: tuple[NotHttpServer, SidecarProcess]) -> None:
    upstream, sc = served
    reply = httpx.get(f"{sc.url}/readyz", timeout=TIMEOUT)
    error = reply.json()["error"]
    assert (reply.status_code, error["code"]) == (503, "upstream_not_ready"), reply.text
    assert "not HTTP" in error["message"] and "SSH-2.0-OpenSSH_9.6" in error["message"], error
    assert "--upstream" in error["message"], error


def test_a_start_fails_at_once_and_sends_no_rollback_stop(served: tuple[NotHttpServer, SidecarProcess]) -> None:
    upstream, sc = served
    reply = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]}, timeout=TIMEOUT)
    error = reply.json()["error"]
    assert (reply.status_code, error["code"]) == (502, "upstream_not_http"), reply.text
    cap = httpx.get(f"{sc.url}/v1/captures/{error['details']['capture_id']}", timeout=TIMEOUT).json()
    assert (cap["state"], [e["code"] for e in cap["errors"]]) == ("failed", ["upstream_not_http"]), cap
    assert not any(line.startswith(b"POST /stop_profile") for line in upstream.received), upstream.received
    # the slot is free: the next start is refused the same way, not 409 for the failed one
    again = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]}, timeout=TIMEOUT)
    assert (again.status_code, again.json()["error"]["code"]) == (502, "upstream_not_http"), again.text


def test_the_cli_start_says_so_in_one_line(served: tuple[NotHttpServer, SidecarProcess]) -> None:
    _, sc = served
    proc = subprocess.run([sys.executable, "-m", "sidecar", "start", "--sidecar", sc.url, "--stages", "0"],
                          capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
                          env=child_env({"COLUMNS": "400"}))
    out = proc.stdout + proc.stderr
    assert (proc.returncode, "Traceback" in out, "upstream_not_http" in out) == (1, False, True), out
    assert "another service listens there" in out, out


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_readyz_tells_an_http_server_that_is_not_vllm_from_one_still_loading(tmp_path: Path) -> None:
    # vLLM and vLLM-Omni serve /health from their first moment; a 404 there was "still loading"
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    with serving(_NotFound) as other, SidecarProcess(other, deploy, state_dir=tmp_path / "state") as sc:
        reply = httpx.get(f"{sc.url}/readyz", timeout=TIMEOUT)
    error = reply.json()["error"]
    assert (reply.status_code, error["code"]) == (503, "upstream_not_ready"), reply.text
    assert "not vLLM" in error["message"] and "--upstream" in error["message"], error
    assert "loading" not in error["message"], error


async def test_a_banner_parsed_before_the_request_is_written_is_still_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schedule CI met under load: the banner arrives and is parsed (aiohttp's parser then
    closes the connection) before the request is written, so the write fails as a reset. Held
    here as a condition: the request waits until the parser has failed. Before, /readyz said
    "did not answer (RemoteProtocolError)" and a start was "sent, its effect unknown"."""
    import asyncio

    import aiohttp

    from sidecar.errors import UpstreamNotHttp
    from sidecar.upstream.server import UpstreamServer

    written_late: list[bool] = []
    send = aiohttp.ClientRequest.send

    async def after_the_parse(self: aiohttp.ClientRequest, conn: Any) -> aiohttp.ClientResponse:
        async with asyncio.timeout(30):
            while conn.protocol.exception() is None:
                await asyncio.sleep(0)
        written_late.append(True)
        return await send(self, conn)

    monkeypatch.setattr(aiohttp.ClientRequest, "send", after_the_parse)
    with NotHttpServer() as upstream:
        async with UpstreamServer(upstream.url, stop_budget_s=1800) as server:
            probe = await server.probe()
            assert "not HTTP" in (probe.reason or "") and "SSH-2.0-OpenSSH_9.6" in (probe.reason or ""), probe
            with pytest.raises(UpstreamNotHttp, match="SSH-2.0-OpenSSH_9.6"):
                await server.start_profile([0])
    assert len(written_late) >= 2, written_late  # the schedule was the one meant
