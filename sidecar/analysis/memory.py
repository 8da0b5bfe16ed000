"""What holds memory, per device, in the summary's one pass: torch's memory events, streamed.

With ``profile_memory`` torch writes an instant event ``[memory]`` per allocation and free (args
``Device Type``, ``Device Id``, ``Addr``, ``Bytes`` (negative: a free), ``Total Allocated``,
``Total Reserved``) and ``[OutOfMemory]`` per failed allocation. Kineto writes a thread's events
as one block, after its CPU ops, so in the pass each is charged to the innermost op of its thread
through a per-thread index of the ops (start, end, parent), built only for traces whose header says
``profile_memory`` and capped at ``MAX_INDEXED_OPS``. The threads' blocks follow one another in
the file, not in time (on CUDA the backward pass allocates on the autograd thread, and frees what
the main thread allocated): so each event is also buffered (48 bytes, at most ``MAX_REPLAYED``)
and what depends on time order (what is live, the peak, what was live at it, the chart) is
replayed in time order at the trace's end. State kept: the index, the buffers, one entry per live
allocation in the replay, per op name its live bytes, a copy of those at the peak, and a chart
series of at most ``MAX_POINTS``. ``MemoryTracker`` is fed by ``summary.Aggregate``;
``device_memory`` turns it into ``DeviceMemory``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from typing import Any

from sidecar.analysis.models import DeviceMemory, LiveOp, MemoryOpStat

MEMORY_EVENT, OOM_EVENT = "[memory]", "[OutOfMemory]"
INSTANT = "cpu_instant_event"
# torch's c10::DeviceType numbers (ROCm reports CUDA; Ascend NPUs are PrivateUse1)
DEVICE_TYPES = {0: "cpu", 1: "cuda", 2: "mkldnn", 5: "ideep", 6: "hip", 9: "xla", 12: "xpu", 13: "mps",
                15: "hpu", 19: "mtia", 20: "privateuseone"}
NO_OP = "(outside any recorded op)"
MAX_INDEXED_OPS = 2_000_000  # ops indexed per trace for attribution (~24 bytes each)
MAX_DEVICES = 64
MAX_LIVE = 1 << 20  # live allocations tracked per device; past it, new ones are counted, not kept
MAX_REPLAYED = 2_000_000  # memory events buffered per trace for the time-ordered replay (~48 bytes each)
MAX_POINTS = 240  # chart points per device (the largest allocated of each time bucket)
MAX_STACK = 8  # enclosing ops kept for a live op's stack
TOP_LIVE = 10
_UNSET = object()
_NONE = -(1 << 63)  # a figure (or address) the event did not carry, in the buffers
_NEVER, _ALWAYS = float("-inf"), float("inf")
_NEAR = 36  # ops searched first when a thread's next memory event is past several op starts
_SNAPSHOTS_EXACT = 1000  # peak copies taken at any new peak; after that, only at a 0.1 % higher one


def format_bytes(n: float) -> str:
    """``61.2 GiB``: binary units, one decimal (torch's ``_memory_viz._format_size``, with a space)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def device_type_name(n: int | None) -> str:
    return "unknown" if n is None else DEVICE_TYPES.get(n, f"type{n}")


class ThreadOps:
    """The ops of one thread in start order: where each starts and ends, its stat row and the
    op enclosing it (-1: none). Kineto writes a thread's ops sorted by start."""

    __slots__ = ("starts", "ends", "rows", "parents", "at")

    def __init__(self) -> None:
        self.starts = array("d")
        self.ends = array("d")
        self.rows: list[list[Any]] = []
        self.parents = array("i")
        self.at = (-1, float("-inf"))  # where the last lookup ended: (op index, the time looked up)

    def stack(self, i: int) -> list[str]:
        """Names of op ``i`` and the ops enclosing it, outermost first (the innermost ``MAX_STACK``)."""
        out: list[str] = []
        while i >= 0 and len(out) < MAX_STACK:
            out.append(self.rows[i][0])
            i = self.parents[i]
        return out[::-1]


def _buffers() -> tuple[array, array, array, array, array, list[list[int]]]:
    """A device's events as the pass saw them, for ``_replay``: ts, bytes, address, Total Allocated,
    Total Reserved (``_NONE`` where absent), and the record of the op charged."""
    return array("d"), array("q"), array("q"), array("q"), array("q"), []


class _Device:
    """One device's state: per-op counts and the buffered events in the pass, the replay's
    figures after ``MemoryTracker.finish`` (see the module docstring)."""

    __slots__ = ("kind", "ops", "buffers", "limit", "start", "cur", "reserved", "peak", "peak_ts",
                 "peak_reserved_at", "peak_reserved", "alloc_peak", "drift", "stacks", "at_peak", "copies", "copied",
                 "ooms", "points", "t0", "width", "edge", "first_ts")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        # op name -> [allocs, bytes allocated, frees, bytes freed, bytes live now, blocks live now]
        self.ops: dict[str, list[int]] = {}
        self.buffers = _buffers()
        self.limit: str | None = None  # a cap the replay hit
        self.start: int | None = None  # allocated before the first event
        self.cur = 0
        self.reserved: int | None = None
        self.peak = 0
        self.peak_ts: float | None = None
        self.peak_reserved_at: int | None = None
        self.peak_reserved = -1  # the largest Total Reserved seen (-1: none)
        self.alloc_peak = -1  # the largest Total Allocated seen (-1: none)
        self.drift = 0
        self.stacks: dict[str, list[str]] = {}  # op name -> the stack of its first allocation
        self.at_peak: dict[str, tuple[int, int]] = {}
        self.copies = 0
        self.copied = 0  # the peak the last copy was taken at
        self.ooms = 0
        self.points: list[list[Any]] = []  # [bucket, ts, allocated, reserved]
        self.t0 = 0.0
        self.width = 1.0  # µs per chart bucket, doubled whenever the points fill up
        self.edge = float("-inf")  # where the next bucket starts (µs)
        self.first_ts: float | None = None

    def copy_peak(self, peak: int) -> None:
        self.at_peak = {k: (r[4], r[5]) for k, r in self.ops.items() if r[5]}
        self.copies += 1
        self.copied = peak

    def point(self, ts: float, cur: int, reserved: int | None) -> list[Any]:
        """A new chart bucket at ``ts``, after the last one (``MAX_POINTS`` to ``2 * MAX_POINTS`` of
        them over the window, each the highest allocated of its time); the last point."""
        pts = self.points
        b = int((ts - self.t0) / self.width)
        pts.append([b, ts, cur, reserved])
        if len(pts) > 2 * MAX_POINTS:
            self.width *= 2
            merged: list[list[Any]] = []
            for p in pts:
                p[0] //= 2
                if merged and merged[-1][0] == p[0]:
                    m = merged[-1]
                    if p[2] > m[2]:
                        m[1], m[2] = p[1], p[2]
                    if p[3] is not None and (m[3] is None or p[3] > m[3]):
                        m[3] = p[3]
                else:
                    merged.append(p)
            self.points = pts = merged
        self.edge = self.t0 + (pts[-1][0] + 1) * self.width
        return pts[-1]


class MemoryTracker:
    """The memory events of one trace (``events``), and the per-op table (``ops``, after ``finish``)."""

    def __init__(self) -> None:
        self.devices: dict[tuple[int, int], _Device] = {}
        self.ops: dict[tuple[str, str], list[int]] = {}  # (name, device type) -> [allocs, bytes, frees, bytes]
        self.limits: list[str] = []
        self._room = MAX_REPLAYED  # events left to buffer (-1: the cap was hit and said)

    def _limit(self, what: str) -> None:
        if what not in self.limits:
            self.limits.append(what)

    def _device(self, dtype: Any, did: Any) -> _Device | None:
        key = (dtype if dtype is not None else -1, did if did is not None else -1)
        dev = self.devices.get(key)
        if dev is None:
            if len(self.devices) >= MAX_DEVICES:
                self._limit(f"memory events of more than {MAX_DEVICES} devices: the rest left out")
                return None
            dev = self.devices[key] = _Device(device_type_name(dtype))
        return dev

    def events(self, batch: list[Any], index: dict[tuple[Any, Any], ThreadOps]) -> None:
        """``[memory]`` / ``[OutOfMemory]`` events in file order; ``index`` holds each thread's ops
        (by (pid, tid)) when the trace is indexed. Each event is charged to the innermost op of its
        thread here and counted on that op; what depends on the order across threads (what is live,
        the peak, the chart) is replayed by ``finish`` in time order: Kineto writes each thread's
        events as one block, and on CUDA the backward pass runs on a thread of its own, so the file
        order is not the time order (a free on the autograd thread comes before its allocation on
        the main thread's). One loop; the last event's device, its thread's index and the op its
        last event was charged to live in locals (a run of events is one device's, one thread's,
        mostly one op's)."""
        dtype: Any = _UNSET
        did: Any = _UNSET
        pid: Any = _UNSET
        tid: Any = _UNSET
        ix = dev = None
        pos, seen = -1, _NEVER
        starts: Any = ()
        ends: Any = ()
        parents: Any = ()
        rows: Any = ()
        ops: dict[str, list[int]] = {}
        b_ts, b_nb, b_addr, b_tot, b_res, b_rec = _buffers()  # the device's, from its first event on (file order)
        room = self._room  # events this trace may still buffer
        # The op the last event was charged to (``i``, its record ``rec``) is every later event's of
        # the same thread and device while ts lies in [seen, nxt) and ts <= iend: no op starts
        # before nxt and that op (none: iend is +inf) has not ended. ``pos``: the last op started
        # at or before ``seen``; ``n``: the thread's ops.
        rec: list[int] = []
        i = n = 0
        nxt = iend = _NEVER
        for e in batch:
            a = e.args
            if a is None:
                continue
            if a.device_type != dtype or a.device_id != did:
                dtype, did = a.device_type, a.device_id
                dev = self._device(dtype, did)
                if dev is None:
                    continue
                ops = dev.ops
                b_ts, b_nb, b_addr, b_tot, b_res, b_rec = dev.buffers
                nxt = _NEVER  # the charged op's record is the last device's
            elif dev is None:
                continue
            if e.name == OOM_EVENT:
                dev.ooms += 1
                continue
            nbytes = a.nbytes
            if not nbytes:
                continue
            ts = e.ts
            if e.tid != tid or e.pid != pid:
                if ix is not None:
                    ix.at = (pos, seen)
                pid, tid = e.pid, e.tid
                ix = index.get((pid, tid))
                if ix is not None:
                    starts, ends, parents, rows = ix.starts, ix.ends, ix.parents, ix.rows
                    pos, seen = ix.at
                    n = len(starts)
                nxt = _NEVER
            if not (seen <= ts < nxt and ts <= iend):
                # The innermost op open at ts: the last started before it, or what encloses that.
                # A thread's events come in time order: from the last lookup, an op that ended is
                # left for the ops enclosing it; ops started since are passed by a bisection over
                # the next few (over the rest past them); back in time, over all of them.
                if ix is None:
                    i, seen, nxt, iend = -1, _NEVER, _ALWAYS, _ALWAYS
                else:
                    if ts < seen or ts >= nxt:
                        if ts < seen:
                            pos = bisect_right(starts, ts) - 1
                        else:
                            hi = pos + _NEAR if pos + _NEAR < n else n
                            pos = bisect_right(starts, ts, pos + 1, hi) - 1
                            if pos == hi - 1 and hi < n:
                                pos = bisect_right(starts, ts, hi) - 1
                        i = pos
                        nxt = starts[pos + 1] if pos + 1 < n else _ALWAYS
                    seen = ts
                    while i >= 0:
                        iend = ends[i]
                        if iend >= ts:
                            break
                        i = parents[i]
                    else:
                        iend = _ALWAYS
                name = rows[i][0] if i >= 0 else NO_OP
                rec = ops.get(name)  # type: ignore[assignment]
                if rec is None:
                    rec = ops[name] = [0, 0, 0, 0, 0, 0]
                    dev.stacks[name] = ix.stack(i) if i >= 0 else []  # type: ignore[union-attr]
            if nbytes > 0:
                rec[0] += 1
                rec[1] += nbytes
            else:
                rec[2] += 1
                rec[3] -= nbytes
            if room <= 0:
                if room == 0:
                    self._limit(f"more than {MAX_REPLAYED:,} memory events in one trace: later ones are counted per op, "
                                "but the peak, what was live and the chart cover the events before them")
                    room = -1
                continue
            room -= 1
            b_ts.append(ts)
            b_nb.append(nbytes)
            addr = a.addr
            b_addr.append(addr if addr is not None else _NONE)
            total = a.total_allocated
            b_tot.append(total if total is not None else _NONE)
            r = a.total_reserved
            b_res.append(r if r is not None else _NONE)
            b_rec.append(rec)
        self._room = room
        if ix is not None:
            ix.at = (pos, seen)

    def finish(self) -> None:
        for dev in self.devices.values():
            _replay(dev)
            if dev.limit:
                self._limit(dev.limit)
            for name, rec in dev.ops.items():
                mine = self.ops.setdefault((name, dev.kind), [0, 0, 0, 0])
                for i in range(4):
                    mine[i] += rec[i]


def _replay(dev: _Device) -> None:
    """A device's buffered events in time order (stable: file order among equal times): what was
    allocated before the first, what is live by address and by op, the peak and what was live at
    it, the largest ``Total Allocated`` / ``Total Reserved`` torch wrote, and the chart."""
    b_ts, b_nb, b_addr, b_tot, b_res, b_rec = dev.buffers
    dev.buffers = _buffers()
    if not b_ts:
        return
    # the threads' runs, merged (timsort finds the runs: linear where the file is in time order)
    order = sorted(range(len(b_ts)), key=b_ts.tolist().__getitem__)
    first = order[0]  # the peak so far: what was allocated before the window
    total0, r0 = b_tot[first], b_res[first]
    dev.start = max(0, total0 - b_nb[first]) if total0 != _NONE else 0
    dev.peak_ts = dev.first_ts = dev.t0 = b_ts[first]
    dev.peak_reserved_at = r0 if r0 != _NONE else None
    allocs: dict[int, tuple[int, list[int]]] = {}
    cur = peak = dev.start
    drift = 0
    alloc_peak = peak_reserved = -1
    reserved: int | None = None
    pending = True
    edge = _NEVER
    last: list[Any] = []
    for k in order:
        ts = b_ts[k]
        nbytes = b_nb[k]
        total = b_tot[k]  # _NONE (below every figure) where the event did not carry it
        r = b_res[k]
        cur += nbytes
        if total > alloc_peak:
            alloc_peak = total
        if r != _NONE:
            reserved = r
            if r > peak_reserved:
                peak_reserved = r
        if nbytes > 0:
            addr = b_addr[k]
            if addr != _NONE:  # no address: counted, not kept live
                old = allocs.get(addr)
                if old is not None:  # allocated again without a free in between: the old one is gone
                    old[1][4] -= old[0]
                    old[1][5] -= 1
                if old is not None or len(allocs) < MAX_LIVE:
                    rec = b_rec[k]
                    allocs[addr] = (nbytes, rec)
                    rec[4] += nbytes
                    rec[5] += 1
                else:
                    dev.limit = f"more than {MAX_LIVE:,} live allocations on one device: later ones not attributed"
            if cur > peak:
                peak = cur
                dev.peak_ts, dev.peak_reserved_at = ts, reserved
                if total != _NONE and abs(cur - total) > drift:  # checked where it matters most
                    drift = abs(cur - total)
                if dev.copies < _SNAPSHOTS_EXACT or cur > dev.copied * 1.001:
                    pending = True
        else:
            if pending:  # the live set is still the peak's: nothing was freed since
                dev.copy_peak(peak)
                pending = False
            old = allocs.pop(b_addr[k], None)  # _NONE is never a key
            if old is not None:
                old[1][4] -= old[0]
                old[1][5] -= 1
        if ts >= edge:
            last = dev.point(ts, cur, reserved)
            edge = dev.edge
        else:  # the same chart bucket: keep its highest
            if cur > last[2]:
                last[1], last[2] = ts, cur
            if r != _NONE and (last[3] is None or r > last[3]):
                last[3] = r
    dev.cur, dev.peak, dev.alloc_peak, dev.peak_reserved, dev.drift, dev.reserved = (
        cur, peak, alloc_peak, peak_reserved, drift, reserved)
    if pending:
        dev.copy_peak(peak)


def device_memory(tracker: MemoryTracker, *, stage_id: int | None, replica: int | None, rank: int | None,
                  window_start: float | None, steps: int, step_starts: list[float],
                  capacities: dict[int, int]) -> list[DeviceMemory]:
    """The ``DeviceMemory`` of each device a finished tracker saw."""
    out = []
    for (dtype, did), dev in sorted(tracker.devices.items()):
        rows = dev.ops.values()
        allocs, alloc_bytes = sum(r[0] for r in rows), sum(r[1] for r in rows)
        frees, freed_bytes = sum(r[2] for r in rows), sum(r[3] for r in rows)
        if allocs + frees == 0 and dev.ooms == 0:
            continue
        live = sorted(dev.at_peak.items(), key=lambda kv: -kv[1][0])
        reserved = dev.peak_reserved_at if dtype != 0 or dev.peak_reserved_at else None  # the CPU allocator reserves nothing
        free = reserved - dev.peak if reserved is not None else None
        base = window_start if window_start is not None else dev.first_ts
        out.append(DeviceMemory(
            stage_id=stage_id, replica=replica, rank=rank, device_type=dev.kind, device=did,
            capacity_bytes=capacities.get(did) if dtype == 1 else None,
            events=allocs + frees, allocs=allocs, frees=frees, alloc_bytes=alloc_bytes, freed_bytes=freed_bytes,
            steps=steps, alloc_bytes_per_step=alloc_bytes / steps if steps else None,
            freed_bytes_per_step=freed_bytes / steps if steps else None,
            start_allocated_bytes=dev.start or 0, end_allocated_bytes=dev.cur, peak_allocated_bytes=dev.peak,
            peak_us=dev.peak_ts,
            peak_offset_us=dev.peak_ts - base if dev.peak_ts is not None and base is not None else None,
            peak_step=bisect_right(step_starts, dev.peak_ts) if dev.peak_ts is not None and step_starts else None,
            reserved_at_peak_bytes=reserved, free_at_peak_bytes=free,
            free_at_peak_share=free / reserved if free is not None and reserved else None,
            peak_reserved_bytes=dev.peak_reserved if dev.peak_reserved > 0 or (dtype != 0 and dev.peak_reserved >= 0) else None,
            allocator_peak_allocated_bytes=dev.alloc_peak if dev.alloc_peak >= 0 else None,
            accounting_drift_bytes=dev.drift,
            before_window_bytes_at_peak=max(0, dev.peak - sum(v[0] for _, v in live)),
            live_at_peak=[LiveOp(name=n, bytes=v[0], blocks=v[1], stack=dev.stacks.get(n, [])) for n, v in live[:TOP_LIVE]
                          if v[0] > 0],
            ooms=dev.ooms,
            series=[(p[1] - base if base is not None else 0.0, p[2], p[3] if p[3] is not None else 0) for p in dev.points],
        ))
    return out


def merge_device(a: DeviceMemory, b: DeviceMemory) -> DeviceMemory:
    """Two windows of one device (one stage process's traces from several session folders): the
    counts add up, the peak and what held it are the higher window's."""
    hi, lo = (a, b) if a.peak_allocated_bytes >= b.peak_allocated_bytes else (b, a)
    steps = a.steps + b.steps
    counts = {k: getattr(a, k) + getattr(b, k) for k in ("events", "allocs", "frees", "alloc_bytes", "freed_bytes", "ooms")}
    return hi.model_copy(update={
        **counts, "steps": steps,
        "alloc_bytes_per_step": counts["alloc_bytes"] / steps if steps else None,
        "freed_bytes_per_step": counts["freed_bytes"] / steps if steps else None,
        "accounting_drift_bytes": max(a.accounting_drift_bytes, b.accounting_drift_bytes),
        "peak_reserved_bytes": max((x for x in (a.peak_reserved_bytes, b.peak_reserved_bytes) if x is not None), default=None),
        "allocator_peak_allocated_bytes": max((x for x in (a.allocator_peak_allocated_bytes, b.allocator_peak_allocated_bytes)
                                               if x is not None), default=None),
    })


def op_stats(rows: dict[tuple[str, str], list[int]], top: int) -> list[MemoryOpStat]:
    """The ``top`` op names by bytes allocated."""
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
    return [MemoryOpStat(name=n, device_type=k, allocs=r[0], alloc_bytes=r[1], frees=r[2], freed_bytes=r[3],
                         self_bytes=r[1] - r[3]) for (n, k), r in ranked]


__all__ = ["MAX_INDEXED_OPS", "format_bytes", "MemoryTracker", "ThreadOps", "device_memory", "device_type_name", "merge_device", "op_stats"]
