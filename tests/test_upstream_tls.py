"""An ``https://`` upstream, through a real ``omni-sidecar serve``, and an ``https://`` sidecar (a
TLS proxy in front of one), through the CLI: vLLM serves TLS with ``--ssl-keyfile/--ssl-certfile``,
often self-signed. A certificate the sidecar does not trust is
said as such, with the fix (``SSL_CERT_FILE``), and the fix works; ``https://`` to a server that
serves plain HTTP names ``http://``. Before, both were "could not connect (ConnectError); check that
the server is running", about a server that was running.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest

from sidecar._child import child_env
from sidecar.api.launcher import SidecarProcess
from tests.fixtures.emulator import make_deploy
from tests.fixtures.http import serving

pytestmark = pytest.mark.slow

TIMEOUT = 120


class _Vllm(BaseHTTPRequestHandler):
    """As much of vLLM's surface as readiness reads: /health 200, the profiler routes mounted."""

    protocol_version = "HTTP/1.1"
    posts: list[str] = []

    def _reply(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_GET(self) -> None:
        # /health: vLLM's; /healthz: a sidecar's, for the client's side
        self._reply(200 if self.path in ("/health", "/healthz") else 405 if self.path == "/start_profile" else 404)

    def do_POST(self) -> None:
        type(self).posts.append(self.path)
        self._reply(200)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tls")
    key, crt = root / "key.pem", root / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, crt


@pytest.fixture(scope="module")
def https_vllm(cert: tuple[Path, Path]) -> Iterator[str]:
    with serving(_Vllm, tls=cert) as url:
        yield url


@pytest.fixture(scope="module")
def http_vllm() -> Iterator[str]:
    with serving(_Vllm) as url:
        yield url


def test_a_self_signed_certificate_is_named_with_the_fix_and_nothing_is_sent(https_vllm: str, tmp_path: Path) -> None:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    _Vllm.posts.clear()
    with SidecarProcess(https_vllm, deploy, state_dir=tmp_path / "state") as sc:
        ready = httpx.get(f"{sc.url}/readyz", timeout=TIMEOUT)
        start = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]}, timeout=TIMEOUT)
    said = ready.json()["error"]["message"]
    assert ready.status_code == 503 and "certificate was not accepted" in said and "SSL_CERT_FILE" in said, ready.text
    error = start.json()["error"]
    assert (start.status_code, error["code"]) == (503, "upstream_unreachable"), start.text
    assert "certificate was not accepted" in error["message"] and "nothing was sent" in error["message"], error
    assert _Vllm.posts == [], _Vllm.posts


def test_with_ssl_cert_file_the_same_server_is_ready(https_vllm: str, cert: tuple[Path, Path], tmp_path: Path) -> None:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    with SidecarProcess(https_vllm, deploy, state_dir=tmp_path / "state", env={"SSL_CERT_FILE": str(cert[1])}) as sc:
        ready = httpx.get(f"{sc.url}/readyz", timeout=TIMEOUT)
    assert (ready.status_code, ready.json().get("profiler_mounted")) == (200, True), ready.text


def test_https_to_a_plain_http_server_names_http(http_vllm: str, tmp_path: Path) -> None:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    with SidecarProcess(http_vllm.replace("http://", "https://"), deploy, state_dir=tmp_path / "state") as sc:
        ready = httpx.get(f"{sc.url}/readyz", timeout=TIMEOUT)
    said = ready.json()["error"]["message"]
    assert ready.status_code == 503 and "TLS handshake failed" in said and "use http://" in said, ready.text


def _cli_status(url: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", "status", "20261207-000000-abcdef", "--sidecar", url],
                          capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
                          env=child_env({"COLUMNS": "400", **(env or {})}))


@pytest.mark.parametrize("case", ["self_signed", "plain_http"])
def test_the_cli_names_a_tls_failure_of_a_sidecar_url_with_its_fix(https_vllm: str, http_vllm: str, case: str) -> None:
    url = https_vllm if case == "self_signed" else http_vllm.replace("http://", "https://")
    proc = _cli_status(url)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert (proc.returncode, "Traceback" in said, "nothing was sent" in said) == (1, False, True), said
    assert ("SSL_CERT_FILE" if case == "self_signed" else "use http://") in said, said


def test_with_ssl_cert_file_the_cli_reaches_the_sidecar(https_vllm: str, cert: tuple[Path, Path]) -> None:
    # past TLS: the stand-in has no such capture, and answers so (404), which the CLI reports as such
    said = " ".join((lambda p: p.stdout + p.stderr)(_cli_status(https_vllm, {"SSL_CERT_FILE": str(cert[1])})).split())
    assert ("TLS" in said, "not reachable" in said, "HTTP 404" in said) == (False, False, True), said
