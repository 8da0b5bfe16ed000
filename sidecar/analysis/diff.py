"""Compare two captures (or traces): per stage, which ops and kernels got slower or faster, and
what holds more or less memory.

``diff_summaries(a, b)`` works on two ``CaptureSummary`` made with every row (``top`` large),
``diff_paths(a_paths, b_paths)`` makes them (streamed, files in parallel) and compares. As in
HTA's TraceDiff, rows are matched by name and carry both counts and times; here each table is
ranked by the absolute change in self CPU time (ops) or self device time (ops by GPU time they
launched, kernels), with the totals of both sides. Stages are matched by stage id; a capture of
one unnamed trace on each side compares those. With memory on (``profile_memory``), each device's
peak, reserved memory and churn on both sides, and ops ranked by the change in bytes they allocated
(key_averages' memory columns).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from sidecar.analysis.capture import TraceSource, summarize_paths
from sidecar.analysis.models import CaptureSummary, DeviceMemory, GpuStat, LiveOp, MemoryOpStat, OpStat, SummaryBody

ALL_ROWS = 1 << 30
_STEP = re.compile(r"^ProfilerStep#\d+$")


class OpDelta(BaseModel):
    name: str
    count_a: int = 0
    count_b: int = 0
    self_us_a: float = 0.0
    self_us_b: float = 0.0
    self_device_us_a: float = 0.0
    self_device_us_b: float = 0.0
    delta_self_us: float = 0.0  # b - a
    delta_self_device_us: float = 0.0


class KernelDelta(BaseModel):
    name: str
    kind: str  # kernel | memcpy | memset
    count_a: int = 0
    count_b: int = 0
    total_us_a: float = 0.0
    total_us_b: float = 0.0
    delta_us: float = 0.0


class TotalsDelta(BaseModel):
    span_us_a: float = 0.0
    span_us_b: float = 0.0
    cpu_op_self_us_a: float = 0.0
    cpu_op_self_us_b: float = 0.0
    annotation_self_us_a: float | None = None  # the rows of ops_by_self_cpu include annotations: their total
    annotation_self_us_b: float | None = None
    kernel_us_a: float = 0.0
    kernel_us_b: float = 0.0
    gpu_us_a: float = 0.0  # kernels + memcpy + memset
    gpu_us_b: float = 0.0
    kernels_a: int = 0
    kernels_b: int = 0
    cpu_ops_a: int = 0
    cpu_ops_b: int = 0
    step_mean_us_a: float | None = None
    step_mean_us_b: float | None = None


class MemoryDelta(BaseModel):
    """One device's memory on both sides (matched by stage, replica, rank and device; a device on
    one side only has None on the other). Bytes."""

    stage_id: int | None = None
    replica: int | None = None
    rank: int | None = None
    device_type: str
    device: int
    peak_allocated_bytes_a: int | None = None
    peak_allocated_bytes_b: int | None = None
    delta_peak_allocated_bytes: int | None = None  # b - a, where both sides have the device
    reserved_at_peak_bytes_a: int | None = None
    reserved_at_peak_bytes_b: int | None = None
    alloc_bytes_per_step_a: float | None = None
    alloc_bytes_per_step_b: float | None = None
    ooms_a: int = 0
    ooms_b: int = 0
    top_live_a: LiveOp | None = None  # the op holding the most at the peak
    top_live_b: LiveOp | None = None


class MemoryOpDelta(BaseModel):
    """One op name's memory events on one kind of device, both sides (``MemoryOpStat``)."""

    name: str
    device_type: str
    allocs_a: int = 0
    allocs_b: int = 0
    alloc_bytes_a: int = 0
    alloc_bytes_b: int = 0
    self_bytes_a: int = 0  # allocated - freed (key_averages' self memory)
    self_bytes_b: int = 0
    delta_alloc_bytes: int = 0  # b - a


class StageDiff(BaseModel):
    stage_id: int | None = None
    totals: TotalsDelta = Field(default_factory=TotalsDelta)
    ops_by_self_cpu: list[OpDelta] = Field(default_factory=list)
    ops_by_self_device: list[OpDelta] = Field(default_factory=list)
    kernels: list[KernelDelta] = Field(default_factory=list)
    memory: list[MemoryDelta] = Field(default_factory=list)  # per device with memory events on either side
    memory_ops: list[MemoryOpDelta] = Field(default_factory=list)  # by |change in bytes allocated|
    only_in_a: list[str] = Field(default_factory=list)  # op/kernel names, first few
    only_in_b: list[str] = Field(default_factory=list)


class CaptureDiff(BaseModel):
    a: str
    b: str
    stages: list[StageDiff] = Field(default_factory=list)
    total: StageDiff = Field(default_factory=StageDiff)
    errors: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)  # each side's (a file given twice, events left out)


def _totals(a: SummaryBody, b: SummaryBody) -> TotalsDelta:
    def gpu(x: SummaryBody) -> float:
        return x.totals.kernel_us + x.totals.memcpy_us + x.totals.memset_us

    return TotalsDelta(
        span_us_a=a.window.span_us, span_us_b=b.window.span_us,
        cpu_op_self_us_a=a.totals.cpu_op_self_us, cpu_op_self_us_b=b.totals.cpu_op_self_us,
        annotation_self_us_a=a.totals.annotation_self_us, annotation_self_us_b=b.totals.annotation_self_us,
        kernel_us_a=a.totals.kernel_us, kernel_us_b=b.totals.kernel_us,
        gpu_us_a=gpu(a), gpu_us_b=gpu(b), kernels_a=a.totals.kernels, kernels_b=b.totals.kernels,
        cpu_ops_a=a.totals.cpu_ops, cpu_ops_b=b.totals.cpu_ops,
        step_mean_us_a=a.window.step_mean_us or a.window.engine_step_mean_us,
        step_mean_us_b=b.window.step_mean_us or b.window.engine_step_mean_us,
    )


def _ops(body: SummaryBody) -> dict[str, OpStat]:
    """Ops and annotations by name; ``ProfilerStep#N`` pooled as ``ProfilerStep*`` (as
    key_averages does), so step numbers need not line up between A and B."""
    rows: dict[str, OpStat] = {}
    for table in (body.cpu_ops, body.annotations):
        for o in table:
            if _STEP.match(o.name):
                s = rows.get("ProfilerStep*")
                rows["ProfilerStep*"] = o.model_copy(update={"name": "ProfilerStep*"}) if s is None else s.model_copy(update={
                    "count": s.count + o.count, "total_us": s.total_us + o.total_us, "self_us": s.self_us + o.self_us,
                    "self_device_us": s.self_device_us + o.self_device_us})
            else:
                rows.setdefault(o.name, o)
    return rows


def _kernels(body: SummaryBody) -> dict[tuple[str, str], GpuStat]:
    out = {}
    for kind, table in (("kernel", body.kernels), ("memcpy", body.memcpy), ("memset", body.memset)):
        for k in table:
            out[(kind, k.name)] = k
    return out


def _memory(a: SummaryBody, b: SummaryBody) -> list[MemoryDelta]:
    def by_device(body: SummaryBody) -> dict[tuple[object, ...], DeviceMemory]:
        return {(m.stage_id, m.replica, m.rank, m.device_type, m.device): m for m in body.memory}

    def side(m: DeviceMemory | None, s: str) -> dict[str, object]:
        if m is None:
            return {}
        return {f"peak_allocated_bytes_{s}": m.peak_allocated_bytes, f"reserved_at_peak_bytes_{s}": m.reserved_at_peak_bytes,
                f"alloc_bytes_per_step_{s}": m.alloc_bytes_per_step, f"ooms_{s}": m.ooms,
                f"top_live_{s}": m.live_at_peak[0] if m.live_at_peak else None}

    ma, mb = by_device(a), by_device(b)
    out = []
    for key in [*ma, *(k for k in mb if k not in ma)]:  # each side's devices in its summary's order
        x, y = ma.get(key), mb.get(key)
        out.append(MemoryDelta.model_validate({
            "stage_id": key[0], "replica": key[1], "rank": key[2], "device_type": key[3], "device": key[4],
            **side(x, "a"), **side(y, "b"),
            "delta_peak_allocated_bytes": y.peak_allocated_bytes - x.peak_allocated_bytes if x and y else None}))
    return out


def _memory_ops(a: SummaryBody, b: SummaryBody, top: int) -> list[MemoryOpDelta]:
    def by_op(body: SummaryBody) -> dict[tuple[str, str], MemoryOpStat]:
        return {(o.name, o.device_type): o for o in body.memory_ops}

    oa, ob = by_op(a), by_op(b)
    rows = []
    for key in oa.keys() | ob.keys():
        x, y = oa.get(key), ob.get(key)
        d = MemoryOpDelta(name=key[0], device_type=key[1],
                          allocs_a=x.allocs if x else 0, allocs_b=y.allocs if y else 0,
                          alloc_bytes_a=x.alloc_bytes if x else 0, alloc_bytes_b=y.alloc_bytes if y else 0,
                          self_bytes_a=x.self_bytes if x else 0, self_bytes_b=y.self_bytes if y else 0)
        d.delta_alloc_bytes = d.alloc_bytes_b - d.alloc_bytes_a
        rows.append(d)
    return sorted(rows, key=lambda d: (-abs(d.delta_alloc_bytes), d.name, d.device_type))[:top]


def diff_bodies(a: SummaryBody, b: SummaryBody, *, top: int = 20, stage_id: int | None = None) -> StageDiff:
    """One stage (or the totals): both sides' rows by name, ranked by |change|."""
    oa, ob = _ops(a), _ops(b)
    ops = []
    for name in oa.keys() | ob.keys():
        x, y = oa.get(name), ob.get(name)
        d = OpDelta(
            name=name,
            count_a=x.count if x else 0, count_b=y.count if y else 0,
            self_us_a=x.self_us if x else 0.0, self_us_b=y.self_us if y else 0.0,
            self_device_us_a=x.self_device_us if x else 0.0, self_device_us_b=y.self_device_us if y else 0.0,
        )
        d.delta_self_us = d.self_us_b - d.self_us_a
        d.delta_self_device_us = d.self_device_us_b - d.self_device_us_a
        ops.append(d)
    ka, kb = _kernels(a), _kernels(b)
    kernels = []
    for key in ka.keys() | kb.keys():
        x, y = ka.get(key), kb.get(key)
        d = KernelDelta(name=key[1], kind=key[0], count_a=x.count if x else 0, count_b=y.count if y else 0,
                        total_us_a=x.total_us if x else 0.0, total_us_b=y.total_us if y else 0.0)
        d.delta_us = d.total_us_b - d.total_us_a
        kernels.append(d)
    by_cpu = sorted(ops, key=lambda d: (-abs(d.delta_self_us), d.name))[:top]
    by_dev = sorted((d for d in ops if d.self_device_us_a or d.self_device_us_b), key=lambda d: (-abs(d.delta_self_device_us), d.name))[:top]
    return StageDiff(
        stage_id=stage_id,
        totals=_totals(a, b),
        ops_by_self_cpu=by_cpu,
        ops_by_self_device=by_dev,
        kernels=sorted(kernels, key=lambda d: (-abs(d.delta_us), d.name))[:top],
        memory=_memory(a, b),
        memory_ops=_memory_ops(a, b, top),
        only_in_a=sorted((oa.keys() - ob.keys()) | {k[1] for k in ka.keys() - kb.keys()})[:top],
        only_in_b=sorted((ob.keys() - oa.keys()) | {k[1] for k in kb.keys() - ka.keys()})[:top],
    )


def diff_summaries(a: CaptureSummary, b: CaptureSummary, *, top: int = 20, label_a: str = "a", label_b: str = "b") -> CaptureDiff:
    """Per stage present on either side (an absent side counts as empty), plus the totals."""
    sa = {s.stage_id: s for s in a.stages}
    sb = {s.stage_id: s for s in b.stages}
    stages = []
    empty = SummaryBody()
    for sid in sorted(sa.keys() | sb.keys(), key=lambda v: (v is None, v or 0)):
        stages.append(diff_bodies(sa.get(sid, empty), sb.get(sid, empty), top=top, stage_id=sid))
    warnings = [f"a: {w}" for w in a.warnings] + [f"b: {w}" for w in b.warnings]
    if sa and sb and not sa.keys() & sb.keys():
        warnings.append(
            f"no stage is on both sides (A: {_stage_names(sa)}; B: {_stage_names(sb)}): each stage is "
            "compared with nothing, only the total compares A with B. A trace file outside a session "
            "folder has no stage: give both sides the same way (session or capture folders, or files)")
    return CaptureDiff(
        a=label_a, b=label_b, stages=stages, total=diff_bodies(a, b, top=top),
        errors=[f"a: {e}" for e in a.errors] + [f"b: {e}" for e in b.errors],
        warnings=warnings,
    )


def _stage_names(stages: dict[int | None, object]) -> str:
    ids = sorted(stages, key=lambda v: (v is None, v or 0))
    return "stage " + ", ".join("?" if sid is None else str(sid) for sid in ids)


def diff_paths(
    a: Iterable[str | Path | TraceSource], b: Iterable[str | Path | TraceSource], *, top: int = 20,
    workers: int | None = None, label_a: str | None = None, label_b: str | None = None,
    on_file: Callable[[int, int], None] | None = None,
) -> CaptureDiff:
    """Summarise both sides with every row (in parallel per file), then ``diff_summaries``.
    ``on_file(done, total)``: A's files read so far, then B's (``summarize_paths``)."""
    a, b = list(a), list(b)
    sa = summarize_paths(a, top=ALL_ROWS, workers=workers, on_file=on_file)
    sb = summarize_paths(b, top=ALL_ROWS, workers=workers, on_file=on_file)
    return diff_summaries(sa, sb, top=top, label_a=label_a or _label(a), label_b=label_b or _label(b))


def _label(paths: Sequence[object]) -> str:
    return ", ".join(str(getattr(p, "path", p)) for p in paths)


__all__ = ["ALL_ROWS", "CaptureDiff", "KernelDelta", "MemoryDelta", "MemoryOpDelta", "OpDelta", "StageDiff", "TotalsDelta", "diff_bodies", "diff_paths", "diff_summaries"]
