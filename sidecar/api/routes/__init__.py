"""The API's routes, one ``APIRouter`` per resource: health (``/healthz``, ``/readyz``,
``/v1/clock``, ``/metrics``), stages, captures (and the plan), artifacts (file downloads),
analysis (summary, timeline, diff) and the upstream-compatible ``/start_profile`` /
``/stop_profile``. The web page's router is ``sidecar.api.web``. A route reaches the app's
controller, settings and scrubber through ``sidecar.api.state`` (``app.state.api``).
"""

from __future__ import annotations

from fastapi import APIRouter

from sidecar.api.routes import analysis, artifacts, captures, compat, health, stages

# the order the app includes them (no two of their paths overlap, so it only orders /docs)
ROUTERS: tuple[APIRouter, ...] = (
    health.router, stages.router, captures.router, artifacts.router, analysis.router, compat.router,
)

__all__ = ["ROUTERS", "analysis", "artifacts", "captures", "compat", "health", "stages"]
