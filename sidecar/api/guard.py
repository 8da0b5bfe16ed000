"""What every request must pass before a route runs, as one pure ASGI middleware:

- ``Host`` (and ``Origin`` when sent) name an allowed host: loopback names by default, more with
  ``--allowed-host`` (``*``: any). A DNS-rebinding page arrives with its own host name; a
  cross-site page with its own origin. A loopback ``Origin`` is this sidecar's own page only on the
  ``Host``'s port: a page of another server on this host (a notebook, a dev server) can send a
  body-less ``POST`` (start, stop) without a preflight, so it is refused like another site's.
- A mutating request's body is ``application/json`` (415 otherwise). curl's ``-d`` default,
  ``application/x-www-form-urlencoded``, and ``text/plain`` are exactly what an HTML form on any
  web page can send without a preflight, so they are refused, not read as JSON.
- A body is at most ``max_body`` bytes (413), whether announced by ``Content-Length`` or streamed.

Every reply says ``X-Content-Type-Options: nosniff`` and ``X-Frame-Options: DENY`` (no browser
renders a reply as another type, no other site frames ``/docs`` or the page).

And every request gets an answer when the server shuts down under it: on SIGTERM ``omni-sidecar
serve`` begins the active capture's stop (``app.begin_shutdown``), uvicorn stops accepting, waits
``timeout_graceful_shutdown`` for the requests in flight, then cancels those still running. A
request still waiting on a capture then (``POST .../stop?wait=true``, ``POST /stop_profile``, ``GET
...?until=started``, a start the server has not answered yet) answered uvicorn's plain-text ``500
Internal Server Error``; it is answered 503 ``sidecar_closing``, naming what becomes of the capture.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sidecar.api.errors import error_response
from sidecar.config.settings import is_loopback
from sidecar.errors import BodyTooLarge, HostNotAllowed, MediaTypeUnsupported, SidecarClosing, SidecarError

MAX_BODY = 1024 * 1024  # 1 MiB: the largest real body is a few hundred bytes
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_PORTS = {"http": 80, "https": 443}
REPLY_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"))


def _hostname(value: str) -> str:
    """``host[:port]`` or ``[v6]:port`` → the bare lower-case name."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _port(host: str, scheme: str) -> int | None:
    """The port of a ``Host`` value (the scheme's default when it names none); None: not a port."""
    tail = host.strip()
    tail = tail[tail.find("]") + 1 :] if tail.startswith("[") else tail
    if tail.count(":") != 1:
        return DEFAULT_PORTS.get(scheme)
    port = tail.rsplit(":", 1)[1]
    return int(port) if port.isdigit() else None


class RequestGuard:
    def __init__(self, app: ASGIApp, *, allowed_hosts: Iterable[str] = (), max_body: int = MAX_BODY) -> None:
        self.app = app
        hosts = {h.strip().lower() for h in allowed_hosts if h.strip()}
        self.any_host = "*" in hosts
        self.hosts = {_hostname(h) for h in hosts - {"*"}}
        self.max_body = max_body

    def _allowed(self, name: str) -> bool:
        return self.any_host or is_loopback(name) or name in self.hosts

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        """A name given with --allowed-host (any port), or a loopback name on the port the request
        came to: this sidecar's own page, whichever loopback name it was opened by."""
        try:
            parts = urlsplit(origin)
            name, port = parts.hostname or "", parts.port or DEFAULT_PORTS.get(parts.scheme)
        except ValueError:  # a port that is not a number
            return False
        if self.any_host or name in self.hosts:
            return True
        return is_loopback(name) and host is not None and port is not None and port == _port(host, parts.scheme)

    def _check(self, scope: Scope) -> SidecarError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if host is not None and not self._allowed(_hostname(host)):
            return HostNotAllowed(
                f"Host {host!r} is not allowed: this sidecar answers to loopback names"
                + (f" and {sorted(self.hosts)}" if self.hosts else "")
                + "; start it with --allowed-host NAME to add one",
                details={"host": host},
            )
        origin = headers.get("origin")
        if origin is not None and (origin == "null" or not self._origin_allowed(origin, host)):
            return HostNotAllowed(
                f"Origin {origin!r} is not allowed (a page of another site, or of another server on this "
                "host: a loopback page on another port than the sidecar's); call the API from a script or "
                "from the sidecar's own page, or add the page's host name with --allowed-host NAME",
                details={"origin": origin, "host": host},
            )
        if scope.get("method") in MUTATING:
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            has_body = headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers
            if (ctype or has_body) and not (ctype == "application/json" or ctype.endswith("+json")):
                return MediaTypeUnsupported(
                    f"the body must be JSON, got content-type {ctype or 'none'!r}; send "
                    "`-H 'content-type: application/json'` with curl -d (form and text bodies are refused: "
                    "any web page can send those)",
                    details={"content_type": ctype or None},
                )
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_body:
                return self._too_large()
        return None

    def _too_large(self) -> BodyTooLarge:
        return BodyTooLarge(
            f"the body is larger than {self.max_body} bytes; the API's bodies are a few hundred bytes",
            details={"max_bytes": self.max_body},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_reply_headers(send)
        refused = self._check(scope)
        if refused is not None:
            await error_response(refused)(scope, receive, send)
            return
        seen = 0

        async def bounded_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _BodyTooLarge(self._too_large())
            return message

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await error_response(self._too_large())(scope, receive, send)
        except asyncio.CancelledError:  # the server's shutdown ended the request (module docstring)
            if started:  # a reply under way cannot be replaced: the connection ends as it would have
                raise
            uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python >= 3.11
            if uncancel is not None:
                uncancel()  # answered, not cancelled: the server closes the connection after the reply
            await error_response(_closing(scope.get("path", "")))(scope, receive, send)


def _with_reply_headers(send: Send) -> Send:
    """``send`` that adds ``REPLY_HEADERS`` to the reply's start where a route has not set them."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            present = {k.lower() for k, _ in headers}
            headers += [(k, v) for k, v in REPLY_HEADERS if k not in present]
            message = {**message, "headers": headers}
        await send(message)

    return sending


def _closing(path: str) -> SidecarClosing:
    return SidecarClosing(
        f"the sidecar is shutting down and ended this request ({path}) while it was still waiting. A capture "
        "it was waiting on is stopped during the shutdown, or, if its stop is still unanswered then, at the next "
        "start-up from the journal: read its outcome with GET /v1/captures/{id} once the sidecar is back",
        details={"path": path},
    )


class _BodyTooLarge(StarletteHTTPException):
    """A streamed body passed the limit: raised out of ``receive``; FastAPI lets HTTP exceptions
    through its body parsing, so the app's handler answers 413 with ``error``, the limit and its
    details as an announced body gets them (or this middleware does)."""

    def __init__(self, error: BodyTooLarge) -> None:
        super().__init__(413, error.message)
        self.error = error


__all__ = ["MAX_BODY", "RequestGuard"]
