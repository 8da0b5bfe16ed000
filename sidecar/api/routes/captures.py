"""Captures: start (``POST /v1/captures``, at once or at ``start_at``), list, get (optionally held
until a scheduled start is sent), stop, heartbeat, a fleet's clock record, and the plan
(``POST``/``GET /v1/plan``). Every rule is the controller's; a route maps a body onto one call.
A JSON ``null`` body is no body: every field takes its default.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal, Optional

from fastapi import APIRouter, Body, Query, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from sidecar.api.bodies import JsonBodyRoute
from sidecar.api.openapi import error as openapi_error
from sidecar.api.openapi import responses
from sidecar.api.responses import SafeJSONResponse
from sidecar.api.state import TOKEN, Api
from sidecar.control.budget import MAX_PROBE_STEPS, MIN_BUDGET_MB, MIN_STOP_S
from sidecar.control.limits import capture_profiles
from sidecar.control.models import LABEL_MAX, MAX_ENGINE_STEPS, ClockRecord, label_problem
from sidecar.control.schedule import HOLD_MAX_S
from sidecar.errors import (CaptureActive, PlanInvalid, PlanTimeout, PlanUnmeasurable, ProfileNotPerCapture,
                            StepsUnbounded)
from sidecar.errors import (
    CaptureStateError,
    RequestInvalid,
    SidecarClosing,
    StageSelectionError,
    StartAtInvalid,
    StepsNotReached,
    StepsUnavailable,
    UpstreamUnreachable,
    WindowInvalid,
)

LATEST_TIME = 253402300799.0  # 9999-12-31T23:59:59Z, the last second a date can show

router = APIRouter(tags=["captures"], route_class=JsonBodyRoute)


def _a_number(value: Any) -> Any:
    """JSON numbers only: `true` is not stage 1 nor "0" stage 0 (JSON Schema's integer includes 3.0,
    so a whole float is a whole number; 3.5 is still refused by the type itself)."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError("must be a JSON number")
    return value


def _whole(*bounds: Any) -> Any:
    """An integer (3.0 included; never a bool or a string) within ``bounds`` (``Field(ge=...)``)."""
    return Annotated[(int, *bounds, BeforeValidator(_a_number))]


Whole = _whole()


def _number(*bounds: Any) -> Any:
    """A JSON number (never a bool or a string: "10" is not 10 seconds) within ``bounds``."""
    return Annotated[(float, *bounds, BeforeValidator(_a_number))]


PLAIN_TEXT = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"  # JSON Schema's (ECMA 262) spelling of _plain_text's rule


def _plain_text(value: Any) -> Any:
    """A label is shown in lists and tables: no control characters (an escape sequence there would
    recolour or retitle a terminal), said with where the first one is."""
    why = label_problem(value) if isinstance(value, str) else None
    if why is not None:
        raise ValueError(why)
    return value


# the stage presets a capture may carry (a set of torch options each: limits.check_profile)
CAPTURE_PROFILES = tuple(capture_profiles())


class CaptureRequest(BaseModel):
    """Body of ``POST /v1/captures``. Omitted ``stages`` = every profiled stage, sent explicitly."""

    model_config = ConfigDict(extra="forbid")

    # strict: `true` is not stage 1, "0" is not stage 0
    stages: list[Whole] | None = Field(default=None, description="stage ids; omit for every profiled stage")
    label: Annotated[Optional[str], BeforeValidator(_plain_text)] = Field(
        default=None, max_length=LABEL_MAX, description="plain text: no control characters",
        json_schema_extra={"pattern": PLAIN_TEXT})  # said in the schema; refused by _plain_text, with where
    duration_s: _number(Field(gt=0)) | None = Field(default=None, description="stop automatically after this many seconds")
    lease_s: _number(Field(gt=0)) | None = Field(default=None, description="stop unless a heartbeat arrives within this")
    kind: Literal["torch", "nsys"] = Field(
        default="torch", description="torch: trace files the sidecar checks; nsys: `profiler: cuda` stages"
    )
    steps: _whole(Field(ge=1, le=MAX_ENGINE_STEPS)) | None = Field(default=None,
                                    description="stop after the server has run this many engine steps")
    delay_steps: _whole(Field(ge=0, le=MAX_ENGINE_STEPS)) | None = Field(default=None,
                                          description="start once the server has run this many engine steps")
    steps_bound: Literal["server", "count"] | None = Field(
        default=None,
        description="what ends a `steps` window: `server` (default: every stage's own max_iterations cap, as "
                    "`omni-sidecar render --steps N` writes it; refused where there is none) or `count` (the "
                    "sidecar's best-effort count of /metrics, asked for by name: a trace may hold more or fewer; each "
                    "verdict's steps_traced says)")
    start_at: Annotated[float, Field(ge=0, le=LATEST_TIME), BeforeValidator(_a_number)] | None = Field(
        default=None,
        description="epoch seconds on this sidecar's clock (GET /v1/clock): the start is sent then, and the "
                    "answer (202, state `starting`) comes once the capture is prepared; at once when past. A stop "
                    "before then cancels it, nothing sent")
    profile: Literal[CAPTURE_PROFILES] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="a stage preset (memory, shapes, stacks, ops, light) whose torch options this capture records "
                    "with, sent as the start's `profiler_kwargs` (plain vLLM 0.33 or newer; elsewhere refused, "
                    "naming `omni-sidecar render --profile NAME`)")


class PlanRequest(BaseModel):
    """Body of ``POST /v1/plan``: probe captures, then the steps that fit the bounds."""

    model_config = ConfigDict(extra="forbid")

    stages: list[Whole] | None = Field(default=None, min_length=1,
                                       description="stage ids; omit for every profiled stage")
    budget_mb: _number(Field(ge=MIN_BUDGET_MB)) | None = Field(default=None,
                                    description="trace size on disk the window must fit (the smallest trace a window "
                                                "writes is a few kB)")
    max_stop_s: _number(Field(ge=MIN_STOP_S)) | None = Field(default=None, description="how long the server's stop may take")
    probe_steps: list[_whole(Field(ge=1, le=MAX_PROBE_STEPS))] = Field(default=[1, 2], min_length=1, max_length=4,
                                         description="engine steps of each probe capture")
    refine: bool = Field(default=True, description="a plan 8x or more beyond its longest probe probes once more, "
                                                   "at half its steps (at most 5 s of them)")


# the routes whose body may be JSON `null` or absent (the defaults): the document says so
NULLABLE_BODIES = ("/v1/captures", "/v1/plan")


@router.post(
    "/v1/captures",
    status_code=201,
    dependencies=[TOKEN],
    summary="Start a capture (409 if one is active; 422 for a bad stage set, before any upstream call)",
    responses={**responses("mutating", "start"),
               202: {"description": "a scheduled start (`start_at`): the capture, prepared and `starting`"},
               409: openapi_error(CaptureActive, ProfileNotPerCapture),
               422: openapi_error(RequestInvalid, StageSelectionError, WindowInvalid, StepsUnavailable,
                                  StepsUnbounded, StartAtInvalid),
               503: openapi_error(UpstreamUnreachable, SidecarClosing), 504: openapi_error(StepsNotReached)},
)
async def start_capture(api: Api, req: Annotated[Optional[CaptureRequest], Body()] = None) -> SafeJSONResponse:
    req = req or CaptureRequest()
    opts = dict(label=req.label, duration_s=req.duration_s, lease_s=req.lease_s, kind=req.kind, steps=req.steps,
                delay_steps=req.delay_steps, steps_bound=req.steps_bound, profile=req.profile)
    if req.start_at is not None:
        return api.capture_response(await api.controller.schedule(req.stages, start_at=req.start_at, **opts), 202)
    return api.capture_response(await api.controller.start(req.stages, **opts), 201)


@router.post("/v1/plan", dependencies=[TOKEN],
             summary="Probe captures of a few engine steps, then the steps and stop that fit a budget",
             responses={**responses("mutating", "start"),
                        409: openapi_error(CaptureActive, PlanUnmeasurable),
                        422: openapi_error(RequestInvalid, StageSelectionError, StepsUnavailable, PlanInvalid),
                        504: openapi_error(PlanTimeout)})
async def plan(api: Api, request: Request, req: Annotated[Optional[PlanRequest], Body()] = None) -> SafeJSONResponse:
    req = req or PlanRequest()
    work = asyncio.ensure_future(api.controller.plan(req.stages, budget_mb=req.budget_mb, max_stop_s=req.max_stop_s,
                                                     probe_steps=tuple(req.probe_steps), refine=req.refine))
    gone = asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client hung up (or this request was cancelled): the plan's probe is stopped
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise PlanUnmeasurable("the client hung up while the plan ran: its probe was stopped, nothing planned",
                               details={"cancelled": True})
    return SafeJSONResponse(api.scrubber.data(work.result().model_dump(mode="json")))


async def _hung_up(request: Request) -> None:
    """Returns once the client has closed its connection. A plan runs for minutes; without this a
    killed CLI or a dropped curl left it probing, holding the capture slot, to its end."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.get("/v1/plan", summary="The latest plan, and its prediction for `steps`")
async def last_plan(api: Api, steps: Optional[int] = Query(None, ge=1, le=MAX_ENGINE_STEPS)) -> SafeJSONResponse:
    result = api.controller.last_plan
    if result is None:
        return SafeJSONResponse({"plan": None, "prediction": None})
    prediction = None
    if steps is not None:
        size_mb, stop_s = result.predict(steps)
        spread = result.predict_range(steps)  # the server's whole window, probed more than once
        prediction = {"steps": steps, "mb": round(size_mb, 3), "stop_s": round(stop_s, 3),
                      "mb_range": [round(v, 3) for v in spread[0]] if spread else None,
                      "stop_range_s": [round(v, 3) for v in spread[1]] if spread and spread[1] else None}
    return SafeJSONResponse({"plan": api.scrubber.data(result.model_dump(mode="json")), "prediction": prediction})


@router.get("/v1/captures", summary="Captures, newest first (survives restarts), a page at a time",
            response_model=dict[str, Any])
async def list_captures(
    api: Api,
    limit: int = Query(100, ge=1, le=1000, description="at most this many captures"),
    before: Optional[str] = Query(
        None, min_length=1, max_length=128,
        description="only captures older than this capture id (the previous page's next_before)"
    ),
) -> SafeJSONResponse:
    page, next_before = api.controller.page(limit, before)
    return SafeJSONResponse({"captures": [api.capture_json(c) for c in page], "next_before": next_before})


@router.get(
    "/v1/captures/{capture_id}",
    summary="One capture: state, verdicts, files",
    responses=responses("capture"),
)
async def get_capture(
    api: Api,
    capture_id: str,
    until: Optional[Literal["started"]] = Query(
        None, description="started: answer once the capture has left `starting` (a scheduled start sent and "
                          "answered, or failed), or after `timeout`"),
    timeout: float = Query(HOLD_MAX_S, gt=0, le=HOLD_MAX_S,
                           description="with until: seconds to wait at most (and the sidecar's hold_max_s)"),
) -> SafeJSONResponse:
    if until == "started":
        held = min(timeout, api.hold_max_s)
        return api.capture_response(await api.controller.wait_started(capture_id, timeout=held))
    return api.capture_response(api.controller.get(capture_id))


@router.post(
    "/v1/captures/{capture_id}/stop",
    status_code=202,
    dependencies=[TOKEN],
    summary="Stop a capture (202 at once; ?wait=true blocks until it is terminal)",
    responses={**responses("mutating", "capture"), 200: {"description": "the capture, terminal"}},
)
async def stop_capture(
    api: Api,
    capture_id: str,
    wait: bool = Query(False, description="block until the capture is terminal"),
    timeout: float | None = Query(None, gt=0, description="with wait: give up waiting after this many seconds"),
) -> SafeJSONResponse:
    # stopping a capture that is already stopping or finished returns it unchanged
    cap = await api.controller.stop(capture_id)
    if wait and not cap.terminal:
        cap = await api.controller.wait(capture_id, timeout=timeout)
    return api.capture_response(cap, 200 if cap.terminal else 202)


@router.post(
    "/v1/captures/{capture_id}/heartbeat",
    dependencies=[TOKEN],
    summary="Extend the capture's lease",
    responses={**responses("mutating", "capture"), 409: openapi_error(CaptureStateError)},
)
async def heartbeat(api: Api, capture_id: str) -> SafeJSONResponse:
    return api.capture_response(await api.controller.heartbeat(capture_id))


@router.post(
    "/v1/captures/{capture_id}/clock",
    dependencies=[TOKEN],
    summary="Record a fleet's measurement of this host's clock with the capture (docs/fleet-clocks.md)",
    responses=responses("mutating", "capture"),
)
async def record_clock(api: Api, capture_id: str, record: ClockRecord) -> SafeJSONResponse:
    return api.capture_response(await api.controller.record_clock(capture_id, record))
