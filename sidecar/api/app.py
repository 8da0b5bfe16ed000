"""The HTTP surface: ``create_app(controller, deploy, settings)`` builds a FastAPI app that maps
routes onto ``CaptureController`` calls and errors onto one status table (``errors.py``). No rule
lives here: stage selection, retries, the state machine and artifact confinement are the
controller's. Lifespan: ``controller.open()`` (recovery) at start-up, ``controller.close()``
(stops the active capture) at shutdown.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional
from urllib.parse import unquote_to_bytes

from fastapi import Body, Depends, FastAPI, Query, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, field_validator

import sidecar
from sidecar.api import web
from sidecar.api.auth import BearerAuth
from sidecar.api.errors import error_response, install_error_handlers
from sidecar.api.insight import router as insight_router
from sidecar.analysis.isolated import stop_all as stop_analyses
from sidecar.api.guard import RequestGuard
from sidecar.api.metrics import Metrics, MetricsMiddleware
from sidecar.api.openapi import ERROR_RESPONSES, install_docs, responses
from sidecar.api.responses import SafeJSONResponse
from sidecar.config.models import DeployConfig
from sidecar.control import filenames
from sidecar.control.models import MAX_ENGINE_STEPS, Capture, CaptureState, ClockRecord
from sidecar.control.schedule import HOLD_MAX_S
from sidecar.api.openapi import error as openapi_error
from sidecar.errors import (
    CaptureNotFound,
    CaptureNotTerminal,
    CaptureStateError,
    RequestInvalid,
    SidecarClosing,
    StageSelectionError,
    StageSetMismatch,
    SummaryUnavailable,
    TraceError,
    TraceTooLarge,
    UpstreamNotReady,
    UpstreamUnreachable,
    StartAtInvalid,
    StepsNotReached,
    StepsUnavailable,
    WindowInvalid,
)
from sidecar.scrub import Scrubber, register_secret

if TYPE_CHECKING:
    from sidecar.config.settings import SidecarSettings
    from sidecar.control.controller import CaptureController
    from sidecar.upstream.server import UpstreamServer

log = logging.getLogger("sidecar.api")
LATEST_TIME = 253402300799.0  # 9999-12-31T23:59:59Z, the last second a date can show


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


class CaptureRequest(BaseModel):
    """Body of ``POST /v1/captures``. Omitted ``stages`` = every profiled stage, sent explicitly."""

    model_config = ConfigDict(extra="forbid")

    # strict: `true` is not stage 1, "0" is not stage 0
    stages: list[Whole] | None = Field(default=None, description="stage ids; omit for every profiled stage")
    label: str | None = Field(default=None, max_length=200)
    duration_s: float | None = Field(default=None, gt=0, description="stop automatically after this many seconds")
    lease_s: float | None = Field(default=None, gt=0, description="stop unless a heartbeat arrives within this")
    kind: Literal["torch", "nsys"] = Field(
        default="torch", description="torch: trace files the sidecar checks; nsys: `profiler: cuda` stages"
    )
    steps: _whole(Field(ge=1, le=MAX_ENGINE_STEPS)) | None = Field(default=None,
                                    description="stop after the server has run this many engine steps")
    delay_steps: _whole(Field(ge=0, le=MAX_ENGINE_STEPS)) | None = Field(default=None,
                                          description="start once the server has run this many engine steps")
    start_at: Annotated[float, Field(ge=0, le=LATEST_TIME), BeforeValidator(_a_number)] | None = Field(
        default=None,
        description="epoch seconds on this sidecar's clock (GET /v1/clock): the start is sent then, and the "
                    "answer (202, state `starting`) comes once the capture is prepared; at once when past. A stop "
                    "before then cancels it, nothing sent")


class PlanRequest(BaseModel):
    """Body of ``POST /v1/plan``: probe captures, then the steps that fit the bounds."""

    model_config = ConfigDict(extra="forbid")

    stages: list[Whole] | None = Field(default=None, min_length=1,
                                       description="stage ids; omit for every profiled stage")
    budget_mb: float | None = Field(default=None, gt=0, description="trace size on disk the window must fit")
    max_stop_s: float | None = Field(default=None, gt=0, description="how long the server's stop may take")
    probe_steps: list[_whole(Field(ge=1, le=MAX_ENGINE_STEPS))] = Field(default=[1, 2], min_length=1, max_length=4,
                                         description="engine steps of each probe capture")
    refine: bool = Field(default=True, description="a plan 8x or more beyond its longest probe probes once more, "
                                                   "at half its steps (at most 5 s of them)")


def _describe_kinds(app: FastAPI, deploy: Any) -> None:
    """The document says which stages each capture ``kind`` takes (torch: ``profiler: torch``
    stages, nsys: ``profiler: cuda`` ones): ``CaptureRequest`` is one variant per kind that has
    stages in this deploy, so a schema-valid body is not refused ``stage_not_torch`` /
    ``stage_not_cuda``."""
    ids = {kind: sorted(s.stage_id for s in deploy.stages if s.profiler == profiler)
           for kind, profiler in (("torch", "torch"), ("nsys", "cuda"))}
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        comps = schema.get("components", {}).get("schemas", {})
        model = comps.get("CaptureRequest")
        if model is None or "anyOf" in model:
            return schema
        variants = []
        for kind, stage_ids in ids.items():
            if not stage_ids and kind != "torch":
                continue
            variant = copy.deepcopy(model)
            props = variant.setdefault("properties", {})
            props["kind"] = {**props.get("kind", {}), "enum": [kind]}
            if kind != "torch":  # the default is torch: an nsys capture says so
                variant["required"] = sorted({*variant.get("required", []), "kind"})
            stages = props.get("stages", {})
            for option in stages.get("anyOf", [stages]):
                if option.get("type") == "array" and stage_ids:
                    option.update(minItems=1, uniqueItems=True, maxItems=len(stage_ids),
                                  items={"type": "integer", "enum": stage_ids})
            variants.append(variant)
        comps["CaptureRequest"] = {"title": model.get("title", "CaptureRequest"),
                                   "description": model.get("description", ""), "anyOf": variants}
        plan = comps.get("PlanRequest", {}).get("properties", {}).get("stages", {})
        for option in plan.get("anyOf", [plan]):  # a plan probes torch stages, each once
            if option.get("type") == "array" and ids["torch"]:
                option.update(minItems=1, uniqueItems=True, maxItems=len(ids["torch"]),
                              items={"type": "integer", "enum": ids["torch"]})
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _raw_relpath(request: Request, capture_id: str, relpath: str) -> str:
    """``relpath`` as the bytes the client sent: the server decodes a URL's ``%FF`` to U+FFFD, so a
    file name that is not UTF-8 (listed with its ``name_quoted``) is taken from the raw path."""
    raw = request.scope.get("raw_path")
    if not isinstance(raw, bytes) or "\ufffd" not in relpath:
        return relpath
    head = f"/v1/captures/{capture_id}/files/".encode()
    path = unquote_to_bytes(raw.split(b"?", 1)[0])
    at = path.find(head)
    return os.fsdecode(path[at + len(head):]) if at >= 0 else relpath


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


def create_app(
    controller: CaptureController,
    deploy: DeployConfig,
    settings: SidecarSettings | None = None,
    *,
    upstream: UpstreamServer | None = None,
) -> FastAPI:
    upstream = upstream if upstream is not None else getattr(controller, "upstream", None)
    token = settings.read_token() if settings is not None else None
    register_secret(token)  # the journal and error records scrub it too, not only replies
    scrubber = Scrubber([token] if token else [])
    auth = BearerAuth(token)
    metrics = Metrics(controller.state_counts)
    hold_max_s = settings.hold_max_s if settings is not None else HOLD_MAX_S

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        recovered = await controller.open()
        for cap in recovered or []:
            log.warning("capture %s was left active by a previous run; stopped on recovery", cap.id)
        try:
            yield
        finally:
            # SIGTERM lands here (uvicorn): stop the active capture before the process exits
            await controller.close()
            stop_analyses()  # a summary in flight must not hold the exit (its caller gets 503)
            if upstream is not None:
                with contextlib.suppress(Exception):
                    await upstream.aclose()

    app = FastAPI(
        title="omni-sidecar",
        version=sidecar.__version__,
        description="Profiling controller beside `vllm serve <model> --omni`: validated, bounded, verified captures.",
        lifespan=lifespan,
        docs_url=None,  # served from the package's own Swagger UI assets below, never a CDN
        redoc_url=None,
        responses=ERROR_RESPONSES["common"],
    )
    install_error_handlers(app, scrubber)
    install_docs(app, stage_ids=[s.stage_id for s in deploy.stages if s.profiler == "torch"])
    _describe_kinds(app, deploy)
    app.add_middleware(RequestGuard, allowed_hosts=settings.allowed_hosts if settings is not None else ())
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: refused requests are counted too
    mutating = [Depends(auth)]

    def capture_json(cap: Capture) -> dict[str, Any]:
        return scrubber.data(cap.model_dump(mode="json"))

    def capture_response(cap: Capture, status: int = 200) -> SafeJSONResponse:
        return SafeJSONResponse(capture_json(cap), status_code=status)

    # --- health --------------------------------------------------------------------------

    @app.get("/healthz", tags=["health"], summary="The sidecar process is alive")
    async def healthz() -> dict[str, Any]:
        active = controller.active
        journal = controller.journal.health() if getattr(controller, "journal", None) is not None else None
        return {
            "status": "ok",
            "version": sidecar.__version__,
            "active_capture": active.id if active else None,
            "journal": journal,  # quarantined entries and failed writes: history needs a look
        }

    @app.get(
        "/readyz",
        tags=["health"],
        summary="Upstream healthy and its profiler endpoints mounted",
        responses={503: openapi_error(UpstreamNotReady)},
    )
    async def readyz() -> Response:
        if upstream is None:
            return error_response(UpstreamNotReady("no upstream configured"), scrubber=scrubber)
        probe = await upstream.probe()
        if not probe.ready:  # the readiness rule is the probe's (ProbeResult.ready)
            return error_response(
                UpstreamNotReady(
                    probe.reason or "upstream not ready",
                    details={
                        "healthy": probe.healthy,
                        "profiler_mounted": probe.profiler_mounted,
                        "upstream": upstream.base_url,
                    },
                ),
                scrubber=scrubber,
            )
        return SafeJSONResponse(
            scrubber.data({"status": "ready", "upstream": upstream.base_url, "profiler_mounted": probe.profiler_mounted})
        )

    # --- stages --------------------------------------------------------------------------

    def stages_report() -> dict[str, Any]:
        from sidecar.config.rules import validate_deploy

        findings = [f.model_dump(mode="json") for f in validate_deploy(deploy)]
        return scrubber.data(
            {
                "deploy_config": str(deploy.path) if deploy.path else None,
                "platform": deploy.platform,
                "stages": [
                    {
                        "stage_id": s.stage_id,
                        "kind": s.kind.value,
                        "profiler": s.profiler,
                        "profiler_dir": s.profiler_dir,
                        "num_replicas": s.num_replicas,
                        "profiler_config": s.profiler_config.model_dump(mode="json") if s.profiler_config else None,
                        "findings": [f for f in findings if f.get("stage_id") == s.stage_id],
                    }
                    for s in deploy.stages
                ],
                "findings": findings,
            }
        )

    # the deploy is fixed for the app's lifetime, so its report is computed once, not per request
    stages_json = stages_report()

    @app.get("/v1/stages", tags=["stages"], summary="Stages of the deploy, their profiler and findings")
    async def stages() -> dict[str, Any]:
        return stages_json

    @app.get("/v1/clock", tags=["health"], summary="This host's realtime and monotonic clocks (ns), for a "
             "fleet's clock-offset exchange (docs/fleet-clocks.md)")
    async def clock() -> dict[str, int]:
        return {"realtime_ns": time.time_ns(), "monotonic_ns": time.monotonic_ns()}

    # --- captures ------------------------------------------------------------------------

    @app.post(
        "/v1/captures",
        status_code=201,
        tags=["captures"],
        dependencies=mutating,
        summary="Start a capture (409 if one is active; 422 for a bad stage set, before any upstream call)",
        responses={**responses("mutating", "start"),
                   202: {"description": "a scheduled start (`start_at`): the capture, prepared and `starting`"},
                   422: openapi_error(RequestInvalid, StageSelectionError, WindowInvalid, StepsUnavailable,
                                      StartAtInvalid),
                   503: openapi_error(UpstreamUnreachable, SidecarClosing), 504: openapi_error(StepsNotReached)},
    )
    async def start_capture(req: CaptureRequest = Body(default_factory=CaptureRequest)) -> SafeJSONResponse:
        opts = dict(label=req.label, duration_s=req.duration_s, lease_s=req.lease_s, kind=req.kind, steps=req.steps,
                    delay_steps=req.delay_steps)
        if req.start_at is not None:
            return capture_response(await controller.schedule(req.stages, start_at=req.start_at, **opts), 202)
        return capture_response(await controller.start(req.stages, **opts), 201)

    @app.post("/v1/plan", tags=["captures"], dependencies=mutating,
              summary="Probe captures of a few engine steps, then the steps and stop that fit a budget",
              responses={**responses("mutating", "start"),
                         422: openapi_error(RequestInvalid, StageSelectionError, StepsUnavailable)})
    async def plan(req: PlanRequest = Body(default_factory=PlanRequest)) -> SafeJSONResponse:
        result = await controller.plan(req.stages, budget_mb=req.budget_mb, max_stop_s=req.max_stop_s,
                                       probe_steps=tuple(req.probe_steps), refine=req.refine)
        return SafeJSONResponse(scrubber.data(result.model_dump(mode="json")))

    @app.get("/v1/plan", tags=["captures"], summary="The latest plan, and its prediction for `steps`")
    async def last_plan(steps: Optional[int] = Query(None, ge=1, le=MAX_ENGINE_STEPS)) -> SafeJSONResponse:
        result = controller.last_plan
        if result is None:
            return SafeJSONResponse({"plan": None, "prediction": None})
        prediction = None
        if steps is not None:
            size_mb, stop_s = result.predict(steps)
            spread = result.predict_range(steps)  # the server's whole window, probed more than once
            prediction = {"steps": steps, "mb": round(size_mb, 3), "stop_s": round(stop_s, 3),
                          "mb_range": [round(v, 3) for v in spread[0]] if spread else None,
                          "stop_range_s": [round(v, 3) for v in spread[1]] if spread and spread[1] else None}
        return SafeJSONResponse({"plan": scrubber.data(result.model_dump(mode="json")), "prediction": prediction})

    @app.get("/v1/captures", tags=["captures"], summary="Captures, newest first (survives restarts), a page at a time",
             response_model=dict[str, Any])
    async def list_captures(
        limit: int = Query(100, ge=1, le=1000, description="at most this many captures"),
        before: Optional[str] = Query(
            None, max_length=128, description="only captures older than this capture id (the previous page's next_before)"
        ),
    ) -> SafeJSONResponse:
        caps = controller.list()
        if before is not None:
            ref = next((c for c in caps if c.id == before), None)
            if ref is not None:
                key = (ref.created_at, ref.id)
                caps = [c for c in caps if (c.created_at, c.id) < key]
            else:  # an id past retention: ids sort by creation time
                caps = [c for c in caps if c.id < before]
        page = caps[:limit]
        more = len(caps) > limit
        return SafeJSONResponse(
            {"captures": [capture_json(c) for c in page], "next_before": page[-1].id if more and page else None}
        )

    @app.get(
        "/v1/captures/{capture_id}",
        tags=["captures"],
        summary="One capture: state, verdicts, files",
        responses=responses("capture"),
    )
    async def get_capture(
        capture_id: str,
        until: Optional[Literal["started"]] = Query(
            None, description="started: answer once the capture has left `starting` (a scheduled start sent and "
                              "answered, or failed), or after `timeout`"),
        timeout: float = Query(HOLD_MAX_S, gt=0, le=HOLD_MAX_S,
                               description="with until: seconds to wait at most (and the sidecar's hold_max_s)"),
    ) -> SafeJSONResponse:
        if until == "started":
            held = min(timeout, hold_max_s)
            return capture_response(await controller.wait_started(capture_id, timeout=held))
        return capture_response(controller.get(capture_id))

    @app.post(
        "/v1/captures/{capture_id}/stop",
        status_code=202,
        tags=["captures"],
        dependencies=mutating,
        summary="Stop a capture (202 at once; ?wait=true blocks until it is terminal)",
        responses={**responses("mutating", "capture"), 200: {"description": "the capture, terminal"}},
    )
    async def stop_capture(
        capture_id: str,
        wait: bool = Query(False, description="block until the capture is terminal"),
        timeout: float | None = Query(None, gt=0, description="with wait: give up waiting after this many seconds"),
    ) -> SafeJSONResponse:
        # stopping a capture that is already stopping or finished returns it unchanged
        cap = await controller.stop(capture_id)
        if wait and not cap.terminal:
            cap = await controller.wait(capture_id, timeout=timeout)
        return capture_response(cap, 200 if cap.terminal else 202)

    @app.post(
        "/v1/captures/{capture_id}/heartbeat",
        tags=["captures"],
        dependencies=mutating,
        summary="Extend the capture's lease",
        responses={**responses("mutating", "capture"), 409: openapi_error(CaptureStateError)},
    )
    async def heartbeat(capture_id: str) -> SafeJSONResponse:
        return capture_response(await controller.heartbeat(capture_id))

    @app.post(
        "/v1/captures/{capture_id}/clock",
        tags=["captures"],
        dependencies=mutating,
        summary="Record a fleet's measurement of this host's clock with the capture (docs/fleet-clocks.md)",
        responses=responses("mutating", "capture"),
    )
    async def record_clock(capture_id: str, record: ClockRecord) -> SafeJSONResponse:
        return capture_response(await controller.record_clock(capture_id, record))

    @app.get(
        "/v1/captures/{capture_id}/files/{relpath:path}",
        tags=["captures"],
        summary="Download one artifact, confined to the capture's session folders",
        responses={
            **responses("capture", "download"),
            200: {"description": "the file", "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        },
        response_class=FileResponse,
    )
    async def download(request: Request, capture_id: str, relpath: str) -> FileResponse:
        path = controller.artifact_path(capture_id, _raw_relpath(request, capture_id, relpath))
        return FileResponse(path, filename=filenames.shown(path.name))

    @app.get(
        "/v1/captures/{capture_id}/summary",
        tags=["captures"],
        summary="Top ops per stage (cached)",
        responses={
            404: openapi_error(CaptureNotFound, SummaryUnavailable),
            409: openapi_error(CaptureNotTerminal),
            422: openapi_error(TraceError, TraceTooLarge),
        },
    )
    async def summary(capture_id: str, top: int = Query(20, ge=1, le=500)) -> SafeJSONResponse:
        return SafeJSONResponse(scrubber.data(await controller.summarize(capture_id, top=top)))

    # --- compat: the upstream's own endpoints, with the sidecar's safety -------------------

    @app.post(
        "/start_profile",
        tags=["compat"],
        dependencies=mutating,
        summary="Upstream-compatible start: starts a capture of the given stages (all profiled if none)",
        responses={**responses("mutating", "start"), 422: openapi_error(RequestInvalid, StageSelectionError),
                   503: openapi_error(UpstreamUnreachable, SidecarClosing)},
    )
    async def compat_start(body: CompatProfileRequest | None = Body(default=None)) -> SafeJSONResponse:
        cap = await controller.start(body.stages if body else None, label="compat")
        return SafeJSONResponse({"status": "SUCCESS", "capture_id": cap.id, "capture": capture_json(cap)})

    @app.post(
        "/stop_profile",
        tags=["compat"],
        dependencies=mutating,
        summary="Upstream-compatible stop: stops the active capture and waits until its traces are checked",
        responses={**responses("mutating"), 409: openapi_error(StageSetMismatch)},
    )
    async def compat_stop(body: CompatStopRequest | None = Body(default=None)) -> SafeJSONResponse:
        cap = await controller.stop_active(body.stages if body else None)
        if cap is None:
            # the upstream answers SUCCESS to a stop without a start; so do we, and say so
            return SafeJSONResponse({"status": "SUCCESS", "capture_id": None, "capture": None})
        status = "SUCCESS" if cap.state is CaptureState.completed else cap.state.value.upper()
        return SafeJSONResponse({"status": status, "capture_id": cap.id, "capture": capture_json(cap)})

    @app.get(
        "/metrics",
        tags=["health"],
        summary="Prometheus metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(insight_router)
    app.include_router(web.router)  # the web page: /, /captures/{id}, /stages, /web/* (sidecar/api/web)
    app.state.controller = controller
    app.state.deploy = deploy
    app.state.settings = settings
    return app


def build_app(settings: SidecarSettings, deploy: DeployConfig) -> FastAPI:
    """The app ``omni-sidecar serve`` runs: upstream and controller built from ``settings``."""
    from sidecar.control.controller import CaptureController, ControlSettings
    from sidecar.upstream.server import UpstreamServer

    upstream = UpstreamServer.from_settings(settings)
    controller = CaptureController(
        upstream, deploy, state_dir=settings.state_dir, settings=ControlSettings.from_settings(settings)
    )
    return create_app(controller, deploy, settings, upstream=upstream)


__all__ = ["CaptureRequest", "CompatProfileRequest", "PlanRequest", "build_app", "create_app"]
