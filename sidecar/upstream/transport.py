"""httpx's API over aiohttp's connections: the upstream client's transport.

The client keeps httpx (its requests, timeouts, streams and errors are what ``server.py`` and its
tests speak); the bytes go through aiohttp, whose C parser and loop-native connections cost half
of httpcore's CPU per request (0.39 ms against 0.77 ms here, 128 clients posting at once: a fleet
worker's turn of stops; bench/transport.py prints it). That CPU is what a fleet's stop at 1,024
upstream targets is made of (docs/fleet-clocks.md).

aiohttp's errors are turned into httpx's by what they say about delivery, the one thing
``server.py`` decides on: refused or not connected in time is ``ConnectError``/``ConnectTimeout``
(never delivered: a start may be sent again); a read that timed out is ``ReadTimeout``; a
connection dropped after the request went out is ``RemoteProtocolError`` (delivered or not,
nobody knows); a failed TLS handshake is ``TlsRefused`` (a ``ConnectError``: nothing was sent); a reply that is not HTTP is ``NotHttp`` (a ``RemoteProtocolError``: whatever
answered is not the server). httpx-aiohttp (PyPI) maps a dropped connection to ``ConnectTimeout``, which would
have a start sent twice, so the mapping is this module's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import aiohttp

# Below uvicorn's 5 s keep-alive (vLLM's API server), so a pooled connection is dropped here
# before the server closes it under a request in flight. Not a guarantee: a loop busy when the
# server's close arrives sees it only after its next request took the connection.
KEEPALIVE_S = 4.0
MAX_CONNECTIONS = 100
# A request extension: True sends the request on a connection of its own, closed after it. For a
# request that must not be sent twice (a start): on a pooled connection the server has closed, it
# is lost with its effect unknown, where aiohttp sends an idempotent one again by itself.
FRESH_CONNECTION = "sidecar.fresh_connection"


class NotHttp(httpx.RemoteProtocolError):
    """The peer answered bytes that are not an HTTP response: another service on the port."""


def _not_http(exc: aiohttp.ClientResponseError) -> NotHttp:
    # aiohttp's parser message spans lines and draws a caret under the byte it stopped at
    lines = (line.strip() for line in str(exc.message).splitlines())
    return NotHttp(" ".join(line for line in lines if line.strip("^"))[:300])


@functools.cache
def _request_class() -> type[aiohttp.ClientRequest]:
    import aiohttp
    from aiohttp.http_exceptions import HttpProcessingError

    class Request(aiohttp.ClientRequest):
        """aiohttp's request, keeping a reply that did not parse when it came first. A service that
        speaks first (an SSH daemon's banner) may be parsed before the request is written: the
        parser closes the connection and the write fails as a reset, the banner lost."""

        async def send(self, conn: Any) -> aiohttp.ClientResponse:
            try:
                return await super().send(conn)
            except aiohttp.ClientConnectionError:  # a reset write, a dropped connection
                parsed = conn.protocol.exception() if conn.protocol is not None else None
                if isinstance(parsed, HttpProcessingError):
                    raise aiohttp.ClientResponseError(self.request_info, (), status=parsed.code or 400,
                                                      message=str(parsed.message)) from parsed
                raise

    return Request


class TlsRefused(httpx.ConnectError):
    """The TLS handshake failed (a certificate not trusted, a server that does not speak TLS):
    nothing was sent. ``certificate``: the certificate was what was refused."""

    def __init__(self, message: str, *, certificate: bool) -> None:
        super().__init__(message)
        self.certificate = certificate


def _tls_refused(exc: aiohttp.ClientSSLError) -> TlsRefused:
    import aiohttp

    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert = exc.certificate_error
        return TlsRefused(str(getattr(cert, "verify_message", "") or getattr(cert, "reason", "") or cert),
                          certificate=True)
    cause = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else exc
    return TlsRefused(str(getattr(cause, "reason", "") or cause), certificate=False)


def _httpx_error(exc: BaseException) -> httpx.HTTPError | None:
    import aiohttp

    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientResponseError):  # the reply did not parse (no raise_for_status here)
        return _not_http(exc)
    if isinstance(exc, aiohttp.ClientSSLError):
        return _tls_refused(exc)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message)
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, unresolvable: nothing was sent
        return httpx.ConnectError(message)
    if isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)):
        return httpx.ReadTimeout(message)
    if isinstance(exc, aiohttp.ClientPayloadError):
        return httpx.ReadError(message)
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return httpx.RemoteProtocolError(message)
    return None


@contextlib.contextmanager
def _as_httpx() -> Iterator[None]:
    try:
        yield
    except httpx.HTTPError:
        raise
    except Exception as exc:
        mapped = _httpx_error(exc)
        if mapped is None:
            raise
        raise mapped from exc


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx():
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One pooled aiohttp session, opened on the first request (inside the running loop) and closed
    by :meth:`aclose`: at most ``limit`` connections, idle ones kept ``keepalive_s``; and one without
    a pool for requests marked :data:`FRESH_CONNECTION`. No proxy from
    the environment, no redirects, no decompression (httpx decodes). Every session verifies TLS
    with aiohttp's one default context, built once per process."""

    def __init__(self, *, limit: int = MAX_CONNECTIONS, keepalive_s: float = KEEPALIVE_S) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # for FRESH_CONNECTION requests: no pool
        self._limit = limit
        self._keepalive_s = keepalive_s

    def _open(self, *, pooled: bool) -> aiohttp.ClientSession:
        import aiohttp

        connector = (aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=self._keepalive_s) if pooled
                     else aiohttp.TCPConnector(limit=self._limit, force_close=True))
        return aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False,
                                     request_class=_request_class(),
                                     skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))

    def _session_for(self, request: httpx.Request) -> aiohttp.ClientSession:
        if request.extensions.get(FRESH_CONNECTION):
            if self._fresh is None:
                self._fresh = self._open(pooled=False)
            return self._fresh
        if self._session is None:
            self._session = self._open(pooled=True)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import aiohttp

        session = self._session_for(request)
        timeout: dict[str, Any] = request.extensions.get("timeout", {})
        data: Any
        try:
            data = request.content or None
        except httpx.RequestNotRead:
            data = request.stream  # sent as it is produced: a held start's last byte waits
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "transfer-encoding"]
        # httpx has made the URL's user:password its Authorization header; aiohttp refuses both at once
        url = request.url.copy_with(userinfo=b"") if request.url.userinfo else request.url
        with _as_httpx():
            response = await session.request(
                request.method, str(url), headers=headers, data=data,
                allow_redirects=False, compress=None,
                timeout=aiohttp.ClientTimeout(total=None, connect=timeout.get("pool"),
                                              sock_connect=timeout.get("connect"), sock_read=timeout.get("read")),
            )
        extensions: dict[str, Any] = {"http_version": b"HTTP/1.1"}
        if response.reason:
            extensions["reason_phrase"] = response.reason.encode()
        return httpx.Response(response.status, headers=list(response.raw_headers), stream=_Body(response),
                              request=request, extensions=extensions)

    async def aclose(self) -> None:
        sessions = [s for s in (self._session, self._fresh) if s is not None]
        self._session = self._fresh = None
        for session in sessions:
            await session.close()
