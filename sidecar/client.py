"""Python clients for the sidecar's HTTP API: ``AsyncSidecarClient`` (httpx.AsyncClient; the
rollout hook and fleet use it) and ``SidecarClient`` (sync, for the CLI and scripts). Error
replies come back as the matching ``SidecarError`` subclass, chosen by the reply's ``code``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from sidecar import errors as _errors
from sidecar.control.models import Capture
from sidecar.errors import SidecarError, StageSelectionError

DEFAULT_URL = "http://127.0.0.1:8092"
DEFAULT_TIMEOUT = 30.0
# POST /v1/captures returns when the upstream accepted the start, which blocks server-side (the
# sidecar's own start timeout is 300 s by default); a short client timeout would abandon it
START_TIMEOUT = 360.0


def _error_classes() -> dict[str, type[SidecarError]]:
    found: dict[str, type[SidecarError]] = {}
    pending: list[type[SidecarError]] = [SidecarError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    # codes that are instances of one class with a per-case code
    for code in ("stages_empty", "stage_duplicate", "stage_unknown", "stage_not_profiled", "stage_not_torch"):
        found.setdefault(code, StageSelectionError)
    for code in ("capture_not_terminal", "summary_unavailable", "stage_set_mismatch"):
        found.setdefault(code, _errors.CaptureError)
    return found


_BY_CODE = _error_classes()


class SidecarUnreachable(SidecarError):
    """No answer from the sidecar at all (not running, wrong URL, or it timed out)."""

    code = "sidecar_unreachable"


class WaitTimeout(SidecarError):
    """``wait_capture`` gave up before the capture became terminal; it is still running."""

    code = "wait_timeout"


def error_from_response(response: httpx.Response) -> SidecarError:
    """The typed error a non-2xx reply stands for (``{"error": {"code", "message", "details"}}``)."""
    try:
        payload = response.json().get("error") or {}
    except (ValueError, AttributeError):
        payload = {}
    code = str(payload.get("code") or f"http_{response.status_code}")
    message = str(payload.get("message") or f"HTTP {response.status_code} from {response.request.url}")
    details = payload.get("details") if isinstance(payload.get("details"), dict) else {}
    details = {**details, "status": response.status_code}
    cls = _BY_CODE.get(code, SidecarError)
    return cls(message, code=code, details=details)


def _auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _capture_body(
    stages: list[int] | None, label: str | None, duration_s: float | None, lease_s: float | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"stages": stages, "label": label, "duration_s": duration_s, "lease_s": lease_s}
    return {k: v for k, v in body.items() if v is not None}


def _unreachable(base_url: str, err: httpx.TransportError) -> SidecarUnreachable:
    kind = "timed out" if isinstance(err, httpx.TimeoutException) else "is not reachable"
    return SidecarUnreachable(
        f"sidecar at {base_url} {kind} ({type(err).__name__}); is `omni-sidecar serve` running there?",
        details={"url": base_url},
    )


class AsyncSidecarClient:
    """Async client. Use as ``async with AsyncSidecarClient(url) as c: ...`` or call ``aclose()``."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=_auth_headers(token), timeout=timeout, transport=transport
        )

    async def __aenter__(self) -> AsyncSidecarClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise _unreachable(self.base_url, err) from None
        if response.is_error:
            raise error_from_response(response)
        return response

    async def healthz(self) -> dict[str, Any]:
        return (await self._request("GET", "/healthz")).json()

    async def readyz(self) -> dict[str, Any]:
        return (await self._request("GET", "/readyz")).json()

    async def stages(self) -> dict[str, Any]:
        return (await self._request("GET", "/v1/stages")).json()

    async def start_capture(
        self,
        stages: list[int] | None = None,
        label: str | None = None,
        duration_s: float | None = None,
        lease_s: float | None = None,
    ) -> Capture:
        body = _capture_body(stages, label, duration_s, lease_s)
        reply = await self._request("POST", "/v1/captures", json=body, timeout=max(self.timeout, START_TIMEOUT))
        return Capture.model_validate(reply.json())

    async def stop_capture(self, capture_id: str, wait: bool = False, timeout: float | None = None) -> Capture:
        """Ask for a stop (returns at once); with ``wait`` poll until the capture is terminal."""
        cap = Capture.model_validate((await self._request("POST", f"/v1/captures/{capture_id}/stop")).json())
        if wait and not cap.terminal:
            cap = await self.wait_capture(capture_id, timeout=timeout)
        return cap

    async def get_capture(self, capture_id: str) -> Capture:
        return Capture.model_validate((await self._request("GET", f"/v1/captures/{capture_id}")).json())

    async def wait_capture(self, capture_id: str, timeout: float | None = None, poll_s: float = 0.5) -> Capture:
        """Poll until terminal. Polling, not one long request: a flush can outlast any HTTP timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            cap = await self.get_capture(capture_id)
            if cap.terminal:
                return cap
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"capture {capture_id} still {cap.state.value} after {timeout:g}s; wait again or check it later",
                    details={"capture_id": capture_id, "state": cap.state.value},
                )
            await asyncio.sleep(poll_s)

    async def list_captures(self) -> list[Capture]:
        data = (await self._request("GET", "/v1/captures")).json()
        return [Capture.model_validate(c) for c in data["captures"]]

    async def heartbeat(self, capture_id: str) -> Capture:
        return Capture.model_validate((await self._request("POST", f"/v1/captures/{capture_id}/heartbeat")).json())

    async def summary(self, capture_id: str, top: int = 20) -> dict[str, Any]:
        return (await self._request("GET", f"/v1/captures/{capture_id}/summary", params={"top": top})).json()

    async def download(self, capture_id: str, relpath: str) -> bytes:
        return (await self._request("GET", f"/v1/captures/{capture_id}/files/{relpath}")).content


class SidecarClient:
    """Sync twin of ``AsyncSidecarClient`` (same methods, same errors)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.base_url, headers=_auth_headers(token), timeout=timeout, transport=transport)

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise _unreachable(self.base_url, err) from None
        if response.is_error:
            raise error_from_response(response)
        return response

    def healthz(self) -> dict[str, Any]:
        return self._request("GET", "/healthz").json()

    def readyz(self) -> dict[str, Any]:
        return self._request("GET", "/readyz").json()

    def stages(self) -> dict[str, Any]:
        return self._request("GET", "/v1/stages").json()

    def start_capture(
        self,
        stages: list[int] | None = None,
        label: str | None = None,
        duration_s: float | None = None,
        lease_s: float | None = None,
    ) -> Capture:
        body = _capture_body(stages, label, duration_s, lease_s)
        reply = self._request("POST", "/v1/captures", json=body, timeout=max(self.timeout, START_TIMEOUT))
        return Capture.model_validate(reply.json())

    def stop_capture(self, capture_id: str, wait: bool = False, timeout: float | None = None) -> Capture:
        cap = Capture.model_validate(self._request("POST", f"/v1/captures/{capture_id}/stop").json())
        if wait and not cap.terminal:
            cap = self.wait_capture(capture_id, timeout=timeout)
        return cap

    def get_capture(self, capture_id: str) -> Capture:
        return Capture.model_validate(self._request("GET", f"/v1/captures/{capture_id}").json())

    def wait_capture(self, capture_id: str, timeout: float | None = None, poll_s: float = 0.5) -> Capture:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            cap = self.get_capture(capture_id)
            if cap.terminal:
                return cap
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"capture {capture_id} still {cap.state.value} after {timeout:g}s; wait again or check it later",
                    details={"capture_id": capture_id, "state": cap.state.value},
                )
            time.sleep(poll_s)

    def list_captures(self) -> list[Capture]:
        return [Capture.model_validate(c) for c in self._request("GET", "/v1/captures").json()["captures"]]

    def heartbeat(self, capture_id: str) -> Capture:
        return Capture.model_validate(self._request("POST", f"/v1/captures/{capture_id}/heartbeat").json())

    def summary(self, capture_id: str, top: int = 20) -> dict[str, Any]:
        return self._request("GET", f"/v1/captures/{capture_id}/summary", params={"top": top}).json()

    def download(self, capture_id: str, relpath: str) -> bytes:
        return self._request("GET", f"/v1/captures/{capture_id}/files/{relpath}").content


__all__ = ["AsyncSidecarClient", "SidecarClient", "SidecarUnreachable", "WaitTimeout", "error_from_response"]
