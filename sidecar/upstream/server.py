"""Async client for one vLLM-Omni (or plain vLLM) server: readiness, a probe that changes nothing,
and ``start_profile``/``stop_profile`` that always send an explicit, non-empty stage list.

HTTP 200 only means "delivered" (docs/design.md §3). Errors: ``UpstreamUnreachable`` (never delivered),
``UpstreamTimeout`` (sent, effect unknown), ``UpstreamError`` (non-2xx; details ``status``, ``body``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, Field
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from sidecar.errors import MetricsUnavailable, UpstreamError, UpstreamSessionActive, UpstreamTimeout
from sidecar.errors import StagesEmpty, StagesInvalid, UpstreamNotHttp, UpstreamUnreachable
from sidecar.upstream.metrics import KEPT_SAMPLES, MAX_METRICS_BYTES, STEP_SAMPLES, Labels, MetricsSnapshot
from sidecar.upstream.metrics import MetricsUnreadable, parse_metrics, step_counts
from sidecar.upstream.transport import FRESH_CONNECTION, AiohttpTransport, NotHttp, TlsRefused
from sidecar.versions import ServerVersion

_T = TypeVar("_T")

if TYPE_CHECKING:
    from sidecar.config.settings import SidecarSettings

# Upstream error bodies end up in journals and API replies; a stack dump is not useful there.
_BODY_LIMIT = 2000


class Flavor(str, Enum):
    omni = "omni"  # vLLM-Omni: body {"stages": [...]}
    vllm = "vllm"  # plain vLLM: no body (one engine, no stages)


class UpstreamTimeouts(BaseModel):
    """Seconds. ``start``/``stop`` are read timeouts: both calls block server-side with no limit."""

    connect: float = Field(default=5, gt=0)
    start: float = Field(default=300, gt=0)
    stop: float = Field(default=1800, gt=0)
    probe: float = Field(default=5, gt=0)

    @classmethod
    def from_settings(cls, settings: SidecarSettings) -> UpstreamTimeouts:
        return cls(
            connect=settings.connect_timeout_s,
            start=settings.start_timeout_s,
            stop=settings.stop_timeout_s,
            probe=settings.probe_timeout_s,
        )


class ProbeResult(BaseModel):
    healthy: bool
    profiler_mounted: bool | None  # None: unknown (server unhealthy or an unexpected status)
    reason: str | None = None  # why it is not ready, in words a person can act on
    # False only when no connection could be made (refused, connect timeout): the server is not
    # there. A slow or failing reply is reachable: a server busy flushing a stop is not gone.
    reachable: bool = True

    @property
    def ready(self) -> bool:
        return self.healthy and self.profiler_mounted is True


def _json(body: dict[str, Any]) -> bytes:
    """A request's JSON body, compact as httpx writes it."""
    return json.dumps(body, separators=(",", ":")).encode()


def _is_5xx(exc: BaseException) -> bool:
    return type(exc) is UpstreamError and int(exc.details.get("status", 0)) >= 500


class UpstreamServer:
    """One upstream server. Owns an ``httpx.AsyncClient`` (over aiohttp: ``transport.py``; tests
    may pass another ``transport``); close it with :meth:`aclose`."""

    def __init__(
        self,
        base_url: str,
        *,
        flavor: Flavor = Flavor.omni,
        timeouts: UpstreamTimeouts | None = None,
        stop_budget_s: float = 1800,
        transport: httpx.AsyncBaseTransport | None = None,
        start_attempts: int = 3,
        stop_5xx_attempts: int = 5,
        retry_wait_max_s: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.flavor = Flavor(flavor)
        self.timeouts = timeouts or UpstreamTimeouts()
        self.stop_budget_s = stop_budget_s
        self.start_attempts = start_attempts
        self.stop_5xx_attempts = stop_5xx_attempts
        self.retry_wait_max_s = retry_wait_max_s
        self._transport = transport or AiohttpTransport()
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            transport=self._transport,
            timeout=httpx.Timeout(self.timeouts.probe, connect=self.timeouts.connect),
            # The upstream is a local server; a proxy from the environment would only get in the way.
            trust_env=False,
        )
        self._urls: dict[tuple[str, tuple[str, ...]], httpx.URL] = {}
        self._version: ServerVersion | None = None  # what identify() found, until the server is gone
        self.omni_version: str | None = None  # vLLM-Omni's release as the user told it (it serves it nowhere)
        # The profiling POSTs' headers, made once: the URL's user:password as the Authorization
        # header, as httpx's client makes it for the requests it builds (probes, /metrics).
        base = httpx.URL(self.base_url)
        self._post_headers: dict[str, str] = {}
        if base.username or base.password:
            creds = base64.b64encode(f"{base.username}:{base.password}".encode()).decode()
            self._post_headers["authorization"] = f"Basic {creds}"

    def _url(self, path: str, names: tuple[str, ...] = ()) -> httpx.URL:
        """``path`` (with ``name[]`` params) as an absolute URL, parsed once per server: httpx
        parses a relative path against the base URL on every request (a /metrics read's query of
        sample names: ~0.1 ms), which a fleet of a thousand in-process targets pays a thousand times."""
        url = self._urls.get((path, names))
        if url is None:
            url = self._urls[(path, names)] = httpx.URL(self.base_url + path, params=[("name[]", n) for n in names])
        return url

    @classmethod
    def from_settings(cls, settings: SidecarSettings, **kwargs: Any) -> UpstreamServer:
        return cls(
            settings.upstream_url,
            flavor=Flavor(settings.flavor),
            timeouts=UpstreamTimeouts.from_settings(settings),
            stop_budget_s=settings.stop_budget_s,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"UpstreamServer({self.base_url!r}, flavor={self.flavor.value})"

    async def __aenter__(self) -> UpstreamServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    # --- readiness ------------------------------------------------------------------------

    async def probe(self) -> ProbeResult:
        """``GET /health`` then ``GET /start_profile`` (405 = mounted, 404 = not configured)."""
        timeout = httpx.Timeout(self.timeouts.probe, connect=min(self.timeouts.connect, self.timeouts.probe))
        try:
            health = await self._client.get("/health", timeout=timeout)
        except TlsRefused as exc:
            return ProbeResult(healthy=False, profiler_mounted=None, reason=self._tls(f"{self.base_url}/health", exc))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._version = None  # what comes back on this port may be another server (another version)
            return ProbeResult(
                healthy=False,
                profiler_mounted=None,
                reachable=False,
                reason=f"upstream {self.base_url} is not reachable ({type(exc).__name__}); "
                "check that `vllm serve` is running and --upstream points at it",
            )
        except NotHttp as exc:
            return ProbeResult(healthy=False, profiler_mounted=None, reason=self._not_http(f"{self.base_url}/health", exc))
        except httpx.HTTPError as exc:
            return ProbeResult(
                healthy=False,
                profiler_mounted=None,
                reason=f"upstream {self.base_url}/health did not answer ({type(exc).__name__}); the server "
                "may be busy (a stop flushing traces) or hung",
            )
        if health.status_code == 404:  # every vLLM (and vLLM-Omni) API server serves /health
            return ProbeResult(
                healthy=False,
                profiler_mounted=None,
                reason=f"upstream {self.base_url}/health answered 404: an HTTP server that is not vLLM listens "
                "there. Point --upstream at the address `vllm serve` listens on",
            )
        if health.status_code != 200:
            return ProbeResult(
                healthy=False,
                profiler_mounted=None,
                reason=f"upstream {self.base_url}/health answered {health.status_code}; "
                "the server is still loading or unhealthy",
            )
        try:
            mounted = await self._client.get("/start_profile", timeout=timeout)
        except httpx.HTTPError as exc:
            return ProbeResult(
                healthy=True,
                profiler_mounted=None,
                reason=f"GET {self.base_url}/start_profile failed ({type(exc).__name__})",
            )
        if mounted.status_code == 405:
            return ProbeResult(healthy=True, profiler_mounted=True, reason=None)
        if mounted.status_code == 404:
            return ProbeResult(
                healthy=True,
                profiler_mounted=False,
                reason=f"the profiler endpoints are not mounted: {self._not_mounted()}",
            )
        return ProbeResult(
            healthy=True,
            profiler_mounted=None,
            reason=f"GET /start_profile answered {mounted.status_code} (expected 405 when mounted, "
            "404 when not); is --upstream a vLLM-Omni server?",
        )

    def _not_mounted(self) -> str:
        """Why a server serves no profiler routes, and the fix, in the words of the way it was started."""
        if self.flavor is Flavor.vllm:
            return ("`vllm serve` was started without a profiler (no --profiler-config); restart it with e.g. "
                    "--profiler-config '{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/data/perf\"}'")
        return ("no stage of the server's deploy config sets profiler_config.profiler; add one (e.g. profiler: "
                "torch with torch_profiler_dir) and restart the server")

    async def identify(self) -> ServerVersion:
        """What the server is (kept until a call finds it unreachable): its vLLM version from
        ``GET /version`` (vLLM-Omni answers vLLM's there, not its own), and whether it is vLLM-Omni,
        told by a route only vLLM-Omni serves (``GET /v1/omni/sleep``: 405 there, 404 on plain
        vLLM), else by its ``vllm_omni:`` metric families, else by the configured flavor. Two or
        three GETs that change nothing; never raises (a version not served says so)."""
        if self._version is not None:
            return self._version
        timeout = httpx.Timeout(self.timeouts.probe, connect=min(self.timeouts.connect, self.timeouts.probe))
        vllm: str | None = None
        answered = True
        try:
            reply = await self._client.get("/version", timeout=timeout)
            if reply.status_code == 200:
                vllm = str(reply.json().get("version") or "") or None
        except httpx.HTTPError:
            answered = False
        except (ValueError, AttributeError):
            pass
        found = ServerVersion.of(await self._kind(timeout), vllm, self.omni_version)
        if answered:  # a server not up yet is asked again next time
            self._version = found
        return found

    @property
    def version(self) -> ServerVersion | None:
        """What :meth:`identify` found so far (None: not asked yet, or the server went away since)."""
        return self._version

    async def _kind(self, timeout: httpx.Timeout) -> Literal["vllm", "omni"]:
        try:
            route = await self._client.get("/v1/omni/sleep", timeout=timeout)
            if route.status_code in (404, 405):
                return "omni" if route.status_code == 405 else "vllm"
        except httpx.HTTPError:
            pass
        try:
            text = await self._metrics_text(None, ())
            return "omni" if "vllm_omni:" in text else "vllm"
        except MetricsUnavailable:
            return "omni" if self.flavor is Flavor.omni else "vllm"

    async def warm(self) -> bool:
        """Open the pool before it is needed (one ``GET /health``, best effort): the session, a
        connection for the stop and the scrapes, and the server's answer before the start's
        preparation (without it a fleet's prepare phase took 2.5x as long at 128 targets:
        bench/fanout.py). The start itself goes on a connection of its own. False when the server
        did not answer."""
        timeout = httpx.Timeout(self.timeouts.probe, connect=min(self.timeouts.connect, self.timeouts.probe))
        try:
            await self._client.get("/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return True

    async def metrics(self, *, timeout_s: float | None = None) -> MetricsSnapshot:
        """``GET /metrics``, parsed (sidecar/upstream/metrics.py). ``MetricsUnavailable`` when it
        cannot be read: not served (404), failed, too slow, too big or not Prometheus text."""
        return self._read_metrics(await self._metrics_text(timeout_s, KEPT_SAMPLES), parse_metrics)

    async def step_counts(self, *, timeout_s: float | None = None) -> dict[Labels, int]:
        """``GET /metrics``'s engine-step counters only (``metrics.step_counts``: a ``steps``
        window's fast read); ``MetricsUnavailable`` as :meth:`metrics`."""
        return self._read_metrics(await self._metrics_text(timeout_s, STEP_SAMPLES), step_counts)

    def _read_metrics(self, text: str, parse: Callable[[str], _T]) -> _T:
        try:
            return parse(text)
        except MetricsUnreadable as exc:
            raise MetricsUnavailable(f"GET {self.base_url}/metrics: {exc}",
                                     details={"url": f"{self.base_url}/metrics"}) from None

    async def _metrics_text(self, timeout_s: float | None, samples: tuple[str, ...]) -> str:
        url = f"{self.base_url}/metrics"
        read = self.timeouts.probe if timeout_s is None else timeout_s
        timeout = httpx.Timeout(read, connect=min(self.timeouts.connect, read))
        try:
            async with self._client.stream("GET", self._url("/metrics", samples), timeout=timeout) as resp:
                # read to its end whatever the status: a reply left unread closes its keep-alive
                # connection (a fleet scraping servers without /metrics opened one per stop after)
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_METRICS_BYTES:
                        raise MetricsUnavailable(f"GET {url} is above {MAX_METRICS_BYTES} bytes; not a vLLM server's",
                                                 details={"url": url})
        except httpx.HTTPError as exc:
            raise MetricsUnavailable(f"GET {url} failed ({type(exc).__name__})", details={"url": url}) from None
        if resp.status_code != 200:
            raise MetricsUnavailable(
                f"GET {url} answered {resp.status_code}; the server exposes no Prometheus metrics here",
                details={"url": url, "status": resp.status_code})
        return body.decode("utf-8", "replace")

    # --- profiling ------------------------------------------------------------------------

    async def start_profile(self, stages: list[int], *,
                            before_send: Callable[[], Awaitable[None]] | None = None,
                            options: dict[str, Any] | None = None) -> None:
        """Start the profiler on exactly ``stages``. Retried only when never delivered.
        ``options``: the start body's per-capture keys a plain vLLM >= 0.32 reads
        (``profile_prefix``, ``max_iterations``, ``delay_iterations``, ``profiler_kwargs``: what
        :meth:`identify` says it takes); never sent to vLLM-Omni, whose body is its stage list.
        A 409 (a session still open upstream) is ``UpstreamSessionActive``.

        ``before_send`` is awaited just before the request is complete (a fan-out releasing its
        starts together); if it raises, the request is never completed and the server never
        handles it. With a body, everything but its last byte is sent first (the server cannot
        dispatch a request whose body is incomplete), so what is left after the release is one
        byte per target: the skew across a fleet is a write, not httpx's per-request CPU."""
        body = self._body(stages)
        if options and self.flavor is Flavor.vllm:
            body = dict(options)
        timeout = httpx.Timeout(self.timeouts.start, connect=self.timeouts.connect)
        released = before_send is None

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                await before_send()  # type: ignore[misc]

        if body is not None and before_send is not None:
            payload = _json(body)

            async def held() -> AsyncIterator[bytes]:
                yield payload[:-1]
                await release()
                yield payload[-1:]

            request = self._request("/start_profile", body, timeout, content=held(), length=len(payload), fresh=True)
        else:
            request = self._request("/start_profile", body, timeout, fresh=True)
            await release()
        try:
            await self._send(request)  # the first attempt without the retry machinery (_again)
            return
        except UpstreamUnreachable:
            if self.start_attempts <= 1:
                await release()
                raise
        await release()  # never connected: the fan-out is released before the retries wait
        await self._again(lambda: self._post("/start_profile", body, timeout, fresh=True),
                          retry=lambda e: isinstance(e, UpstreamUnreachable), attempts=self.start_attempts - 1)

    async def stop_profile(self, stages: list[int], *, budget_s: float | None = None) -> None:
        """Stop the profiler on exactly ``stages``; retried on connect errors and (up to
        ``stop_5xx_attempts`` times) 5xx, with backoff, within ``budget_s`` (default ``stop_budget_s``). Each attempt's read timeout is cut to what is left
        of the budget, so a hung stop ends as ``UpstreamTimeout`` when the budget does."""
        body = self._body(stages)
        budget = self.stop_budget_s if budget_s is None else budget_s
        deadline = time.monotonic() + budget
        failures_5xx = 0

        def retryable(exc: BaseException) -> bool:
            # stop is a no-op when idle, so repeating it is safe. Connection errors are retried for
            # the whole budget (a restarting server); a 5xx only a few times, because a dead stage
            # answers 500 to every stop and waiting out a 30-minute budget would not change that.
            nonlocal failures_5xx
            if isinstance(exc, UpstreamUnreachable):
                return True
            if isinstance(exc, UpstreamTimeout):
                # The server handles stops one after another, so a repeated stop waits behind the
                # first and answers once it is done: asking again is harmless and informative.
                return True
            if _is_5xx(exc):
                failures_5xx += 1
                return failures_5xx < self.stop_5xx_attempts
            return False

        async def once() -> None:
            left = max(deadline - time.monotonic(), 0.05)
            read = min(self.timeouts.stop, left)
            await self._post("/stop_profile", body, httpx.Timeout(read, connect=min(self.timeouts.connect, left)))

        try:
            await once()  # the first attempt without the retry machinery (_again)
            return
        except UpstreamError as exc:
            if not retryable(exc) or time.monotonic() >= deadline:
                raise
        await self._again(once, retry=retryable, deadline=deadline)

    async def _again(self, call: Callable[[], Awaitable[None]], *, retry: Callable[[BaseException], bool],
                     attempts: int | None = None, deadline: float | None = None) -> None:
        """The attempts after a first one made without tenacity, whose per-call state was a tenth of
        a start's or stop's CPU where a fleet's worker sends 128 in one turn: the waits tenacity
        would have made from the first (0.2 s, 0.4, 0.8, ... up to ``retry_wait_max_s``), for at most
        ``attempts`` more or until ``deadline`` (monotonic)."""
        await asyncio.sleep(min(0.2, self.retry_wait_max_s))
        if deadline is not None:
            stop = stop_after_delay(max(deadline - time.monotonic(), 0.0))
        else:
            assert attempts is not None, "one bound: attempts or deadline"
            stop = stop_after_attempt(attempts)
        try:
            async for attempt in AsyncRetrying(retry=retry_if_exception(retry), stop=stop, reraise=True,
                                               wait=wait_exponential(multiplier=0.4, max=self.retry_wait_max_s)):
                with attempt:
                    await call()
        except RetryError as exc:  # pragma: no cover - reraise=True makes this unreachable
            raise exc.last_attempt.exception() from None  # type: ignore[misc]

    # --- plumbing -------------------------------------------------------------------------

    def _body(self, stages: list[int]) -> dict[str, Any] | None:
        if isinstance(stages, (str, bytes)) or not isinstance(stages, (list, tuple)):
            raise StagesInvalid(
                f"stages must be a list of stage ids, got {type(stages).__name__}",
            )
        if not stages:
            # {"stages": []} profiles nothing and still answers SUCCESS upstream (docs/design.md §3).
            raise StagesEmpty(
                "the stage list is empty: an empty list profiles nothing upstream; name the stages "
                "to profile (e.g. [0, 2])",
            )
        if any(isinstance(s, bool) or not isinstance(s, int) for s in stages):
            raise StagesInvalid(f"stage ids must be integers, got {list(stages)!r}")
        if self.flavor is Flavor.vllm:
            return None
        return {"stages": [int(s) for s in stages]}

    def _request(self, path: str, body: dict[str, Any] | None, timeout: httpx.Timeout, *,
                 content: AsyncIterator[bytes] | None = None, length: int = 0, fresh: bool = False) -> httpx.Request:
        """A profiling POST, made here rather than by the client's ``build_request``, which merges
        the client's parameters, cookies and headers anew into every request and parses its URL
        again (0.22 ms of CPU per request on this project's machine, where a fleet's worker sends
        128 stops at once). ``content``: a body sent as it is produced (``length`` bytes).
        ``fresh``: on a connection of its own (a start, which is never sent twice: a pooled
        connection the server closed while this loop was busy would lose it, its effect unknown;
        a stop lost so is sent again, so stops keep the pool)."""
        headers = dict(self._post_headers)
        if content is not None:
            headers |= {"content-type": "application/json", "content-length": str(length)}
            data: bytes | AsyncIterator[bytes] | None = content
        elif body is not None:
            headers["content-type"] = "application/json"
            data = _json(body)
        else:
            data = None
        extensions: dict[str, Any] = {"timeout": timeout.as_dict()}
        if fresh:
            extensions[FRESH_CONNECTION] = True
        return httpx.Request("POST", self._url(path), content=data, headers=headers, extensions=extensions)

    @staticmethod
    def _tls(url: str, exc: TlsRefused) -> str:
        if exc.certificate:
            return (f"{url}: the server's TLS certificate was not accepted ({exc}); nothing was sent. For a "
                    "self-signed certificate, start the sidecar with SSL_CERT_FILE=<the server's certificate or "
                    "its CA, PEM>")
        return (f"{url}: the TLS handshake failed ({exc}); nothing was sent. If the server serves plain HTTP, "
                "use http:// in --upstream")

    @staticmethod
    def _not_http(url: str, exc: NotHttp) -> str:
        return (f"{url} answered with something that is not HTTP ({exc}): another service listens there. "
                "Point --upstream at the address `vllm serve` listens on (http://host:port; https:// where it serves TLS)")

    async def _post(self, path: str, body: dict[str, Any] | None, timeout: httpx.Timeout, *, fresh: bool = False) -> None:
        await self._send(self._request(path, body, timeout, fresh=fresh))

    async def _send(self, request: httpx.Request) -> None:
        url = str(request.url)
        read = request.extensions["timeout"].get("read")
        if self._client.is_closed:
            raise RuntimeError(f"{self!r} is closed")
        try:
            # straight to the transport: no auth, redirects or cookies to handle on a profiling POST
            # (the client's send handles each, a tenth of a millisecond per request)
            resp = await self._transport.handle_async_request(request)
            try:
                await resp.aread()
            finally:
                await resp.aclose()
        except TlsRefused as exc:
            raise UpstreamUnreachable(self._tls(url, exc), details={"url": url, "tls": str(exc)}) from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._version = None  # a server that comes back may be another version
            raise UpstreamUnreachable(
                f"could not connect to {url} ({exc.__class__.__name__}); the request was not delivered. "
                "Check that the server is running and --upstream is right",
                details={"url": url},
            ) from None
        except NotHttp as exc:
            raise UpstreamNotHttp(self._not_http(url, exc), details={"url": url}) from None
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(
                f"{url} did not answer within {read:g}s ({exc.__class__.__name__}); the request "
                "was sent and its effect is unknown",
                details={"url": url, "timeout_s": read},
            ) from None
        except httpx.HTTPError as exc:
            # A dropped connection mid-request: delivered or not, nobody knows.
            raise UpstreamTimeout(
                f"{url} failed mid-request ({exc.__class__.__name__}: {exc}); its effect is unknown",
                details={"url": url, "dropped": True},
            ) from None
        if resp.is_success:
            return
        text = resp.text[:_BODY_LIMIT]
        detail = text
        try:
            payload = resp.json()
            # FastAPI's {"detail": ...} or vLLM's ErrorResponse {"error": {"message": ...}}
            if isinstance(payload, dict) and "detail" in payload:
                detail = str(payload["detail"])[:_BODY_LIMIT]
            elif isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                detail = str(payload["error"].get("message", text))[:_BODY_LIMIT]
        except ValueError:
            pass
        if resp.status_code == 409:
            raise UpstreamSessionActive(
                f"POST {url} answered 409: {detail}",
                details={"status": 409, "body": text, "url": url},
            )
        hint = ""
        if resp.status_code == 404:
            hint = f"; the profiler endpoints are not mounted: {self._not_mounted()}"
        raise UpstreamError(
            f"POST {url} answered {resp.status_code}: {detail}{hint}",
            details={"status": resp.status_code, "body": text, "url": url},
        )
