"""What the clients make of a URL that answers, but not as the sidecar does (a proxy's HTML page,
another service's JSON): a typed error naming the URL and the likely fix, never a JSON decode
error, a KeyError or a pydantic error from inside the client. The replies come from a real HTTP
server on a free 127.0.0.1 port (a sidecar never sends them: respx is for faults, and none is
installed here)."""

from __future__ import annotations

import http.server
import json
from collections.abc import Iterator

import pytest

from sidecar.client import AsyncSidecarClient, SidecarClient, SidecarReplyInvalid
from sidecar.errors import SidecarError
from tests.fixtures.http import serving

# path -> (status, content type, body)
REPLIES = {
    "/healthz": (200, "text/html", b"<html>a login page</html>"),
    "/v1/captures": (200, "application/json", json.dumps({"items": []}).encode()),
    "/v1/captures/abc": (200, "application/json", json.dumps({"id": "abc"}).encode()),
    "/v1/clock": (200, "application/json", b"[1, 2]"),
    "/v1/captures/gone": (404, "application/json", json.dumps({"error": "no such thing"}).encode()),
    "/v1/captures/odd": (500, "application/json", json.dumps({"error": ["x"]}).encode()),
}


class _Other(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        status, ctype, body = REPLIES.get(self.path.split("?")[0], (404, "text/plain", b"not found"))
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def other_url() -> Iterator[str]:
    with serving(_Other) as url:
        yield url


@pytest.mark.parametrize(("call", "path"), [
    (lambda c: c.healthz(), "/healthz"),                 # not JSON
    (lambda c: c.list_captures(), "/v1/captures"),       # JSON of another shape
    (lambda c: c.resolve_id("a"), "/v1/captures"),
    (lambda c: c.get_capture("abc"), "/v1/captures/abc"),  # not a capture
    (lambda c: c.clock(), "/v1/clock"),                  # not an object
])
def test_a_reply_that_is_not_the_sidecars_is_a_typed_error_naming_the_url(other_url: str, call, path: str) -> None:
    with SidecarClient(other_url) as client, pytest.raises(SidecarReplyInvalid) as info:
        call(client)
    assert info.value.code == "sidecar_reply_invalid"
    assert path in info.value.message and "omni-sidecar serve" in info.value.message


async def test_the_async_client_says_the_same(other_url: str) -> None:
    async with AsyncSidecarClient(other_url) as client:
        with pytest.raises(SidecarReplyInvalid):
            await client.healthz()


@pytest.mark.parametrize(("capture_id", "status", "message"), [("gone", 404, "no such thing"), ("odd", 500, "HTTP 500")])
def test_an_error_reply_of_another_shape_is_still_a_typed_error(other_url: str, capture_id: str, status: int,
                                                                message: str) -> None:
    with SidecarClient(other_url) as client, pytest.raises(SidecarError) as info:
        client.get_capture(capture_id)
    assert info.value.details["status"] == status and message in info.value.message
