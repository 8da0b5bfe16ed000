"""The sidecar against a neighbour on the same host, through a real ``omni-sidecar serve`` over the
emulator and, for what only a browser does, a real Chromium. An exploratory pass tried: artifact
paths with ``..``, ``%2e%2e``, encoded slashes, absolute paths, NUL, full-width dots; symlinks to
``/etc/passwd`` or another capture's folder planted in a session folder, the folder (and its parent)
replaced by a link after the capture, a FIFO planted there; the token in a query string, a label,
an id and a wrong header (scrubbed from replies and the journal, refused); empty and whitespace
token files (refused at start); ``Host`` of another name with and without a port, a trailing dot,
IPv6 and IPv4-mapped literals, absolute-form targets, HTTP/1.0 without ``Host``; ``OPTIONS`` and
CORS headers (none sent); the page's DOM writes (text only) and where it keeps the token
(``sessionStorage``). What it found is tested here, each test failing before its fix:

- a page served from another port of this host (any local web server: a notebook, a dev server) is
  a loopback ``Origin``, which the guard let through: its ``fetch(..., {method: "POST", mode:
  "no-cors"})`` without a body is a simple request (no preflight, no content type), and started a
  capture of every stage on a sidecar without ``--token-file`` (or stopped one with ``/stop_profile``);
- replies carried no ``X-Content-Type-Options: nosniff`` nor any framing rule outside the page
  (``/docs`` could be framed by any site), and a downloaded trace file, whatever its name, carried no
  ``Content-Security-Policy``: a listed ``.html`` was ``text/html`` from the sidecar's own origin.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.web import WebStack, wait_for

pytestmark = pytest.mark.slow

TIMEOUT = 120


def _captures(stack: WebStack) -> list[str]:
    reply = httpx.get(f"{stack.url}/v1/captures", params={"limit": 1000}, timeout=TIMEOUT)
    return [c["id"] for c in reply.json()["captures"]]


NEIGHBOUR_PAGE = (
    b"<!doctype html><title>neighbour</title><script>"
    b"window.send = (url) => fetch(url, {method: 'POST', mode: 'no-cors'}).then(() => 'sent', (e) => String(e));"
    b"</script>"
)


class _NeighbourPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(NEIGHBOUR_PAGE)))
        self.end_headers()
        self.wfile.write(NEIGHBOUR_PAGE)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def neighbour(open_page: Any, web_stack: WebStack) -> Iterator[Callable[[str], str]]:
    """A page of another web server on this host (127.0.0.1, another port: a notebook, a dev
    server); ``send(path)`` has it ``POST`` the sidecar's ``path`` without a body, as any page can
    without a preflight, and returns once the browser sent it and its opaque answer came back.
    The server is real: Chromium lets only a page served from a loopback address reach loopback."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NeighbourPage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        page = open_page(f"http://127.0.0.1:{server.server_address[1]}")
        page.goto("/")

        def send(path: str) -> str:
            return str(page.evaluate("(url) => window.send(url)", f"{web_stack.url}{path}"))

        yield send
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("path", ["/v1/captures", "/start_profile"])
def test_a_page_on_another_local_port_cannot_start_a_capture(neighbour: Any, web_stack: WebStack,
                                                             path: str) -> None:
    before = _captures(web_stack)
    assert neighbour(path) == "sent"  # the browser sent it: a no-cors POST is a simple request
    assert _captures(web_stack) == before
    assert httpx.get(f"{web_stack.url}/healthz", timeout=TIMEOUT).json()["active_capture"] is None


def test_a_page_on_another_local_port_cannot_stop_a_capture(neighbour: Any, web_stack: WebStack) -> None:
    cap = httpx.post(f"{web_stack.url}/v1/captures", json={"stages": [0]}, timeout=TIMEOUT).json()
    try:
        assert neighbour("/stop_profile") == "sent"
        assert neighbour(f"/v1/captures/{cap['id']}/stop") == "sent"
        assert httpx.get(f"{web_stack.url}/v1/captures/{cap['id']}", timeout=TIMEOUT).json()["state"] == "active"
    finally:
        httpx.post(f"{web_stack.url}/v1/captures/{cap['id']}/stop", params={"wait": "true"}, timeout=TIMEOUT)


def test_the_sidecar_under_another_loopback_name_is_still_its_own_origin(web_stack: WebStack) -> None:
    port = web_stack.url.rsplit(":", 1)[1]
    reply = httpx.post(f"{web_stack.url}/v1/captures", json={"stages": [0]},
                       headers={"origin": f"http://localhost:{port}"}, timeout=TIMEOUT)
    assert reply.status_code == 201, reply.text
    httpx.post(f"{web_stack.url}/v1/captures/{reply.json()['id']}/stop", params={"wait": "true"}, timeout=TIMEOUT)


@pytest.mark.parametrize("path", ["/", "/web/app.js", "/healthz", "/v1/captures", "/docs", "/openapi.json",
                                  "/no/such/route"])
def test_every_reply_says_nosniff_and_no_framing(web_stack: WebStack, path: str) -> None:
    reply = httpx.get(f"{web_stack.url}{path}", timeout=TIMEOUT)
    assert reply.headers.get("x-content-type-options") == "nosniff", dict(reply.headers)
    assert reply.headers.get("x-frame-options") == "DENY", dict(reply.headers)


@pytest.fixture(scope="module")
def html_artifact(web_stack: WebStack) -> tuple[str, str]:
    """(capture id, relpath) of a ``page.html`` a neighbour wrote into a session folder while the
    capture recorded: the capture lists it as one of its files."""
    root = web_stack.deploy.parent / "traces" / "stage0"  # make_deploy's torch_profiler_dir
    before = set(root.glob("*_stage0_*"))
    cap = httpx.post(f"{web_stack.url}/v1/captures", json={"stages": [0], "label": "html"}, timeout=TIMEOUT).json()
    try:
        assert wait_for(lambda: bool(set(root.glob("*_stage0_*")) - before), timeout=TIMEOUT)
        (set(root.glob("*_stage0_*")) - before).pop().joinpath("page.html").write_text(
            "<script>fetch('/v1/captures', {method: 'POST'})</script>")
    finally:
        done = httpx.post(f"{web_stack.url}/v1/captures/{cap['id']}/stop", params={"wait": "true"},
                          timeout=TIMEOUT).json()
    session = next(s for v in done["verdicts"] for s in v["sessions"] if any(f["name"] == "page.html" for f in s["files"]))
    return done["id"], f"{Path(session['local_path']).name}/page.html"


def test_a_downloaded_file_is_never_a_page_of_the_sidecar(web_stack: WebStack, html_artifact: tuple[str, str]) -> None:
    capture_id, relpath = html_artifact
    reply = httpx.get(f"{web_stack.url}/v1/captures/{capture_id}/files/{relpath}", timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-disposition"].startswith("attachment;")
    assert reply.headers.get("x-content-type-options") == "nosniff"
    csp = reply.headers.get("content-security-policy", "")
    assert "sandbox" in csp and "default-src 'none'" in csp, dict(reply.headers)


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o640, True), (0o600, False), (0o400, False)])
def test_a_token_file_others_can_read_is_warned_at_start(tmp_path: Path, shared_emulator_factory: Callable[..., Any],
                                                        sidecar_factory: Callable[..., Any], mode: int, warned: bool) -> None:
    from tests.fixtures.emulator import make_deploy

    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    token = tmp_path / "token"
    token.write_text("tok-perm-0123456789\n")
    token.chmod(mode)
    emu = shared_emulator_factory(deploy, extra_args=["--workers", "thread"])
    sc = sidecar_factory(emu.url, deploy, token_file=token, log_path=tmp_path / "sidecar.log")
    log = (tmp_path / "sidecar.log").read_text()
    said = f"--token-file {token} can be read by other users of this host (mode {mode:03o})"
    assert (said in log, f"chmod 600 {token}" in log) == (warned, warned), log[-2000:]
    assert httpx.get(f"{sc.url}/healthz", timeout=30).status_code == 200  # a warning: it serves
