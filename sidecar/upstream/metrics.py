"""The server's Prometheus ``/metrics``, read: one scrape is a :class:`MetricsSnapshot` (the
samples of the families a window reads), two make a :class:`WindowMetrics` (what the server did between them, per
engine), and :func:`engine_steps` is the step count a ``steps`` window is measured in.

Names and labels are those of the real servers (fixtures in tests/data/metrics/, docs/captures.md):
plain vLLM labels each engine ``engine="<n>"``; vLLM-Omni relabels the same ``vllm:`` families
``stage="<id>", replica="<r>"``. ``vllm:iteration_tokens_total`` observes once per engine step that
scheduled tokens, so its ``_count`` is the step counter.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

# A /metrics reply bigger than this is not a vLLM server's (a few hundred kB with every family).
MAX_METRICS_BYTES = 8_000_000

STEP_FAMILY = "vllm:iteration_tokens_total"  # a histogram; one observation per engine step
REQUESTS_FAMILY = "vllm:request_success"  # counter, labelled by finished_reason
PROMPT_FAMILY = "vllm:prompt_tokens"
GENERATION_FAMILY = "vllm:generation_tokens"
# The latency histograms a window keeps: short name -> family.
LATENCY_FAMILIES: dict[str, str] = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
}
# vLLM-Omni's own families (``vllm_omni:*``, every release 0.30.0 to 0.32.0rc1; its doc's
# ``vllm:omni_*`` names are not what it serves): short name -> family, each a histogram of seconds
# per stage (``stage``) or per hand-over (``from_stage``, ``to_stage``), or of the whole pipeline.
OMNI_FAMILIES: dict[str, str] = {
    "stage_gen": "vllm_omni:stage_gen_time_s",
    "stage_in_queue": "vllm_omni:stage_in_queue_s",
    "transfer_tx": "vllm_omni:transfer_tx_s",
    "transfer_rx": "vllm_omni:transfer_rx_s",
    "e2e": "vllm_omni:e2e_request_latency_s",
}
_OMNI = frozenset(OMNI_FAMILIES.values())
# What a snapshot keeps (a window reads nothing else): only these families' sample lines are read.
KEPT_FAMILIES = (STEP_FAMILY, REQUESTS_FAMILY, PROMPT_FAMILY, GENERATION_FAMILY, *LATENCY_FAMILIES.values())
_READ_FAMILIES = (*KEPT_FAMILIES, *OMNI_FAMILIES.values())  # the omni ones kept apart (MetricsSnapshot.omni)
# The same as sample names, for the server's exporter to render only those: prometheus_client's
# ``/metrics?name[]=...``, which plain vLLM's /metrics is (make_asgi_app). vLLM-Omni 0.30's ignores
# the parameter (measured: 122 kB either way) and the parse keeps the same lines.
_COUNTERS = (REQUESTS_FAMILY, PROMPT_FAMILY, GENERATION_FAMILY)
KEPT_SAMPLES = tuple(
    f"{fam}{suffix}" for fam in _READ_FAMILIES
    for suffix in (("_total",) if fam in _COUNTERS else ("_bucket", "_count", "_sum")))
STEP_SAMPLES = (f"{STEP_FAMILY}_count",)
_KEPT_SAMPLE = {sample: (fam, sample[len(fam) + 1:]) for fam in _READ_FAMILIES for sample in KEPT_SAMPLES
                if sample.startswith(fam + "_") and sample[len(fam) + 1:] in ("total", "bucket", "count", "sum")}
_KEPT_LINE = re.compile(rf"^({'|'.join(re.escape(n) for n in KEPT_SAMPLES)})(?:{{([^}}\n]*)}})?[ \t]+(\S+)", re.M)
# The labels that name one engine: vLLM-Omni's stage and replica, plain vLLM's engine index.
ENGINE_LABELS = ("stage", "replica", "engine")

Labels = tuple[tuple[str, str], ...]


def _engine_key(labels: Mapping[str, str]) -> Labels:
    return tuple((k, labels[k]) for k in ENGINE_LABELS if k in labels)


def _omni_key(labels: Mapping[str, str]) -> Labels:
    """A vLLM-Omni family's sample: its stage, or its hand-over (replicas summed), or none (the pipeline)."""
    return tuple((k, labels[k]) for k in ("stage", "from_stage", "to_stage") if k in labels)


@dataclass
class _Histogram:
    count: float = 0.0
    sum: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count


@dataclass
class MetricsSnapshot:
    """The ``vllm:`` counters and histograms of one scrape, summed per engine (other labels, such
    as ``finished_reason`` or ``model_name``, are added up)."""

    taken_at: float  # time.time() of the reply
    counters: dict[tuple[str, Labels], float] = field(default_factory=dict)  # family -> value
    histograms: dict[tuple[str, Labels], _Histogram] = field(default_factory=dict)
    # vLLM-Omni's own histograms (OMNI_FAMILIES), per stage or hand-over (not engines)
    omni: dict[tuple[str, Labels], _Histogram] = field(default_factory=dict)

    def engines(self) -> list[Labels]:
        keys = {k for _, k in self.counters} | {k for _, k in self.histograms}
        return sorted(keys)


class MetricsUnreadable(ValueError):
    """The reply is not Prometheus text the parser accepts (or is too big to be a server's)."""


def parse_metrics(text: str, *, taken_at: float | None = None) -> MetricsSnapshot:
    """A ``/metrics`` body → snapshot of the ``KEPT_FAMILIES``' samples. It is read at both edges
    of every window, so only their sample lines are looked at (1 ms for a vLLM-Omni reply of
    100 kB; prometheus_client's parser took 17 ms for all of it, 6 for these families' lines:
    tests/test_steps.py checks both give the same snapshot on the real servers' replies).
    ``MetricsUnreadable`` for a kept sample whose value is not a number."""
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsUnreadable(f"the /metrics reply is {len(text)} bytes, above {MAX_METRICS_BYTES}")
    snap = MetricsSnapshot(taken_at=time.time() if taken_at is None else taken_at)
    for m in _KEPT_LINE.finditer(text):
        family, part = _KEPT_SAMPLE[m.group(1)]
        try:
            value = float(m.group(3))
        except ValueError:
            raise MetricsUnreadable(f"the /metrics reply is not Prometheus text: {m.group(0)[:200]!r}") from None
        labels = dict(_LABEL.findall(m.group(2) or ""))
        if family in _OMNI:
            key, into = (family, _omni_key(labels)), snap.omni
        else:
            key, into = (family, _engine_key(labels)), snap.histograms
        if part == "total":
            snap.counters[key] = snap.counters.get(key, 0.0) + value
            continue
        hist = into.setdefault(key, _Histogram())
        if part == "bucket":
            bound = float(labels.get("le", "inf"))
            hist.buckets[bound] = hist.buckets.get(bound, 0.0) + value
        elif part == "count":
            hist.count += value
        else:
            hist.sum += value
    return snap


def engine_steps(snap: MetricsSnapshot) -> dict[Labels, int]:
    """Engine steps counted so far, per engine (``vllm:iteration_tokens_total``'s count)."""
    return {k: int(h.count) for (name, k), h in snap.histograms.items() if name == STEP_FAMILY}


# --- a window: the difference of two snapshots -----------------------------------------------


class Latency(BaseModel):
    """One latency histogram over the window; p50/p95 interpolated within the buckets' deltas."""

    count: int
    sum_s: float
    mean_s: float | None = None
    p50_s: float | None = None
    p95_s: float | None = None


class EngineMetrics(BaseModel):
    """What one engine (a vLLM-Omni stage replica, or a vLLM engine) did during the window."""

    stage: str | None = None  # vLLM-Omni's stage label
    replica: str | None = None
    engine: str | None = None  # plain vLLM's engine index
    engine_steps: int | None = None
    requests_finished: int | None = None
    prompt_tokens: int | None = None
    generation_tokens: int | None = None
    latency: dict[str, Latency] = Field(default_factory=dict)  # ttft | itl | e2e | queue


class WindowMetrics(BaseModel):
    """The server's ``/metrics`` at the window's start and stop, differenced. ``unavailable`` says
    why there is nothing (no /metrics, a failed scrape): a capture never fails for it."""

    seconds: float | None = None  # between the two scrapes
    engines: list[EngineMetrics] = Field(default_factory=list)
    # vLLM-Omni's own families over the window (OMNI_FAMILIES): short name -> stage ("0"), hand-over
    # ("0->1") or the pipeline ("") -> latency; empty on plain vLLM
    omni: dict[str, dict[str, Latency]] = Field(default_factory=dict)
    unavailable: str | None = None


def quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """``q`` of a cumulative-bucket histogram, linear within the bucket, as Prometheus'
    ``histogram_quantile`` does (the +Inf bucket answers its lower bound)."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _bounded_quantile(buckets: Mapping[float, float], q: float, count: int, total: float) -> float | None:
    """``quantile`` no higher than the observations' sum allows: the k-th smallest of ``count``
    non-negative durations (k = ceil(q * count)) is at most ``total / (count - k + 1)``. Without it a
    window whose requests all sit in vLLM's first latency bucket (0.3 s: queue times of microseconds)
    reads p50 0.15 s and p95 0.285 s whatever they took."""
    value = quantile(buckets, q)
    if value is None or count <= 0 or total < 0:
        return value
    k = min(count, max(1, math.ceil(q * count - 1e-9)))
    return min(value, total / (count - k + 1))


def _delta_hist(before: _Histogram | None, after: _Histogram) -> Latency:
    b = before or _Histogram()
    buckets = {le: after.buckets[le] - b.buckets.get(le, 0.0) for le in after.buckets}
    count = int(round(after.count - b.count))
    total = after.sum - b.sum
    return Latency(count=count, sum_s=total, mean_s=total / count if count > 0 else None,
                   p50_s=_bounded_quantile(buckets, 0.5, count, total) if count > 0 else None,
                   p95_s=_bounded_quantile(buckets, 0.95, count, total) if count > 0 else None)


def window_metrics(before: MetricsSnapshot, after: MetricsSnapshot) -> WindowMetrics:
    """What each engine did between ``before`` and ``after`` (a counter that went back, a server
    restarted in between, counts from zero)."""
    out: list[EngineMetrics] = []
    for key in after.engines():
        if not key:
            continue  # families without an engine label (the API server's own) are not an engine's

        def delta(family: str) -> int | None:
            now = after.counters.get((family, key))
            if now is None:
                return None
            was = before.counters.get((family, key), 0.0)
            return int(round(now - was if now >= was else now))

        labels = dict(key)
        steps_now = after.histograms.get((STEP_FAMILY, key))
        steps_was = before.histograms.get((STEP_FAMILY, key))
        steps = None
        if steps_now is not None:
            was = steps_was.count if steps_was is not None else 0.0
            steps = int(steps_now.count - was if steps_now.count >= was else steps_now.count)
        latency = {short: _delta_hist(before.histograms.get((fam, key)), after.histograms[(fam, key)])
                   for short, fam in LATENCY_FAMILIES.items() if (fam, key) in after.histograms}
        out.append(EngineMetrics(stage=labels.get("stage"), replica=labels.get("replica"), engine=labels.get("engine"),
                                 engine_steps=steps, requests_finished=delta(REQUESTS_FAMILY),
                                 prompt_tokens=delta(PROMPT_FAMILY), generation_tokens=delta(GENERATION_FAMILY),
                                 latency=latency))
    seconds = max(after.taken_at - before.taken_at, 0.0)
    omni: dict[str, dict[str, Latency]] = {}
    for short, family in OMNI_FAMILIES.items():
        for (fam, key), hist in sorted(after.omni.items()):
            if fam == family:
                labels = dict(key)
                where = (f"{labels['from_stage']}->{labels['to_stage']}" if "from_stage" in labels
                         else labels.get("stage", ""))
                omni.setdefault(short, {})[where] = _delta_hist(before.omni.get((fam, key)), hist)
    if not out:
        return WindowMetrics(seconds=seconds, omni=omni, unavailable="the server's /metrics has no per-engine vllm: "
                             "families (started with --disable-log-stats?)")
    return WindowMetrics(seconds=seconds, engines=out, omni=omni)


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def step_counts(text: str) -> dict[Labels, int]:
    """The engines' step counters of a ``/metrics`` body (a ``steps`` window's read, every 20 ms:
    the kept-lines scan of :func:`parse_metrics`, 1.4 ms for a vLLM-Omni reply where
    prometheus_client's parse of all of it took 17 ms of a free core and 150 ms beside the stages)."""
    return engine_steps(parse_metrics(text))


def steps_by_stage(base: Mapping[Labels, int], now: Mapping[Labels, int], stages: Iterable[int] | None) -> dict[str, int]:
    """The engine steps a window has run from ``base`` to ``now`` (both :func:`engine_steps`), per
    stage among ``stages``: its most-advanced engine (vLLM-Omni's ``stage`` label; engines without
    one, plain vLLM's, under ``""``). Each engine is measured from its own base (an engine absent
    from ``base`` from 0); one whose counter went back (restarted) has run none."""
    wanted = {str(s) for s in stages} if stages is not None else None
    out: dict[str, int] = {}
    for key, n in now.items():
        stage = dict(key).get("stage")
        if wanted is None or stage is None or stage in wanted:
            label = stage or ""
            out[label] = max(out.get(label, 0), n - base.get(key, 0), 0)
    return out


def steps_since(base: Mapping[Labels, int], now: Mapping[Labels, int], stages: Iterable[int] | None) -> int:
    """The engine steps a window has run: its most-advanced engine among ``stages``
    (:func:`steps_by_stage`)."""
    return max(steps_by_stage(base, now, stages).values(), default=0)


__all__ = [
    "EngineMetrics",
    "Latency",
    "MetricsSnapshot",
    "MetricsUnreadable",
    "WindowMetrics",
    "engine_steps",
    "parse_metrics",
    "quantile",
    "KEPT_FAMILIES",
    "KEPT_SAMPLES",
    "OMNI_FAMILIES",
    "STEP_SAMPLES",
    "step_counts",
    "steps_by_stage",
    "steps_since",
    "window_metrics",
]
