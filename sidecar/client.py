"""Python clients for the sidecar's HTTP API: ``AsyncSidecarClient`` (httpx.AsyncClient; the
rollout hook and fleet use it) and ``SidecarClient`` (sync, for the CLI and scripts). Error
replies come back as the matching ``SidecarError`` subclass, chosen by the reply's ``code``.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import quote

import httpx
import pydantic

from sidecar.control import filenames
from sidecar.control.budget import Plan
from sidecar.control.models import Capture, CaptureState
from sidecar.control.schedule import HOLD_MAX_S

if TYPE_CHECKING:
    from sidecar.analysis.diff import CaptureDiff
    from sidecar.analysis.models import CaptureSummary
from sidecar.config.settings import token_problem
from sidecar.errors import CaptureIdAmbiguous, CaptureNotFound, RequestInvalid, SettingInvalid, SidecarError, TokenInvalid
from sidecar.errors import class_for_code
from sidecar.urls import http_url, with_scheme, without_query

DEFAULT_URL = "http://127.0.0.1:8092"
DEFAULT_TIMEOUT = 30.0
# POST /v1/captures returns when the upstream accepted the start, which blocks server-side (the
# sidecar's own start timeout is 300 s by default); a short client timeout would abandon it
START_TIMEOUT = 360.0
PLAN_TIMEOUT = 3600.0  # a plan is probe captures, each a start, some steps and a verified stop
# a summary or a diff may analyse a capture's traces first (a large capture's take minutes; later
# reads of it are served from that one analysis)
ANALYSIS_TIMEOUT = 600.0
PAGE_MAX = 1000  # the most captures GET /v1/captures sends in one page


class SidecarUnreachable(SidecarError):
    """No answer from the sidecar at all (not running, wrong URL, or it timed out)."""

    code = "sidecar_unreachable"


class SidecarReplyInvalid(SidecarError):
    """The sidecar's URL answered, but not as the sidecar does (not JSON, or not the shape of the
    route's reply): most often a proxy or another service at that address."""

    code = "sidecar_reply_invalid"


class WaitTimeout(SidecarError):
    """``wait_capture`` gave up before the capture became terminal; it is still running."""

    code = "wait_timeout"


def error_from_response(response: httpx.Response) -> SidecarError:
    """The typed error a non-2xx reply stands for (``{"error": {"code", "message", "details"}}``)."""
    try:
        payload = response.json().get("error") or {}
    except (ValueError, AttributeError):
        payload = {}
    if not isinstance(payload, dict):  # {"error": "text"}: another service's shape, not the sidecar's
        payload = {"message": payload} if isinstance(payload, str) else {}
    code = str(payload.get("code") or f"http_{response.status_code}")
    message = str(payload.get("message") or f"HTTP {response.status_code} from {response.request.url}")
    details = payload.get("details") if isinstance(payload.get("details"), dict) else {}
    details = {**details, "status": response.status_code}
    cls = class_for_code(code)
    if cls is None:  # a code this client does not know (a newer sidecar): the base class carries it
        return SidecarError.relay(code, message, details=details)
    return cls(message, details=details)


def _auth_headers(token: str | None) -> dict[str, str]:
    """The header that carries ``token``; a token no header can carry is refused here, when the
    client is built (the rule the server applies to its --token-file)."""
    if token is None or token == "":  # an empty OMNI_SIDECAR_TOKEN: no token, as it always was
        return {}
    why = token_problem(token) if isinstance(token, str) else f"is a {type(token).__name__}, not a string"
    if why is not None:
        raise TokenInvalid(f"the sidecar token {why}; pass the token exactly as the sidecar's --token-file holds it",
                           key="token")
    return {"Authorization": f"Bearer {token}"}


def _capture_id(capture_id: str) -> str:
    """``capture_id`` as one percent-encoded path segment; an empty one (an unset shell variable,
    most likely) is refused, not sent (``/v1/captures/`` is the list of captures), and so is one no
    URL segment can carry (``/``, ``.``, ``..``): sent as it is, ``a#b``, ``a?x`` or ``b/../a``
    would address capture ``a``."""
    if not isinstance(capture_id, str) or not capture_id.strip():
        raise CaptureNotFound(f"an empty capture id ({capture_id!r}); give the id or a unique start of it "
                              "(`omni-sidecar list` shows them)", details={"prefix": capture_id})
    if "/" in capture_id or capture_id in (".", ".."):
        raise CaptureNotFound(f"no capture id is {capture_id!r} (ids hold no '/' and are not '.' or '..'); "
                              "`omni-sidecar list` shows them", details={"prefix": capture_id})
    return quote(capture_id, safe="")


def _json_value(name: str, value: Any) -> Any:
    """``value`` as JSON carries it: a numpy number (stage ids from an array or a DataFrame) as the
    int or float it holds; what JSON cannot carry (inf, nan, a set, an array, a datetime) is refused
    here, naming the field, before anything is sent (the sidecar's schema judges the rest)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(number := float(value)):
            raise RequestInvalid(f"{name} is {value}: JSON carries no inf or nan; pass a finite number",
                                 key=name, details={"field": name})
        return number
    if isinstance(value, (list, tuple)):
        return [_json_value(f"{name}[{i}]", item) for i, item in enumerate(value)]
    kind = type(value).__name__
    listed = isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray, Mapping))
    fix = "a list (list(...) of it)" if listed else "a number or a string, as help() of the call says"
    raise RequestInvalid(f"{name} is a {kind}, which a JSON request cannot carry; pass {fix}",
                         key=name, details={"field": name, "type": kind})


def _body(fields: dict[str, Any]) -> dict[str, Any]:
    """A request body of the fields given (None: left out), each as JSON carries it (``_json_value``)."""
    return {k: _json_value(k, v) for k, v in fields.items() if v is not None}


def _tls_failure(err: BaseException) -> ssl.SSLError | None:
    """The TLS error under a failed connect (httpx chains it below httpcore's), if that was it."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def _unreachable(base_url: str, err: httpx.TransportError) -> SidecarUnreachable:
    # ``sent``: False where no connection was made, so the request never reached the sidecar
    details = {"url": base_url, "sent": not isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout))}
    tls = _tls_failure(err) if isinstance(err, httpx.ConnectError) else None
    if isinstance(tls, ssl.SSLCertVerificationError):
        return SidecarUnreachable(
            f"sidecar at {base_url}: its TLS certificate was not accepted ({tls.verify_message or tls.reason}); "
            "nothing was sent. For a self-signed certificate, set SSL_CERT_FILE=<its certificate or CA, PEM> "
            "for this process", details=details)
    if tls is not None:
        return SidecarUnreachable(
            f"sidecar at {base_url}: the TLS handshake failed ({tls.reason or tls}); nothing was sent. "
            "`omni-sidecar serve` serves plain HTTP: use http:// unless a TLS proxy is in front of it",
            details=details)
    kind = "timed out" if isinstance(err, httpx.TimeoutException) else "is not reachable"
    return SidecarUnreachable(
        f"sidecar at {base_url} {kind} ({type(err).__name__}); is `omni-sidecar serve` running there?",
        details=details)


def _sidecar_url(text: str) -> str:
    url = http_url(text)
    if url is None:  # else every call fails as "not reachable", which sends the user to the wrong fix
        raise SettingInvalid(f"sidecar URL {text!r} is not an http(s) URL; give it with its scheme, e.g. "
                             f"{with_scheme(text, DEFAULT_URL.split('://')[-1])}", details={"url": text})
    base = without_query(url)
    if base is not None:
        raise SettingInvalid(f"sidecar URL {text!r} has a query or a fragment, which its routes cannot follow; "
                             f"give the sidecar's address alone, e.g. {base}", details={"url": text})
    return url


def _dropped_read(err: BaseException) -> bool:
    """A kept-alive connection the server closed as the request went out (the keep-alive race:
    `Server disconnected without sending a response`): nothing was processed, so a read may go again."""
    return isinstance(err, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))


def _may_resend(call: _Call, err: BaseException) -> bool:
    """A read (GET) is sent once more on a fresh connection when its connection was dropped
    unanswered; a write is never resent (the first may have been processed)."""
    return call.method == "GET" and _dropped_read(err)


# Idle connections are dropped here after 4 s, before the sidecar's uvicorn closes them (5 s): at
# httpx's default (5 s, the same) a write could go out on a connection the server was closing, and
# a write is never resent. The upstream client keeps the same margin (sidecar/upstream/transport.py).
_LIMITS = httpx.Limits(keepalive_expiry=4.0)
# --- the API as data: both clients send these and parse the replies the same way ---------------


def _reply_invalid(response: httpx.Response, exc: BaseException) -> SidecarReplyInvalid:
    ctype = response.headers.get("content-type", "no content-type")
    what = "is not JSON" if isinstance(exc, ValueError) and not isinstance(exc, pydantic.ValidationError) \
        else "is not the sidecar's reply to that route"
    return SidecarReplyInvalid(
        f"{response.request.method} {response.request.url} answered {response.status_code} ({ctype}), "
        f"and the body {what} ({type(exc).__name__}); is that URL the sidecar itself "
        "(`omni-sidecar serve`), not a proxy or another service?",
        details={"url": str(response.request.url), "status": response.status_code, "content_type": ctype},
    )


def _json(response: httpx.Response) -> Any:
    data = response.json()
    if not isinstance(data, dict):  # every such route answers an object
        raise TypeError(f"a JSON {type(data).__name__}, not an object")
    return data


def _capture(response: httpx.Response) -> Capture:
    return Capture.model_validate(response.json())


def _plan(response: httpx.Response) -> Plan:
    return Plan.model_validate(response.json())


def _captures(response: httpx.Response) -> list[Capture]:
    return [Capture.model_validate(c) for c in response.json()["captures"]]


class _IdPage(NamedTuple):
    ids: list[str]
    next_before: str | None  # None: the oldest page


def _id_page(response: httpx.Response) -> _IdPage:
    data = _json(response)
    ids = [c["id"] for c in data["captures"]]
    if not all(isinstance(i, str) for i in ids):
        raise TypeError("a capture id that is not a string")
    after = data.get("next_before")  # a sidecar from before pages: one page
    return _IdPage(ids, after if isinstance(after, str) and after in ids[-1:] else None)


def _summary(response: httpx.Response) -> CaptureSummary:
    from sidecar.analysis.models import CaptureSummary

    return CaptureSummary.model_validate(response.json())


def _diff(response: httpx.Response) -> CaptureDiff:
    from sidecar.analysis.diff import CaptureDiff

    return CaptureDiff.model_validate(response.json())


def _content(response: httpx.Response) -> bytes:
    return response.content


class _Call(NamedTuple):
    """One request and how to read its reply."""

    method: str
    path: str
    parse: Callable[[httpx.Response], Any]
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    min_timeout: float | None = None  # a call that blocks server-side waits at least this long

    def send_kwargs(self, timeout: float) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.json is not None:
            kwargs["json"] = self.json
        if self.params is not None:
            kwargs["params"] = self.params
        if self.min_timeout is not None:
            kwargs["timeout"] = max(timeout, self.min_timeout)
        return kwargs

    def reply(self, response: httpx.Response) -> Any:
        if response.is_error:
            raise error_from_response(response)
        try:
            return self.parse(response)
        except (ValueError, KeyError, TypeError, AttributeError, pydantic.ValidationError) as exc:
            # pydantic's ValidationError and json's decode error are ValueErrors; named for the reader
            raise _reply_invalid(response, exc) from None


def match_capture_id(text: str, ids: list[str]) -> str:
    """``text`` itself, or the one id of ``ids`` it is a prefix of."""
    _capture_id(text)  # the start of every id: refused
    if text in ids:
        return text
    found = [i for i in ids if i.startswith(text)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise CaptureNotFound(f"no capture id starts with {text!r}; `omni-sidecar list` shows them",
                              details={"prefix": text})
    raise CaptureIdAmbiguous(
        f"{text!r} is the start of {len(found)} capture ids: {', '.join(found)}; give more of the id",
        details={"prefix": text, "candidates": found},
    )


class _Calls:
    """Every route the clients use, built once."""

    healthz = _Call("GET", "/healthz", _json)
    readyz = _Call("GET", "/readyz", _json)
    stages = _Call("GET", "/v1/stages", _json)
    clock = _Call("GET", "/v1/clock", _json)
    list_captures = _Call("GET", "/v1/captures", _captures)

    @staticmethod
    def newest_captures(limit: int) -> _Call:
        return _Call("GET", "/v1/captures", _captures, params={"limit": limit})

    @staticmethod
    def capture_ids(before: str | None) -> _Call:
        """One page of capture ids, newest first, older than ``before`` (the most the sidecar sends)."""
        return _Call("GET", "/v1/captures", _id_page, params={"limit": PAGE_MAX, **({"before": before} if before else {})})

    @staticmethod
    def start_capture(
        stages: list[int] | None, label: str | None, duration_s: float | None, lease_s: float | None,
        steps: int | None = None, delay_steps: int | None = None, start_at: float | None = None,
        steps_bound: str | None = None, profile: str | None = None,
    ) -> _Call:
        body = _body({"stages": stages, "label": label, "duration_s": duration_s, "lease_s": lease_s,
                      "steps": steps, "delay_steps": delay_steps, "start_at": start_at,
                      "steps_bound": steps_bound, "profile": profile})
        return _Call("POST", "/v1/captures", _capture, json=body, min_timeout=START_TIMEOUT)

    @staticmethod
    def plan(stages: list[int] | None, budget_mb: float | None, max_stop_s: float | None,
             probe_steps: list[int] | None, refine: bool | None = None) -> _Call:
        body = _body({"stages": stages, "budget_mb": budget_mb, "max_stop_s": max_stop_s,
                      "probe_steps": probe_steps, "refine": refine})
        return _Call("POST", "/v1/plan", _plan, json=body, min_timeout=PLAN_TIMEOUT)

    @staticmethod
    def stop_capture(capture_id: str) -> _Call:
        return _Call("POST", f"/v1/captures/{_capture_id(capture_id)}/stop", _capture)

    @staticmethod
    def get_capture(capture_id: str) -> _Call:
        return _Call("GET", f"/v1/captures/{_capture_id(capture_id)}", _capture)

    @staticmethod
    def until_started(capture_id: str, timeout: float) -> _Call:
        """The capture once it left ``starting``, held open server-side up to ``timeout`` s (a
        sidecar without ``until`` answers at once: the caller polls then)."""
        return _Call("GET", f"/v1/captures/{_capture_id(capture_id)}", _capture, params={"until": "started", "timeout": timeout},
                     min_timeout=timeout + 10)

    @staticmethod
    def record_clock(capture_id: str, record: dict[str, Any]) -> _Call:
        return _Call("POST", f"/v1/captures/{_capture_id(capture_id)}/clock", _capture, json=record)

    @staticmethod
    def heartbeat(capture_id: str) -> _Call:
        return _Call("POST", f"/v1/captures/{_capture_id(capture_id)}/heartbeat", _capture)

    @staticmethod
    def summary(capture_id: str, top: int) -> _Call:
        return _Call("GET", f"/v1/captures/{_capture_id(capture_id)}/summary", _summary, params={"top": top},
                     min_timeout=ANALYSIS_TIMEOUT)

    @staticmethod
    def diff(a: str, b: str, top: int) -> _Call:
        return _Call("GET", f"/v1/captures/{_capture_id(a)}/diff/{_capture_id(b)}", _diff, params={"top": top}, min_timeout=ANALYSIS_TIMEOUT)

    @staticmethod
    def download(capture_id: str, relpath: str) -> _Call:
        # a name that is not UTF-8 (as Capture holds it) travels as its bytes, percent-encoded
        return _Call("GET", f"/v1/captures/{_capture_id(capture_id)}/files/{filenames.quoted(relpath) or relpath}", _content)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _held_for(deadline: float | None) -> float:
    """How long to ask the sidecar to hold a request open: to the deadline, at most ``HOLD_MAX_S``."""
    return HOLD_MAX_S if deadline is None else min(max(deadline - time.monotonic(), 0.01), HOLD_MAX_S)


def _wait_over(cap: Capture, timeout: float | None, deadline: float | None, *, started: bool = False) -> bool:
    """True once ``cap`` is terminal (``started``: once it left ``starting``); ``WaitTimeout`` past
    the deadline; False: poll again."""
    if cap.terminal or (started and cap.state is not CaptureState.starting):
        return True
    now = time.monotonic()
    if deadline is not None and timeout is not None and now >= deadline:
        waited = now - (deadline - timeout)  # measured: what the caller really waited
        raise WaitTimeout(
            f"capture {cap.id} still {cap.state.value} after {waited:.1f}s; wait again or check it later",
            details={"capture_id": cap.id, "state": cap.state.value, "waited_s": round(waited, 3)},
        )
    return False


class AsyncSidecarClient:
    """Async client. Use as ``async with AsyncSidecarClient(url) as c: ...`` or call ``aclose()``.
    Its connections belong to the event loop that runs it: made once and driven by one
    ``asyncio.run`` after another, it opens new ones in each (the last run's died with its loop);
    from two loops running at once it refuses (a client per loop, or ``SidecarClient``)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = _sidecar_url(base_url)
        self.timeout = timeout
        self._new_http = lambda: httpx.AsyncClient(
            base_url=self.base_url, headers=_auth_headers(token), timeout=timeout, transport=transport, limits=_LIMITS
        )
        self._http = self._new_http()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop self._http's connections belong to

    async def __aenter__(self) -> AsyncSidecarClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http_here().aclose()

    def _http_here(self) -> httpx.AsyncClient:
        """The connection pool for the running loop. httpx's connections (and its pool's locks) are
        bound to the loop that opened them: reused from another one they fail deep in httpcore with
        ``Event loop is closed`` or ``bound to a different event loop``."""
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is loop:
            self._loop = loop
            return self._http
        if self._loop.is_running():
            raise RuntimeError(
                "this AsyncSidecarClient is in use on another event loop, which still runs (another thread's); "
                "make one client per loop (`async with AsyncSidecarClient(url) as c:` inside the coroutine), "
                "or use SidecarClient from code that is not async")
        if not self._http.is_closed:  # an earlier asyncio.run: its connections ended with its loop
            self._http = self._new_http()
        self._loop = loop
        return self._http

    async def _send(self, call: _Call) -> Any:
        # The fleet's client: a thousand targets send a thousand of these at once, so an absolute
        # URL (httpx parses a relative one twice, against its base). Both clients resend inline:
        # one resend, no retry policy to build per request.
        url, kwargs, http = self.base_url + call.path, call.send_kwargs(self.timeout), self._http_here()
        try:
            try:
                response = await http.request(call.method, url, **kwargs)
            except httpx.TransportError as err:
                if not _may_resend(call, err):
                    raise
                response = await http.request(call.method, url, **kwargs)
        except httpx.TransportError as err:
            raise _unreachable(self.base_url, err) from None
        return call.reply(response)

    async def healthz(self) -> dict[str, Any]:
        """As :meth:`SidecarClient.healthz`."""
        return await self._send(_Calls.healthz)

    async def readyz(self) -> dict[str, Any]:
        """As :meth:`SidecarClient.readyz`."""
        return await self._send(_Calls.readyz)

    async def stages(self) -> dict[str, Any]:
        """As :meth:`SidecarClient.stages`."""
        return await self._send(_Calls.stages)

    async def clock(self) -> dict[str, Any]:
        """The sidecar host's ``realtime_ns`` and ``monotonic_ns`` (``GET /v1/clock``)."""
        return await self._send(_Calls.clock)

    async def start_capture(
        self,
        stages: list[int] | None = None,
        label: str | None = None,
        duration_s: float | None = None,
        lease_s: float | None = None,
        steps: int | None = None,
        delay_steps: int | None = None,
        start_at: float | None = None,
        steps_bound: str | None = None,
        profile: str | None = None,
    ) -> Capture:
        """Start a capture of ``stages`` (None: every profiled stage) and return it. It records until
        ``stop_capture``, ``duration_s`` seconds, or a ``lease_s`` without a ``heartbeat``: a script
        that may die before its stop gives one of them. ``steps``: a window of that many engine
        steps, ended by the server's own cap (``omni-sidecar render --steps N``), or with
        ``steps_bound="count"`` by the sidecar's best-effort count (``delay_steps``: the start waits for that many first). ``start_at``
        (epoch seconds on the sidecar's clock): the start is sent then, and this returns once it is
        prepared (state ``starting``); ``wait_started`` waits for the server's answer. ``profile``:
        a stage preset's torch options for this capture only (plain vLLM 0.33 or newer)."""
        return await self._send(_Calls.start_capture(stages, label, duration_s, lease_s, steps, delay_steps,
                                                    start_at, steps_bound, profile))

    async def plan(self, stages: list[int] | None = None, budget_mb: float | None = None,
                   max_stop_s: float | None = None, probe_steps: list[int] | None = None,
                   refine: bool | None = None) -> Plan:
        """Probe captures, then the steps that fit ``budget_mb`` and ``max_stop_s`` (docs/captures.md)."""
        return await self._send(_Calls.plan(stages, budget_mb, max_stop_s, probe_steps, refine))

    async def stop_capture(self, capture_id: str, wait: bool = False, timeout: float | None = None) -> Capture:
        """Ask for a stop (returns at once); with ``wait`` poll until the capture is terminal."""
        cap: Capture = await self._send(_Calls.stop_capture(capture_id))
        if wait and not cap.terminal:
            cap = await self.wait_capture(capture_id, timeout=timeout)
        return cap

    async def get_capture(self, capture_id: str) -> Capture:
        """As :meth:`SidecarClient.get_capture`."""
        return await self._send(_Calls.get_capture(capture_id))

    async def wait_capture(self, capture_id: str, timeout: float | None = None, poll_s: float = 0.5) -> Capture:
        """Poll until terminal. Polling, not one long request: a flush can outlast any HTTP timeout."""
        deadline = _deadline(timeout)
        while not _wait_over(cap := await self.get_capture(capture_id), timeout, deadline):
            await asyncio.sleep(poll_s)
        return cap

    async def wait_started(self, capture_id: str, timeout: float | None = None, poll_s: float = 0.05) -> Capture:
        """Until a scheduled start was answered (or failed): the capture left ``starting``. One
        request held open by the sidecar at a time; polls every ``poll_s`` (growing) where it is not."""
        deadline, delay = _deadline(timeout), poll_s
        while True:
            held, t0 = _held_for(deadline), time.monotonic()
            if _wait_over(cap := await self._send(_Calls.until_started(capture_id, held)), timeout, deadline,
                          started=True):
                return cap
            if time.monotonic() - t0 < held / 2:  # answered at once: an older sidecar
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 1.0)

    async def list_captures(self, limit: int | None = None) -> list[Capture]:
        """Captures, newest first: the newest 100 (the sidecar's page), or ``limit`` of them (at most
        1000); a live capture is always among the newest. ``resolve_id`` looks through them all."""
        return await self._send(_Calls.list_captures if limit is None else _Calls.newest_captures(limit))

    async def resolve_id(self, text: str) -> str:
        """As :meth:`SidecarClient.resolve_id`."""
        ids, page = [], _IdPage([], None)
        while (page := await self._send(_Calls.capture_ids(page.next_before))).ids:
            ids += page.ids
            if page.next_before is None:
                break
        return match_capture_id(text, ids)

    async def record_clock(self, capture_id: str, record: dict[str, Any]) -> Capture:
        """Keep a fleet's clock measurement with the capture (``POST /v1/captures/{id}/clock``)."""
        return await self._send(_Calls.record_clock(capture_id, record))

    async def heartbeat(self, capture_id: str) -> Capture:
        """As :meth:`SidecarClient.heartbeat`."""
        return await self._send(_Calls.heartbeat(capture_id))

    async def summary(self, capture_id: str, top: int = 20) -> CaptureSummary:
        """As :meth:`SidecarClient.summary`."""
        return await self._send(_Calls.summary(capture_id, top))

    async def diff(self, a: str, b: str, top: int = 20) -> CaptureDiff:
        """Per stage, B − A: ops and kernels by the change in their time, and memory (``top``: 1 to 500 rows)."""
        return await self._send(_Calls.diff(a, b, top))

    async def download(self, capture_id: str, relpath: str) -> bytes:
        """As :meth:`SidecarClient.download`."""
        return await self._send(_Calls.download(capture_id, relpath))


class SidecarClient:
    """Sync twin of ``AsyncSidecarClient``: the same methods, not awaited, and the same errors. Use
    as ``with SidecarClient(url) as c: ...`` or call ``close()``. One client may be shared by
    threads. A call blocks its thread, also inside a running event loop (a notebook cell): there,
    ``AsyncSidecarClient`` keeps the loop free."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = _sidecar_url(base_url)
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.base_url, headers=_auth_headers(token), timeout=timeout, transport=transport,
                                  limits=_LIMITS)

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> Any:
        kwargs = call.send_kwargs(self.timeout)
        try:
            try:
                response = self._http.request(call.method, call.path, **kwargs)
            except httpx.TransportError as err:
                if not _may_resend(call, err):
                    raise
                response = self._http.request(call.method, call.path, **kwargs)
        except httpx.TransportError as err:
            raise _unreachable(self.base_url, err) from None
        return call.reply(response)

    def healthz(self) -> dict[str, Any]:
        """The sidecar is alive: ``status``, ``version``, ``active_capture`` (its id or None), ``journal``."""
        return self._send(_Calls.healthz)

    def readyz(self) -> dict[str, Any]:
        """The upstream answers and its profiler endpoints are mounted (``UpstreamNotReady`` otherwise)."""
        return self._send(_Calls.readyz)

    def stages(self) -> dict[str, Any]:
        """The deploy's stages: profiler kind and folder, findings, and what the server is (``server``)."""
        return self._send(_Calls.stages)

    def clock(self) -> dict[str, Any]:
        """The sidecar host's ``realtime_ns`` and ``monotonic_ns`` (``GET /v1/clock``)."""
        return self._send(_Calls.clock)

    def start_capture(
        self,
        stages: list[int] | None = None,
        label: str | None = None,
        duration_s: float | None = None,
        lease_s: float | None = None,
        steps: int | None = None,
        delay_steps: int | None = None,
        start_at: float | None = None,
        steps_bound: str | None = None,
        profile: str | None = None,
    ) -> Capture:
        """Start a capture of ``stages`` (None: every profiled stage) and return it. It records until
        ``stop_capture``, ``duration_s`` seconds, or a ``lease_s`` without a ``heartbeat``: a script
        that may die before its stop gives one of them. ``steps``: a window of that many engine
        steps, ended by the server's own cap (``omni-sidecar render --steps N``), or with
        ``steps_bound="count"`` by the sidecar's best-effort count (``delay_steps``: the start waits for that many first). ``start_at``
        (epoch seconds on the sidecar's clock): the start is sent then, and this returns once it is
        prepared (state ``starting``); ``wait_started`` waits for the server's answer. ``profile``:
        a stage preset's torch options for this capture only (plain vLLM 0.33 or newer)."""
        return self._send(_Calls.start_capture(stages, label, duration_s, lease_s, steps, delay_steps,
                                                    start_at, steps_bound, profile))

    def plan(self, stages: list[int] | None = None, budget_mb: float | None = None,
             max_stop_s: float | None = None, probe_steps: list[int] | None = None,
             refine: bool | None = None) -> Plan:
        """Probe captures, then the steps that fit ``budget_mb`` and ``max_stop_s`` (docs/captures.md)."""
        return self._send(_Calls.plan(stages, budget_mb, max_stop_s, probe_steps, refine))

    def stop_capture(self, capture_id: str, wait: bool = False, timeout: float | None = None) -> Capture:
        """Ask for a stop (returns at once); with ``wait`` poll until the capture is terminal."""
        cap: Capture = self._send(_Calls.stop_capture(capture_id))
        if wait and not cap.terminal:
            cap = self.wait_capture(capture_id, timeout=timeout)
        return cap

    def get_capture(self, capture_id: str) -> Capture:
        """The capture as it is now (``CaptureNotFound`` for an unknown id)."""
        return self._send(_Calls.get_capture(capture_id))

    def wait_capture(self, capture_id: str, timeout: float | None = None, poll_s: float = 0.5,
                     on_poll: Callable[[Capture], None] | None = None) -> Capture:
        """Poll until terminal. Polling, not one long request: a flush can outlast any HTTP timeout.
        ``on_poll`` sees each state read (a progress display)."""
        deadline = _deadline(timeout)
        while True:
            cap = self.get_capture(capture_id)
            if on_poll is not None:
                on_poll(cap)
            if _wait_over(cap, timeout, deadline):
                return cap
            time.sleep(poll_s)

    def wait_started(self, capture_id: str, timeout: float | None = None, poll_s: float = 0.05) -> Capture:
        """As :meth:`AsyncSidecarClient.wait_started`."""
        deadline, delay = _deadline(timeout), poll_s
        while True:
            held, t0 = _held_for(deadline), time.monotonic()
            if _wait_over(cap := self._send(_Calls.until_started(capture_id, held)), timeout, deadline, started=True):
                return cap
            if time.monotonic() - t0 < held / 2:  # answered at once: an older sidecar
                time.sleep(delay)
                delay = min(delay * 1.5, 1.0)

    def list_captures(self, limit: int | None = None) -> list[Capture]:
        """Captures, newest first: the newest 100 (the sidecar's page), or ``limit`` of them (at most
        1000); a live capture is always among the newest. ``resolve_id`` looks through them all."""
        return self._send(_Calls.list_captures if limit is None else _Calls.newest_captures(limit))

    def resolve_id(self, text: str) -> str:
        """The capture whose id is ``text`` or starts with it, among every capture the sidecar
        keeps (``CaptureNotFound`` / ``CaptureIdAmbiguous`` listing the candidates otherwise): ids
        are long to type."""
        ids, page = [], _IdPage([], None)
        while (page := self._send(_Calls.capture_ids(page.next_before))).ids:
            ids += page.ids
            if page.next_before is None:
                break
        return match_capture_id(text, ids)

    def record_clock(self, capture_id: str, record: dict[str, Any]) -> Capture:
        """Keep a fleet's clock measurement with the capture (``POST /v1/captures/{id}/clock``)."""
        return self._send(_Calls.record_clock(capture_id, record))

    def heartbeat(self, capture_id: str) -> Capture:
        """Renew the capture's lease (``lease_s``): without one in time it stops itself."""
        return self._send(_Calls.heartbeat(capture_id))

    def summary(self, capture_id: str, top: int = 20) -> CaptureSummary:
        """Top ops per stage of a finished capture (``CaptureNotTerminal`` while it records; ``top``: 1 to 500)."""
        return self._send(_Calls.summary(capture_id, top))

    def diff(self, a: str, b: str, top: int = 20) -> CaptureDiff:
        """As :meth:`AsyncSidecarClient.diff`."""
        return self._send(_Calls.diff(a, b, top))

    def download(self, capture_id: str, relpath: str) -> bytes:
        """One trace file's bytes; ``relpath`` is ``<session folder name>/<file name>`` as the verdicts list them."""
        return self._send(_Calls.download(capture_id, relpath))


__all__ = ["AsyncSidecarClient", "SidecarClient", "SidecarReplyInvalid", "SidecarUnreachable", "WaitTimeout",
           "error_from_response"]
