"""Aggregate trace events into a summary in one pass, in memory bounded by the aggregates.

State kept per trace: one row per distinct name, one open-op stack per thread, one 4-byte slot per
CPU op ``External id`` (so GPU time and CUDA API calls can be charged to the op that launched
them, as torch's key_averages does), and per device a sorted block of at most 64k intervals.
"""

from __future__ import annotations

import re
from array import array
from pathlib import Path
from typing import Any

from sidecar.analysis.models import (
    DeviceStat,
    GpuStat,
    OpStat,
    StreamStat,
    TraceMeta,
    TraceSummary,
    Totals,
    Window,
)
from sidecar.analysis.reader import TraceEvent, TraceReader
from sidecar.errors import TraceError

# Categories, as Kineto names them.
OP, ANNOTATION, RUNTIME = "cpu_op", "user_annotation", "runtime"
KERNEL, MEMCPY, MEMSET = "kernel", "gpu_memcpy", "gpu_memset"
_RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver"})
_STEP = re.compile(r"^ProfilerStep#\d+$")
# vLLM's worker wraps every engine step in "execute_context_<n>(<tok>)_generation_<n>(<tok>)"
# ("execute_<tok>_context_..." with detailed_trace_annotation); vLLM-Omni's diffusion worker in
# "diffusion_forward" / "diffusion_forward_batch".
_ENGINE_STEP = re.compile(r"^execute_(\d+_)?context_\d+|^diffusion_forward(_batch)?$")
_RANK_IN_NAME = re.compile(r"^trace_rank(\d+)\.json")
_EPS = 5e-4  # µs: timestamps carry ns precision; float sums must not un-nest siblings
_BLOCK = 65536  # device intervals merged per sorted block
_OVERHEAD_GAP = 200.0  # µs between a CUPTI buffer request and the API call that caused it
_EXT_DENSE_LIMIT = 1 << 23  # External ids above this go to a dict (the array stays <= 32 MB)
_UNSET = array("i", [-1])

# A stat row: [name, count, total, self, self_device]
_NAME, _COUNT, _TOTAL, _SELF, _SELF_DEV = range(5)


class _DeviceBusy:
    """Union of intervals on one device, merged in sorted blocks (bounded memory)."""

    __slots__ = ("pending", "cur_s", "cur_e", "busy")

    def __init__(self) -> None:
        self.pending: list[tuple[float, float]] = []
        self.cur_s = self.cur_e = None
        self.busy = 0.0

    def add(self, s: float, e: float) -> None:
        self.pending.append((s, e))
        if len(self.pending) >= _BLOCK:
            self.flush()

    def flush(self) -> None:
        self.pending.sort()
        cs, ce, busy = self.cur_s, self.cur_e, self.busy
        for s, e in self.pending:
            if cs is None:
                cs, ce = s, e
            elif s <= ce:
                if e > ce:
                    ce = e
            else:
                busy += ce - cs
                cs, ce = s, e
        self.pending = []
        self.cur_s, self.cur_e, self.busy = cs, ce, busy

    def total(self) -> float:
        self.flush()
        return self.busy + ((self.cur_e - self.cur_s) if self.cur_s is not None else 0.0)


class Aggregate:
    """Summable state of one or more traces. ``add_batch`` for events, ``merge`` for others."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, list[Any]]] = {c: {} for c in (OP, ANNOTATION, RUNTIME, KERNEL, MEMCPY, MEMSET)}
        self.streams: dict[tuple[int | None, int, int], list[float]] = {}  # -> [count, busy]
        self.devices: dict[tuple[int | None, int], float] = {}  # busy after finish()
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0
        self.step_total = 0.0
        self.step_names: list[str] = []
        self.engine_steps = 0
        self.engine_step_total = 0.0
        self.events = 0
        self.out_of_order = 0
        self.truncated = False
        self.errors: list[str] = []
        self.files: list[str] = []
        self.rank: int | None = None
        # per-trace state, dropped by finish()
        self._stacks: dict[tuple[Any, Any], list[tuple[float, list[Any]]]] = {}
        self._last_start: dict[tuple[Any, Any], float] = {}
        self._ext = array("i")
        self._ext_sparse: dict[int, int] = {}
        self._overhead: list[list[Any]] = []  # CUPTI overhead: [start, end, dur, best gap, op row]
        self.overhead_us = 0.0
        self._rows: list[list[Any]] = []  # rows referenced by External id, by position
        self._row_pos: dict[int, int] = {}  # id(row) -> position in _rows
        self._busy: dict[int, _DeviceBusy] = {}

    # --- one trace ---------------------------------------------------------------------------

    def _row(self, cat: str, name: str) -> list[Any]:
        table = self.tables[cat]
        row = table.get(name)
        if row is None:
            row = table[name] = [name, 0, 0.0, 0.0, 0.0]
        return row

    def _remember(self, ext: int, row: list[Any]) -> None:
        pos = self._row_pos.get(id(row))
        if pos is None:
            pos = self._row_pos[id(row)] = len(self._rows)
            self._rows.append(row)
        if 0 <= ext < _EXT_DENSE_LIMIT:
            ext_arr = self._ext
            if ext >= len(ext_arr):
                ext_arr.extend(_UNSET * max(ext + 1 - len(ext_arr), len(ext_arr) // 4 + 1024))
            ext_arr[ext] = pos
        else:
            self._ext_sparse[ext] = pos

    def _launcher(self, ext: int | None) -> list[Any] | None:
        if ext is None or ext <= 0:
            return None
        if ext < len(self._ext):
            pos = self._ext[ext]
        else:
            pos = self._ext_sparse.get(ext, -1)
        return self._rows[pos] if pos >= 0 else None

    def _place_overhead(self, ts: float, parent: list[Any]) -> None:
        """CUPTI's "Activity Buffer Request" runs inside a CUDA call on the profiling (main, tid ==
        pid) thread; torch nests it in the op running there, so it is not that op's self time.
        Kineto writes it with no thread and no id, before the API calls: it belongs to the op of
        the first main-thread API call that starts after it ends (within _OVERHEAD_GAP)."""
        for ov in self._overhead:
            gap = ts - ov[1]
            if -_EPS <= gap <= _OVERHEAD_GAP and (ov[3] is None or gap < ov[3]):
                ov[3], ov[4] = gap, parent

    def add_batch(self, events: list[TraceEvent]) -> None:
        stacks, last_start = self._stacks, self._last_start
        row_of = self._row
        start, end = self.start, self.end
        for e in events:
            if e.ph != "X":
                continue
            cat = e.cat
            if cat == "python_function" or cat is None:
                continue
            ts = e.ts
            dur = e.dur
            te = ts + dur
            if cat == OP or cat == ANNOTATION:
                key = (e.pid, e.tid)
                row = row_of(cat, e.name)
                row[1] += 1
                row[2] += dur
                row[3] += dur
                st = stacks.get(key)
                if st is None:
                    st = stacks[key] = []
                if ts < last_start.get(key, ts) - _EPS:
                    self.out_of_order += 1
                last_start[key] = ts
                while st and st[-1][0] <= ts + _EPS:
                    st.pop()
                if st:
                    st[-1][1][3] -= dur  # a child's time is not its parent's self time
                st.append((te, row))
                a = e.args
                if a is not None and a.external_id:
                    self._remember(a.external_id, row)
                if cat == ANNOTATION:
                    if _STEP.match(e.name):
                        self.steps += 1
                        self.step_total += dur
                        if len(self.step_names) < 8:
                            self.step_names.append(e.name)
                    elif _ENGINE_STEP.match(e.name):
                        self.engine_steps += 1
                        self.engine_step_total += dur
            elif cat in _RUNTIME_CATS:
                row = row_of(RUNTIME, e.name)
                row[1] += 1
                row[2] += dur
                row[3] += dur
                a = e.args
                if a is not None:
                    parent = self._launcher(a.external_id)
                    if parent is not None:
                        parent[3] -= dur  # the API call ran inside that op on its thread
                        if self._overhead and e.tid == e.pid:
                            self._place_overhead(ts, parent)
            elif cat == "overhead":
                self.overhead_us += dur
                if len(self._overhead) < 4096:
                    self._overhead.append([ts, te, dur, None, None])
                continue
            elif cat == KERNEL or cat == MEMCPY or cat == MEMSET:
                row = row_of(cat, e.name)
                row[1] += 1
                row[2] += dur
                a = e.args
                if a is not None:
                    parent = self._launcher(a.external_id)
                    if parent is not None:
                        parent[4] += dur
                    dev = a.device if a.device is not None else (e.pid if isinstance(e.pid, int) else -1)
                    stream = a.stream if a.stream is not None else (e.tid if isinstance(e.tid, int) else -1)
                else:
                    dev = e.pid if isinstance(e.pid, int) else -1
                    stream = e.tid if isinstance(e.tid, int) else -1
                sk = (None, dev, stream)
                s = self.streams.get(sk)
                if s is None:
                    s = self.streams[sk] = [0, 0.0]
                s[0] += 1
                s[1] += dur
                busy = self._busy.get(dev)
                if busy is None:
                    busy = self._busy[dev] = _DeviceBusy()
                busy.add(ts, te)
            else:
                continue  # Trace spans, overhead, gpu_user_annotation: not part of the window
            if start is None or ts < start:
                start = ts
            if end is None or te > end:
                end = te
        self.start, self.end = start, end
        self.events += len(events)

    def finish(self, rank: int | None = None) -> None:
        """End of one trace: settle device unions, tag devices with the rank, drop pass state."""
        self.rank = rank
        for ov in self._overhead:
            if ov[4] is not None:
                ov[4][3] -= ov[2]
        for dev, b in self._busy.items():
            self.devices[(rank, dev)] = b.total()
        if rank is not None:
            self.streams = {(rank, d, s): v for (_, d, s), v in self.streams.items()}
        self._stacks, self._last_start, self._busy = {}, {}, {}
        self._ext, self._ext_sparse, self._rows, self._row_pos = array("i"), {}, [], {}
        self._overhead = []

    # --- many traces -------------------------------------------------------------------------

    def merge(self, other: Aggregate) -> None:
        for cat, table in other.tables.items():
            mine = self.tables[cat]
            for name, row in table.items():
                m = mine.get(name)
                if m is None:
                    mine[name] = list(row)
                else:
                    for i in (1, 2, 3, 4):
                        m[i] += row[i]
        for k, v in other.streams.items():
            m = self.streams.setdefault(k, [0, 0.0])
            m[0] += v[0]
            m[1] += v[1]
        for k, v in other.devices.items():
            self.devices[k] = self.devices.get(k, 0.0) + v
        if other.start is not None:
            self.start = other.start if self.start is None else min(self.start, other.start)
            self.end = other.end if self.end is None else max(self.end, other.end)
        self.steps += other.steps
        self.step_total += other.step_total
        self.step_names = (self.step_names + other.step_names)[:8]
        self.engine_steps += other.engine_steps
        self.engine_step_total += other.engine_step_total
        self.events += other.events
        self.out_of_order += other.out_of_order
        self.overhead_us += other.overhead_us
        self.truncated = self.truncated or other.truncated
        self.errors += other.errors
        self.files += other.files

    def body(self, top: int) -> dict[str, Any]:
        """The fields of ``SummaryBody``, tables cut to the ``top`` rows by time."""
        span = (self.end - self.start) if self.start is not None and self.end is not None else 0.0

        def ops(cat: str, key: int) -> list[OpStat]:
            rows = sorted(self.tables[cat].values(), key=lambda r: r[key], reverse=True)[:top]
            return [OpStat(name=r[0], count=r[1], total_us=r[2], self_us=r[3], self_device_us=r[4]) for r in rows]

        def gpu(cat: str) -> list[GpuStat]:
            rows = sorted(self.tables[cat].values(), key=lambda r: r[2], reverse=True)[:top]
            return [GpuStat(name=r[0], count=r[1], total_us=r[2]) for r in rows]

        def idle(busy: float) -> float:
            return max(0.0, 1.0 - busy / span) if span > 0 else 0.0

        t = self.tables
        by_device = [
            o for o in ops(OP, _SELF_DEV) if o.self_device_us > 0
        ]
        return dict(
            truncated=self.truncated,
            errors=list(self.errors),
            window=Window(
                start_us=self.start,
                end_us=self.end,
                span_us=span,
                steps=self.steps,
                step_mean_us=(self.step_total / self.steps) if self.steps else None,
                step_names=self.step_names,
                engine_steps=self.engine_steps,
                engine_step_mean_us=(self.engine_step_total / self.engine_steps) if self.engine_steps else None,
            ),
            totals=Totals(
                events=self.events,
                cpu_ops=sum(r[1] for r in t[OP].values()),
                cpu_op_self_us=sum(r[3] for r in t[OP].values()),
                kernels=sum(r[1] for r in t[KERNEL].values()),
                kernel_us=sum(r[2] for r in t[KERNEL].values()),
                memcpy_us=sum(r[2] for r in t[MEMCPY].values()),
                memset_us=sum(r[2] for r in t[MEMSET].values()),
                runtime_us=sum(r[2] for r in t[RUNTIME].values()),
                out_of_order=self.out_of_order,
                profiler_overhead_us=self.overhead_us,
            ),
            cpu_ops=ops(OP, _SELF),
            cpu_ops_by_device=by_device,
            annotations=ops(ANNOTATION, _TOTAL),
            runtime=ops(RUNTIME, _TOTAL),
            kernels=gpu(KERNEL),
            memcpy=gpu(MEMCPY),
            memset=gpu(MEMSET),
            devices=[
                DeviceStat(rank=r, device=d, busy_us=b, idle_share=idle(b))
                for (r, d), b in sorted(self.devices.items(), key=lambda kv: (kv[0][0] or -1, kv[0][1]))
            ],
            streams=[
                StreamStat(rank=r, device=d, stream=s, count=v[0], busy_us=v[1], idle_share=idle(v[1]))
                for (r, d, s), v in sorted(self.streams.items(), key=lambda kv: (kv[0][0] or -1, kv[0][1], kv[0][2]))
            ],
        )


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


def aggregate_trace(path: str | Path) -> tuple[Aggregate, TraceMeta, int]:
    """One pass over ``path``. Raises ``TraceError`` when nothing usable was read."""
    reader = TraceReader(path)
    agg = Aggregate()
    for batch in reader.batches():
        agg.add_batch(batch)
    meta = _meta(reader.meta)
    if meta.rank is None:  # no distributedInfo (single process): vLLM still names the file by rank
        m = _RANK_IN_NAME.match(Path(path).name)
        meta.rank = int(m.group(1)) if m else None
    agg.finish(meta.rank)
    agg.files = [str(path)]
    if reader.truncated:
        if agg.events == 0:
            raise TraceError(reader.error or f"{path}: truncated before the first event", details={"file": str(path)})
        agg.truncated = True
        agg.errors.append(reader.error or f"{path}: truncated")
    elif agg.events == 0:
        pass  # a valid trace with an empty traceEvents array: an empty summary, not an error
    return agg, meta, reader.raw_bytes


def summarize_trace(path: str | Path, *, top: int = 20, strict: bool = False) -> TraceSummary:
    """Summary of one trace file (``.json`` or ``.json.gz``).

    Raises ``TraceError`` (code ``trace_invalid``, message naming the file) for unreadable input.
    A file cut short returns the summary of the events read so far with ``truncated=True`` and the
    reason in ``errors``; with ``strict=True`` it raises instead, the partial summary in
    ``details["partial"]``.
    """
    agg, meta, raw = aggregate_trace(path)
    summary = TraceSummary(file=str(path), bytes_raw=raw, meta=meta, **agg.body(top))
    if strict and summary.truncated:
        raise TraceError(summary.errors[0], details={"file": str(path), "partial": summary.model_dump(mode="json")})
    return summary



__all__ = ["Aggregate", "aggregate_trace", "summarize_trace"]
