"""The HTTP surface: ``create_app(controller, deploy, settings)`` builds a FastAPI app that maps
routes onto ``CaptureController`` calls and errors onto one status table (``errors.py``). No rule
lives here: stage selection, retries, the state machine and artifact confinement are the
controller's. The factory only wires: the shared state (``state.ApiState`` on ``app.state.api``),
the lifespan (``controller.open()``, recovery, at start-up; ``controller.close()``, which stops the
active capture, at shutdown: begun by ``begin_shutdown`` as soon as the server starts shutting down,
awaited by the lifespan), the middleware, the error handlers, the OpenAPI document and the
routers (``sidecar.api.routes``, one per resource, and the page, ``sidecar.api.web``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

import sidecar
from sidecar.analysis.isolated import stop_all as stop_analyses
from sidecar.api import web
from sidecar.api.auth import BearerAuth
from sidecar.api.errors import install_error_handlers
from sidecar.api.guard import RequestGuard
from sidecar.api.metrics import Metrics, MetricsMiddleware
from sidecar.api.openapi import ERROR_RESPONSES, describe_kinds, install_docs
from sidecar.api.routes import ROUTERS, stages
from sidecar.api.routes.captures import NULLABLE_BODIES, CaptureRequest, PlanRequest
from sidecar.api.routes.compat import CompatProfileRequest
from sidecar.api.state import ApiState
from sidecar.config.models import DeployConfig
from sidecar.control.schedule import HOLD_MAX_S
from sidecar.scrub import Scrubber, register_secret

if TYPE_CHECKING:
    from sidecar.config.settings import SidecarSettings
    from sidecar.control.controller import CaptureController
    from sidecar.upstream.server import UpstreamServer

log = logging.getLogger("sidecar.api")


class CaptureLog:
    """One log line when a capture starts recording and one when it ends (``WARNING`` for an end
    that is not ``completed``: its stop reason and first error or non-ok stage), from the
    controller's change notifications: what an operator reads in ``serve``'s log, recovered
    captures included. The controller itself logs only what goes wrong inside it."""

    REMEMBERED = 4096  # captures whose last line is kept, to say each once

    def __init__(self) -> None:
        self._said: OrderedDict[str, str] = OrderedDict()

    def __call__(self, cap: Any) -> None:
        phase = "ended" if cap.state.terminal else "started" if cap.state.value == "active" else None
        if phase is None or self._said.get(cap.id) == phase:
            return
        self._said[cap.id] = phase
        self._said.move_to_end(cap.id)
        if len(self._said) > self.REMEMBERED:
            self._said.popitem(last=False)
        label = f" ({cap.label})" if cap.label else ""
        if phase == "started":
            log.info("capture %s%s started: stages %s", cap.id, label, ", ".join(map(str, cap.stages)))
            return
        why = [f"{e.code}: {e.message}" for e in cap.errors[:1]]
        why += [f"stage {v.stage_id} {v.verdict.value}: {v.reason}" for v in cap.verdicts
                if v.verdict is not None and v.verdict.value != "ok"][: 1 - len(why)]
        reason = cap.stop_reason.value if cap.stop_reason else "none"
        level = logging.INFO if cap.state.value == "completed" else logging.WARNING
        log.log(level, "capture %s%s %s (stop: %s)%s", cap.id, label, cap.state.value, reason,
                f"; {why[0]}" if why else "")


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    api: ApiState = app.state.api
    await api.controller.open()  # recovered captures: their ends are logged as any other's (CaptureLog)
    try:
        yield
    finally:
        # SIGTERM lands here (uvicorn), after the requests' grace: the stop of the active capture
        # ``omni-sidecar serve`` began when the shutdown did (begin_shutdown) ends before the exit
        await begin_shutdown(app)
        stop_analyses()  # a summary in flight must not hold the exit (its caller gets 503)
        if api.upstream is not None:
            with contextlib.suppress(Exception):
                await api.upstream.aclose()


def begin_shutdown(app: FastAPI) -> asyncio.Task[None]:
    """Begin ``controller.close()`` now, once (stop the active capture, reason ``shutdown``; refuse new
    starts); the lifespan's shutdown awaits the same task. ``omni-sidecar serve`` calls it when the
    server starts shutting down, before uvicorn gives the requests in flight their grace: a client
    waiting on the capture (``stop?wait=true``, a held ``GET``, a start waiting for its steps) then
    gets the capture's end, and only one still waiting when the grace ends is answered 503."""
    api: ApiState = app.state.api
    if api.closing is None:
        api.closing = asyncio.get_running_loop().create_task(api.controller.close(), name="sidecar-shutdown")
    return api.closing


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
    metrics = Metrics(controller.state_counts, server=lambda: getattr(upstream, "version", None),
                      subscribe=controller.subscribe)
    controller.subscribe(CaptureLog())

    app = FastAPI(
        title="omni-sidecar",
        version=sidecar.__version__,
        description="Profiling controller beside `vllm serve <model> --omni`: validated, bounded, verified captures.",
        lifespan=lifespan,
        docs_url=None,  # served from the package's own Swagger UI assets below, never a CDN
        redoc_url=None,
        responses=ERROR_RESPONSES["common"],
    )
    app.state.api = ApiState(
        controller=controller,
        deploy=deploy,
        settings=settings,
        upstream=upstream,
        scrubber=scrubber,
        auth=BearerAuth(token),
        metrics=metrics,
        hold_max_s=settings.hold_max_s if settings is not None else HOLD_MAX_S,
        stages=stages.report(deploy, scrubber),
    )
    # what the page (sidecar/api/web) and tests read beside the routes
    app.state.controller = controller
    app.state.deploy = deploy
    app.state.settings = settings

    install_error_handlers(app, scrubber)
    install_docs(app, stage_ids=[s.stage_id for s in deploy.stages if s.profiler == "torch"],
                 nullable_bodies=NULLABLE_BODIES)
    describe_kinds(app, deploy)
    app.add_middleware(RequestGuard, allowed_hosts=settings.allowed_hosts if settings is not None else ())
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: refused requests are counted too
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(web.router)  # the web page: /, /captures/{id}, /stages, /web/* (sidecar/api/web)
    for route in app.routes:  # HEAD is GET without the body (RFC 9110 9.3.2: `curl -I`, load balancers); the
        if isinstance(route, APIRoute) and "GET" in route.methods:  # server leaves the body out; FastAPI adds none
            route.methods.add("HEAD")
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


__all__ = ["CaptureRequest", "CompatProfileRequest", "PlanRequest", "begin_shutdown", "build_app", "create_app",
           "lifespan"]
