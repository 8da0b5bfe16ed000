"""Liveness, readiness, this host's clocks and the Prometheus scrape: ``/healthz``, ``/readyz``,
``/v1/clock``, ``/metrics``. Open to every caller, token or not."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Response

import sidecar
from sidecar.api.errors import error_response
from sidecar.api.openapi import error as openapi_error
from sidecar.api.responses import SafeJSONResponse
from sidecar.api.state import Api
from sidecar.errors import UpstreamNotReady

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The sidecar process is alive")
async def healthz(api: Api) -> dict[str, Any]:
    controller = api.controller
    active = controller.active
    journal = controller.journal.health() if getattr(controller, "journal", None) is not None else None
    return {
        "status": "ok",
        "version": sidecar.__version__,
        "active_capture": active.id if active else None,
        "journal": journal,  # quarantined entries and failed writes: history needs a look
    }


@router.get(
    "/readyz",
    summary="Upstream healthy and its profiler endpoints mounted",
    responses={503: openapi_error(UpstreamNotReady)},
)
async def readyz(api: Api) -> Response:
    upstream, scrubber = api.upstream, api.scrubber
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


@router.get("/v1/clock", summary="This host's realtime and monotonic clocks (ns), for a "
            "fleet's clock-offset exchange (docs/fleet-clocks.md)")
async def clock() -> dict[str, int]:
    return {"realtime_ns": time.time_ns(), "monotonic_ns": time.monotonic_ns()}


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def prometheus_metrics(api: Api) -> Response:
    return Response(api.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
