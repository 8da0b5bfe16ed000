"""Why a GPU is slow, per device, in the summary's one pass: HTA's four analyses, streamed.

``TraceAttribution`` is fed by ``summary.Aggregate`` (GPU events, CUDA API calls, step
annotations) and settles into one ``DeviceAttribution`` per device, which merges and becomes the
device's ``temporal``, ``idle_breakdown``, ``kernel_categories``, ``overlap``, ``launch`` and
``steady`` fields. Definitions are HTA 0.5.0's (docs/summaries.md, "Why a stage is slow"), checked
against HTA's own figures on the committed traces; memory is bounded: a device's GPU events held in
arrays (``MAX_GPU_EVENTS`` at a time) and swept in time order, launch delays in a log-bucket sketch,
a handful of kernels awaiting their API call.
"""

from __future__ import annotations

import math
import re
from array import array
from typing import Any

from sidecar.analysis.models import (
    GpuStat,
    IdleBreakdown,
    KernelCategory,
    LaunchStats,
    LeftOut,
    Overlap,
    SteadyWindow,
    Temporal,
)

# HTA's kernel types (hta/utils/utils.py): communication = NCCL kernels, memory = memcpy/memset,
# computation = neither and no "Sync" in the name; the rest is "other".
_COMM = re.compile(r"^nccl.*Kernel")
_MEMORY = re.compile(r"^Memcpy|^Memset|^dma")
_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
COMPUTE, COMMUNICATION, MEMORY, OTHER = 0, 1, 2, 3
# Kernel categories by name, first match wins (attention before gemm: flash/fmha kernels are cutlass)
_CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("communication", re.compile(r"^nccl|cross_device_reduce|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all", re.I)),
    ("memory", _MEMORY),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|paged_|mha_|_mha", re.I)),
    ("gemm", re.compile(r"gemm|matmul|cutlass|cublas|wgmma|nvjet|xmma|_mma|splitk", re.I)),
    ("reduction", re.compile(r"reduce|softmax|norm|argmax|topk|sort|scan|cumsum|welford", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton_poi|fill|copy|index|gather|scatter|"
                               r"cat_|activation|gelu|silu|relu|add|mul|rotary|embedding", re.I)),
)
CATEGORY_NAMES = ("gemm", "attention", "communication", "elementwise", "reduction", "memory", "other")
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync"})
CAPTURE_BEGIN = frozenset({"cudaStreamBeginCapture", "cudaStreamBeginCaptureToGraph"})
CAPTURE_END = "cudaStreamEndCapture"
CAPTURE_CALLS = CAPTURE_BEGIN | {CAPTURE_END}
KERNEL_WAIT_US = 30.0  # HTA's consecutive_kernel_delay default (its trace clock is µs)
SHORT_KERNEL_US = 10.0
CPU_BOUND_SHORTER = 0.5  # share of launches whose kernel ran shorter than its launch call
CPU_BOUND_HOST_WAIT = 0.5  # share of idle time spent waiting on the host
# GPU events of one device held for the sweep in time order: 32 bytes each, and 68 more while it sorts
# them (about 10 s of a busy decode loop); past it each block is swept in turn
MAX_GPU_EVENTS = 1 << 18
_MAX_PENDING = 1 << 16  # GPU events waiting for their API call (it follows within a few events)
_MAX_EARLY = 1 << 16  # launch calls read before their GPU event (one in 34,470 on a 3.3 s H100 capture)
_MAX_CAPTURE_CALLS = 1 << 16
_TOP = 5
_NAN = math.nan
_log, _ceil = math.log, math.ceil


def kernel_category(name: str, cat: str) -> str:
    if cat != "kernel":
        return "memory"
    for label, rx in _CATEGORIES:
        if rx.search(name):
            return label
    return "other"


def kernel_kind(name: str, cat: str) -> int:
    """HTA's kernel type: COMPUTE, COMMUNICATION, MEMORY or OTHER."""
    if _COMM.match(name):
        return COMMUNICATION
    if cat != "kernel" or _MEMORY.match(name):
        return MEMORY
    return OTHER if _NOT_COMPUTE.match(name) else COMPUTE


class Sketch:
    """Quantiles of non-negative values in log buckets of 1 % relative width (DDSketch's idea):
    memory grows with the range of values, not their count; merges by adding counts."""

    __slots__ = ("buckets", "zeros", "n")
    _LOG = math.log(1.02)
    INV_LOG = 1.0 / _LOG
    MIN = 1e-3  # µs: below this a value is zero

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.zeros = 0
        self.n = 0

    def add(self, v: float) -> None:
        self.n += 1
        if v < self.MIN:
            self.zeros += 1
            return
        k = _ceil(_log(v) * self.INV_LOG)
        b = self.buckets
        b[k] = b.get(k, 0) + 1

    def merge(self, other: Sketch) -> None:
        self.n += other.n
        self.zeros += other.zeros
        for k, c in other.buckets.items():
            self.buckets[k] = self.buckets.get(k, 0) + c

    def quantile(self, q: float) -> float | None:
        """numpy's linear-interpolation percentile, to the buckets' 1 %."""
        if self.n == 0:
            return None
        pos = q * (self.n - 1)
        lo, hi = self._at(int(math.floor(pos))), self._at(int(math.ceil(pos)))
        return lo + (hi - lo) * (pos - math.floor(pos))

    def _at(self, rank: int) -> float:
        if rank < self.zeros:
            return 0.0
        seen = self.zeros
        for k in sorted(self.buckets):
            seen += self.buckets[k]
            if rank < seen:
                return 2.0 * math.exp(k * self._LOG) / 1.02 / (1.0 + 1.0 / 1.02)  # bucket's midpoint
        return 0.0


class DeviceAttribution:
    """Settled, summable figures of one device (one or more traces)."""

    def __init__(self) -> None:
        self.window_us = 0.0  # steady window: first to last GPU event, less what was left out
        self.start_us: float | None = None
        self.end_us: float | None = None
        self.busy = [0.0, 0.0, 0.0, 0.0, 0.0]  # compute, comm, compute∪comm, ∪memory, all
        self.idle = [0.0, 0.0, 0.0]  # host_wait, kernel_wait, other (per stream, summed)
        self.cats: dict[str, list[Any]] = {}  # category -> [count, total, top rows]
        self.gpu_us = 0.0
        self.sketch = Sketch()
        self.launches = 0
        self.shorter = 0  # launches whose kernel ran shorter than the API call
        self.kernels = 0
        self.short = 0  # kernels shorter than SHORT_KERNEL_US
        self.left_out: list[LeftOut] = []

    def merge(self, o: DeviceAttribution) -> None:
        self.window_us += o.window_us
        self.start_us = o.start_us if self.start_us is None else min(self.start_us, o.start_us or self.start_us)
        self.end_us = o.end_us if self.end_us is None else max(self.end_us, o.end_us or self.end_us)
        self.busy = [a + b for a, b in zip(self.busy, o.busy)]
        self.idle = [a + b for a, b in zip(self.idle, o.idle)]
        for c, (n, t, top) in o.cats.items():
            m = self.cats.setdefault(c, [0, 0.0, []])
            m[0] += n
            m[1] += t
            m[2] = sorted(m[2] + top, key=lambda r: -r[2])[:_TOP]
        self.gpu_us += o.gpu_us
        self.sketch.merge(o.sketch)
        self.launches += o.launches
        self.shorter += o.shorter
        self.kernels += o.kernels
        self.short += o.short
        self.left_out += o.left_out

    # --- the fields ---------------------------------------------------------------------------

    def fields(self) -> dict[str, Any]:
        w = self.window_us
        comp, comm, cc, ccm, busy = self.busy

        def of(x: float, whole: float) -> float:
            return x / whole if whole > 0 else 0.0

        idle_us = max(0.0, w - busy)
        parts = (comp, max(0.0, cc - comp), max(0.0, ccm - cc), max(0.0, busy - ccm))
        temporal = Temporal(
            window_us=w, compute_us=parts[0], communication_us=parts[1], memory_us=parts[2], other_us=parts[3],
            idle_us=idle_us, compute_share=of(parts[0], w), communication_share=of(parts[1], w),
            memory_share=of(parts[2], w), other_share=of(parts[3], w), idle_share=of(idle_us, w),
        )
        hw, kw, ot = self.idle
        gaps = hw + kw + ot
        idle = IdleBreakdown(
            idle_us=gaps, host_wait_us=hw, kernel_wait_us=kw, other_us=ot,
            host_wait_share=of(hw, gaps), kernel_wait_share=of(kw, gaps), other_share=of(ot, gaps),
        )
        cats = [
            KernelCategory(category=c, count=int(v[0]), total_us=v[1], share=of(v[1], self.gpu_us),
                           top=[GpuStat(name=r[0], count=r[1], total_us=r[2]) for r in v[2]])
            for c, v in sorted(self.cats.items(), key=lambda kv: -kv[1][1])
        ]
        overlapped = max(0.0, comm + comp - cc)
        overlap = Overlap(communication_us=comm, overlapped_us=overlapped, share=of(overlapped, comm) if comm > 0 else None)
        shorter_share = of(self.shorter, self.launches)
        cpu_bound = shorter_share >= CPU_BOUND_SHORTER and idle.host_wait_share >= CPU_BOUND_HOST_WAIT and temporal.idle_share >= 0.5
        launch = LaunchStats(
            launches=self.launches, delay_p50_us=self.sketch.quantile(0.5), delay_p95_us=self.sketch.quantile(0.95),
            kernels=self.kernels, short_share=of(self.short, self.kernels), gpu_shorter_than_launch_share=shorter_share,
            cpu_bound=cpu_bound,
            rule=(f"cpu_bound when ≥ {CPU_BOUND_SHORTER:.0%} of kernels ran shorter than their launch call, "
                  f"≥ {CPU_BOUND_HOST_WAIT:.0%} of idle time waited on the host and the GPU was idle ≥ 50 % of the window"),
        )
        steady = SteadyWindow(start_us=self.start_us, end_us=self.end_us, span_us=w, left_out=list(self.left_out))
        return dict(temporal=temporal, idle_breakdown=idle, kernel_categories=cats, overlap=overlap, launch=launch, steady=steady)


# A GPU event before the first step (the profiler-start transient): only the device's busy time
TRANSIENT = 4
# which unions an event of each kind joins: compute, comm, compute∪comm, ∪memory, all, and the
# device's busy time (all, the transient too)
_JOINS = {COMPUTE: (0, 2, 3, 4, 5), COMMUNICATION: (1, 2, 3, 4, 5), MEMORY: (3, 4, 5), OTHER: (4, 5), TRANSIENT: (5,)}


class _Dev:
    """Pass state of one device: its GPU events as the file gives them, in arrays (start, end, its
    API call's start, stream and kind), swept in time order by ``TraceAttribution.sweep`` into the
    six unions (compute, comm, compute∪comm, ∪memory, all, busy) and each stream's gaps.
    ``first``/``last`` bound the steady events (the transient is only busy)."""

    __slots__ = ("first", "last", "ts", "te", "rt", "code", "prev", "swept", "gen", "cs", "ce", "tot", "idle",
                 "sketch", "launches", "shorter", "kernels", "short")

    def __init__(self) -> None:
        self.first = math.inf
        self.last = -math.inf
        self.ts = array("d")
        self.te = array("d")
        self.rt = array("d")  # NaN until the API call is read (every comparison with NaN is false)
        self.code = array("q")  # stream index * 8 + kind
        self.prev: list[float | None] = []  # per stream (its index): the end of its last event swept
        self.swept = -math.inf  # the latest end swept so far (a sweep before the end: the cap was hit)
        self.gen = 0  # sweeps so far: a pending event's index is into this generation's arrays
        self.cs: list[float | None] = [None] * 6
        self.ce = [0.0] * 6
        self.tot = [0.0] * 6
        self.idle = [0.0, 0.0, 0.0]
        self.sketch = Sketch()
        self.launches = self.shorter = self.kernels = self.short = 0

    def unions(self) -> list[float]:
        return [t + (self.ce[i] - c if c is not None else 0.0) for i, (t, c) in enumerate(zip(self.tot, self.cs))]


class TraceAttribution:
    """Pass state of one trace. Kineto writes a trace's CPU ops and annotations before its GPU
    events, and each GPU event just before its CUDA API call: the first step is known when the
    GPU events arrive, and a GPU event waits only for its own API call (``pending``; the rare
    launch call read before its GPU event waits for that, in ``early``). It writes the
    GPU events as CUPTI hands over its buffers: each buffer in time order, the buffers not (a 3.3 s
    H100 capture holds three runs, each reaching back over much of the window), so a device's
    events are held and swept in time order at the end (``MAX_GPU_EVENTS`` at a time)."""

    def __init__(self, steady: bool = True) -> None:
        self.steady = steady
        self.step_start = math.inf  # first step annotation (ProfilerStep#N, engine step)
        self._cut = -math.inf  # GPU events before this are the profiler-start transient
        self.captures: list[list[float]] = []  # CUDA graph captures: [begin, end], paired by _pair
        self._capture_calls: list[tuple[float, int]] = []  # (when, 1: a begin, -1: an end), in the file's order
        self.devs: dict[int, _Dev] = {}
        self.streams: dict[tuple[int, int], tuple[_Dev, int]] = {}  # (device, stream) -> its device, its index * 8
        # correlation -> GPU events awaiting their API call: (device, index, the device's sweeps, ts, dur)
        self.pending: dict[int, list[tuple[_Dev, int, int, float, float]]] = {}
        # correlation -> a launch call read before its GPU event (CUPTI's buffer order): (ts, dur)
        self.early: dict[int, tuple[float, float]] = {}
        self._kinds: dict[str, int] = {}
        self.transient = [math.inf, -math.inf, 0]  # GPU events before the first step: first, last, count
        self.busy: dict[int, float] = {}  # per device, after finish(): the union of all its GPU events
        self.limits: list[str] = []

    def step(self, ts: float) -> None:
        if ts < self.step_start:
            self.step_start = ts
            if self.steady:
                self._cut = ts

    def gpu(self, sk: tuple[int, int], ts: float, te: float, dur: float, name: str, cat: str, corr: int | None) -> None:
        """One kernel / memcpy / memset on stream ``sk`` = (device, stream)."""
        st = self.streams.get(sk)
        if st is None:
            d = self.devs.get(sk[0])
            if d is None:
                d = self.devs[sk[0]] = _Dev()
            st = self.streams[sk] = (d, len(d.prev) * 8)
            d.prev.append(None)
        d, base = st
        if ts < self._cut:  # the profiler-start transient: the device's busy time only
            t = self.transient
            t[0], t[1], t[2] = min(t[0], ts), max(t[1], te), t[2] + 1
            k = TRANSIENT
        else:
            k = self._kinds.get(name)
            if k is None:
                k = self._kinds[name] = kernel_kind(name, cat)
            if cat == "kernel":
                d.kernels += 1
                if dur < SHORT_KERNEL_US:
                    d.short += 1
        i = len(d.ts)
        d.ts.append(ts)
        d.te.append(te)
        d.rt.append(_NAN)
        d.code.append(base + k)
        if corr:
            pending = self.pending
            if self.early and corr in self.early:  # its launch call came first
                rts, rdur = self.early.pop(corr)
                if k != TRANSIENT:
                    d.rt[i] = rts
                    self._launched(d, ts, dur, rts, rdur)
            elif k == TRANSIENT:  # its API call, when it comes, is not an early one
                if len(pending) < _MAX_PENDING:
                    pending.setdefault(corr, [])
            else:
                w = pending.get(corr)
                if w is not None:
                    w.append((d, i, d.gen, ts, dur))
                elif len(pending) < _MAX_PENDING:
                    pending[corr] = [(d, i, d.gen, ts, dur)]
                else:
                    self._limit(f"more than {_MAX_PENDING:,} GPU events awaiting their API call: later ones' launch "
                                "delays are not counted")
        if i + 1 >= MAX_GPU_EVENTS:
            self._pair()
            self.sweep(d)

    def sweep(self, d: _Dev) -> None:
        """A device's held events in time order (stable: file order among equal starts): each
        stream's gaps (HTA's idle categories: host wait when the next event's API call started after
        the gap began, kernel wait when the gap is under 30 µs, else other; a graph capture, paired
        by ``_pair`` before, inside a gap is not idle), then the unions."""
        if not d.ts:
            return
        ts, te, rt, code = d.ts.tolist(), d.te, d.rt, d.code
        if min(ts) < d.swept:
            self._limit(f"more than {MAX_GPU_EVENTS:,} GPU events on one device, and later ones start before earlier "
                        "ones ended: its busy and idle figures are approximate (each block swept in time order)")
        order = sorted(range(len(ts)), key=ts.__getitem__)  # the buffers' runs, merged
        cs, ce, tot, idle, prev = d.cs, d.ce, d.tot, d.idle, d.prev
        caps = self.captures
        first, last = d.first, d.last
        joins = _JOINS
        for j in order:
            s = ts[j]
            e = te[j]
            c = code[j]
            k = c & 7
            if k != TRANSIENT:
                if s < first:
                    first = s
                if e > last:
                    last = e
                si = c >> 3
                p = prev[si]
                if p is not None:
                    gap = s - p
                    if gap > 0:
                        g = 0 if rt[j] > p else 1 if gap < KERNEL_WAIT_US else 2
                        if caps:
                            for b, x in caps:
                                if b < s and x > p:
                                    gap -= min(x, s) - max(b, p)
                        if gap > 0:
                            idle[g] += gap
                prev[si] = e
            for i in joins[k]:
                cur = cs[i]
                if cur is None:
                    cs[i], ce[i] = s, e
                elif s <= ce[i]:
                    if e > ce[i]:
                        ce[i] = e
                else:
                    tot[i] += ce[i] - cur
                    cs[i], ce[i] = s, e
        d.first, d.last = first, last
        d.swept = max(d.swept, max(te))
        d.ts, d.te, d.rt, d.code = array("d"), array("d"), array("d"), array("q")
        d.gen += 1

    def _pair(self) -> None:
        """The graph captures, from their begin and end calls in time order: CUPTI's buffers can
        put a capture's end in the file before its begin. An end closes the latest open begin."""
        caps: list[list[float]] = []
        begun: list[float] = []
        for t, what in sorted(self._capture_calls):
            if what > 0:
                begun.append(t)
            elif begun:
                caps.append([begun.pop(), t])
        self.captures = sorted(caps)

    def _limit(self, what: str) -> None:
        if what not in self.limits:
            self.limits.append(what)

    def runtime(self, name: str, ts: float, dur: float, corr: int | None) -> None:
        if self.steady and (name in CAPTURE_BEGIN or name == CAPTURE_END):
            if len(self._capture_calls) < _MAX_CAPTURE_CALLS:
                self._capture_calls.append((ts, 1) if name in CAPTURE_BEGIN else (ts + dur, -1))
            else:
                self._limit(f"more than {_MAX_CAPTURE_CALLS:,} CUDA graph capture calls: later captures count as idle")
        waiting = self.pending.pop(corr, None) if corr else None
        if waiting is None:
            if corr and name in LAUNCH_CALLS:  # read before its GPU event: it waits for that
                if len(self.early) < _MAX_EARLY:
                    self.early[corr] = (ts, dur)
                else:
                    self._limit(f"more than {_MAX_EARLY:,} launch calls read before their GPU event (or without one): "
                                "later ones' launch delays are not counted")
            return
        launch = name in LAUNCH_CALLS
        for d, i, gen, gts, gdur in waiting:
            if d.gen == gen:  # else swept already (the cap): its gap was read without the API call
                d.rt[i] = ts
            if launch:
                self._launched(d, gts, gdur, ts, dur)

    @staticmethod
    def _launched(d: _Dev, gts: float, gdur: float, ts: float, dur: float) -> None:
        """A launch call (at ``ts``, ``dur`` long) and its GPU event (``gts``, ``gdur``): the
        launch delay into the device's sketch, and whether the kernel ran shorter than its launch."""
        delay = gts - ts - dur
        sk = d.sketch
        sk.n += 1
        if delay < Sketch.MIN:
            sk.zeros += 1
        else:
            k = _ceil(_log(delay) * Sketch.INV_LOG)
            b = sk.buckets
            b[k] = b.get(k, 0) + 1
        d.launches += 1
        if gdur < dur:
            d.shorter += 1

    def finish(self, tables: dict[str, dict[str, list[Any]]]) -> dict[int, DeviceAttribution]:
        """Settle every device (its busy time into ``busy``); ``tables`` (the trace's
        kernel/memcpy/memset rows) give each category's top kernels."""
        self._pair()  # for the sweeps' gaps and the left-out spans below
        for d in self.devs.values():
            self.sweep(d)
        self.pending, self.early = {}, {}
        # categories from the trace's own tables (one GPU per trace in practice; a trace with
        # several gives each of them the trace's split)
        cats: dict[str, list[Any]] = {}
        gpu_us = 0.0
        for cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            for row in tables.get(cat, {}).values():
                c = cats.setdefault(kernel_category(row[0], cat), [0, 0.0, []])
                c[0] += int(row[1])
                c[1] += row[2]
                c[2].append([row[0], int(row[1]), row[2]])
                gpu_us += row[2]
        for c in cats.values():
            c[2] = sorted(c[2], key=lambda r: -r[2])[:_TOP]
        out: dict[int, DeviceAttribution] = {}
        for dev, d in self.devs.items():
            *busy, self.busy[dev] = d.unions()
            if d.first == math.inf:  # only transient events: busy, nothing to attribute
                continue
            a = DeviceAttribution()
            a.busy = busy
            a.start_us, a.end_us = d.first, d.last
            captured = 0.0
            for b, e in self.captures:
                lo, hi = max(b, d.first), min(e, d.last)
                if hi > lo:
                    captured += hi - lo
                    a.left_out.append(LeftOut(what="cuda_graph_capture", start_us=b, end_us=e, us=hi - lo))
            if dev == min(self.devs) and self.transient[2]:
                t = self.transient
                a.left_out.insert(0, LeftOut(what="profiler_start", start_us=t[0], end_us=self.step_start,
                                             us=max(0.0, self.step_start - t[0]), gpu_events=int(t[2])))
            a.window_us = max(0.0, d.last - d.first - captured)
            a.idle = d.idle
            a.cats = {c: [v[0], v[1], list(v[2])] for c, v in cats.items()}
            a.gpu_us = gpu_us
            a.sketch = d.sketch
            a.launches, a.shorter, a.kernels, a.short = d.launches, d.shorter, d.kernels, d.short
            out[dev] = a
        return out


__all__ = ["CATEGORY_NAMES", "DeviceAttribution", "Sketch", "TraceAttribution", "kernel_category", "kernel_kind"]
