"""Traces of many hosts on one clock: each trace's events mapped through its host's clock offset,
the start skew against the requested start and within each stage, the pipeline's hand-overs and
the common window (docs/fleet-clocks.md), with the definitions of ``sidecar/analysis/starts.py``.

A trace's own clock: Kineto writes ``ts`` in µs relative to ``baseTimeNanoseconds`` (a trace
without one in its header, such as the emulator's, has absolute ``ts``: base 0). Its host's
clock is ``offset_ns`` ahead of the reference clock (the fleet's), so an event at ``ts`` sits at
``base + ts·1000 − offset_ns`` on the reference clock. Each trace is read once, streamed
(``TraceReader``), for its profiler span and its first and last profiled event.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.analysis.capture import TraceSource
from sidecar.analysis.models import Handover, StageStart
from sidecar.analysis.reader import TraceReader, read_header
from sidecar.analysis.starts import PROFILER_SPAN, Start, common_span, handovers, stage_starts
from sidecar.analysis.timeline import _rank
from sidecar.analysis.timeline import trace_base_ns as _trace_base_ns
from sidecar.errors import TraceError


@dataclass(frozen=True)
class HostClock:
    """Where a trace was recorded and how its clock relates to the reference clock."""

    host: str  # the machine's name (one per clock domain)
    offset_ns: int = 0  # the host's clock − the reference clock
    error_ns: int | None = None  # bound on |offset error|; None: not measured (offset 0 assumed)
    method: str = "unmeasured"  # exchange / in_process / unmeasured


@dataclass(frozen=True)
class FleetSource:
    """One trace of a fleet capture: the file, which target recorded it, on which host clock."""

    source: TraceSource
    target: str
    clock: HostClock


def trace_base_ns(header: dict[str, Any]) -> int:
    """What the trace's ``ts`` count from, in ns (0 where they are absolute: ``timeline.trace_base_ns``)."""
    return _trace_base_ns(header) or 0


def clock_shift_ns(base_ns: int, clock: HostClock) -> int:
    """What to add to ``ts·1000`` of a trace to put it on the reference clock."""
    return base_ns - clock.offset_ns


@dataclass
class TraceSpan:
    """One trace on the reference clock: its profiler span and its first and last profiled event
    (its work), epoch ns."""

    target: str
    file: str
    host: str
    stage_id: int | None
    replica: int | None
    rank: int | None
    base_ns: int
    offset_ns: int
    error_ns: int | None
    first_ns: int | None = None
    last_ns: int | None = None
    events: int = 0
    start_skew_ms: float | None = None  # its profiling start (else first_ns) − the requested start
    profiling_start_ns: int | None = None  # Kineto's profiler span (``PyTorch Profiler (N)``)
    profiling_end_ns: int | None = None

    @property
    def start(self) -> Start:
        """This trace for the rules of ``sidecar/analysis/starts.py`` (epoch µs)."""
        def us(ns: int | None) -> float | None:
            return None if ns is None else ns / 1000

        return Start(stage_id=self.stage_id, replica=self.replica, rank=self.rank, pipeline=self.target,
                     profiling_start_us=us(self.profiling_start_ns), profiling_end_us=us(self.profiling_end_ns),
                     first_work_us=us(self.first_ns), last_work_us=us(self.last_ns))


def trace_span(fs: FleetSource) -> TraceSpan:
    """Read ``fs`` once for its profiler span and its first and last profiled event (``X`` events
    but the profiler's own span), mapped onto the reference clock. ``TraceError`` when it cannot
    be read."""
    header = read_header(fs.source.path)
    base = trace_base_ns(header)
    shift = clock_shift_ns(base, fs.clock)
    lo = hi = p_lo = p_hi = None
    n = 0
    reader = TraceReader(fs.source.path)
    for batch in reader.batches():
        for e in batch:
            if e.ph != "X" or e.ts <= 0:
                continue
            end = e.ts + max(e.dur, 0.0)
            if e.cat == PROFILER_SPAN:
                p_lo = e.ts if p_lo is None or e.ts < p_lo else p_lo
                p_hi = end if p_hi is None or end > p_hi else p_hi
                continue
            n += 1
            lo = e.ts if lo is None or e.ts < lo else lo
            hi = end if hi is None or end > hi else hi
    src = fs.source

    def ns(ts: float | None) -> int | None:
        return None if ts is None else shift + round(ts * 1000)

    return TraceSpan(
        target=fs.target, file=str(src.path), host=fs.clock.host, stage_id=src.stage_id, replica=src.replica,
        rank=_rank(header, src.path), base_ns=base, offset_ns=fs.clock.offset_ns, error_ns=fs.clock.error_ns,
        first_ns=ns(lo), last_ns=ns(hi), events=n, profiling_start_ns=ns(p_lo), profiling_end_ns=ns(p_hi),
    )


@dataclass
class Alignment:
    """Every trace of a capture on one clock, the skew of their starts within each stage, the
    pipelines' hand-overs and the common window."""

    requested_ns: int | None  # the start asked for (start_at, else when the starts were sent)
    spans: list[TraceSpan] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    spread_ms: float | None = None  # the widest spread of profiling starts within one stage
    skew_p50_ms: float | None = None  # median profiling start − requested start
    skew_max_ms: float | None = None
    window_ns: tuple[int, int] | None = None  # latest profiling start → earliest profiling end
    window_empty: bool = False  # the traces were never all recording at once
    stages: list[StageStart] = field(default_factory=list)  # per stage: its members' profiling starts
    handovers: list[Handover] = field(default_factory=list)  # per target: a stage's first work after its upstream's

    @property
    def window_ms(self) -> float | None:
        return None if self.window_ns is None else (self.window_ns[1] - self.window_ns[0]) / 1e6


def align(sources: Sequence[FleetSource], *, requested_ns: int | None = None) -> Alignment:
    """Each source's span on the reference clock (read once each), the start skew per trace
    against ``requested_ns``, its spread within each stage, each target's hand-overs from stage to
    stage, and the common window. A source that cannot be read is named in ``errors``;
    ``TraceError`` when none can."""
    out = Alignment(requested_ns=requested_ns)
    for fs in sources:
        try:
            out.spans.append(trace_span(fs))
        except TraceError as err:
            out.errors.append(str(err))
    if not out.spans and out.errors:
        raise TraceError("no readable trace in the fleet capture: " + "; ".join(out.errors[:5]),
                         details={"errors": out.errors})
    starts = [s.start for s in out.spans]
    span = common_span(starts)
    if span is None:
        return out
    out.stages, out.handovers = stage_starts(starts), handovers(starts)
    out.spread_ms = max(st.spread_us for st in out.stages) / 1000
    if requested_ns is not None:
        for sp, st in zip(out.spans, starts):
            if st.start_us is not None:
                sp.start_skew_ms = (round(st.start_us * 1000) - requested_ns) / 1e6
        skews = [sp.start_skew_ms for sp in out.spans if sp.start_skew_ms is not None]
        out.skew_p50_ms = statistics.median(skews)
        out.skew_max_ms = max(skews, key=abs)
    lo, hi = (round(v * 1000) for v in span)
    if lo < hi:
        out.window_ns = (lo, hi)
    else:
        out.window_empty = True
    return out


@dataclass
class ReplicaStraggler:
    """One of the slowest replicas of a step against the median replica."""

    replica: int | None
    target: str
    wall_ms: float  # its last event − its first event, all its traces, on the reference clock
    median_wall_ms: float
    excess_ms: float
    stage_id: int | None  # the stage where it loses the most against the median replica
    stage_excess_ms: float
    diff: Any = None  # sidecar.analysis.diff.CaptureDiff: median replica (a) vs this one (b)


@dataclass
class Stragglers:
    median_replica: int | None
    median_wall_ms: float
    replicas: int
    slowest: list[ReplicaStraggler] = field(default_factory=list)
    # replicas not ranked: without a trace of every stage the others have, their wall reads short
    left_out: list[str] = field(default_factory=list)


def _walls(spans: Sequence[TraceSpan]) -> dict[int | None, dict[int | None, tuple[int, int]]]:
    """Per replica, per stage: (first, last) event on the reference clock."""
    out: dict[int | None, dict[int | None, tuple[int, int]]] = {}
    for s in spans:
        if s.first_ns is None or s.last_ns is None:
            continue
        stages = out.setdefault(s.replica, {})
        lo, hi = stages.get(s.stage_id, (s.first_ns, s.last_ns))
        stages[s.stage_id] = (min(lo, s.first_ns), max(hi, s.last_ns))
    return out


def stragglers(sources: Sequence[FleetSource], alignment: Alignment, *, k: int = 3, top: int = 10,
               diff_ops: bool = True) -> Stragglers:
    """For one step (one capture): the ``k`` slowest replicas by wall time against the median
    replica (the lower median), the stage where each loses the most, and (``diff_ops``) the diff
    of its top ops against the median replica's (``sidecar.analysis.diff.diff_paths``). Only the
    replicas with a trace of every stage are ranked; the others are ``left_out``, said."""
    walls = _walls(alignment.spans)
    every = set().union(*(set(w) for w in walls.values())) if walls else set()
    left_out = {rep: sorted(every - set(w), key=lambda s: (s is None, s or 0)) for rep, w in walls.items()
                if set(w) != every}
    walls = {rep: w for rep, w in walls.items() if rep not in left_out}
    said = [f"replica {rep}: no trace of stage {', '.join(map(str, missing))} (the other replicas have one): not "
            "ranked, its wall would read short" for rep, missing in sorted(left_out.items(), key=lambda kv: str(kv[0]))]

    def wall(rep: int | None) -> int:
        st = walls[rep].values()
        return max(h for _, h in st) - min(lo for lo, _ in st)

    ranked = sorted(walls, key=wall)
    if not ranked:
        return Stragglers(median_replica=None, median_wall_ms=0.0, replicas=0, left_out=said)
    med = ranked[(len(ranked) - 1) // 2]
    med_wall = wall(med)
    out = Stragglers(median_replica=med, median_wall_ms=med_wall / 1e6, replicas=len(ranked), left_out=said)
    by_replica: dict[int | None, list[FleetSource]] = {}
    for fs in sources:
        by_replica.setdefault(fs.source.replica, []).append(fs)
    for rep in [r for r in reversed(ranked) if r != med][:max(0, k)]:
        excess = {sid: (hi - lo) - (walls[med][sid][1] - walls[med][sid][0] if sid in walls[med] else 0)
                  for sid, (lo, hi) in walls[rep].items()}
        stage = max(excess, key=lambda sid: excess[sid])
        diff = None
        if diff_ops:
            from sidecar.analysis.diff import diff_paths

            diff = diff_paths([fs.source for fs in by_replica[med]], [fs.source for fs in by_replica[rep]], top=top,
                              label_a=f"replica {med} (median)", label_b=f"replica {rep}")
        out.slowest.append(ReplicaStraggler(
            replica=rep, target=by_replica[rep][0].target, wall_ms=wall(rep) / 1e6, median_wall_ms=med_wall / 1e6,
            excess_ms=(wall(rep) - med_wall) / 1e6, stage_id=stage, stage_excess_ms=excess[stage] / 1e6, diff=diff))
    return out


__all__ = ["Alignment", "ReplicaStraggler", "Stragglers", "stragglers", "FleetSource", "HostClock", "TraceSpan", "align", "clock_shift_ns", "trace_base_ns", "trace_span"]
