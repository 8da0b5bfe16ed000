"""Aggregate trace events into a summary in one pass, in memory bounded by the aggregates.

State kept per trace: one row per distinct name, one open-op stack per thread, one 4-byte slot per
CPU op ``External id`` (so GPU time and CUDA API calls can be charged to the op that launched
them, as torch's key_averages does), and per device its GPU events, 32 bytes each, up to 262,144
at a time, swept in time order at the end (``attribution``, which also gives each device its busy
time).
A trace's devices are keyed by (stage, replica, rank, device): every stage process calls its own
GPU ``cuda:0``, so the device number alone would add different GPUs together.

Every one of those is capped (names, threads, open ops per thread, devices and streams, sparse
ids), so a hostile file of unique names or ever-nested ops cannot grow them without bound: what
passes a cap is counted in an overflow row or left out, and ``limits`` says which cap was hit.

``Aggregate`` is the pass (``add_batch``, ``finish``) and the sum of several traces (``merge``).
``sidecar.analysis.report`` runs it over one file (``aggregate_trace``) and turns a finished
aggregate into the summary models.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from typing import Any

from sidecar.analysis.attribution import (
    CAPTURE_CALLS,
    LAUNCH_CALLS,
    DeviceAttribution,
    TraceAttribution,
)
from sidecar.analysis.memory import (
    INSTANT,
    MAX_INDEXED_OPS,
    MEMORY_EVENT,
    OOM_EVENT,
    MemoryTracker,
    ThreadOps,
    device_memory,
    merge_device,
)
from sidecar.analysis.models import DeviceMemory
from sidecar.analysis.events import TraceEvent
from sidecar.analysis.starts import PROFILER_SPAN

# Categories, as Kineto names them.
OP, ANNOTATION, RUNTIME = "cpu_op", "user_annotation", "runtime"
KERNEL, MEMCPY, MEMSET = "kernel", "gpu_memcpy", "gpu_memset"
GPU_ANNOTATION = "gpu_user_annotation"
_RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver"})
_STEP = re.compile(r"^ProfilerStep#\d+$")
# vLLM's worker wraps every engine step in "execute_context_<n>(<tok>)_generation_<n>(<tok>)"
# ("execute_<tok>_context_..." with detailed_trace_annotation); vLLM-Omni's diffusion worker in
# "diffusion_forward" / "diffusion_forward_batch".
_ENGINE_STEP = re.compile(r"^execute_(\d+_)?context_\d+|^diffusion_forward(_batch)?$")
_EPS = 5e-4  # µs: timestamps carry ns precision; float sums must not un-nest siblings
_OVERHEAD_GAP = 200.0  # µs between a CUPTI buffer request and the API call that caused it
_OVERHEAD_LIMIT = 1 << 16  # overhead events kept for placement (a few per trace in practice)
# Caps that only a hostile or broken trace reaches (a real one has thousands of names, tens of
# threads, a call depth of tens, a handful of devices)
_MAX_ROWS = 200_000  # distinct names, all tables together
_MAX_NAME_BYTES = 32 << 20  # characters of those names
_MAX_THREADS = 4096
_MAX_KEY_CHARS = 256  # a pid/tid string longer than this is not a thread id
_MAX_OPEN = 1024  # open ops on one thread's stack
_MAX_DEVICES = 256  # (device, stream) pairs and devices
_MAX_SPARSE_IDS = 1 << 18
OTHER_NAMES = "(other names: too many distinct names in this trace)"
_EXT_DENSE_LIMIT = 1 << 23  # External ids above this go to a dict (the array stays <= 32 MB)
_UNSET = array("i", [-1])

# A stat row: [name, count, total, self, self_device, position among the rows External ids name]
ROW_NAME, ROW_COUNT, ROW_TOTAL, ROW_SELF, ROW_SELF_DEV, ROW_POS = range(6)


def engine_step_kind(name: str) -> str | None:
    """``prefill`` / ``decode`` / ``mixed`` (``idle``: no token) for vLLM's execute_* markers, ``diffusion`` for
    vLLM-Omni's diffusion_forward*, None for anything else."""
    if name.startswith("diffusion_forward"):
        return "diffusion" if name in ("diffusion_forward", "diffusion_forward_batch") else None
    m = _CTX_GEN.match(name)
    if m is None:
        return "step" if _ENGINE_STEP.match(name) else None
    ctx, gen = int(m.group(1)), int(m.group(2))
    if not ctx and not gen:
        return "idle"  # scheduled nothing (vLLM 0.30 runs one at a profiler start and stop)
    if ctx and gen:
        return "mixed"
    return "prefill" if ctx else "decode"


_CTX_GEN = re.compile(r"^execute_(?:\d+_)?context_(\d+)(?:\([^)]*\))?_generation_(\d+)")


DeviceKey = tuple[int | None, int | None, int | None, int]  # (stage, replica, rank, device)
SpanKey = tuple[int | None, int | None, int | None, int | None]  # (stage, replica, rank, device; None: the host)


def _widen(spans: dict[SpanKey, tuple[float, float]], other: dict[SpanKey, tuple[float, float]]) -> None:
    """Each device's (first, last) in ``spans`` widened by ``other``'s."""
    for k, (lo, hi) in other.items():
        mine = spans.get(k)
        spans[k] = (lo, hi) if mine is None else (min(mine[0], lo), max(mine[1], hi))


class Aggregate:
    """Summable state of one or more traces. ``add_batch`` for events, ``merge`` for others."""

    def __init__(self, *, steady: bool = True) -> None:
        self.tables: dict[str, dict[str, list[Any]]] = {c: {} for c in (OP, ANNOTATION, RUNTIME, KERNEL, MEMCPY, MEMSET)}
        self.streams: dict[tuple[Any, ...], list[float]] = {}  # (stage, replica, rank, dev, stream) -> [count, busy]
        self.devices: dict[DeviceKey, list[float]] = {}  # -> [busy, span of its trace], after finish()
        self.step_kinds: dict[str, list[float]] = {}  # engine step kind -> [count, total]
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0
        self.step_total = 0.0
        self.step_names: list[str] = []
        self.engine_steps = 0
        self.engine_step_total = 0.0
        self.events = 0
        self.bytes_raw = 0
        self.out_of_order = 0
        self.truncated = False
        self.errors: list[str] = []
        self.files: list[str] = []
        self.rank: int | None = None
        self.stage_id: int | None = None
        self.replica: int | None = None
        self.overhead_us = 0.0
        self.attribution: dict[DeviceKey, DeviceAttribution] = {}  # after finish()
        # (stage, replica, rank, device type, device id) -> what held its memory, after finish()
        self.memory: dict[tuple[Any, ...], DeviceMemory] = {}
        self.memory_ops: dict[tuple[str, str], list[int]] = {}  # (op, device type) -> [allocs, bytes, frees, bytes]
        # first and last event, epoch µs, per GPU; per host (device None) in a trace with no GPU
        self.epochs: dict[SpanKey, tuple[float, float]] = {}
        self.profiling: tuple[float, float] | None = None  # this trace's Kineto profiler span (ts, end)
        self.profiling_epochs: dict[SpanKey, tuple[float, float]] = {}  # that span per device, epoch µs
        self.epoch_offset_us: float | None = None  # baseTimeNanoseconds / 1000 of this trace
        self.end_epoch_us: float | None = None  # the last event's end, epoch µs (the latest of merged traces)
        # per-trace state, dropped by finish()
        self._att = TraceAttribution(steady=steady)
        self._stacks: dict[tuple[Any, Any], list[Any]] = {}  # (pid, tid) -> [last start, open ops, ThreadOps | None]
        self._ops_index: dict[tuple[Any, Any], ThreadOps] = {}  # (pid, tid) -> its ops, in memory traces
        self._mem = MemoryTracker()
        self._index_ops = False  # index each thread's ops for the memory events (profile_memory traces)
        self._step_starts: list[float] = []
        self.capacities: dict[int, int] = {}  # GPU memory per device id, from the trace's deviceProperties
        self._ext = array("i")
        self._ext_sparse: dict[int, int] = {}
        self._rows: list[list[Any]] = []  # rows named by External ids, by ROW_POS
        # CUPTI overhead, sorted by end: ends, and [start, end, dur, best gap, op row]
        self._ov_ends: list[float] = []
        self._ov: list[list[Any]] = []
        self._stream_of: dict[tuple[int, int], list[float]] = {}
        self._names = 0  # distinct names in the tables
        self._name_bytes = 0
        self.limits: list[str] = []  # caps this trace hit (see the module docstring)

    def _limit(self, what: str) -> None:
        if what not in self.limits:
            self.limits.append(what)

    def _room_for(self, name: str) -> bool:
        """Whether one more distinct name fits the caps (else it is counted under OTHER_NAMES)."""
        if self._names < _MAX_ROWS and self._name_bytes + len(name) <= _MAX_NAME_BYTES:
            self._names += 1
            self._name_bytes += len(name)
            return True
        self._limit(f"more than {_MAX_ROWS:,} distinct names or {_MAX_NAME_BYTES >> 20} MB of them: the rest counted as {OTHER_NAMES!r}")
        return False

    # --- one trace ---------------------------------------------------------------------------

    def _new_row(self, table: dict[str, list[Any]], name: str) -> list[Any]:
        if not self._room_for(name):
            name = OTHER_NAMES
            if name in table:
                return table[name]
        row = table[name] = [name, 0, 0.0, 0.0, 0.0, len(self._rows)]
        self._rows.append(row)
        return row

    def _new_gpu_row(self, table: dict[str, list[Any]], name: str) -> list[Any]:
        if not self._room_for(name):
            name = OTHER_NAMES
            if name in table:
                return table[name]
        row = table[name] = [name, 0, 0.0, 0.0, 0.0, -1]
        return row

    def _new_thread(self, key: tuple[Any, Any], ts: float) -> list[Any]:
        if len(self._stacks) >= _MAX_THREADS or any(isinstance(k, str) and len(k) > _MAX_KEY_CHARS for k in key):
            self._limit(f"more than {_MAX_THREADS:,} threads (or a thread id of over {_MAX_KEY_CHARS} characters): "
                        "their ops share one stack")
            key = (None, None)
            if key in self._stacks:
                return self._stacks[key]
        th = self._stacks[key] = [ts, [], None]
        if self._index_ops:
            th[2] = self._ops_index[key] = ThreadOps()
        return th

    def index_ops(self, header: dict[str, Any]) -> None:
        """Before the first batch: index each thread's ops when the trace recorded memory (its
        memory events come after the ops and are charged to them), and note each GPU's memory."""
        self._index_ops = bool(header.get("profile_memory"))
        props = header.get("deviceProperties")
        for i, d in enumerate(props if isinstance(props, list) else []):
            if isinstance(d, dict) and isinstance(d.get("totalGlobalMem"), int):
                did = d.get("id")
                self.capacities[did if isinstance(did, int) else i] = d["totalGlobalMem"]

    def _device_slot(self, dev: int, stream: int) -> tuple[int, int]:
        if len(self._stream_of) < _MAX_DEVICES:
            return dev, stream
        self._limit(f"more than {_MAX_DEVICES} device streams: the rest counted as device -1, stream -1")
        return -1, -1

    def _remember_slow(self, ext: int, pos: int) -> None:
        if 0 <= ext < _EXT_DENSE_LIMIT:
            ext_arr = self._ext
            ext_arr.extend(_UNSET * max(ext + 1 - len(ext_arr), len(ext_arr) // 4 + 1024))
            ext_arr[ext] = pos
        elif len(self._ext_sparse) < _MAX_SPARSE_IDS:
            self._ext_sparse[ext] = pos
        else:
            self._limit(f"more than {_MAX_SPARSE_IDS:,} External ids above {_EXT_DENSE_LIMIT:,}: later ones not linked")

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
        the first main-thread API call that starts after it ends (within _OVERHEAD_GAP). Only the
        overheads ending in [ts - gap, ts] are looked at (bisect on the sorted ends)."""
        ends, ovs = self._ov_ends, self._ov
        i = bisect_left(ends, ts - _OVERHEAD_GAP)
        n = len(ends)
        while i < n and ends[i] <= ts + _EPS:
            ov = ovs[i]
            gap = ts - ov[1]
            if ov[3] is None or gap < ov[3]:
                ov[3], ov[4] = gap, parent
            i += 1

    def _add_overhead(self, ts: float, te: float, dur: float) -> None:
        self.overhead_us += dur
        if len(self._ov) < _OVERHEAD_LIMIT:
            i = bisect_left(self._ov_ends, te)
            self._ov_ends.insert(i, te)
            self._ov.insert(i, [ts, te, dur, None, None])

    def add_batch(self, events: list[TraceEvent]) -> None:
        stacks = self._stacks
        tables = self.tables
        t_op, t_ann, t_rt = tables[OP], tables[ANNOTATION], tables[RUNTIME]
        ext_arr = self._ext
        rows = self._rows
        stream_of = self._stream_of
        new_row = self._new_row
        att_gpu, att_runtime, att_pending = self._att.gpu, self._att.runtime, self._att.pending
        start, end = self.start, self.end
        if start is None:
            start, end = float("inf"), float("-inf")
        ext_n = len(ext_arr)
        eps, max_open = _EPS, _MAX_OPEN
        # Kineto writes a thread's ops in runs: its stack and last start are kept in locals
        last_pid = last_tid = last_th = st = ix = None
        memory: list[Any] = []  # this batch's memory events, taken after its ops
        ix_rows: list[Any] = []
        ix_start = ix_end = ix_row = ix_parent = ix_rows.append  # the thread's index, in memory traces
        last_ts = 0.0
        # Rows' self times are kept as minus their children's time until finish() adds the totals.
        for e in events:  # "X" events only, and placeholders (cat None) for the other phases
            cat = e.cat
            if cat is None:
                continue
            if cat == OP or cat == ANNOTATION:
                ts = e.ts
                dur = e.dur
                te = ts + dur
                name = e.name
                if cat == OP:
                    row = t_op.get(name)
                    if row is None:
                        row = new_row(t_op, name)
                else:
                    row = t_ann.get(name)
                    if row is None:
                        row = new_row(t_ann, name)
                    self._annotation(name, ts, dur)
                    self._inside_op(e.pid, e.tid, ts, dur)
                row[1] += 1
                row[2] += dur
                pid, tid = e.pid, e.tid
                tse = ts + eps
                if tid == last_tid and pid == last_pid and st is not None:
                    if tse < last_ts:
                        self.out_of_order += 1
                else:
                    if st is not None:
                        last_th[0] = last_ts
                    key = (pid, tid)
                    th = stacks.get(key)  # [start of the last op seen, open ops as (end, row)]
                    if th is None:
                        th = self._new_thread(key, ts)
                    elif tse < th[0]:
                        self.out_of_order += 1
                    last_pid, last_tid, last_th, st, ix = pid, tid, th, th[1], th[2]
                    if ix is not None:
                        ix_rows = ix.rows
                        ix_start, ix_end, ix_row, ix_parent = ix.starts.append, ix.ends.append, ix_rows.append, ix.parents.append
                last_ts = ts
                while st:
                    top = st[-1]
                    if top[0] > tse:
                        top[1][3] -= dur  # a child's time is not its parent's self time
                        break
                    st.pop()
                if ix is None:
                    entry: tuple[Any, ...] = (te, row)
                else:  # a memory trace: (end, row, position in the thread's index)
                    entry = (te, row, len(ix_rows))
                    ix_start(ts)
                    ix_end(te)
                    ix_row(row)
                    ix_parent(st[-1][2] if st else -1)
                if len(st) < max_open:
                    st.append(entry)
                else:  # deeper than any real call stack: not a parent
                    self._limit(f"more than {_MAX_OPEN} open ops on one thread: deeper ones are nobody's parent")
                a = e.args
                if a is not None:
                    x = a.external_id
                    if x:
                        if 0 < x < ext_n:
                            ext_arr[x] = row[5]
                        else:
                            self._remember_slow(x, row[5])
                            ext_n = len(ext_arr)
            elif cat == "python_function":
                continue
            elif cat == KERNEL or cat == MEMCPY or cat == MEMSET:
                ts = e.ts
                dur = e.dur
                te = ts + dur
                table = tables[cat]
                name = e.name
                row = table.get(name)
                if row is None:
                    row = self._new_gpu_row(table, name)
                row[1] += 1
                row[2] += dur
                a = e.args
                corr = None
                if a is not None:
                    corr = a.correlation
                    x = a.external_id
                    if x is not None and x > 0:
                        pos = ext_arr[x] if x < ext_n else self._ext_sparse.get(x, -1)
                        if pos >= 0:
                            rows[pos][4] += dur
                    dev = a.device
                    if dev is None:
                        dev = e.pid if isinstance(e.pid, int) else -1
                    stream = a.stream
                    if stream is None:
                        stream = e.tid if isinstance(e.tid, int) else -1
                else:
                    dev = e.pid if isinstance(e.pid, int) else -1
                    stream = e.tid if isinstance(e.tid, int) else -1
                sk = (dev, stream)
                s = stream_of.get(sk)
                if s is None:
                    sk = self._device_slot(dev, stream)
                    dev = sk[0]
                    s = stream_of.get(sk)
                    if s is None:
                        s = stream_of[sk] = [0, 0.0]
                s[0] += 1
                s[1] += dur
                att_gpu(sk, ts, te, dur, name, cat, corr)
            elif cat in _RUNTIME_CATS:
                ts = e.ts
                dur = e.dur
                te = ts + dur
                name = e.name
                row = t_rt.get(name)
                if row is None:
                    row = new_row(t_rt, name)
                row[1] += 1
                row[2] += dur
                a = e.args
                if a is not None:
                    corr = a.correlation
                    if corr in att_pending or name in CAPTURE_CALLS or name in LAUNCH_CALLS:
                        att_runtime(name, ts, dur, corr)
                    parent = self._launcher(a.external_id)
                    if parent is not None:
                        parent[3] -= dur  # the API call ran inside that op on its thread
                        if self._ov_ends and e.tid == e.pid:
                            self._place_overhead(ts, parent)
            elif cat == GPU_ANNOTATION:
                # torch's key_averages charges a record_function its GPU-side span as self device
                # time (a row of its own, device type CUDA): the same here, on the annotation row.
                name = e.name
                row = t_ann.get(name)
                if row is None:
                    row = new_row(t_ann, name)
                row[4] += e.dur
                continue
            elif cat == "overhead":
                self._add_overhead(e.ts, e.ts + e.dur, e.dur)
                continue
            elif cat == INSTANT:
                if e.ph == "i" and (e.name == MEMORY_EVENT or e.name == OOM_EVENT):  # not an "X" of that category
                    memory.append(e)
                continue
            elif cat == PROFILER_SPAN:  # when the profiler recorded, not work (sidecar/analysis/starts.py)
                p = self.profiling
                self.profiling = (e.ts, e.ts + e.dur) if p is None else (min(p[0], e.ts), max(p[1], e.ts + e.dur))
                continue
            else:
                continue  # flows and the rest: not part of the window
            if ts < start:
                start = ts
            if te > end:
                end = te
        if st is not None:
            last_th[0] = last_ts
        if start != float("inf"):
            self.start, self.end = start, end
        self.events += len(events)
        if memory:
            self._mem.events(memory, self._ops_index)
        if self._index_ops and sum(len(ix.rows) for ix in self._ops_index.values()) > MAX_INDEXED_OPS:
            self._limit(f"more than {MAX_INDEXED_OPS:,} ops indexed for the memory events: later ops are not indexed "
                        "(their allocations count, charged to an enclosing op indexed before, or to none)")
            self._index_ops = False
            for th in stacks.values():  # the ops indexed so far still charge the events that fall in them
                th[2] = None

    def _inside_op(self, pid: Any, tid: Any, ts: float, dur: float) -> None:
        """An annotation opened inside an op (c10d wraps each collective so: the op
        ``record_param_comms``, then ``nccl:all_reduce``) is not one of the op's children, as in
        torch's key_averages: the op's self time keeps the annotation's span (the API calls in it,
        which Kineto gives the op's External id, come off the op as they do elsewhere). Before, they
        came off twice: -12 µs of self CPU where torch counts 582. The stack walk that follows
        takes ``dur`` off the op; given back here first. Annotations are few: this runs for them alone."""
        th = self._stacks.get((pid, tid))
        if th is None:
            return
        parent = next((ent for ent in reversed(th[1]) if ent[0] > ts + _EPS), None)
        if parent is not None and self.tables[OP].get(parent[1][ROW_NAME]) is parent[1]:
            parent[1][ROW_SELF] += dur

    def _annotation(self, name: str, ts: float, dur: float) -> None:
        if _STEP.match(name):
            self._att.step(ts)
            self._step_starts.append(ts)
            self.steps += 1
            self.step_total += dur
            if len(self.step_names) < 8:
                self.step_names.append(name)
            return
        kind = engine_step_kind(name) if name.startswith(("execute_", "diffusion_forward")) else None
        if kind is not None:
            self._att.step(ts)
            self._step_starts.append(ts)
            self.engine_steps += 1
            self.engine_step_total += dur
            k = self.step_kinds.setdefault(kind, [0, 0.0])
            k[0] += 1
            k[1] += dur

    def _epochs_of(self, key: SpanKey) -> None:
        """This trace's first and last event and its profiler span, on the hosts' clock, as ``key``'s."""
        if self.epoch_offset_us is None or self.start is None or self.end is None:
            return
        self.epochs[key] = (self.epoch_offset_us + self.start, self.epoch_offset_us + self.end)
        if self.profiling is not None:
            self.profiling_epochs[key] = (self.epoch_offset_us + self.profiling[0], self.epoch_offset_us + self.profiling[1])

    def finish(self, rank: int | None = None, *, stage_id: int | None = None, replica: int | None = None) -> None:
        """End of one trace: settle device unions, key devices by (stage, replica, rank), drop
        pass state."""
        self.rank, self.stage_id, self.replica = rank, stage_id, replica
        for table in (self.tables[OP], self.tables[ANNOTATION], self.tables[RUNTIME]):
            for row in table.values():  # self time: the total less the children's (kept negative)
                row[ROW_SELF] += row[ROW_TOTAL]
        for ov in self._ov:
            if ov[4] is not None:
                ov[4][3] -= ov[2]
        span = (self.end - self.start) if self.start is not None and self.end is not None else 0.0
        if self.epoch_offset_us is not None and self.end is not None:
            self.end_epoch_us = self.epoch_offset_us + self.end
        if self._stream_of and self.tables[OP] and not any(row[4] for row in self.tables[OP].values()):
            # Kineto of PyTorch 1.x wrote a GPU event's correlation id as its External id (HTA's
            # V100 test trace): then no kernel finds its op, and 0 would read as "launched nothing"
            self._limit("no GPU event names a CPU op of this trace as its launcher (its External id is not an op's: "
                        "older Kineto wrote the correlation id there): self device time per op is not known here "
                        "and reads 0; the per-device GPU figures do not depend on it")
        attributed = self._att.finish(self.tables)
        for what in self._att.limits:
            self._limit(what)
        for dev, busy in self._att.busy.items():
            self.devices[(stage_id, replica, rank, dev)] = [busy, span]
        for dev, a in attributed.items():
            self.attribution[(stage_id, replica, rank, dev)] = a
            self._epochs_of((stage_id, replica, rank, dev))
        if not attributed:
            # No GPU: a CPU trace (plain vLLM or vLLM-Omni on CPU) still says when its host started
            # recording and worked, so its stage's start skew and the pipeline's hand-overs are known
            self._epochs_of((stage_id, replica, rank, None))
        self._att = TraceAttribution(steady=self._att.steady)
        for (dev, stream), v in self._stream_of.items():
            self.streams[(stage_id, replica, rank, dev, stream)] = v
        self._mem.finish()
        for m in device_memory(self._mem, stage_id=stage_id, replica=replica, rank=rank, window_start=self.start,
                               steps=self.engine_steps or self.steps, step_starts=sorted(self._step_starts),
                               capacities=self.capacities):
            self.memory[(stage_id, replica, rank, m.device_type, m.device)] = m
        for k, v in self._mem.ops.items():
            self.memory_ops[k] = v
        self.limits += [w for w in self._mem.limits if w not in self.limits]
        self._mem, self._ops_index, self._step_starts = MemoryTracker(), {}, []
        self._stacks, self._stream_of = {}, {}
        self._ext, self._ext_sparse, self._rows = array("i"), {}, []
        self._ov, self._ov_ends = [], []

    # --- many traces -------------------------------------------------------------------------

    def merge(self, other: Aggregate) -> None:
        for cat, table in other.tables.items():
            mine = self.tables[cat]
            for name, row in table.items():
                m = mine.get(name)
                if m is None and not self._room_for(name):
                    m = mine.get(OTHER_NAMES)
                    if m is None:
                        m = mine[OTHER_NAMES] = [OTHER_NAMES, 0, 0.0, 0.0, 0.0, -1]
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
            m = self.devices.setdefault(k, [0.0, 0.0])
            m[0] += v[0]
            m[1] += v[1]
        for k, a in other.attribution.items():
            mine_a = self.attribution.get(k)
            if mine_a is None:
                self.attribution[k] = a
            else:
                mine_a.merge(a)
        _widen(self.epochs, other.epochs)
        _widen(self.profiling_epochs, other.profiling_epochs)
        if other.end_epoch_us is not None:
            self.end_epoch_us = max(self.end_epoch_us or other.end_epoch_us, other.end_epoch_us)
        for k, v in other.step_kinds.items():
            m = self.step_kinds.setdefault(k, [0, 0.0])
            m[0] += v[0]
            m[1] += v[1]
        if other.start is not None:
            self.start = other.start if self.start is None else min(self.start, other.start)
            self.end = other.end if self.end is None else max(self.end, other.end)
        self.steps += other.steps
        self.step_total += other.step_total
        self.step_names = (self.step_names + other.step_names)[:8]
        self.engine_steps += other.engine_steps
        self.engine_step_total += other.engine_step_total
        self.events += other.events
        self.bytes_raw += other.bytes_raw
        self.out_of_order += other.out_of_order
        self.overhead_us += other.overhead_us
        self.truncated = self.truncated or other.truncated
        self.errors += other.errors
        self.files += other.files
        self.limits += [w for w in other.limits if w not in self.limits]
        for k, m in other.memory.items():
            mine_m = self.memory.get(k)
            self.memory[k] = m if mine_m is None else merge_device(mine_m, m)
        for k, v in other.memory_ops.items():
            r = self.memory_ops.setdefault(k, [0, 0, 0, 0])
            for i in range(4):
                r[i] += v[i]


__all__ = ["ROW_COUNT", "ROW_NAME", "ROW_POS", "ROW_SELF", "ROW_SELF_DEV", "ROW_TOTAL", "Aggregate", "engine_step_kind"]
