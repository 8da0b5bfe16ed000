"""One Perfetto-ready trace of a whole capture: every stage, replica and rank a named process.

``write_timeline(paths, out)`` streams each source trace once, slice by slice, into one output
(bounded memory: one slice of events at a time, plus small id maps). Per source: every event is
kept; its process becomes one process named ``stage 0 · replica 0 · rank 0 (llm)``, its
threads and GPU streams threads of that process (``GPU 0 · stream 7``); timestamps move onto one
clock, from each trace's own ``baseTimeNanoseconds`` (Kineto writes ``ts`` in µs relative to it);
flow ids are made unique per source, and flow events without a usable id or time are dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.analysis.capture import TraceSource, locate
from sidecar.analysis.reader import RawTraceReader, read_header, trace_base_ns
from sidecar.analysis.writer import TraceWriter, output_path
from sidecar.errors import TraceError

_FLOW_PHASES = frozenset({"s", "t", "f"})
_FLOW_ID_STRIDE = 1 << 40  # source k's flow ids move by k × this, so they never meet
_DROPPED_META = frozenset({"process_name", "process_labels", "process_sort_index"})
_MAX_THREADS = 65536  # (pid, tid) pairs mapped per source; more only in a hostile file


@dataclass
class TimelineProcess:
    pid: int
    name: str
    file: str
    stage_id: int | None
    replica: int | None
    rank: int | None
    kind: str | None
    offset_us: float  # added to every ts of this source
    events: int = 0
    kernels: int = 0


@dataclass
class TimelineReport:
    out: str
    base_time_ns: int | None
    processes: list[TimelineProcess] = field(default_factory=list)
    events: int = 0
    raw_bytes: int = 0
    flows_dropped: int = 0
    trimmed: int = 0  # events outside the window asked for, left out
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # a file given twice (merged once); events no profiler writes, left out


def _as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _rank(header: dict[str, Any], path: Path) -> int | None:
    dist = header.get("distributedInfo")
    rank = _as_int(dist.get("rank")) if isinstance(dist, dict) else None
    if rank is None and path.name.startswith("trace_rank"):
        digits = "".join(ch for ch in path.name[len("trace_rank"):].split(".")[0] if ch.isdigit())
        rank = int(digits) if digits else None
    return rank


def process_name(src: TraceSource, rank: int | None) -> str:
    """``stage 0 · replica 0 · rank 0 (llm)``."""
    kind = f" ({src.kind})" if src.kind else ""
    return f"{src.label} · rank {rank if rank is not None else 0}{kind}"


def _plain(v: Any) -> Any:
    """A pid or tid as a key: an object or array (no profiler writes one) as its text."""
    return v if v is None or isinstance(v, (str, int, float)) else str(v)[:200]


class _SourceRewriter:
    """Maps one source's (pid, tid) pairs to threads of one output process, shifts ts."""

    def __init__(self, proc: TimelineProcess, index: int, *, window_us: tuple[float, float] | None = None) -> None:
        self.proc = proc
        self.window_us = window_us
        self.trimmed = 0  # events outside the window, left out
        self.flow_shift = index * _FLOW_ID_STRIDE
        self.tids: dict[tuple[Any, Any], int] = {}
        self.labels: dict[Any, str] = {}  # source pid -> "CPU" / "GPU 0" (process_labels)
        self.named: set[int] = set()
        self.flows_dropped = 0

    def _tid(self, pid: Any, tid: Any, out: list[Any]) -> int:
        key = (pid, tid)
        t = self.tids.get(key)
        if t is None:
            if len(self.tids) >= _MAX_THREADS:  # a hostile file of unique ids: one shared thread
                return _MAX_THREADS + 1
            t = self.tids[key] = len(self.tids) + 1
        return t

    def _thread_label(self, pid: Any, tid: Any, name: str | None) -> str:
        label = self.labels.get(pid)
        if label is None:  # Kineto: GPU n is pid n; host processes have their OS pid
            if isinstance(pid, int) and not isinstance(pid, bool):
                label = f"GPU {pid}" if 0 <= pid < 64 else "CPU"
            else:
                label = str(pid) if pid not in (None, "") else ""
        base = name.strip() if name else (f"stream {tid}" if label.startswith("GPU") else f"thread {tid}")
        return f"{label} · {base}" if label else base

    def _outside(self, e: dict[str, Any], off: float) -> bool:
        """The event (moved by ``off``) does not overlap the window; one without a time is kept."""
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            return False
        dur = e.get("dur")
        start = ts + off
        end = start + (dur if isinstance(dur, (int, float)) and not isinstance(dur, bool) and dur > 0 else 0)
        lo, hi = self.window_us  # type: ignore[misc]
        return end < lo or start > hi

    def rewrite(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        newpid = self.proc.pid
        off = self.proc.offset_us
        for e in events:
            ph = e.get("ph")
            pid, tid = _plain(e.get("pid")), _plain(e.get("tid"))
            if ph == "M":
                name = e.get("name")
                if isinstance(name, str) and name in _DROPPED_META:
                    if name == "process_labels" and isinstance(e.get("args"), dict):
                        lab = e["args"].get("labels")
                        if isinstance(lab, str):
                            self.labels[pid] = lab
                    continue
                t = self._tid(pid, tid, out)
                args = e.get("args") if isinstance(e.get("args"), dict) else {}
                if name == "thread_name":
                    args = {"name": self._thread_label(pid, tid, args.get("name"))}
                    self.named.add(t)
                out.append({**e, "pid": newpid, "tid": t, "args": args, "ts": 0})
                continue
            if isinstance(ph, str) and ph in _FLOW_PHASES:
                fid = e.get("id")
                if not isinstance(e.get("ts"), (int, float)) or not (isinstance(fid, (int, str)) and not isinstance(fid, bool)):
                    self.flows_dropped += 1
                    continue
                e["id"] = fid + self.flow_shift if isinstance(fid, int) else f"{self.flow_shift}:{fid}"
            if self.window_us is not None and self._outside(e, off):
                self.trimmed += 1
                continue
            t = self._tid(pid, tid, out)
            if t not in self.named:
                self.named.add(t)
                out.append({"ph": "M", "name": "thread_name", "pid": newpid, "tid": t, "ts": 0,
                            "args": {"name": self._thread_label(pid, tid, None)}})
            e["pid"] = newpid
            e["tid"] = t
            ts = e.get("ts")
            if isinstance(ts, (int, float)) and not isinstance(ts, bool):
                e["ts"] = ts + off
            if e.get("cat") == "kernel":
                self.proc.kernels += 1
            out.append(e)
        self.proc.events += len(events)
        return out


def _tell_apart(procs: list[TimelineProcess]) -> None:
    """Processes of one name (the same stage, replica and rank from several captures, merged from a
    stage dir) get their session folder's name appended, so a timeline never shows two alike; where
    that folder is one they share (two bare files side by side), their file name, and where neither
    tells them apart, as much of their path as does."""
    names = Counter(p.name for p in procs)
    clash = [p for p in procs if names[p.name] > 1]
    base = {id(p): p.name for p in clash}

    def tags(p: TimelineProcess) -> list[str]:
        parts = Path(p.file).parts
        return [Path(p.file).parent.name, Path(p.file).name,
                *("/".join(parts[-k:]) for k in range(2, len(parts) + 1))]

    left = clash
    for depth in range(max((len(tags(p)) for p in clash), default=0)):
        for p in left:
            t = tags(p)
            p.name = f"{base[id(p)]} · {t[min(depth, len(t) - 1)]}"
        names = Counter(p.name for p in procs)
        left = [p for p in left if names[p.name] > 1]
        if not left:
            return


def write_timeline(paths: Iterable[str | Path | TraceSource], out: str | Path, *,
                   clock_offsets_ns: Mapping[str, int] | None = None,
                   window_ns: tuple[int, int] | None = None,
                   on_file: Callable[[int, int], None] | None = None,
                   skipped: Iterable[str] = ()) -> TimelineReport:
    """Merge every trace under ``paths`` into ``out`` (``.json`` or ``.json.gz``).

    Sources are ordered by stage, replica, rank. A source that cannot be read is left out and
    named in ``errors`` (a source cut short keeps the events read before the cut); ``TraceError``
    when none is usable. ``clock_offsets_ns`` (by file path): how far each file's host clock is
    ahead of the reference clock (a fleet's, ``sidecar/analysis/aligned.py``); its events move
    back by that much. ``window_ns`` (reference clock, epoch ns) keeps only the events that
    overlap it (metadata always kept). ``on_file(done, total)``: files merged so far, before the
    first and after each (as ``summarize_paths`` calls it). ``out`` is checked first
    (``output_path``: never a folder or one of the sources). A file given twice is merged once
    (``warnings``); what could not be read (a trace-named folder entry that is no file, and
    ``skipped``: the caller's own list) is in ``errors`` and in the output's ``otherData``
    (``omni_sidecar_not_read``), so a lost rank shows wherever the timeline goes.
    """
    offsets = {str(k): int(v) for k, v in (clock_offsets_ns or {}).items()}
    found = locate(paths)
    sources = found.sources
    out = output_path(out, [s.path for s in sources])
    headers: list[tuple[TraceSource, dict[str, Any]]] = []
    errors: list[str] = list(skipped) + found.unreadable
    for src in sources:
        try:
            headers.append((src, read_header(src.path)))
        except TraceError as err:
            errors.append(str(err))
    if not headers:
        raise TraceError("no readable trace to merge: " + "; ".join(errors), details={"errors": errors})

    def order(item: tuple[TraceSource, dict[str, Any]]) -> tuple[int, int, int, str]:
        src, head = item
        r = _rank(head, src.path)
        return (src.stage_id if src.stage_id is not None else 1 << 30, src.replica or 0, r or 0, str(src.path))

    headers.sort(key=order)
    skews = [offsets.get(str(src.path), 0) for src, _ in headers]
    bases = [trace_base_ns(h) for _, h in headers]
    known = [b - k for b, k in zip(bases, skews) if b is not None]
    base = min(known) if known else None
    report = TimelineReport(out=str(out), base_time_ns=base, errors=errors, warnings=list(found.repeated))
    procs = []
    for i, ((src, head), b, k) in enumerate(zip(headers, bases, skews)):
        rank = _rank(head, src.path)
        procs.append(TimelineProcess(
            pid=i + 1, name=process_name(src, rank), file=str(src.path), stage_id=src.stage_id,
            replica=src.replica, rank=rank, kind=src.kind,
            offset_us=((b - k - base) / 1000.0) if (b is not None and base is not None) else -k / 1000.0,
        ))
    # the window on the output's clock: its ts are µs from its base (absolute where there is none)
    window_us = None if window_ns is None else tuple((w - (base or 0)) / 1000.0 for w in window_ns)
    _tell_apart(procs)
    header: dict[str, Any] = {"schemaVersion": 1, "displayTimeUnit": "ms"}
    if base is not None:
        header["baseTimeNanoseconds"] = base
    header["otherData"] = {"omni_sidecar_timeline": [
        {"pid": p.pid, "name": p.name, "file": p.file, "offset_us": p.offset_us} for p in procs]}
    if errors:
        header["otherData"]["omni_sidecar_not_read"] = list(errors)
    with TraceWriter(out, header) as w:
        for p in procs:
            w.write([
                {"ph": "M", "name": "process_name", "pid": p.pid, "tid": 0, "ts": 0, "args": {"name": p.name}},
                {"ph": "M", "name": "process_sort_index", "pid": p.pid, "tid": 0, "ts": 0, "args": {"sort_index": p.pid}},
            ])
        for i, p in enumerate(procs):
            if on_file is not None:
                on_file(i, len(procs))
            rw = _SourceRewriter(p, i, window_us=window_us)  # type: ignore[arg-type]
            reader = RawTraceReader(p.file)
            try:
                for batch in reader.batches():
                    w.write(rw.rewrite(batch))
            except TraceError as err:
                errors.append(str(err))
            if reader.truncated and reader.error:
                errors.append(reader.error)
            note = reader.unusable_note()
            if note:
                report.warnings.append(f"{p.file}: {note}")
            report.flows_dropped += rw.flows_dropped
            report.trimmed += rw.trimmed
        report.events, report.raw_bytes = w.events, w.raw_bytes
    if on_file is not None:
        on_file(len(procs), len(procs))
    report.processes = procs
    return report


def write_slim_timeline(paths: Iterable[str | Path | TraceSource], out: str | Path, *, max_mb: float,
                        skipped: Iterable[str] = ()) -> TimelineReport:
    """``write_timeline`` of ``paths`` (one stage's traces, say), then the result made to fit
    ``max_mb`` of JSON by ``slim_trace`` (Python stack events, flows, CUDA API calls, then the
    window's tail go first; what went is in ``otherData.omni_sidecar_slim``). Written as ``out``;
    the merged file in between is a temporary beside it."""
    from sidecar.analysis.slim import slim_trace

    out = Path(out)
    merged = out.with_name(f".{out.name}.merged.json")
    try:
        report = write_timeline(paths, merged, skipped=skipped)
        slim_trace(merged, out, max_mb=max_mb)
    finally:
        merged.unlink(missing_ok=True)
    return report


__all__ = ["TimelineProcess", "TimelineReport", "process_name", "trace_base_ns",
           "write_slim_timeline", "write_timeline"]
