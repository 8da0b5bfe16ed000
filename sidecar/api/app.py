"""The HTTP surface: ``create_app(controller, deploy, settings)`` builds a FastAPI app that maps
routes onto ``CaptureController`` calls and errors onto one status table (``errors.py``). No rule
lives here: stage selection, retries, the state machine and artifact confinement are the
controller's. Lifespan: ``controller.open()`` (recovery) at start-up, ``controller.close()``
(stops the active capture) at shutdown.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Body, Depends, FastAPI, Query, Response
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

import sidecar
from sidecar.api.auth import BearerAuth
from sidecar.api.errors import error_response, install_error_handlers
from sidecar.api.metrics import Metrics, MetricsMiddleware
from sidecar.config.models import DeployConfig
from sidecar.control.models import Capture, CaptureState
from sidecar.scrub import Scrubber

if TYPE_CHECKING:
    from sidecar.config.settings import SidecarSettings
    from sidecar.control.controller import CaptureController
    from sidecar.upstream.server import UpstreamServer

log = logging.getLogger("sidecar.api")


class CaptureRequest(BaseModel):
    """Body of ``POST /v1/captures``. Omitted ``stages`` = every profiled stage, sent explicitly."""

    model_config = ConfigDict(extra="forbid")

    stages: list[int] | None = Field(default=None, description="stage ids; omit for every profiled stage")
    label: str | None = Field(default=None, max_length=200)
    duration_s: float | None = Field(default=None, gt=0, description="stop automatically after this many seconds")
    lease_s: float | None = Field(default=None, gt=0, description="stop unless a heartbeat arrives within this")
    kind: Literal["torch", "nsys"] = Field(
        default="torch", description="torch: trace files the sidecar checks; nsys: `profiler: cuda` stages"
    )


class CompatProfileRequest(BaseModel):
    """The upstream server's body for ``/start_profile`` and ``/stop_profile``."""

    stages: list[int] | None = None


class _JsonByDefault:
    """``curl -d '{...}'`` sends ``application/x-www-form-urlencoded``; no route takes forms, so a
    POST body without a JSON content type is read as JSON (DESIGN.md §1's curl line must work)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            ctype = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
            if not ctype or ctype.startswith(b"application/x-www-form-urlencoded"):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def create_app(
    controller: CaptureController,
    deploy: DeployConfig,
    settings: SidecarSettings | None = None,
    *,
    upstream: UpstreamServer | None = None,
) -> FastAPI:
    upstream = upstream if upstream is not None else getattr(controller, "upstream", None)
    token = settings.read_token() if settings is not None else None
    scrubber = Scrubber([token] if token else [])
    auth = BearerAuth(token)
    metrics = Metrics(controller.list)

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
            if upstream is not None:
                with contextlib.suppress(Exception):
                    await upstream.aclose()

    app = FastAPI(
        title="omni-sidecar",
        version=sidecar.__version__,
        description="Profiling controller beside `vllm serve <model> --omni`: validated, bounded, verified captures.",
        lifespan=lifespan,
    )
    install_error_handlers(app, scrubber)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(_JsonByDefault)
    mutating = [Depends(auth)]

    def capture_json(cap: Capture) -> dict[str, Any]:
        return scrubber.data(cap.model_dump(mode="json"))

    def capture_response(cap: Capture, status: int = 200) -> JSONResponse:
        return JSONResponse(capture_json(cap), status_code=status)

    # --- health --------------------------------------------------------------------------

    @app.get("/healthz", tags=["health"], summary="The sidecar process is alive")
    async def healthz() -> dict[str, Any]:
        active = controller.active
        return {"status": "ok", "version": sidecar.__version__, "active_capture": active.id if active else None}

    @app.get("/readyz", tags=["health"], summary="Upstream healthy and its profiler endpoints mounted")
    async def readyz() -> Response:
        if upstream is None:
            return error_response("upstream_not_ready", "no upstream configured", scrubber=scrubber)
        probe = await upstream.probe()
        if not probe.ready:  # the readiness rule is the probe's (ProbeResult.ready)
            return error_response(
                "upstream_not_ready",
                probe.reason or "upstream not ready",
                {"healthy": probe.healthy, "profiler_mounted": probe.profiler_mounted, "upstream": upstream.base_url},
                scrubber=scrubber,
            )
        return JSONResponse(
            {"status": "ready", "upstream": upstream.base_url, "profiler_mounted": probe.profiler_mounted}
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

    # --- captures ------------------------------------------------------------------------

    @app.post(
        "/v1/captures",
        status_code=201,
        tags=["captures"],
        dependencies=mutating,
        summary="Start a capture (409 if one is active; 422 for a bad stage set, before any upstream call)",
    )
    async def start_capture(req: CaptureRequest = Body(default_factory=CaptureRequest)) -> JSONResponse:
        cap = await controller.start(
            req.stages, label=req.label, duration_s=req.duration_s, lease_s=req.lease_s, kind=req.kind
        )
        return capture_response(cap, 201)

    @app.get("/v1/captures", tags=["captures"], summary="Every capture, newest first (survives restarts)")
    async def list_captures() -> dict[str, Any]:
        return {"captures": [capture_json(c) for c in controller.list()]}

    @app.get("/v1/captures/{capture_id}", tags=["captures"], summary="One capture: state, verdicts, files")
    async def get_capture(capture_id: str) -> JSONResponse:
        return capture_response(controller.get(capture_id))

    @app.post(
        "/v1/captures/{capture_id}/stop",
        status_code=202,
        tags=["captures"],
        dependencies=mutating,
        summary="Stop a capture (202 at once; ?wait=true blocks until it is terminal)",
    )
    async def stop_capture(
        capture_id: str,
        wait: bool = Query(False, description="block until the capture is terminal"),
        timeout: float | None = Query(None, gt=0, description="with wait: give up waiting after this many seconds"),
    ) -> JSONResponse:
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
    )
    async def heartbeat(capture_id: str) -> JSONResponse:
        return capture_response(await controller.heartbeat(capture_id))

    @app.get(
        "/v1/captures/{capture_id}/files/{relpath:path}",
        tags=["captures"],
        summary="Download one artifact, confined to the capture's session folders",
    )
    async def download(capture_id: str, relpath: str) -> FileResponse:
        path = controller.artifact_path(capture_id, relpath)
        return FileResponse(path, filename=path.name)

    @app.get("/v1/captures/{capture_id}/summary", tags=["captures"], summary="Top ops per stage (cached)")
    async def summary(capture_id: str, top: int = Query(20, ge=1, le=500)) -> JSONResponse:
        return JSONResponse(scrubber.data(await controller.summarize(capture_id, top=top)))

    # --- compat: the upstream's own endpoints, with the sidecar's safety -------------------

    @app.post(
        "/start_profile",
        tags=["compat"],
        dependencies=mutating,
        summary="Upstream-compatible start: starts a capture of the given stages (all profiled if none)",
    )
    async def compat_start(body: CompatProfileRequest | None = Body(default=None)) -> JSONResponse:
        cap = await controller.start(body.stages if body else None, label="compat")
        return JSONResponse({"status": "SUCCESS", "capture_id": cap.id, "capture": capture_json(cap)})

    @app.post(
        "/stop_profile",
        tags=["compat"],
        dependencies=mutating,
        summary="Upstream-compatible stop: stops the active capture and waits until its traces are checked",
    )
    async def compat_stop(body: CompatProfileRequest | None = Body(default=None)) -> JSONResponse:
        cap = await controller.stop_active(body.stages if body else None)
        if cap is None:
            # the upstream answers SUCCESS to a stop without a start; so do we, and say so
            return JSONResponse({"status": "SUCCESS", "capture_id": None, "capture": None})
        status = "SUCCESS" if cap.state is CaptureState.completed else cap.state.value.upper()
        return JSONResponse({"status": status, "capture_id": cap.id, "capture": capture_json(cap)})

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

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


__all__ = ["CaptureRequest", "CompatProfileRequest", "build_app", "create_app"]
