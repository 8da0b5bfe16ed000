"""Prometheus metrics served at ``GET /metrics``: request counts and latencies per route
template, and capture counts per state read from the controller at scrape time (so they are
right after a restart too). Every label set is bounded: route templates (or ``<unmatched>``),
known methods (others are ``OTHER``), status codes. Each app has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sidecar.control.models import CaptureState

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_LIVE = [s.value for s in CaptureState if not s.terminal]


class _CaptureCollector(Collector):
    def __init__(self, state_counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = state_counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        by_state = dict(self._counts())  # counts, not copies of every capture
        family = GaugeMetricFamily("omni_sidecar_captures", "Captures known to the sidecar, by state", labels=["state"])
        for state in CaptureState:
            family.add_metric([state.value], by_state.get(state.value, 0))
        yield family
        active = GaugeMetricFamily("omni_sidecar_capture_active", "1 while a capture is not terminal")
        active.add_metric([], 1 if any(by_state.get(s, 0) for s in _LIVE) else 0)
        yield active


class _ServerCollector(Collector):
    def __init__(self, version: Callable[[], Any]) -> None:
        self._version = version

    def collect(self) -> Iterable[GaugeMetricFamily]:
        version = self._version()
        if version is None:
            return
        info = GaugeMetricFamily("omni_sidecar_upstream_info", "The upstream server as found at connect: 1, its kind "
                                 "and versions as labels (vllm and omni empty where not served)",
                                 labels=["kind", "vllm", "omni"])
        info.add_metric([version.kind, str(version.vllm or ""), str(version.omni or "")], 1)
        yield info


class Metrics:
    def __init__(self, state_counts: Callable[[], Mapping[str, int]], server: Callable[[], Any] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "omni_sidecar_http_requests",
            "HTTP requests served, by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "omni_sidecar_http_request_seconds",
            "HTTP request latency, by route template",
            ["route", "method"],
            registry=self.registry,
        )
        self.registry.register(_CaptureCollector(state_counts))
        if server is not None:
            self.registry.register(_ServerCollector(server))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so streamed file downloads are not buffered."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: dict[str, Any] = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        began = time.perf_counter()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            # the template, not the raw path: ids would make unbounded label sets
            template = getattr(route, "path", None) or "<unmatched>"
            method = scope.get("method", "")
            method = method if method in METHODS else "OTHER"  # made-up methods must not grow the label set
            self.metrics.requests.labels(template, method, str(status["code"])).inc()
            self.metrics.latency.labels(template, method).observe(time.perf_counter() - began)
