"""When each device started profiling, compared where the comparison means something.

A device's profiling start is Kineto's own profiler span (``PyTorch Profiler (N)``, category
``Trace``; its first event where a trace has none), its first work its first op or GPU event.
Starts are compared among the ranks and replicas of one stage only (``stage_starts``): a downstream
stage gets work only when the stage before it hands some over, so its late first work is the
pipeline's hand-over latency (``handovers``), never a skew. Pure functions of ``Start`` records,
fed by the capture summary (``capture.py``) and the fleet's alignment (``aligned.py``), one clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from sidecar.analysis.models import Handover, StageStart

PROFILER_SPAN = "Trace"  # the category of Kineto's own span, ``PyTorch Profiler (N)``


@dataclass(frozen=True)
class Start:
    """One device (or trace) on one clock, epoch µs."""

    stage_id: int | None
    replica: int | None = None
    rank: int | None = None
    device: int | None = None
    profiling_start_us: float | None = None
    profiling_end_us: float | None = None
    first_work_us: float | None = None
    last_work_us: float | None = None
    pipeline: str | None = None  # whose stages hand work to each other (a fleet target); None: one

    @property
    def start_us(self) -> float | None:
        """When it started recording: its profiler span, else its first event."""
        return self.profiling_start_us if self.profiling_start_us is not None else self.first_work_us

    @property
    def end_us(self) -> float | None:
        return self.profiling_end_us if self.profiling_end_us is not None else self.last_work_us


def common_span(starts: Iterable[Start]) -> tuple[float, float] | None:
    """Latest start → earliest end of ``starts`` (None when none has both); end < start where they
    were never all recording at once."""
    known = [(s.start_us, s.end_us) for s in starts if s.start_us is not None and s.end_us is not None]
    if not known:
        return None
    return max(a for a, _ in known), min(b for _, b in known)  # type: ignore[type-var]


def _by_stage(starts: Iterable[Start]) -> dict[int | None, list[Start]]:
    out: dict[int | None, list[Start]] = {}
    for s in starts:
        out.setdefault(s.stage_id, []).append(s)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))


def stage_starts(starts: Sequence[Start]) -> list[StageStart]:
    """Per stage: the spread of its members' profiling starts and the span all of them recorded."""
    out = []
    for sid, members in _by_stage(starts).items():
        timed = [m for m in members if m.start_us is not None]
        if not timed:
            continue
        first = min(timed, key=lambda m: m.start_us)  # type: ignore[arg-type, return-value]
        last = max(timed, key=lambda m: m.start_us)  # type: ignore[arg-type, return-value]
        span = common_span(timed)
        out.append(StageStart(
            stage_id=sid, members=len(timed), earliest_epoch_us=first.start_us, latest_epoch_us=last.start_us,
            spread_us=last.start_us - first.start_us,  # type: ignore[operator]
            common_us=max(0.0, span[1] - span[0]) if span else 0.0,
            latest_replica=last.replica, latest_rank=last.rank, latest_device=last.device))
    return out


def start_skews(starts: Sequence[Start], requested_us: float | None = None) -> list[float | None]:
    """Each start against ``requested_us`` (the capture's start), else against the earliest of its
    own stage; in the order of ``starts``."""
    earliest = {s.stage_id: s.earliest_epoch_us for s in stage_starts(starts)}
    out: list[float | None] = []
    for s in starts:
        ref = requested_us if requested_us is not None else earliest.get(s.stage_id)
        out.append(None if s.start_us is None or ref is None else s.start_us - ref)
    return out


def handovers(starts: Sequence[Start]) -> list[Handover]:
    """Per pipeline, each stage after the first (by stage id) whose first work came after its
    upstream stage's: the latency between them. A stage that worked before its upstream did had
    work already when the window opened: no hand-over is seen in it."""
    pipelines: dict[str | None, list[Start]] = {}
    for s in starts:
        if s.stage_id is not None:
            pipelines.setdefault(s.pipeline, []).append(s)
    out = []
    for name, members in pipelines.items():
        firsts: dict[int, tuple[float, float | None]] = {}  # stage -> (first work, earliest profiling start)
        for sid, st in _by_stage(members).items():
            works = [m.first_work_us for m in st if m.first_work_us is not None]
            began = [m.start_us for m in st if m.start_us is not None]
            if works and sid is not None:
                firsts[sid] = (min(works), min(began) if began else None)
        ids = sorted(firsts)
        for up, sid in pairwise(ids):
            (work, began_at), (up_work, _) = firsts[sid], firsts[up]
            if work < up_work:
                continue
            out.append(Handover(pipeline=name, stage_id=sid, upstream_stage_id=up, latency_us=work - up_work,
                                waited_us=None if began_at is None else work - began_at,
                                first_work_epoch_us=work, upstream_first_work_epoch_us=up_work))
    return out


__all__ = ["PROFILER_SPAN", "Start", "common_span", "handovers", "stage_starts", "start_skews"]
