"""One trace file through the pass, and a finished ``summary.Aggregate`` as the summary models:
``aggregate_trace`` (one file read through ``Aggregate``, with its header as ``TraceMeta``),
``summary_body`` (the ``SummaryBody`` fields of one trace, a stage or a capture, tables cut to the
top rows), ``trace_summary`` (one file's ``TraceSummary``, with the warning where the file is too
big for Perfetto's UI and the ``slim`` command that makes a copy that opens) and ``summarize_trace``
(one file, read and reported). The pass that fills the aggregate is ``sidecar.analysis.summary``;
this reads only what its ``finish`` and ``merge`` leave.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path
from typing import Any

from sidecar.analysis.memory import op_stats
from sidecar.analysis.models import (
    DeviceStat,
    GpuSplit,
    GpuStat,
    OpStat,
    StepKindStat,
    StreamStat,
    Totals,
    TraceMeta,
    TraceSummary,
    Window,
)
from sidecar.analysis.reader import TraceReader, trace_epoch_offset_us
from sidecar.analysis.summary import (
    ANNOTATION,
    KERNEL,
    MEMCPY,
    MEMSET,
    OP,
    ROW_SELF,
    ROW_SELF_DEV,
    ROW_TOTAL,
    RUNTIME,
    Aggregate,
)
from sidecar.errors import TraceError

TOO_BIG_BYTES = 200_000_000  # raw JSON above this: warn that Perfetto's UI may not open it
_RANK_IN_NAME = re.compile(r"^trace_rank(\d+)\.json")


def _meta(header: dict[str, Any]) -> TraceMeta:
    dist = header.get("distributedInfo") if isinstance(header.get("distributedInfo"), dict) else {}
    devices = header.get("deviceProperties") if isinstance(header.get("deviceProperties"), list) else []

    def as_int(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    skip = {"distributedInfo", "deviceProperties", "traceName", "host_name"}
    return TraceMeta(
        rank=as_int(dist.get("rank")),
        world_size=as_int(dist.get("world_size")),
        backend=dist.get("backend") if isinstance(dist.get("backend"), str) else None,
        host_name=header.get("host_name") if isinstance(header.get("host_name"), str) else None,
        trace_name=header.get("traceName") if isinstance(header.get("traceName"), str) else None,
        devices=[str(d.get("name")) for d in devices if isinstance(d, dict) and d.get("name")],
        extra={k: v for k, v in header.items() if k not in skip and isinstance(v, (int, float, str, bool))},
    )


def aggregate_trace(
    path: str | Path, *, stage_id: int | None = None, replica: int | None = None, steady: bool = True
) -> tuple[Aggregate, TraceMeta, int]:
    """One pass over ``path``. Raises ``TraceError`` when nothing usable was read. ``stage_id``
    and ``replica`` key its devices (with the rank from the trace). ``steady=False`` keeps the
    profiler-start transient and graph captures in the attribution window (as HTA does)."""
    reader = TraceReader(path, skip_python=True, complete_only=True)
    agg = Aggregate(steady=steady)
    # The pass allocates millions of short-lived structs and no cycles: the cyclic GC would only
    # rescan the growing tables on every generation-0 threshold.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for n, batch in enumerate(reader.batches()):
            if n == 0:  # the header is read before the first batch
                agg.index_ops(reader.meta)
            agg.add_batch(batch)
    finally:
        if was_enabled:
            gc.enable()
    meta = _meta(reader.meta)
    if meta.rank is None:  # no distributedInfo (single process): vLLM still names the file by rank
        m = _RANK_IN_NAME.match(Path(path).name)
        meta.rank = int(m.group(1)) if m else None
    agg.events += reader.skipped  # Python stack events: counted, never needed
    note = reader.unusable_note()
    if note:
        agg.limits.append(note)
    agg.epoch_offset_us = trace_epoch_offset_us(reader.meta)
    agg.finish(meta.rank, stage_id=stage_id, replica=replica)
    agg.files = [str(path)]
    agg.bytes_raw = reader.raw_bytes
    if reader.truncated:
        if agg.events == 0:
            raise TraceError(reader.error or f"{path}: truncated before the first event", details={"file": str(path)})
        agg.truncated = True
        agg.errors.append(reader.error or f"{path}: truncated")
    return agg, meta, reader.raw_bytes


def summary_body(agg: Aggregate, top: int) -> dict[str, Any]:
    """The fields of ``SummaryBody`` of a finished aggregate, tables cut to the ``top`` rows by time."""
    span = (agg.end - agg.start) if agg.start is not None and agg.end is not None else 0.0

    def ops(cat: str, key: int) -> list[OpStat]:
        rows = sorted(agg.tables[cat].values(), key=lambda r: r[key], reverse=True)[:top]
        return [OpStat(name=r[0], count=r[1], total_us=r[2], self_us=r[3], self_device_us=r[4]) for r in rows]

    def gpu(cat: str) -> list[GpuStat]:
        rows = sorted(agg.tables[cat].values(), key=lambda r: r[2], reverse=True)[:top]
        return [GpuStat(name=r[0], count=r[1], total_us=r[2]) for r in rows]

    def share(part: float, whole: float) -> float:
        return part / whole if whole > 0 else 0.0

    def idle(busy: float, of: float) -> float:
        return max(0.0, 1.0 - busy / of) if of > 0 else 0.0

    def span_of(stream_key: tuple[Any, ...]) -> float:
        d = agg.devices.get(stream_key[:4])
        return d[1] if d else span

    def order(k: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(-1 if v is None else v for v in k)

    t = agg.tables
    kernel_us = sum(r[2] for r in t[KERNEL].values())
    memcpy_us = sum(r[2] for r in t[MEMCPY].values())
    memset_us = sum(r[2] for r in t[MEMSET].values())
    gpu_us = kernel_us + memcpy_us + memset_us
    by_device = [o for o in ops(OP, ROW_SELF_DEV) if o.self_device_us > 0]
    kinds_total = sum(v[1] for v in agg.step_kinds.values())
    return dict(
        truncated=agg.truncated,
        errors=list(agg.errors),
        window=Window(
            start_us=agg.start,
            end_us=agg.end,
            span_us=span,
            steps=agg.steps,
            step_mean_us=(agg.step_total / agg.steps) if agg.steps else None,
            step_names=agg.step_names,
            engine_steps=agg.engine_steps,
            engine_step_mean_us=(agg.engine_step_total / agg.engine_steps) if agg.engine_steps else None,
            end_epoch_us=agg.end_epoch_us,
        ),
        totals=Totals(
            events=agg.events,
            bytes_raw=agg.bytes_raw,
            cpu_ops=sum(r[1] for r in t[OP].values()),
            cpu_op_self_us=sum(r[3] for r in t[OP].values()),
            annotation_self_us=sum(r[3] for r in t[ANNOTATION].values()),
            kernels=sum(r[1] for r in t[KERNEL].values()),
            kernel_us=kernel_us,
            memcpy_us=memcpy_us,
            memset_us=memset_us,
            runtime_us=sum(r[2] for r in t[RUNTIME].values()),
            out_of_order=agg.out_of_order,
            profiler_overhead_us=agg.overhead_us,
        ),
        cpu_ops=ops(OP, ROW_SELF),
        cpu_ops_by_device=by_device,
        annotations=ops(ANNOTATION, ROW_TOTAL),
        runtime=ops(RUNTIME, ROW_TOTAL),
        kernels=gpu(KERNEL),
        memcpy=gpu(MEMCPY),
        memset=gpu(MEMSET),
        devices=[
            DeviceStat(stage_id=k[0], replica=k[1], rank=k[2], device=k[3], busy_us=b, span_us=sp,
                       busy_share=min(1.0, share(b, sp)), idle_share=idle(b, sp),
                       first_event_epoch_us=agg.epochs[k][0] if k in agg.epochs else None,
                       profiling_start_epoch_us=agg.profiling_epochs[k][0] if k in agg.profiling_epochs else None,
                       **(agg.attribution[k].fields() if k in agg.attribution else {}))
            for k, (b, sp) in sorted(agg.devices.items(), key=lambda kv: order(kv[0]))
        ],
        streams=[
            StreamStat(stage_id=k[0], replica=k[1], rank=k[2], device=k[3], stream=k[4], count=v[0],
                       busy_us=v[1], idle_share=idle(v[1], span_of(k)))
            for k, v in sorted(agg.streams.items(), key=lambda kv: order(kv[0]))
        ],
        engine_step_kinds=[
            StepKindStat(kind=k, count=int(v[0]), total_us=v[1], mean_us=v[1] / v[0] if v[0] else 0.0,
                         share=share(v[1], kinds_total))
            for k, v in sorted(agg.step_kinds.items(), key=lambda kv: -kv[1][1])
        ],
        gpu_split=GpuSplit(
            kernel_us=kernel_us, memcpy_us=memcpy_us, memset_us=memset_us,
            kernel_share=share(kernel_us, gpu_us), memcpy_share=share(memcpy_us, gpu_us),
            memset_share=share(memset_us, gpu_us),
        ),
        memory=[m for _, m in sorted(agg.memory.items(), key=lambda kv: order(kv[0]))],
        memory_ops=op_stats(agg.memory_ops, top),
    )


def slim_command(path: str | Path) -> str:
    """The command that makes a trace small enough to open (see ``sidecar.analysis.slim``)."""
    p = Path(path)
    stem = p.name[: -len(".json.gz")] if p.name.endswith(".json.gz") else p.stem
    return f"omni-sidecar slim {p} -o {p.with_name(stem + '.slim.json.gz')} --max-mb 150"


def trace_summary(path: str | Path, agg: Aggregate, meta: TraceMeta, raw: int, top: int) -> TraceSummary:
    """The ``TraceSummary`` of one aggregated file, with the too-big warning where it applies."""
    summary = TraceSummary(file=str(path), bytes_raw=raw, meta=meta, stage_id=agg.stage_id, replica=agg.replica, **summary_body(agg, top))
    summary.warnings += [f"{path}: {what}" for what in agg.limits]
    if raw > TOO_BIG_BYTES:
        summary.too_big = True
        summary.slim_command = slim_command(path)
        summary.warnings.append(
            f"{path}: {raw / 1e6:.0f} MB of JSON; Perfetto's UI fails around 1 GB and is slow well "
            f"before. Make a smaller copy: {summary.slim_command}"
        )
    return summary


def summarize_trace(path: str | Path, *, top: int = 20, strict: bool = False, steady: bool = True) -> TraceSummary:
    """Summary of one trace file (``.json`` or ``.json.gz``).

    Raises ``TraceError`` (code ``trace_invalid``, message naming the file) for unreadable input.
    A file cut short returns the summary of the events read so far with ``truncated=True`` and the
    reason in ``errors``; with ``strict=True`` it raises instead, the partial summary in
    ``details["partial"]``.
    """
    agg, meta, raw = aggregate_trace(path, steady=steady)
    summary = trace_summary(path, agg, meta, raw, top)
    if strict and summary.truncated:
        raise TraceError(summary.errors[0], details={"file": str(path), "partial": summary.model_dump(mode="json")})
    return summary


__all__ = ["TOO_BIG_BYTES", "aggregate_trace", "slim_command", "summarize_trace", "summary_body", "trace_summary"]
