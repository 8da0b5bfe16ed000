"""Summaries of many trace files at once: files and session folders in, one ``CaptureSummary`` out.

A folder is searched (recursively) for ``trace_rank*.json[.gz]`` (vLLM-Omni) and
``*.pt.trace.json[.gz]`` (plain vLLM). Each file becomes a ``TraceSource``: its stage and replica
come from the session folder's name (``<ts>_stage<sid>_rank<r>_<epoch>`` for LLM stages,
``<ts>_stage_<sid>_rep_<rep>_diffusion_<epoch>`` for diffusion stages; a ``replica_<n>`` /
``rep_<n>`` folder above it names the replica of a fleet capture) or are given by the caller.
Files are summarised in parallel (child processes) and merged per stage and into one total. A bad
file becomes an entry in ``errors``; it never hides the others.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar._child import in_child, map_in_children, usable_cores
from sidecar.analysis.findings import capture_findings, with_memory
from sidecar.analysis.models import (
    CaptureSummary,
    CommonWindow,
    DeviceStat,
    ReplicaStat,
    SnapshotSummary,
    StageSummary,
    Straggler,
    TraceMeta,
    TraceSummary,
)
from sidecar.analysis.report import aggregate_trace, summary_body, trace_summary
from sidecar.analysis.snapshot import SNAPSHOT_FILE, summarize_snapshot
from sidecar.analysis.stream import look, trace_entries
from sidecar.analysis.starts import (
    Start,
    common_span,
    handovers,
    stage_starts,
    start_skews,
)
from sidecar.analysis.summary import Aggregate
from sidecar.errors import TraceError

_LLM_SESSION = re.compile(r"_stage(\d+)_rank(\d+)_\d+$")
_DIFFUSION_SESSION = re.compile(r"_stage_(\d+)_rep_(\d+)_diffusion_\d+$")
_REPLICA_DIR = re.compile(r"(?:^|_)(?:replica|rep)[_-]?(\d+)$")
_TRACE = re.compile(r"^trace_rank\d+\.json(\.gz)?$")
_VLLM_TRACE = re.compile(r"^.+\.pt\.trace\.json(\.gz)?$")
PARALLEL_MIN_BYTES = 8 << 20  # below this (on disk, all files) a pool costs more than it saves


@dataclass(frozen=True)
class TraceSource:
    """One trace file and where it sits in the pipeline: stage, replica and the stage's kind
    (``llm`` / ``diffusion``; None when unknown). The rank comes from the trace itself."""

    path: Path
    stage_id: int | None = None
    replica: int | None = None
    kind: str | None = None

    @property
    def label(self) -> str:
        """``stage 0 · replica 0`` (the rank is added by who knows it)."""
        st = f"stage {self.stage_id}" if self.stage_id is not None else "stage ?"
        return f"{st} · replica {self.replica if self.replica is not None else 0}"


def source_of(path: str | Path, *, stage_id: int | None = None, replica: int | None = None) -> TraceSource:
    """A ``TraceSource`` for ``path``, the stage/replica/kind read from its folder names unless
    given."""
    p = Path(path)
    sid = rep = kind = None
    for part in (p.name, p.parent.name):
        m = _DIFFUSION_SESSION.search(part)
        if m:
            sid, rep, kind = int(m.group(1)), int(m.group(2)), "diffusion"
            break
        m = _LLM_SESSION.search(part)
        if m:
            sid, kind = int(m.group(1)), "llm"
            break
    if rep is None:
        for part in p.parent.parts[::-1]:
            m = _REPLICA_DIR.search(part)
            if m:
                rep = int(m.group(1))
                break
    return TraceSource(
        path=p,
        stage_id=stage_id if stage_id is not None else sid,
        replica=replica if replica is not None else rep,
        kind=kind,
    )


def _trace_named(name: str) -> bool:
    return bool(_TRACE.match(name) or _VLLM_TRACE.match(name))


@dataclass
class FoundTraces:
    """What ``locate`` found under some paths: each distinct file once (``sources``), a note per
    file given more than once (``repeated``), and why each trace-named entry in a folder that is
    no readable file was not read (``unreadable``: a folder, a device, a broken link, a loop)."""

    sources: list[TraceSource] = field(default_factory=list)
    repeated: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)


def _folder(p: Path) -> tuple[list[Path], list[str]]:
    entries, bad = trace_entries(p, _trace_named)
    problems = [f"{f} {why}" for f, why in bad]
    hits = [f for f, _ in entries]
    plain = {f for f in hits if f.suffix == ".json"}
    hits = [f for f in hits if not (f.suffix == ".gz" and f.with_suffix("") in plain)]
    if not hits:
        raise TraceError(f"{p}: no readable trace_rank*.json[.gz] in this folder or below it"
                         + "".join(f"; {why}" for why in problems), details={"file": str(p), "errors": problems})
    return hits, problems


def locate(paths: Iterable[str | Path | TraceSource]) -> FoundTraces:
    """The trace files named by ``paths``: files as given, folders searched for ``trace_rank*`` and
    ``*.pt.trace.json[.gz]``, given ``TraceSource`` kept as they are; a file reached twice (given
    twice, as ``./a`` and ``a``, through a link, or in a folder also given) is read once.

    When both ``trace_rankN.json`` and ``.json.gz`` exist the gzip is still being written (vLLM
    compresses after replying to stop): the plain file is the complete one. ``TraceError`` for a
    path that does not exist (or is a broken link or a symlink loop) and for a folder with no
    readable trace.
    """
    found = FoundTraces()
    seen: dict[tuple[int, int], list[Path]] = {}
    for raw in paths:
        if isinstance(raw, TraceSource):
            candidates = [raw]
        else:
            if not str(raw).strip():  # Path("") is the current folder: an unset variable would read it
                raise TraceError("an empty path; give a trace file or a capture's folder", details={"file": str(raw)})
            p = Path(raw)
            st, why = look(p)
            if st is None:
                raise TraceError(f"{p}: {why}", details={"file": str(p)})
            if stat.S_ISDIR(st.st_mode):
                hits, problems = _folder(p)
                found.unreadable += [w for w in problems if w not in found.unreadable]
                candidates = [source_of(f) for f in hits]
            else:
                candidates = [source_of(p)]  # a FIFO or device given by name: the reader says what it is
        for src in candidates:
            sst, _ = look(src.path)
            key = (sst.st_dev, sst.st_ino) if sst is not None else None
            if key is not None and key in seen:
                seen[key].append(src.path)
                continue
            if key is not None:
                seen[key] = [src.path]
            found.sources.append(src)
    for names in seen.values():
        if len(names) > 1:
            also = sorted({str(n) for n in names[1:]} - {str(names[0])})
            found.repeated.append(f"{names[0]} given {len(names)} times" + (f" (also as {', '.join(also)})" if also else "")
                                  + ": read once")
    return found


Result = tuple[Aggregate, TraceMeta, int] | TraceError
Progress = Callable[[int, int], None]  # (files read so far, files in all)


def _aggregate(src: TraceSource) -> Result:
    """One file, in a worker: the aggregate, or the error."""
    try:
        return aggregate_trace(src.path, stage_id=src.stage_id, replica=src.replica)
    except TraceError as err:
        return err


def default_workers(sources: Sequence[TraceSource]) -> int:
    """One process per file up to the cores this process may use; 1 when the files are small."""
    if len(sources) < 2:
        return 1
    try:
        size = sum(s.path.stat().st_size for s in sources)
    except OSError:
        size = 0
    if size < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(len(sources), usable_cores()))


def aggregate_sources(sources: Sequence[TraceSource], *, workers: int | None = None,
                      on_file: Progress | None = None) -> list[Result]:
    """Aggregate every source, in order; ``workers`` child processes (default:
    ``default_workers``), fresh interpreters (``sidecar._child``: never a fork of the caller, never
    its main module run again), the biggest file first. A child (the server's memory-capped
    analysis worker, ``sidecar.analysis.isolated``) starts none: it aggregates the files one after
    another, under its own cap. ``on_file(done, total)`` is called before the first file and as
    each one ends (from another thread where children run them)."""
    tell = on_file or (lambda _done, _total: None)
    count = itertools.count(1)

    def tick(_index: int) -> None:
        tell(next(count), len(sources))

    tell(0, len(sources))
    n = default_workers(sources) if workers is None else max(1, min(workers, len(sources)))
    if n <= 1 or in_child():
        results = []
        for s in sources:
            results.append(_aggregate(s))
            tick(0)
        return results
    # biggest first: the last file to start should be a short one
    order = sorted(range(len(sources)), key=lambda i: -_size(sources[i]))
    done = dict(zip(order, map_in_children(_aggregate, [sources[i] for i in order], workers=n, on_done=tick)))
    return [done[i] for i in range(len(sources))]


def _size(src: TraceSource) -> int:
    try:
        return src.path.stat().st_size
    except OSError:
        return 0


def _replica_stats(sources: Sequence[TraceSource], results: Sequence[Result]) -> list[ReplicaStat]:
    groups: dict[tuple[int | None, int | None, int | None], Aggregate] = {}
    for src, res in zip(sources, results):
        if isinstance(res, TraceError):
            continue
        agg, meta, _ = res
        groups.setdefault((src.stage_id, src.replica, meta.rank), Aggregate()).merge(agg)
    out = []
    for (sid, rep, rank), agg in sorted(groups.items(), key=lambda kv: tuple(-1 if v is None else v for v in kv[0])):
        span = (agg.end - agg.start) if agg.start is not None and agg.end is not None else 0.0
        if agg.engine_steps:
            metric, value = "engine_step_mean", agg.engine_step_total / agg.engine_steps
        elif agg.steps:
            metric, value = "step_mean", agg.step_total / agg.steps
        elif agg.devices:
            metric, value = "device_busy", sum(v[0] for v in agg.devices.values())
        else:
            metric, value = "span", span
        out.append(ReplicaStat(stage_id=sid, replica=rep, rank=rank, files=agg.files, span_us=span, metric=metric, value_us=value))
    return out


def stragglers(replicas: Sequence[ReplicaStat]) -> list[Straggler]:
    """Per stage with two or more replicas/ranks measured the same way: the slowest against the
    median of all of them."""
    by_stage: dict[int | None, list[ReplicaStat]] = {}
    for r in replicas:
        by_stage.setdefault(r.stage_id, []).append(r)
    out = []
    for sid, members in sorted(by_stage.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        metric = members[0].metric
        same = [m for m in members if m.metric == metric]
        if len(same) < 2:
            continue
        slow = max(same, key=lambda m: m.value_us)
        med = statistics.median(m.value_us for m in same)
        out.append(Straggler(
            stage_id=sid, metric=metric, slowest_replica=slow.replica, slowest_rank=slow.rank,
            slowest_us=slow.value_us, median_us=med, ratio=(slow.value_us / med) if med > 0 else 1.0,
            members=len(same),
        ))
    return out


def device_starts(agg: Aggregate) -> list[Start]:
    """Each device's profiling span and first and last work, epoch µs (sidecar/analysis/starts.py)."""
    out = []
    for k, (first, last) in agg.epochs.items():
        span = agg.profiling_epochs.get(k)
        out.append(Start(stage_id=k[0], replica=k[1], rank=k[2], device=k[3], first_work_us=first, last_work_us=last,
                         profiling_start_us=span[0] if span else None, profiling_end_us=span[1] if span else None))
    return out


def common_window(agg: Aggregate, requested_start: float | None = None) -> tuple[CommonWindow | None, dict[Any, float]]:
    """The span every device was recording (epoch µs, from each trace's ``baseTimeNanoseconds``:
    the latest profiling start to the earliest profiling end) and each device's start skew: its
    profiling start against ``requested_start`` (epoch seconds, the capture's start) or, without
    it, against the earliest device of its own stage."""
    starts = device_starts(agg)
    span = common_span(starts)
    if span is None:
        return None, {}
    start, end = span
    window = CommonWindow(
        start_epoch_us=start, end_epoch_us=end, span_us=max(0.0, end - start), devices=len(starts),
        reference="requested_start" if requested_start is not None else "earliest_rank",
        requested_start_epoch_us=requested_start * 1e6 if requested_start is not None else None,
    )
    skews = start_skews(starts, None if requested_start is None else requested_start * 1e6)
    return window, {(s.stage_id, s.replica, s.rank, s.device): k for s, k in zip(starts, skews) if k is not None}


def _with_skew(devices: list[DeviceStat], skew: dict[Any, float]) -> list[DeviceStat]:
    for d in devices:
        d.start_skew_us = skew.get((d.stage_id, d.replica, d.rank, d.device))
    return devices


def snapshots_beside(sources: Sequence[TraceSource]) -> tuple[list[SnapshotSummary], list[str]]:
    """The ``memory_snapshot_rank<N>.pickle`` files in the folders of ``sources`` (vLLM-Omni writes
    one beside each trace of a stage profiled with memory on CUDA), summarised safely
    (sidecar/analysis/snapshot.py), and the errors of those that are refused or unreadable."""
    out: list[SnapshotSummary] = []
    errors: list[str] = []
    seen: set[Path] = set()
    for src in sources:
        folder = src.path.parent
        if folder in seen:
            continue
        seen.add(folder)
        try:
            names = sorted(e.name for e in os.scandir(folder) if SNAPSHOT_FILE.match(e.name))
        except OSError:
            continue
        for name in names:
            try:
                out.append(summarize_snapshot(folder / name, stage_id=src.stage_id, replica=src.replica))
            except TraceError as err:
                errors.append(str(err))
    return out, errors


def _recorded(agg: Aggregate) -> tuple[float, float] | None:
    """When one file recorded, epoch µs: its profiler spans (else its first and last work) over its
    devices; its own clock's window where the trace has no epoch."""
    spans = [agg.profiling_epochs.get(k, v) for k, v in agg.epochs.items()]
    if spans:
        return min(a for a, _ in spans), max(b for _, b in spans)
    if agg.start is not None and agg.end is not None:
        return agg.start, agg.end
    return None


def _span_text(us: float) -> str:
    s = us / 1e6
    if s >= 3600:
        return f"{s / 3600:,.1f} h"
    if s >= 60:
        return f"{s / 60:,.1f} min"
    if s >= 1:
        return f"{s:,.1f} s"
    return f"{us / 1000:,.1f} ms"


def apart_windows(files: Sequence[tuple[TraceSource, Aggregate]]) -> list[str]:
    """A warning per set of files that are merged as one recording but were not recorded at one
    time: files merged into one device (same stage, replica, rank and GPU), and files with no stage
    (no session folder names one: bare traces, taken as the ranks of one job), whose recording
    windows do not overlap. Files that do belong together (one capture's session folders, the
    ranks of one job) overlap, and get none; the figures are never changed."""
    groups: dict[Any, list[int]] = {}
    for i, (src, agg) in enumerate(files):
        keys = {("device", k[:4]) for k in agg.epochs} or {("device", (src.stage_id, src.replica, None, None))}
        if src.stage_id is None:
            keys.add(("bare",))
        for key in keys:
            if i not in groups.setdefault(key, []):
                groups[key].append(i)
    out: list[str] = []
    seen: set[tuple[int, ...]] = set()
    for members in groups.values():
        timed = sorted((w, i) for i in members if (w := _recorded(files[i][1])) is not None)
        if len(timed) < 2 or tuple(sorted(i for _, i in timed)) in seen:
            continue
        clusters: list[tuple[float, float, list[int]]] = []
        for (lo, hi), i in timed:
            if clusters and lo <= clusters[-1][1]:
                c_lo, c_hi, idx = clusters[-1]
                clusters[-1] = (c_lo, max(c_hi, hi), idx + [i])
            else:
                clusters.append((lo, hi, [i]))
        if len(clusters) < 2:
            continue
        seen.add(tuple(sorted(i for _, i in timed)))
        parts = []
        for n, (lo, hi, idx) in enumerate(clusters):
            names = ", ".join(str(files[i][0].path) for i in idx)
            gap = "" if n == 0 else f", {_span_text(lo - clusters[n - 1][1])} after the one before"
            parts.append(f"{names} ({_span_text(hi - lo)}{gap})")
        whole = clusters[-1][1] - clusters[0][0]
        out.append(
            f"these traces do not come from one window: {len(clusters)} recordings that never overlap, "
            + "; ".join(parts)
            + f". They are merged here as one recording whose window spans {_span_text(whole)}, so the window, "
            "GPU busy/idle shares and stragglers mix them: summarise each on its own, or give the session "
            "folders of one capture")
    return out


def summarize_paths(
    paths: Iterable[str | Path | TraceSource], *, top: int = 20, workers: int | None = None,
    requested_start: float | None = None, on_file: Progress | None = None,
) -> CaptureSummary:
    """Summaries of every trace under ``paths``: per file, per stage, per replica, and all merged.

    ``paths`` are files, folders or ``TraceSource`` (a caller that knows each file's stage and
    replica). ``workers`` processes summarise the files in parallel (default: one per file up to
    the usable cores, 1 for small captures). Raises ``TraceError`` when a path does not exist, a
    folder holds no trace, or no file at all can be read (the first file's error, its class kept:
    ``TraceTooLarge`` for a file past the reader's limits); a file that cannot be read beside
    readable ones is reported in ``errors`` (and ``truncated`` where part of it was used).
    ``requested_start`` (epoch seconds) is when the capture was started: each device's
    ``start_skew_us`` is measured from it (else from the earliest device of its stage).
    ``on_file(done, total)``: files read so far, for a progress line (``aggregate_sources``).
    """
    found = locate(paths)
    sources = found.sources
    results = aggregate_sources(sources, workers=workers, on_file=on_file)
    total = Aggregate()
    stages: dict[int | None, Aggregate] = {}
    per_file: list[TraceSummary] = []
    errors: list[str] = list(found.unreadable)  # a rank that cannot be read is said, never lost
    warnings: list[str] = list(found.repeated)
    failed = [res for res in results if isinstance(res, TraceError)]
    if failed and len(failed) == len(results):
        first = failed[0]
        raise type(first)(
            "; ".join([str(e) for e in failed] + found.unreadable),
            details={**first.details, "errors": [str(e) for e in failed] + found.unreadable},
        )
    for src, res in zip(sources, results):
        if isinstance(res, TraceError):
            errors.append(str(res))
            continue
        agg, meta, raw = res
        ts = trace_summary(src.path, agg, meta, raw, top)
        warnings += ts.warnings
        per_file.append(ts)
        stages.setdefault(src.stage_id, Aggregate()).merge(agg)
        total.merge(agg)
    read = [(src, res[0]) for src, res in zip(sources, results) if not isinstance(res, TraceError)]
    warnings += apart_windows(read)
    body = summary_body(total, top)
    body["errors"] = errors + body["errors"]
    body["warnings"] = warnings
    window, skew = common_window(total, requested_start)
    _with_skew(body["devices"], skew)
    stage_bodies = [(sid, agg.files, summary_body(agg, top)) for sid, agg in sorted(stages.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]
    for _, _, b in stage_bodies:
        _with_skew(b["devices"], skew)
    body["snapshots"], failed_snapshots = snapshots_beside(sources)
    body["errors"] += failed_snapshots
    for sid, _, b in stage_bodies:
        b["snapshots"] = [sn for sn in body["snapshots"] if sn.stage_id == sid]
    replicas = _replica_stats(sources, results)
    lagging = stragglers(replicas)
    starts = device_starts(total)
    by_stage, handed = stage_starts(starts), handovers(starts)
    return CaptureSummary(
        **body,
        findings=with_memory(capture_findings(body["devices"], lagging, by_stage, handed), body["memory"]),
        common_window=window,
        stage_starts=by_stage,
        handovers=handed,
        stages=[StageSummary(stage_id=sid, files=files, **b) for sid, files, b in stage_bodies],
        files=per_file,
        replicas=replicas,
        stragglers=lagging,
    )
