"""The upstream server's own profiler endpoints, ``POST /start_profile`` and ``POST /stop_profile``,
with the sidecar's safety: scripts written for ``vllm serve`` call the sidecar instead and get a
validated, verified capture. The replies keep the upstream's ``{"status": "SUCCESS", ...}`` shape."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Body
from pydantic import BaseModel, StrictInt, field_validator

from sidecar.api.bodies import JsonBodyRoute
from sidecar.api.openapi import error as openapi_error
from sidecar.api.openapi import responses
from sidecar.api.responses import SafeJSONResponse
from sidecar.api.state import TOKEN, Api
from sidecar.control.models import CaptureState
from sidecar.errors import RequestInvalid, SidecarClosing, StageSelectionError, StageSetMismatch, UpstreamUnreachable

router = APIRouter(tags=["compat"], dependencies=[TOKEN], route_class=JsonBodyRoute)


class CompatProfileRequest(BaseModel):
    """The upstream server's body for ``/start_profile`` and ``/stop_profile``."""

    stages: list[StrictInt] | None = None


class CompatStopRequest(CompatProfileRequest):
    """``/stop_profile``'s body: the live capture's own stages (any order), each once."""

    @field_validator("stages")
    @classmethod
    def _each_once(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or len(set(value)) != len(value)):
            raise ValueError("stages must name each stage once, at least one (or omit the body)")
        return value


@router.post(
    "/start_profile",
    summary="Upstream-compatible start: starts a capture of the given stages (all profiled if none)",
    responses={**responses("mutating", "start"), 422: openapi_error(RequestInvalid, StageSelectionError),
               503: openapi_error(UpstreamUnreachable, SidecarClosing)},
)
async def compat_start(api: Api, body: Optional[CompatProfileRequest] = Body(default=None)) -> SafeJSONResponse:
    cap = await api.controller.start(body.stages if body else None, label="compat")
    return SafeJSONResponse({"status": "SUCCESS", "capture_id": cap.id, "capture": api.capture_json(cap)})


@router.post(
    "/stop_profile",
    summary="Upstream-compatible stop: stops the active capture and waits until its traces are checked",
    responses={**responses("mutating"), 409: openapi_error(StageSetMismatch)},
)
async def compat_stop(api: Api, body: Optional[CompatStopRequest] = Body(default=None)) -> SafeJSONResponse:
    cap = await api.controller.stop_active(body.stages if body else None)
    if cap is None:
        # the upstream answers SUCCESS to a stop without a start; so do we, and say so
        return SafeJSONResponse({"status": "SUCCESS", "capture_id": None, "capture": None})
    status = "SUCCESS" if cap.state is CaptureState.completed else cap.state.value.upper()
    return SafeJSONResponse({"status": status, "capture_id": cap.id, "capture": api.capture_json(cap)})
