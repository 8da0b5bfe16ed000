"""Artifact checker: after the server answered the stop, decide from what the files show when
they are complete (no fixed wait), what they hold, and one ``StageVerdict`` per stage.

Complete means: no ``trace_rank<N>.json`` still waiting for the gzip vLLM-Omni runs *after* its
reply (``gzip -f`` removes the ``.json`` only once the ``.json.gz`` is whole), and no plain
``.json`` that is still growing without its closing bracket. Plain vLLM writes (and gzips) its
files before it answers, so they are complete at once. Each trace is then read as a stream up to
its first op or kernel: none means no request ran in the window (``empty``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.control.artifacts import (
    TRACE_FILE,
    VLLM_TABLE_FILE,
    Scan,
    StageWatch,
    Window,
    is_trace,
    is_worker_trace,
    scan,
    session_rank,
    session_replica,
)
from sidecar.control.claims import ClaimRegistry
from sidecar.control.models import StageVerdict, Verdict
from sidecar.errors import UpstreamError

WORK_CATEGORIES = ("cpu_op", "kernel")  # an op ran on the host, or a kernel on the device
_PEEK_CHUNK = 256 << 10  # the content check reads this much at a time and stops at the first op


def _json_closed(path: Path) -> bool:
    """The last non-blank byte of a Chrome trace is its closing ``}`` (or ``]``, bare-array form)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - 64, 0))
            tail = f.read().rstrip(b" \t\r\n")
    except OSError:
        return False
    return tail[-1:] in (b"}", b"]")


def trace_has_work(path: Path) -> tuple[bool | None, str | None]:
    """(True: an op or kernel, False: none, None: unreadable) and, when not True, why."""
    try:
        from sidecar.analysis import TraceReader
    except ImportError:  # pragma: no cover - analysis ships with the package
        return True, None
    from sidecar.errors import TraceError

    reader = TraceReader(path, chunk_size=_PEEK_CHUNK)
    batches = reader.batches()
    try:
        for batch in batches:
            if any(e.cat in WORK_CATEGORIES for e in batch):
                return True, None
    except TraceError as exc:
        return None, exc.message
    except (OSError, ValueError) as exc:
        return None, f"{path.name}: unreadable ({exc})"
    finally:
        batches.close()
    if reader.truncated:
        return None, reader.error
    return False, None


@dataclass
class _TraceState:
    sizes: dict[str, int] = field(default_factory=dict)  # unclosed .json -> size at last look


def _pending(watch: StageWatch, found: Scan, state: _TraceState) -> list[str]:
    """Files the server is still writing after its reply."""
    out: list[str] = []
    if watch.flat:
        return out  # written, and gzipped, before stop answered
    for s in found.sessions:
        for f in s.files:
            if not (TRACE_FILE.match(os.path.basename(f.name)) and f.name.endswith(".json")):
                continue
            key = f"{s.local_path}/{f.name}"
            if watch.use_gzip:
                out.append(f"{os.path.basename(s.path)}/{f.name}")  # gzip has not replaced it yet
                continue
            if not _json_closed(Path(s.local_path or "") / f.name):
                # Not closed yet: pending while it grows; unchanged since the last look = cut off.
                if state.sizes.get(key) != f.size:
                    out.append(f"{os.path.basename(s.path)}/{f.name}")
                state.sizes[key] = f.size
    return out


@dataclass
class _Content:
    traces: list[str] = field(default_factory=list)  # worker traces counted (complete, readable)
    idle: list[str] = field(default_factory=list)  # traces with no op and no kernel
    unreadable: list[str] = field(default_factory=list)  # "name: why"
    ranks: set[int] = field(default_factory=set)
    replicas: set[int] = field(default_factory=set)


def _content(watch: StageWatch, found: Scan) -> _Content:
    c = _Content()
    for s in found.sessions:
        folder = Path(s.local_path or "")
        label = os.path.basename(s.path.rstrip("/"))
        for f in s.files:
            if not is_worker_trace(f.name, watch.flat):
                continue
            name = f"{label}/{f.name}"
            if f.size == 0:
                c.unreadable.append(f"{name}: 0 bytes")
                continue
            path = folder / f.name
            if path.suffix == ".json" and not path.exists() and path.with_name(path.name + ".gz").exists():
                path = path.with_name(path.name + ".gz")
            if path.suffix == ".json" and not _json_closed(path):
                c.unreadable.append(f"{name}: the JSON is not closed (cut off, or still being written)")
                continue
            work, why = trace_has_work(path)
            if work is None:
                c.unreadable.append(f"{name}: {why}")
                continue
            c.traces.append(name)
            if not work:
                c.idle.append(name)
            rank, replica = session_rank(s), session_replica(s)
            if rank is not None:
                c.ranks.add(rank)
            if replica is not None:
                c.replicas.add(replica)
    return c


def _copy_rewritten(watch: StageWatch, found: Scan, copy_dir: Path | None) -> None:
    """Plain vLLM rewrites ``profiler_out_<r>.txt`` at every stop: keep this capture's version."""
    if not watch.flat or copy_dir is None:
        return
    for s in found.sessions:
        for i, f in enumerate(s.files):
            if not VLLM_TABLE_FILE.match(f.name):
                continue
            dest = copy_dir / f"stage{watch.stage_id}" / f.name
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(s.local_path or "") / f.name, dest)
            except OSError:
                continue
            s.files[i] = f.model_copy(update={"copy_path": str(dest), "size": dest.stat().st_size})


def _lost(watch: StageWatch, c: _Content) -> str:
    """Which replica or rank is missing, and why, in the user's words."""
    exp, got = watch.expected_traces, len(c.traces)
    head = (f"stage {watch.stage_id} expects {exp} traces ({watch.replicas} replica(s) x {watch.ranks} rank(s)) "
            f"and {got} arrived")
    if watch.names_collide and got <= watch.ranks:
        lost = ", ".join(str(r) for r in range(1, watch.replicas))
        return (
            f"{head}: vLLM-Omni 0.30 writes one folder name for all replicas of an LLM stage: replica {lost}'s "
            "trace was overwritten by replica 0's (every replica is rank 0 of its own engine and starts in "
            "the same second; which replica's trace survived is not recorded). Fix: run one replica per "
            "server (num_replicas: 1, a server per replica, each with its own torch_profiler_dir), or "
            "profile with num_replicas: 1 for the profiled run"
        )
    if watch.kind.value == "diffusion" and watch.replicas > 1:
        lost_reps = [r for r in range(watch.replicas) if r not in c.replicas]
        if lost_reps:
            return (f"{head}: replica(s) {lost_reps} wrote no trace (no complete trace in a "
                    f"..._stage_{watch.stage_id}_rep_<replica>_diffusion_<epoch> folder): that replica's worker "
                    "most likely died or restarted during the window (vLLM-Omni 0.30 still answers SUCCESS); "
                    "check the server log for it")
    if watch.ranks > 1 and not watch.flat and watch.kind.value != "diffusion":
        lost_ranks = [r for r in range(watch.ranks) if r not in c.ranks]
        if lost_ranks:
            return (f"{head}: rank(s) {lost_ranks} wrote no trace (no ..._stage{watch.stage_id}_rank<rank>_<epoch> "
                    "folder with a complete trace): that worker most likely died during the window "
                    "(vLLM-Omni 0.30 still answers SUCCESS); check the server log")
    return (f"{head}: a worker of this stage wrote no trace (it died or restarted during the window; the "
            "server still answers SUCCESS); check the server log")


def verdict(watch: StageWatch, found: Scan, *, pending: list[str], timed_out: bool, collect_timeout_s: float,
            note: str | None = None, sharers: list[str] | None = None, nsys_hint: str | None = None) -> StageVerdict:
    sv = StageVerdict(stage_id=watch.stage_id, profiler_dir=watch.server_dir, sessions=found.sessions,
                      expected_traces=watch.expected_traces if watch.profiler == "torch" else None)
    where = watch.server_dir or "<no torch_profiler_dir>"
    prefix = f"{note}; " if note else ""

    def done(v: Verdict, reason: str | None) -> StageVerdict:
        sv.verdict = v
        sv.reason = f"{prefix}{reason}" if reason else (note or None)
        return sv

    if watch.profiler != "torch":
        return done(Verdict.unverified, nsys_hint or (
            f"stage {watch.stage_id} is profiled with `{watch.profiler}`, which writes no file the sidecar can check"))
    if watch.local_dir is None:
        return done(Verdict.unverified, (
            f"stage {watch.stage_id}'s torch_profiler_dir {where} is not a local path the sidecar can "
            "read; mount it and pass --artifact-root SERVER_PATH=LOCAL_PATH"))
    if not found.visible:
        return done(Verdict.unverified, (
            f"the sidecar cannot see stage {watch.stage_id}'s folder {where} (looked at "
            f"{watch.local_dir}); if the server runs elsewhere or in a container, mount the folder and "
            "pass --artifact-root SERVER_PATH=LOCAL_PATH"))
    skipped = f" Not counted: {'; '.join(found.skipped)}." if found.skipped else ""
    c = _content(watch, found)
    sv.found_traces = len(c.traces)
    shared = [s for s in ([watch.shared_with] if watch.shared_with else []) + (sharers or []) if s]
    if shared and (found.sessions or found.skipped):
        return done(Verdict.ambiguous, (
            f"stage {watch.stage_id}'s folder {where} is also written by {', '.join(shared)}, and vLLM-Omni's "
            "folder names carry no server identity: these traces may be the other server's (or overwritten "
            "by it). Give each server its own torch_profiler_dir (`omni-sidecar render --dir` per replica)"
            + skipped))
    if not found.sessions and watch.flat:
        return done(Verdict.missing, (
            f"no new *.pt.trace.json[.gz] in {where} after stop: the worker did not start its profiler, "
            "exported nothing, or died (a dead or restarted worker: the server still answers 200); check "
            "the server log" + skipped))
    if not found.sessions:
        absent = "" if found.dir_exists else " (the folder does not even exist)"
        return done(Verdict.missing, (
            f"no new session folder for stage {watch.stage_id} under {where}{absent} after stop: the stage's "
            "worker did not start its profiler (a dead or restarted worker, or a profiler error: vLLM-Omni "
            "0.30 swallows both and answers SUCCESS); check the server log for this stage" + skipped))
    if not c.traces and not c.unreadable and not pending:
        folders = ", ".join(s.path for s in found.sessions)
        return done(Verdict.missing, (
            f"stage {watch.stage_id}: session folder(s) {folders} were opened at start but hold no trace: the "
            "stage's worker most likely died or failed during the window (vLLM-Omni 0.30 swallows that and "
            "still answers SUCCESS), or a second start opened a fresh folder; check the server log for this "
            "stage" + skipped))
    if not c.traces:
        if pending and timed_out:
            return done(Verdict.ok, (
                f"gzip had not finished within {collect_timeout_s:g}s for {', '.join(pending)}; the traces are "
                "uncompressed or still being compressed"))
        return done(Verdict.missing, (
            f"stage {watch.stage_id}: no complete trace: {'; '.join(c.unreadable)}" + skipped))
    extra: list[str] = []
    if c.unreadable:
        extra.append(f"not counted: {'; '.join(c.unreadable)}")
    if timed_out and pending:
        extra.append(f"gzip had not finished within {collect_timeout_s:g}s for {', '.join(pending)}; the traces "
                     "are uncompressed or still being compressed")
    if len(c.idle) == len(c.traces):
        idle = (f"no request ran in the window: {', '.join(c.idle)} record no op and no kernel (the traces are "
                "still listed and downloadable); send requests that reach this stage while the capture is "
                "active, and check delay_iterations / max_iterations")
        return done(Verdict.empty, "; ".join([idle, *extra]) + skipped)
    if c.idle:
        extra.append(f"no op ran in {', '.join(c.idle)} (idle)")
    if len(c.traces) < watch.expected_traces:
        return done(Verdict.partial, "; ".join([_lost(watch, c), *extra]) + skipped)
    return done(Verdict.ok, "; ".join(extra) or None)


def after_stop_error(v: StageVerdict, stop_error: UpstreamError) -> StageVerdict:
    """A stage without a trace after a failed stop is ``missing`` for that reason (its worker most
    likely died), whatever the folder shows; ``ok``, ``unverified`` and ``ambiguous`` stand."""
    if v.verdict in (Verdict.ok, Verdict.unverified, Verdict.ambiguous, Verdict.partial, Verdict.empty):
        return v
    return v.model_copy(
        update={
            "verdict": Verdict.missing,
            "reason": (
                f"stage {v.stage_id} wrote no trace and the stop failed on the server "
                f"({stop_error.message}): its worker most likely died during the window. Check the "
                f"server log for stage {v.stage_id} (a crash, an OOM kill) and whether the server still "
                "serves requests; the other stages' traces are kept"
            ),
        }
    )


def found_so_far(verdicts: list[StageVerdict], head: str) -> list[StageVerdict]:
    """Prefix every reason with what happened to the stop and what had been written by then."""
    out = []
    for v in verdicts:
        names = [f"{Path(s.path).name}/{f.name}" for s in v.sessions for f in s.files if is_trace(f.name)]
        found = ", ".join(names) if names else "no trace"
        reason = f"{head}; found so far: {found}" + (f"; {v.reason}" if v.reason else "")
        out.append(v.model_copy(update={"reason": reason}))
    return out


def _claimable(watch: StageWatch, found: Scan) -> list[str]:
    """A session folder is claimed whole; in a flat dir only this capture's files are."""
    out = []
    for s in found.sessions:
        if s.local_path is None:
            continue
        if watch.flat:
            out += [os.path.join(s.local_path, f.name) for f in s.files]
        else:
            out.append(s.local_path)
    return out


async def collect(
    watches: list[StageWatch],
    *,
    window: Window | None = None,
    claims: ClaimRegistry | None = None,
    capture_id: str | None = None,
    collect_timeout_s: float = 120,
    poll_s: float = 0.2,
    copy_dir: Path | None = None,
    wait: bool = True,
    note: str | None = None,
    nsys_hints: dict[int, str] | None = None,
) -> list[StageVerdict]:
    """Wait (bounded by ``collect_timeout_s``) until nothing is still being written after the
    reply, then return a verdict per stage, in ``watches`` order, and claim what they list.
    ``wait=False`` looks once (a stop that timed out: "found so far"); ``note`` prefixes reasons."""
    deadline = time.monotonic() + collect_timeout_s
    states = [_TraceState() for _ in watches]
    while True:
        def look() -> tuple[list[Scan], list[list[str]]]:
            scans = [scan(w, window, claims, capture_id) for w in watches]
            return scans, [_pending(w, s, st) for w, s, st in zip(watches, scans, states)]

        scans, pending = await asyncio.to_thread(look)
        now = time.monotonic()
        timed_out = now >= deadline
        if not wait or timed_out or not any(pending):
            break
        await asyncio.sleep(min(poll_s, max(deadline - now, 0.0)) or poll_s)

    def judge() -> list[StageVerdict]:
        out = []
        for w, s, p in zip(watches, scans, pending):
            _copy_rewritten(w, s, copy_dir)
            sharers = claims.sharers(capture_id, str(w.local_dir)) if claims and capture_id and w.local_dir else []
            out.append(verdict(w, s, pending=p, timed_out=timed_out and bool(p), collect_timeout_s=collect_timeout_s,
                               note=note, sharers=sharers, nsys_hint=(nsys_hints or {}).get(w.stage_id)))
            if claims is not None and capture_id is not None:
                claims.claim(capture_id, _claimable(w, s))
        return out

    return await asyncio.to_thread(judge)


__all__ = ["WORK_CATEGORIES", "after_stop_error", "collect", "found_so_far", "trace_has_work", "verdict"]
