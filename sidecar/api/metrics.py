"""Prometheus metrics served at ``GET /metrics``: request counts and latencies per route
template; the captures in history per state, read from the controller at scrape time (right after
a restart too, and pruned with it by ``--keep``); and the captures that ended in this process per
terminal state, a counter (from 0 at each start, as Prometheus counters are) that pruning never
lowers, for alerts. Every label set is bounded: route templates (or ``<unmatched>``), known methods
(others are ``OTHER``), status codes, capture states. Each app has its own registry.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sidecar.control.models import CaptureState

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_LIVE = [s.value for s in CaptureState if not s.terminal]
_TERMINAL = [s for s in CaptureState if s.terminal]
# A finished capture still changes (a fleet's clock record, notes): its end is counted once, by id.
# History holds at most --keep finished captures, so the ids of the newest this many ends suffice.
_ENDS_REMEMBERED = 65_536
# prometheus_client's default buckets end at 10 s; a stop?wait=true, a start that waits for its
# steps or a first summary lasts minutes: past 10 s they would all read "+Inf"
LATENCY_BUCKETS = (*Histogram.DEFAULT_BUCKETS[:-1], 30.0, 60.0, 120.0, 300.0, 600.0, float("inf"))


class _CaptureCollector(Collector):
    def __init__(self, state_counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = state_counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        by_state = dict(self._counts())  # counts, not copies of every capture
        family = GaugeMetricFamily("omni_sidecar_captures", "Captures in the sidecar's history (the newest --keep "
                                   "finished ones and the live one), by state", labels=["state"])
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


class _CaptureEnds:
    """Counts each capture's end once, from the controller's change notifications."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._seen: OrderedDict[str, None] = OrderedDict()
        for state in _TERMINAL:  # every state present from the first scrape: increase() sees the first end
            counter.labels(state.value)

    def __call__(self, capture: Any) -> None:
        if not capture.state.terminal or capture.id in self._seen:
            return
        self._seen[capture.id] = None
        if len(self._seen) > _ENDS_REMEMBERED:
            self._seen.popitem(last=False)
        self._counter.labels(capture.state.value).inc()


class Metrics:
    def __init__(
        self,
        state_counts: Callable[[], Mapping[str, int]],
        server: Callable[[], Any] | None = None,
        *,
        subscribe: Callable[[Callable[[Any], Any]], Any] | None = None,
    ) -> None:
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
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_CaptureCollector(state_counts))
        self.capture_ends = Counter(
            "omni_sidecar_capture_ends",
            "Captures that ended since this sidecar started, by terminal state (history pruned by --keep "
            "never lowers it)",
            ["state"],
            registry=self.registry,
        )
        if subscribe is not None:  # the controller's change notifications
            subscribe(_CaptureEnds(self.capture_ends))
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
