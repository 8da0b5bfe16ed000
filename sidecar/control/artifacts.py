"""Artifact finder and checker: snapshot each stage's ``torch_profiler_dir`` before start, find the
NEW session folders of that stage after stop (LLM and diffusion naming, exact stage id), wait for gzip
and stable sizes within a bound, then give a per-stage ``StageVerdict``. Filesystem work is sync
here and run through ``asyncio.to_thread`` by :func:`collect`, so big folders never block the loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.config.models import Stage, StageKind
from sidecar.control.models import ArtifactFile, SessionFolder, StageVerdict, Verdict

# DESIGN.md §3 Artifacts; read from vllm_omni/worker/base.py and diffusion/stage_diffusion_client.py.
LLM_SESSION = re.compile(r"^\d{8}-\d{6}_stage(?P<sid>\d+)_rank(?P<rank>\d+)_(?P<epoch>\d+)$")
DIFFUSION_SESSION = re.compile(
    r"^\d{8}-\d{6}_stage_(?P<sid>\d+)_rep_(?P<rep>\d+)_diffusion_(?P<epoch>\d+)$"
)
TRACE_FILE = re.compile(r"^trace_rank\d+\.json(\.gz)?$")
# Plain vLLM (flavor vllm): torch's tensorboard_trace_handler writes straight into the dir, gzipped
# inline: ``<worker>.<ms>.pt.trace.json[.gz]`` (vllm/profiler/wrapper.py).
VLLM_TRACE_FILE = re.compile(r"^.+\.pt\.trace\.json(\.gz)?$")
VLLM_TABLE_FILE = re.compile(r"^profiler_out_\d+\.txt$")
_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def session_stage(name: str, kind: StageKind = StageKind.unknown) -> int | None:
    """The stage id a session folder name belongs to, or None when it is not a session folder
    of that kind. Ids are matched as whole numbers, so ``stage1`` never matches ``stage10``."""
    patterns = {
        StageKind.llm: (LLM_SESSION,),
        StageKind.diffusion: (DIFFUSION_SESSION,),
    }.get(kind, (LLM_SESSION, DIFFUSION_SESSION))
    for pattern in patterns:
        m = pattern.match(name)
        if m:
            return int(m.group("sid"))
    return None


def map_server_path(server_path: str, roots: dict[str, str]) -> Path | None:
    """Where the sidecar reads a server path: the longest ``--artifact-root`` prefix that matches
    (whole path components only), else the path itself. None for URIs (gs://, s3://, ...)."""
    if _URI.match(server_path):
        return None
    path = os.path.expanduser(server_path)
    best: tuple[str, str] | None = None
    for server_root, local_root in roots.items():
        root = server_root.rstrip("/") or "/"
        if path == root or path.startswith(root.rstrip("/") + "/"):
            if best is None or len(root) > len(best[0]):
                best = (root, local_root)
    if best is not None:
        rest = path[len(best[0]) :].lstrip("/")
        return Path(os.path.expanduser(best[1])) / rest
    # vLLM makes the dir absolute against the server's cwd; the sidecar assumes it shares that cwd.
    return Path(os.path.abspath(path))


@dataclass
class StageWatch:
    """One targeted stage: where its folders are, and what was there before start."""

    stage_id: int
    kind: StageKind
    server_dir: str | None
    local_dir: Path | None
    use_gzip: bool = True
    # Entry name -> content digest before start (digest only for this stage's session folders,
    # "" for other entries); None: not snapshotted.
    baseline: dict[str, str] | None = None
    baseline_visible: bool = False
    flat: bool = False  # plain vLLM layout: trace files directly in the dir, no session folders

    def to_json(self) -> dict:
        return {
            "stage_id": self.stage_id,
            "kind": self.kind.value,
            "server_dir": self.server_dir,
            "local_dir": str(self.local_dir) if self.local_dir else None,
            "use_gzip": self.use_gzip,
            "baseline": dict(sorted(self.baseline.items())) if self.baseline is not None else None,
            "baseline_visible": self.baseline_visible,
            "flat": self.flat,
        }

    @classmethod
    def from_json(cls, data: dict) -> StageWatch:
        return cls(
            stage_id=int(data["stage_id"]),
            kind=StageKind(data.get("kind", "unknown")),
            server_dir=data.get("server_dir"),
            local_dir=Path(data["local_dir"]) if data.get("local_dir") else None,
            use_gzip=bool(data.get("use_gzip", True)),
            baseline=_baseline_from_json(data.get("baseline")),
            baseline_visible=bool(data.get("baseline_visible", False)),
            flat=bool(data.get("flat", False)),
        )


def _baseline_from_json(raw: object) -> dict[str, str] | None:
    if raw is None:
        return None
    if isinstance(raw, list):
        return {str(n): "" for n in raw}
    return {str(k): str(v) for k, v in dict(raw).items()}  # type: ignore[call-overload]


# Session names carry the start's epoch second; allow for clock skew between server and sidecar.
_REUSE_WINDOW_S = 120


def _session_epoch(name: str) -> int:
    m = LLM_SESSION.match(name) or DIFFUSION_SESSION.match(name)
    return int(m.group("epoch")) if m else 0


def _digest(folder: str) -> str:
    """What a session folder holds now: changes when any file is added, removed or rewritten."""
    h = hashlib.blake2b(digest_size=8)
    try:
        with os.scandir(folder) as it:
            for e in sorted(it, key=lambda e: e.name):
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                h.update(f"{e.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    except OSError:
        return ""
    return h.hexdigest()


def _file_digest(entry: os.DirEntry) -> str:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return ""
    return f"{st.st_size}:{st.st_mtime_ns}"


def _scan_flat(watch: StageWatch, local: Path) -> _Scan:
    baseline = watch.baseline or {}
    files: list[ArtifactFile] = []
    with os.scandir(local) as it:
        for e in sorted(it, key=lambda e: e.name):
            if not (VLLM_TRACE_FILE.match(e.name) or VLLM_TABLE_FILE.match(e.name)):
                continue
            if not e.is_file(follow_symlinks=False) or baseline.get(e.name) == _file_digest(e):
                continue  # there before start and untouched since
            try:
                files.append(ArtifactFile(name=e.name, size=e.stat(follow_symlinks=False).st_size))
            except OSError:
                continue
    result = _Scan(visible=True)
    if any(VLLM_TRACE_FILE.match(f.name) for f in files):
        result.sessions.append(SessionFolder(path=watch.server_dir or str(local), local_path=str(local), files=files))
    return result


def watch_stage(stage: Stage, roots: dict[str, str], *, flat: bool = False) -> StageWatch:
    server_dir = stage.profiler_dir
    pc = stage.profiler_config
    return StageWatch(
        flat=flat,
        stage_id=stage.stage_id,
        kind=stage.kind,
        server_dir=server_dir,
        local_dir=map_server_path(server_dir, roots) if server_dir else None,
        use_gzip=pc.torch_profiler_use_gzip if pc is not None else True,
    )


def snapshot(watch: StageWatch) -> StageWatch:
    """Record the entries of the stage's folder before start (blocking; run in a thread). This
    stage's session folders also get a content digest: two starts within the same second get the
    same folder name (second-resolution timestamp and epoch), and the server then reuses it."""
    names: dict[str, str] = {}
    visible = False
    if watch.local_dir is not None:
        try:
            with os.scandir(watch.local_dir) as it:
                recent = time.time() - _REUSE_WINDOW_S
                for e in it:
                    # Only entries a scan could report are kept: the journal stays small.
                    if watch.flat:
                        if VLLM_TRACE_FILE.match(e.name) or VLLM_TABLE_FILE.match(e.name):
                            names[e.name] = _file_digest(e)
                        continue
                    if session_stage(e.name, watch.kind) != watch.stage_id:
                        continue
                    # Only a folder named in the last moments can be reused by the coming start.
                    fresh = _session_epoch(e.name) >= recent and e.is_dir(follow_symlinks=False)
                    names[e.name] = _digest(e.path) if fresh else ""
            visible = True
        except OSError:
            # The server creates the folder at the first start, so absent now is not yet a problem.
            pass
    watch.baseline = names
    watch.baseline_visible = visible
    return watch


@dataclass
class _Scan:
    visible: bool
    dir_exists: bool = True
    sessions: list[SessionFolder] = field(default_factory=list)
    gzip_pending: list[str] = field(default_factory=list)  # files still being compressed

    def signature(self) -> tuple:
        return tuple((s.path, tuple((f.name, f.size) for f in s.files)) for s in self.sessions)


def _list_files(folder: Path) -> list[ArtifactFile]:
    out: list[ArtifactFile] = []
    for dirpath, dirnames, filenames in os.walk(folder):  # os.walk does not follow symlinks
        for name in filenames:
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue  # removed meanwhile (gzip deletes the .json when done)
            if not os.path.isfile(full) or os.path.islink(full):
                continue
            out.append(ArtifactFile(name=os.path.relpath(full, folder), size=st.st_size))
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    out.sort(key=lambda f: f.name)
    return out


def scan(watch: StageWatch) -> _Scan:
    """The stage's new session folders and their files now (blocking; run in a thread)."""
    if watch.local_dir is None:
        return _Scan(visible=False)
    try:
        with os.scandir(watch.local_dir) as it:
            entries = [e for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        # Never created: the server makes it at the first start of that stage. If its parent is
        # visible we can see the server's files, so the stage made nothing (missing); if not, the
        # path is probably not mounted here (unverified).
        return _Scan(visible=watch.local_dir.parent.is_dir(), dir_exists=False)
    except OSError:
        return _Scan(visible=False)
    if watch.flat:
        try:
            return _scan_flat(watch, watch.local_dir)
        except OSError:
            return _Scan(visible=False)
    baseline = watch.baseline or {}
    result = _Scan(visible=True)
    for entry in sorted(entries, key=lambda e: e.name):
        if session_stage(entry.name, watch.kind) != watch.stage_id:
            continue
        if entry.name in baseline and (not baseline[entry.name] or _digest(entry.path) == baseline[entry.name]):
            continue  # there before start and untouched since
        local = Path(entry.path)
        files = _list_files(local)
        server_path = (
            os.path.join(watch.server_dir, entry.name) if watch.server_dir else str(local)
        )
        result.sessions.append(SessionFolder(path=server_path, local_path=str(local), files=files))
        if watch.use_gzip:
            # gzip -f removes trace_rank<N>.json only once the .gz is complete.
            result.gzip_pending += [
                f"{entry.name}/{f.name}" for f in files if TRACE_FILE.match(f.name) and f.name.endswith(".json")
            ]
    return result


def _verdict(watch: StageWatch, found: _Scan, timed_out: bool, collect_timeout_s: float) -> StageVerdict:
    sv = StageVerdict(stage_id=watch.stage_id, profiler_dir=watch.server_dir, sessions=found.sessions)
    where = watch.server_dir or "<no torch_profiler_dir>"
    if watch.local_dir is None:
        sv.verdict = Verdict.unverified
        sv.reason = (
            f"stage {watch.stage_id}'s torch_profiler_dir {where} is not a local path the sidecar can "
            "read; mount it and pass --artifact-root SERVER_PATH=LOCAL_PATH"
        )
        return sv
    if not found.visible:
        sv.verdict = Verdict.unverified
        sv.reason = (
            f"the sidecar cannot see stage {watch.stage_id}'s folder {where} (looked at "
            f"{watch.local_dir}); if the server runs elsewhere or in a container, mount the folder and "
            "pass --artifact-root SERVER_PATH=LOCAL_PATH"
        )
        return sv
    if not found.sessions and watch.flat:
        sv.verdict = Verdict.missing
        sv.reason = (
            f"no new *.pt.trace.json[.gz] in {where} after stop: the worker did not start its profiler "
            "or exported nothing; check the server log"
        )
        return sv
    if not found.sessions:
        sv.verdict = Verdict.missing
        absent = "" if found.dir_exists else " (the folder does not even exist)"
        sv.reason = (
            f"no new session folder for stage {watch.stage_id} under {where}{absent} after stop: the stage's "
            "worker did not start its profiler (dead or restarted worker, or a profiler error swallowed "
            "by the server); check the server log for this stage"
        )
        return sv
    trace = VLLM_TRACE_FILE if watch.flat else TRACE_FILE
    without_trace = [
        s.path for s in found.sessions if not any(trace.match(f.name) and f.size > 0 for f in s.files)
    ]
    if without_trace:
        sv.verdict = Verdict.empty
        sv.reason = (
            f"stage {watch.stage_id}: session folder(s) {', '.join(without_trace)} hold no non-empty "
            "trace_rank*.json[.gz]: the profiler started but exported nothing. Either the stage's worker "
            "died or failed during the window (vLLM-Omni swallows that and still answers SUCCESS: check "
            "the server log for this stage), a second start opened a fresh folder, or no request reached "
            "this stage and max_iterations/delay_iterations left nothing to trace"
        )
        return sv
    sv.verdict = Verdict.ok
    if timed_out and found.gzip_pending:
        sv.reason = (
            f"gzip had not finished within {collect_timeout_s:g}s for {', '.join(found.gzip_pending)}; "
            "the traces are uncompressed or still being compressed"
        )
    elif timed_out:
        sv.reason = f"file sizes were still changing after {collect_timeout_s:g}s; the listing may be incomplete"
    return sv


async def collect(
    watches: list[StageWatch],
    *,
    collect_timeout_s: float = 120,
    settle_s: float = 1.0,
    poll_s: float = 0.2,
) -> list[StageVerdict]:
    """Wait until no trace is still being gzipped and the listing is unchanged for ``settle_s``
    (bounded by ``collect_timeout_s``), then return a verdict per stage, in ``watches`` order."""
    deadline = time.monotonic() + collect_timeout_s
    last_sig: tuple | None = None
    stable_since = time.monotonic()
    while True:
        scans = await asyncio.to_thread(lambda: [scan(w) for w in watches])
        now = time.monotonic()
        sig = tuple(s.signature() for s in scans)
        if sig != last_sig:
            last_sig, stable_since = sig, now
        pending = any(s.gzip_pending for s in scans)
        if not pending and now - stable_since >= settle_s:
            return [_verdict(w, s, False, collect_timeout_s) for w, s in zip(watches, scans)]
        if now >= deadline:
            return [_verdict(w, s, True, collect_timeout_s) for w, s in zip(watches, scans)]
        await asyncio.sleep(min(poll_s, max(deadline - now, 0.0)) or poll_s)


def trace_paths(verdicts: list[StageVerdict]) -> list[Path]:
    """Local paths of every trace file of the given verdicts that exists now (for summaries).
    A trace listed as ``.json`` whose gzip finished later is returned as the ``.json.gz``."""
    out: list[Path] = []
    for v in verdicts:
        for s in v.sessions:
            if s.local_path is None:
                continue
            for f in s.files:
                name = os.path.basename(f.name)
                if not (TRACE_FILE.match(name) or VLLM_TRACE_FILE.match(name)):
                    continue
                path = Path(s.local_path) / f.name
                if not path.is_file() and path.suffix == ".json":
                    path = path.with_name(path.name + ".gz")
                if path.is_file() and path not in out:
                    out.append(path)
    return out


def resolve_artifact(verdicts: list[StageVerdict], relpath: str) -> Path | None:
    """``<session folder name>/<file>`` → a local file inside that session folder, or None when it
    is not one (absolute, ``..``, a folder, absent, not a file the capture listed, a name the OS
    refuses). Resolved now, at serve time: a session folder replaced by a symlink since the capture,
    or a file that is a link leaving the folder, is refused."""
    if not relpath or "\x00" in relpath or relpath.startswith(("/", "\\")):
        return None
    parts = Path(relpath).parts
    if len(parts) < 2 or any(p in ("..", ".", "") for p in parts):
        return None
    name = "/".join(parts[1:])
    for v in verdicts:
        for s in v.sessions:
            if s.local_path is None or os.path.basename(s.local_path.rstrip("/")) != parts[0]:
                continue
            if name not in {f.name for f in s.files}:
                return None  # only the files this capture listed, not whatever the folder holds now
            try:
                folder = Path(s.local_path)
                root = folder.resolve()
                if folder.is_symlink() or root != folder.parent.resolve() / folder.name:
                    return None  # the session folder itself became a link since the capture
                target = root.joinpath(*parts[1:]).resolve()
                if not target.is_relative_to(root) or not target.is_file():
                    return None
            except (OSError, ValueError):  # e.g. a 300-character name: ENAMETOOLONG
                return None
            return target
    return None
    parts = Path(relpath).parts
    if len(parts) < 2 or any(p in ("..", ".", "") for p in parts):
        return None
    for v in verdicts:
        for s in v.sessions:
            if s.local_path is None or os.path.basename(s.local_path.rstrip("/")) != parts[0]:
                continue
            if session_stage(parts[0]) is None and "/".join(parts[1:]) not in {f.name for f in s.files}:
                return None  # a flat (plain vLLM) dir: only this capture's files, not its neighbours
            root = Path(s.local_path).resolve()
            target = (root.joinpath(*parts[1:])).resolve()
            if not target.is_relative_to(root) or not target.is_file():
                return None
            return target
    return None
