"""Artifact checker: after the server answered the stop, decide from what the files show when
they are complete (no fixed wait), what they hold, and one ``StageVerdict`` per stage.

Complete means: no ``trace_rank<N>.json`` still waiting for the gzip vLLM-Omni runs *after* its
reply (``gzip -f`` removes the ``.json`` only once the ``.json.gz`` is whole), and no plain
``.json`` without its closing bracket that changed within the quiet period. Plain vLLM writes
(and gzips) its files before it answers, so they are complete at once. Each trace (a session
folder and a rank; its ``.json`` and ``.json.gz`` are one) is then read as a stream up to its
first op or kernel: none means no request ran in the window (``empty``). :func:`decide` is the
rule (a small typed :class:`Decision`), :func:`_words` the one place that words it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from sidecar.control.artifacts import (
    TRACE_FILE,
    VLLM_TABLE_FILE,
    Scan,
    StageWatch,
    Window,
    is_trace,
    is_worker_trace,
    list_files,
    scan,
    session_rank,
    session_replica,
)
from sidecar.control.claims import ClaimRegistry
from sidecar.control.models import ArtifactFile, SessionFolder, StageVerdict, Verdict
from sidecar.errors import UpstreamError

log = logging.getLogger(__name__)

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


class TraceState(str, Enum):
    """What one look at one trace shows."""

    work = "work"  # readable, records an op or a kernel
    idle = "idle"  # readable, records no op and no kernel
    unreadable = "unreadable"  # 0 bytes, cut off, or not a trace
    unsettled = "unsettled"  # still being written when the collect bound ran out
    unchecked = "unchecked"  # the content check could not run (fail closed: never counted)


def trace_has_work(path: Path) -> tuple[TraceState, str | None]:
    """``work``, ``idle``, ``unreadable`` (with why) or ``unchecked`` (the reader cannot be
    imported: the check fails closed, logged) for one trace file, read up to its first op."""
    try:
        from sidecar.analysis import TraceReader
        from sidecar.errors import TraceError
    except ImportError as exc:
        log.error("the trace content check cannot run (%s): verdicts are unverified", exc)
        return TraceState.unchecked, f"the content check cannot run here ({exc}); reinstall omni-sidecar"
    reader = TraceReader(path, chunk_size=_PEEK_CHUNK)
    batches = reader.batches()
    try:
        for batch in batches:
            if any(e.cat in WORK_CATEGORIES for e in batch):
                return TraceState.work, None
    except TraceError as exc:
        return TraceState.unreadable, exc.message
    except (OSError, ValueError) as exc:
        return TraceState.unreadable, f"{path.name}: unreadable ({exc})"
    finally:
        batches.close()
    if reader.truncated:
        return TraceState.unreadable, reader.error
    return TraceState.idle, None


@dataclass(frozen=True)
class TraceLook:
    """One worker trace: a session folder and a trace file (its ``.json`` and ``.json.gz`` are
    one trace), and what reading it showed."""

    folder: str  # the session folder's name (plain vLLM: the dir's)
    name: str  # the trace file without ``.gz``
    state: TraceState
    why: str | None = None
    folder_rank: int | None = None  # LLM: rank<N> in the folder name
    replica: int | None = None  # diffusion: rep_<R> in the folder name
    read: str | None = None  # the file read (``.gz`` or not), where one was

    @property
    def label(self) -> str:
        return f"{self.folder}/{self.name}"

    @property
    def shown(self) -> str:
        """The folder and the file as it is on disk."""
        return f"{self.folder}/{self.read or self.name}"


def _traces(watch: StageWatch, found: Scan) -> dict[tuple[str, str], tuple[SessionFolder, list[ArtifactFile]]]:
    """Worker traces by (session folder, file without ``.gz``): a gzip in progress is one trace."""
    out: dict[tuple[str, str], tuple[SessionFolder, list[ArtifactFile]]] = {}
    for s in found.sessions:
        label = os.path.basename(s.path.rstrip("/"))
        for f in s.files:
            if is_worker_trace(f.name, watch.flat):
                out.setdefault((label, f.name.removesuffix(".gz")), (s, []))[1].append(f)
    return out


@dataclass
class _Quiet:
    """When each unclosed ``.json`` last changed (size or mtime), by its local path."""

    seen: dict[str, tuple[tuple[int, int | None], float]] = field(default_factory=dict)

    def writing(self, path: str, f: ArtifactFile, now: float, quiet_s: float) -> bool:
        sig = (f.size, f.mtime_ns)
        last = self.seen.get(path)
        if last is None or last[0] != sig:
            self.seen[path] = (sig, now)
            return True
        return now - last[1] < quiet_s


def _pending(watch: StageWatch, found: Scan, quiet: _Quiet, now: float, quiet_s: float) -> tuple[list[str], set[str]]:
    """Traces the server is still writing after its reply: a ``.json`` that gzip has not replaced
    yet (gzip mode), or an unclosed ``.json`` that changed within the last ``quiet_s`` (the second
    list: still being written, in either mode)."""
    pending: list[str] = []
    writing: set[str] = set()
    if watch.flat:
        return pending, writing  # written, and gzipped, before stop answered
    for (label, name), (s, files) in _traces(watch, found).items():
        plain = next((f for f in files if not f.name.endswith(".gz")), None)
        if plain is None:
            continue
        path = os.path.join(s.local_path or "", plain.name)
        if not _json_closed(Path(path)) and quiet.writing(path, plain, now, quiet_s):
            writing.add(f"{label}/{name}")
        if watch.use_gzip or f"{label}/{name}" in writing:
            pending.append(f"{label}/{name}")
    return pending, writing


def _look(watch: StageWatch, s: SessionFolder, label: str, name: str, files: list[ArtifactFile],
          writing: set[str], collect_timeout_s: float) -> TraceLook:
    folder = Path(s.local_path or "")
    look = {"folder": label, "name": name, "folder_rank": session_rank(s), "replica": session_replica(s)}
    plain = next((f for f in files if not f.name.endswith(".gz")), None)
    listed = plain or files[0]
    path = folder / listed.name
    if plain is not None and not path.exists() and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")  # gzip finished after the last listing
    elif plain is not None:
        if f"{label}/{name}" in writing:
            return TraceLook(**look, state=TraceState.unsettled, why=(
                f"{label}/{plain.name} was still being written when the {collect_timeout_s:g}s collect bound "
                "ran out"))
        never = (f" and was never compressed within {collect_timeout_s:g}s (the export failed: vLLM-Omni only "
                 "logs \"Failed to export trace\", e.g. on a full disk)") if watch.use_gzip else ""
        if plain.size == 0:
            return TraceLook(**look, state=TraceState.unreadable, why=f"{label}/{plain.name}: 0 bytes{never}")
        if not _json_closed(path):
            return TraceLook(**look, state=TraceState.unreadable, why=(
                f"{label}/{plain.name}: the JSON is not closed (cut off){never}"))
    elif listed.size == 0:
        return TraceLook(**look, state=TraceState.unreadable, why=f"{label}/{listed.name}: 0 bytes")
    state, why = trace_has_work(path)
    if why is not None:  # the reader names the local path; the reason names the session folder
        why = f"{label}/{path.name}: {why.removeprefix(f'{path}: ').removeprefix(f'{path.name}: ')}"
    return TraceLook(**look, state=state, why=why, read=path.name)


def _relisted(watch: StageWatch, found: Scan) -> Scan:
    """A gzip-mode session folder listed without a trace is listed again before it is called
    missing: a gzip that swapped ``.json`` for ``.json.gz`` during the listing hides both."""
    if watch.flat or not watch.use_gzip:
        return found
    for s in found.sessions:
        if s.local_path and not any(is_worker_trace(f.name, False) for f in s.files):
            s.files = list_files(Path(s.local_path))
    return found


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


# --- the rule: a small typed decision per stage ---------------------------------------------


class Rule(str, Enum):
    """Which rule decided a stage's verdict (the words for each are in :func:`_words`)."""

    not_torch = "not_torch"
    not_local = "not_local"
    invisible = "invisible"
    shared = "shared"
    no_flat_trace = "no_flat_trace"
    no_session = "no_session"
    no_trace = "no_trace"
    unchecked = "unchecked"
    unsettled = "unsettled"
    unreadable = "unreadable"
    extra = "extra"
    idle = "idle"
    lost = "lost"
    ok = "ok"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    rule: Rule
    looks: tuple[TraceLook, ...] = ()
    lost_ranks: tuple[int, ...] = ()
    lost_replicas: tuple[int, ...] = ()

    @property
    def counted(self) -> list[TraceLook]:
        return [t for t in self.looks if t.state in (TraceState.work, TraceState.idle)]

    def of(self, *states: TraceState) -> list[TraceLook]:
        return [t for t in self.looks if t.state in states]


def _lost_slots(watch: StageWatch, counted: list[TraceLook]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks (LLM, tensor parallel) and replicas (diffusion) of the expected set with no trace."""
    ranks: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()
    if watch.flat:
        return ranks, replicas
    if watch.kind.value == "diffusion" and watch.replicas > 1:
        have = {t.replica for t in counted}
        replicas = tuple(r for r in range(watch.replicas) if r not in have)
    elif watch.ranks > 1 and watch.kind.value != "diffusion":
        have = {t.folder_rank for t in counted}
        ranks = tuple(r for r in range(watch.ranks) if r not in have)
    return ranks, replicas


def decide(watch: StageWatch, found: Scan, looks: list[TraceLook], *, shared: bool) -> Decision:
    """The verdict of one stage from what was found: never ``ok`` without every expected trace
    counted (readable, complete), and ``unverified`` wherever the sidecar could not tell."""
    if watch.profiler != "torch":
        return Decision(Verdict.unverified, Rule.not_torch)
    if watch.local_dir is None:
        return Decision(Verdict.unverified, Rule.not_local)
    if not found.visible:
        return Decision(Verdict.unverified, Rule.invisible)
    d = tuple(looks)
    if shared and (found.sessions or found.skipped):
        return Decision(Verdict.ambiguous, Rule.shared, d)
    if not found.sessions:
        return Decision(Verdict.missing, Rule.no_flat_trace if watch.flat else Rule.no_session)
    if not looks:
        return Decision(Verdict.missing, Rule.no_trace)
    counted = [t for t in looks if t.state in (TraceState.work, TraceState.idle)]
    if any(t.state is TraceState.unchecked for t in looks):
        return Decision(Verdict.unverified, Rule.unchecked, d)
    lost_ranks, lost_replicas = _lost_slots(watch, counted)
    short = len(counted) < watch.expected_traces or lost_ranks or lost_replicas
    if short and any(t.state is TraceState.unsettled for t in looks):
        return Decision(Verdict.unverified, Rule.unsettled, d)
    if not counted:
        return Decision(Verdict.missing, Rule.unreadable, d)
    if len(counted) > watch.expected_traces:
        return Decision(Verdict.ambiguous, Rule.extra, d)
    if all(t.state is TraceState.idle for t in counted):
        return Decision(Verdict.empty, Rule.idle, d)
    if short:
        return Decision(Verdict.partial, Rule.lost, d, lost_ranks, lost_replicas)
    return Decision(Verdict.ok, Rule.ok, d)


def trace_on_gpu(path: Path) -> bool:
    """Whether a trace was recorded on a GPU: its header lists the devices (``deviceProperties``;
    a CPU-only run writes none). False where the header cannot be read."""
    try:
        from sidecar.analysis.reader import read_header
        from sidecar.errors import TraceError
    except ImportError:
        return False
    try:
        props = read_header(path).get("deviceProperties")
    except (TraceError, OSError, ValueError):
        return False
    return isinstance(props, list) and bool(props)


def missing_snapshots(watch: StageWatch, found: Scan, counted: list[TraceLook]) -> tuple[str, ...]:
    """For a stage with ``torch_profiler_with_memory`` on: each counted trace recorded on a GPU whose
    session folder holds no ``memory_snapshot_rank<N>.pickle`` (vLLM-Omni dumps one there at the
    stop on CUDA; on a CPU it has no allocator history, so none is expected), as folder/file."""
    if not watch.with_memory or watch.flat:
        return ()
    sessions = {os.path.basename(s.path.rstrip("/")): s for s in found.sessions}
    out = []
    for t in counted:
        s, m = sessions.get(t.folder), TRACE_FILE.match(t.name)
        if s is None or m is None:
            continue
        want = f"memory_snapshot_rank{m.group('rank')}.pickle"
        if any(os.path.basename(f.name) == want for f in s.files):
            continue
        path = Path(s.local_path or "") / t.name
        if trace_on_gpu(path if path.exists() else path.with_name(t.name + ".gz")):
            out.append(f"{t.folder}/{want}")
    return tuple(out)


def _no_snapshot(watch: StageWatch, lost: tuple[str, ...]) -> str:
    return (f"stage {watch.stage_id} records memory (torch_profiler_with_memory) on a GPU but wrote no memory "
            f"snapshot: {', '.join(lost)} is missing (vLLM-Omni dumps the CUDA allocator's history there at the "
            "stop and only logs a failure); the summary still has the memory figures from the trace's events. "
            "Check the server log for this stage")


# --- the words: one place turns a decision into the reason a user reads -----------------------


def _lost(watch: StageWatch, d: Decision) -> str:
    """Which replica or rank is missing, and why, in the user's words."""
    exp, got = watch.expected_traces, len(d.counted)
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
    if d.lost_replicas:
        return (f"{head}: replica(s) {list(d.lost_replicas)} wrote no trace (no complete trace in a "
                f"..._stage_{watch.stage_id}_rep_<replica>_diffusion_<epoch> folder): that replica's worker "
                "most likely died or restarted during the window (vLLM-Omni 0.30 still answers SUCCESS); "
                "check the server log for it")
    if d.lost_ranks:
        return (f"{head}: rank(s) {list(d.lost_ranks)} wrote no trace (no ..._stage{watch.stage_id}_rank<rank>_<epoch> "
                "folder with a complete trace): that worker most likely died during the window "
                "(vLLM-Omni 0.30 still answers SUCCESS); check the server log")
    return (f"{head}: a worker of this stage wrote no trace (it died or restarted during the window; the "
            "server still answers SUCCESS); check the server log")


def _words(watch: StageWatch, found: Scan, d: Decision, *, pending: list[str], timed_out: bool,
           collect_timeout_s: float, shared: list[str], nsys_hint: str | None) -> str | None:
    where = watch.server_dir or "<no torch_profiler_dir>"
    skipped = f" Not counted: {'; '.join(found.skipped)}." if found.skipped else ""
    r = d.rule
    if r is Rule.not_torch:
        return nsys_hint or (
            f"stage {watch.stage_id} is profiled with `{watch.profiler}`, which writes no file the sidecar can check")
    if r is Rule.not_local:
        return (f"stage {watch.stage_id}'s torch_profiler_dir {where} is not a local path the sidecar can "
                "read; mount it and pass --artifact-root SERVER_PATH=LOCAL_PATH")
    if r is Rule.invisible:
        return (f"the sidecar cannot see stage {watch.stage_id}'s folder {where} (looked at "
                f"{watch.local_dir}); if the server runs elsewhere or in a container, mount the folder and "
                "pass --artifact-root SERVER_PATH=LOCAL_PATH")
    if r is Rule.shared:
        return (f"stage {watch.stage_id}'s folder {where} is also written by {', '.join(shared)}, and vLLM-Omni's "
                "folder names carry no server identity: these traces may be the other server's (or overwritten "
                "by it). Give each server its own torch_profiler_dir (`omni-sidecar render --dir` per replica)"
                + skipped)
    if found.not_a_folder:
        return (f"{where} is a file, not a folder: the server could not write stage {watch.stage_id}'s traces there "
                "(plain vLLM warns \"Can't create directory\" and still answers 200). Move the file away, or give "
                "torch_profiler_dir another path, and capture again")
    if r is Rule.no_flat_trace:
        return (f"no new *.pt.trace.json[.gz] in {where} after stop: the worker did not start its profiler, "
                "exported nothing, or died (a dead or restarted worker: the server still answers 200); check "
                "the server log" + skipped)
    if r is Rule.no_session:
        absent = "" if found.dir_exists else " (the folder does not even exist)"
        return (f"no new session folder for stage {watch.stage_id} under {where}{absent} after stop: the stage's "
                "worker did not start its profiler (a dead or restarted worker, or a profiler error: vLLM-Omni "
                "0.30 swallows both and answers SUCCESS); check the server log for this stage" + skipped)
    if r is Rule.no_trace:
        folders = ", ".join(s.path for s in found.sessions)
        return (f"stage {watch.stage_id}: session folder(s) {folders} were opened at start but hold no trace: the "
                "stage's worker most likely died or failed during the window (vLLM-Omni 0.30 swallows that and "
                "still answers SUCCESS), or a second start opened a fresh folder; check the server log for this "
                "stage" + skipped)
    bad = [t.why or t.label for t in d.of(TraceState.unreadable)]
    if r is Rule.unchecked:
        return (f"stage {watch.stage_id}: not checked: {'; '.join(t.why or t.label for t in d.of(TraceState.unchecked))}"
                + skipped)
    if r is Rule.unsettled:
        still = [t.why or t.label for t in d.of(TraceState.unsettled)]
        return (f"stage {watch.stage_id}: cannot tell yet: {'; '.join(still)}; raise collect_timeout_s for "
                "traces this large" + (f"; not counted: {'; '.join(bad)}" if bad else "") + skipped)
    if r is Rule.unreadable:
        return f"stage {watch.stage_id}: no complete trace: {'; '.join(bad)}" + skipped
    extra: list[str] = []
    if bad:
        extra.append(f"not counted: {'; '.join(bad)}")
    if timed_out and pending:
        extra.append(f"gzip had not finished within {collect_timeout_s:g}s for {', '.join(pending)}; the traces "
                     "are uncompressed or still being compressed")
    idle = [t.shown for t in d.counted if t.state is TraceState.idle]
    if r is Rule.extra:
        names = ", ".join(t.label for t in d.counted)
        return "; ".join([(
            f"stage {watch.stage_id} expects {watch.expected_traces} trace(s) in one window and {len(d.counted)} "
            f"arrived ({names}): more than this stage writes, so which are this capture's cannot be told (a "
            "second start in the window, another client, or another server writing here)"), *extra]) + skipped
    if r is Rule.idle:
        return "; ".join([(
            f"no request ran in the window: {', '.join(idle)} record{'s' if len(idle) == 1 else ''} no op and no "
            "kernel (the traces are still listed and downloadable); send requests that reach this stage while the capture is "
            "active, and check delay_iterations / max_iterations"), *extra]) + skipped
    if idle:
        extra.append(f"no op ran in {', '.join(idle)} (idle)")
    if r is Rule.lost:
        return "; ".join([_lost(watch, d), *extra]) + skipped
    return "; ".join(extra) or None


def verdict(watch: StageWatch, found: Scan, *, pending: list[str], timed_out: bool, collect_timeout_s: float,
            writing: set[str] | None = None, note: str | None = None, sharers: list[str] | None = None,
            nsys_hint: str | None = None) -> StageVerdict:
    """Decide (:func:`decide`), then word it (:func:`_words`) into the stage's verdict."""
    shared = [s for s in ([watch.shared_with] if watch.shared_with else []) + (sharers or []) if s]
    looks = [] if watch.local_dir is None or watch.profiler != "torch" or not found.visible else [
        _look(watch, s, label, name, files, writing or set(), collect_timeout_s)
        for (label, name), (s, files) in _traces(watch, found).items()]
    d = decide(watch, found, looks, shared=bool(shared))
    reason = _words(watch, found, d, pending=pending, timed_out=timed_out, collect_timeout_s=collect_timeout_s,
                    shared=shared, nsys_hint=nsys_hint)
    lost = missing_snapshots(watch, found, d.counted)
    if lost:
        reason = f"{reason}; {_no_snapshot(watch, lost)}" if reason else _no_snapshot(watch, lost)
    if note:
        reason = f"{note}; {reason}" if reason else note
    return StageVerdict(stage_id=watch.stage_id, profiler_dir=watch.server_dir, sessions=found.sessions,
                        expected_traces=watch.expected_traces if watch.profiler == "torch" else None,
                        found_traces=None if d.rule in (Rule.not_torch, Rule.not_local, Rule.invisible)
                        else len(d.counted),
                        verdict=d.verdict, reason=reason, rule=d.rule.value, lost_ranks=list(d.lost_ranks),
                        lost_replicas=list(d.lost_replicas))


def after_stop_error(v: StageVerdict, stop_error: UpstreamError) -> StageVerdict:
    """A stage without a trace after a failed stop is ``missing`` for that reason (its worker died,
    or the stop did not reach it), whatever the folder shows; ``ok``, ``unverified`` and ``ambiguous`` stand."""
    if v.verdict in (Verdict.ok, Verdict.unverified, Verdict.ambiguous, Verdict.partial, Verdict.empty):
        return v
    return v.model_copy(
        update={
            "verdict": Verdict.missing,
            "rule": "stop_failed",
            "reason": (
                f"stage {v.stage_id} wrote no trace and the stop failed on the server "
                f"({stop_error.message}): its worker died during the window, or the stop did not reach it "
                "and it is still recording (the next start stops it first). Check the server log for stage "
                f"{v.stage_id} (a crash, an OOM kill, the stop's error) and whether the server still serves "
                "requests; the other stages' traces are kept"
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


FIRST_POLL_S = 0.01  # the first look after the reply comes this soon; later ones back off to poll_s
# Looks run on a few threads of their own, not the loop's default pool: they are mostly Python
# (scans, trace reads) and hold the GIL, and a process with many controllers (a fleet's worker,
# 128 upstream targets) ran 20 of them beside its event loop, which then got the GIL one turn in
# 21 and answered the other targets' stops late (measured: a 1,024-target stop 6x one target's).
LOOK_THREADS = 4
_LOOKS = ThreadPoolExecutor(max_workers=LOOK_THREADS, thread_name_prefix="artifact-look")  # as journal._WRITERS


async def collect(
    watches: list[StageWatch],
    *,
    window: Window | None = None,
    claims: ClaimRegistry | None = None,
    capture_id: str | None = None,
    collect_timeout_s: float = 120,
    trace_quiet_s: float = 2.0,
    poll_s: float = 0.2,
    copy_dir: Path | None = None,
    wait: bool = True,
    note: str | None = None,
    nsys_hints: dict[int, str] | None = None,
) -> list[StageVerdict]:
    """Wait (bounded by ``collect_timeout_s``) until nothing is still being written after the
    reply (an unclosed plain ``.json`` is still being written until it has not changed for
    ``trace_quiet_s``), then return a verdict per stage, in ``watches`` order, and claim what they
    list. ``wait=False`` looks once (a stop that timed out: "found so far"); ``note`` prefixes reasons."""
    deadline = time.monotonic() + collect_timeout_s
    quiets = [_Quiet() for _ in watches]

    def judge(scans: list[Scan], pending: list[tuple[list[str], set[str]]], timed_out: bool) -> list[StageVerdict]:
        out = []
        for w, s, (p, writing) in zip(watches, scans, pending):
            s = _relisted(w, s)
            _copy_rewritten(w, s, copy_dir)
            sharers = claims.sharers(capture_id, str(w.local_dir)) if claims and capture_id and w.local_dir else []
            out.append(verdict(w, s, pending=p, writing=writing, timed_out=timed_out and bool(p),
                               collect_timeout_s=collect_timeout_s, note=note, sharers=sharers,
                               nsys_hint=(nsys_hints or {}).get(w.stage_id)))
            if claims is not None and capture_id is not None:
                claims.claim(capture_id, _claimable(w, s))
        return out

    def look() -> list[StageVerdict] | None:
        """One look at every stage; the verdicts once nothing is pending (or the bound ran out),
        decided in the same thread hop: a small trace is complete at the first look."""
        scans = [scan(w, window, claims, capture_id) for w in watches]
        now = time.monotonic()
        pending = [_pending(w, s, q, now, trace_quiet_s) for w, s, q in zip(watches, scans, quiets)]
        timed_out = now >= deadline
        if not wait or timed_out or not any(p for p, _ in pending):
            return judge(scans, pending, timed_out)
        return None

    # Looks start 10 ms apart and double up to poll_s: a small trace's gzip ends within a few
    # milliseconds of the reply, a big one's takes seconds and is not looked at 100 times a second.
    interval = min(FIRST_POLL_S, poll_s)
    loop = asyncio.get_running_loop()
    while (verdicts := await loop.run_in_executor(_LOOKS, look)) is None:
        await asyncio.sleep(min(interval, max(deadline - time.monotonic(), 0.0)) or interval)
        interval = min(interval * 2, poll_s)
    return verdicts


__all__ = ["WORK_CATEGORIES", "Decision", "Rule", "TraceLook", "TraceState", "after_stop_error", "collect", "decide",
           "found_so_far", "trace_has_work", "verdict"]
