"""Artifact finder: snapshot each stage's ``torch_profiler_dir`` before start, then find what a
capture can prove is its own: entries new (or rewritten) since that baseline, named for the exact
stage id (LLM and diffusion naming), stamped inside the capture's window, and claimed by no other
capture. Pure file-system work, sync; :mod:`sidecar.control.collect` runs it in a thread and turns
it into verdicts.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.analysis.stream import not_regular, trace_entries
from sidecar.config.models import Stage, StageKind
from sidecar.control.claims import ClaimRegistry
from sidecar.control.models import ArtifactFile, SessionFolder, StageVerdict
from sidecar.versions import TABLE_BY_RANK, TABLE_BY_WORKER

# docs/design.md §3 Artifacts; read from vllm_omni/worker/base.py and diffusion/stage_diffusion_client.py.
LLM_SESSION = re.compile(r"^\d{8}-\d{6}_stage(?P<sid>\d+)_rank(?P<rank>\d+)_(?P<epoch>\d+)$")
DIFFUSION_SESSION = re.compile(
    r"^\d{8}-\d{6}_stage_(?P<sid>\d+)_rep_(?P<rep>\d+)_diffusion_(?P<epoch>\d+)$"
)
TRACE_FILE = re.compile(r"^trace_rank(?P<rank>\d+)\.json(\.gz)?$")
# Plain vLLM (flavor vllm): torch's tensorboard_trace_handler writes straight into the dir, gzipped
# inline before stop answers: worker ``<id>-rank-<r>.<ns>.pt.trace.json.gz`` (0.30) or
# ``[<prefix>_]dp0_pp0_tp0_dcp0_ep0_rank0.<ns>.pt.trace.json.gz`` (0.31 on), and front-end
# ``[<prefix>_]<host>_<pid>.async_llm.<ns>.pt.trace.json.gz`` (vllm/profiler/wrapper.py,
# torch.profiler; every version's names in sidecar/versions.py).
VLLM_TRACE_FILE = re.compile(r"^.+\.(?P<stamp>\d+)\.pt\.trace\.json(\.gz)?$")
VLLM_FRONTEND_TRACE = re.compile(r"^.+\.async_llm\.\d+\.pt\.trace\.json(\.gz)?$")
# Rewritten in place by every later stop: copied into the capture's state folder at collect time.
# Both namings: ``profiler_out_<r>.txt`` (up to 0.31) and ``<worker>.profiler_out.txt`` (0.32 on).
VLLM_TABLE_FILE = re.compile(f"(?:{TABLE_BY_RANK.pattern})|(?:{TABLE_BY_WORKER.pattern})")
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


def is_trace(name: str) -> bool:
    base = os.path.basename(name)
    return bool(TRACE_FILE.match(base) or VLLM_TRACE_FILE.match(base))


def is_worker_trace(name: str, flat: bool) -> bool:
    """A trace that counts towards the stage's expected count (plain vLLM's front-end trace does not)."""
    base = os.path.basename(name)
    if flat:
        return bool(VLLM_TRACE_FILE.match(base)) and not VLLM_FRONTEND_TRACE.match(base)
    return bool(TRACE_FILE.match(base))


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


@dataclass(frozen=True)
class Window:
    """Wall-clock seconds of a capture: ``opened`` just before start was sent, ``started`` when the
    server accepted it, ``closed`` when it answered the stop (None: not yet, or never)."""

    opened: float
    started: float | None = None
    closed: float | None = None
    skew_s: float = 2.0  # clock skew allowed between the server's stamps and ours

    def session_epoch_ok(self, epoch: int) -> bool:
        # A worker stamps its folder with int(time.time()) while handling *our* start.
        upper = self.started if self.started is not None else (self.closed or time.time())
        return math.floor(self.opened) - self.skew_s <= epoch <= upper + self.skew_s

    def stamp_ok(self, seconds: float) -> bool:
        # A plain-vLLM trace is stamped when written: at stop, or mid-window at max_iterations.
        upper = self.closed if self.closed is not None else time.time()
        return self.opened - self.skew_s <= seconds <= upper + self.skew_s


def stamp_seconds(digits: str) -> float:
    """``time.time_ns()`` (19 digits) or milliseconds (13) or seconds (10) in a name, as seconds."""
    value = int(digits)
    return value / 10 ** max(len(digits) - 10, 0)


@dataclass
class StageWatch:
    """One targeted stage: where its folders are, what was there before start, how many traces
    one window writes, and whether another server writes into the same folder."""

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
    profiler: str = "torch"
    replicas: int = 1
    ranks: int = 1  # per replica
    names_collide: bool = False  # LLM replicas write one folder name (vLLM-Omni 0.30)
    shared_with: str | None = None  # who else writes into this folder (told by fleet/settings)
    with_memory: bool = False  # torch_profiler_with_memory: vLLM-Omni dumps a memory snapshot on CUDA
    # plain vLLM >= 0.32: the capture's profile_prefix, which starts every file name of its window:
    # only files named so are its own (another capture's in the same folder never are)
    prefix: str | None = None

    @property
    def expected_traces(self) -> int:
        return self.replicas * self.ranks

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
            "profiler": self.profiler,
            "replicas": self.replicas,
            "ranks": self.ranks,
            "names_collide": self.names_collide,
            "shared_with": self.shared_with,
            "with_memory": self.with_memory,
            "prefix": self.prefix,
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
            profiler=str(data.get("profiler", "torch")),
            replicas=max(int(data.get("replicas", 1)), 1),
            ranks=max(int(data.get("ranks", 1)), 1),
            names_collide=bool(data.get("names_collide", False)),
            shared_with=data.get("shared_with"),
            with_memory=bool(data.get("with_memory", False)),
            prefix=data.get("prefix"),
        )


def _baseline_from_json(raw: object) -> dict[str, str] | None:
    if raw is None:
        return None
    if isinstance(raw, list):
        return {str(n): "" for n in raw}
    return {str(k): str(v) for k, v in dict(raw).items()}  # type: ignore[call-overload]


# Session names carry the start's epoch second; allow for clock skew between server and sidecar.
_REUSE_WINDOW_S = 120


def _session_match(name: str) -> re.Match[str] | None:
    return LLM_SESSION.match(name) or DIFFUSION_SESSION.match(name)


def _session_epoch(name: str) -> int:
    m = _session_match(name)
    return int(m.group("epoch")) if m else 0


def newest_session_second(watches: list[StageWatch]) -> int | None:
    """The newest start second (the epoch in the name) among the stages' session folders in their
    baselines: a start in that same second would get the same folder name and write into it."""
    return max((_session_epoch(n) for w in watches if not w.flat for n in (w.baseline or {})), default=None)


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
                # the name's bytes: a name that is not UTF-8 has no str encoding
                h.update(os.fsencode(e.name) + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    except OSError:
        return ""
    return h.hexdigest()


def _file_digest(entry: os.DirEntry) -> str:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return ""
    return f"{st.st_size}:{st.st_mtime_ns}"


def watch_stage(stage: Stage, roots: dict[str, str], *, flat: bool = False, shared_with: str | None = None) -> StageWatch:
    server_dir = stage.profiler_dir
    pc = stage.profiler_config
    return StageWatch(
        flat=flat,
        stage_id=stage.stage_id,
        kind=stage.kind,
        server_dir=server_dir,
        local_dir=map_server_path(server_dir, roots) if server_dir else None,
        use_gzip=pc.torch_profiler_use_gzip if pc is not None else True,
        profiler=stage.profiler or "torch",
        # A plain vLLM server is one engine: its ranks, not replicas of a stage.
        replicas=1 if flat else stage.replicas,
        ranks=stage.ranks_per_replica,
        names_collide=False if flat else stage.trace_names_collide,
        shared_with=shared_with,
        with_memory=bool(pc is not None and pc.torch_profiler_with_memory),
    )


def name_files(watches: list[StageWatch], prefix: str | None) -> None:
    """Give a capture's flat watches (plain vLLM) the prefix its start asks the server to name its
    files with (``profile_prefix``); a session-folder stage (vLLM-Omni) names nothing so."""
    for watch in watches:
        if watch.flat:
            watch.prefix = prefix


def _named_for(watch: StageWatch, name: str) -> bool:
    return watch.prefix is None or name.startswith(f"{watch.prefix}_")


def snapshot(watch: StageWatch) -> StageWatch:
    """Record the entries of the stage's folder before start (blocking; run in a thread). This
    stage's session folders also get a content digest: two starts within the same second get the
    same folder name (second-resolution timestamp and epoch), and the server then reuses it."""
    names: dict[str, str] = {}
    visible = False
    if watch.local_dir is not None and watch.profiler == "torch":
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
class Scan:
    """What one look at a stage's folder found for this capture."""

    visible: bool
    dir_exists: bool = True
    not_a_folder: bool = False  # a file stands at the folder's path: seen, and nothing can be written there
    sessions: list[SessionFolder] = field(default_factory=list)
    # New entries this capture does not take, with why (outside the window, another capture's).
    skipped: list[str] = field(default_factory=list)

    def signature(self) -> tuple:
        return tuple((s.path, tuple((f.name, f.size) for f in s.files)) for s in self.sessions)


def list_files(folder: Path, attempts: int = 3) -> list[ArtifactFile]:
    """The files under ``folder`` (no symlinks), sorted. A file that is gone between the listing
    and its stat means the folder changed under the listing (a gzip replaced ``trace.json`` by
    ``trace.json.gz``, which the listing may have passed already): the folder is listed again, so
    neither name is lost."""
    out: list[ArtifactFile] = []
    for _ in range(attempts):
        out, vanished = _list_files_once(folder)
        if not vanished:
            break
    return out


def _list_files_once(folder: Path) -> tuple[list[ArtifactFile], bool]:
    out: list[ArtifactFile] = []
    vanished = False
    for dirpath, dirnames, filenames in os.walk(folder):  # os.walk does not follow symlinks
        for name in filenames:
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                vanished = True
                continue
            except OSError:
                continue
            # Decided from this one lstat: asking the path again (isfile) races the gzip that
            # replaces trace.json by trace.json.gz, and would drop the file without a relist.
            if not stat.S_ISREG(st.st_mode):
                continue
            out.append(_artifact_file(os.path.relpath(full, folder), st))
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    out.sort(key=lambda f: f.name)
    return out, vanished


def _artifact_file(name: str, st: os.stat_result) -> ArtifactFile:
    """A listed file with its identity at this look, so a later read can tell it was replaced."""
    return ArtifactFile(name=name, size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)


def changed_since_listed(verdicts: list[StageVerdict]) -> list[str]:
    """``<session folder>/<file>`` of each listed file that is not the file the verdict saw (another
    size, mtime or inode: rewritten, replaced, e.g. by a later start that reused the folder name)
    or is gone. A ``.json`` listed while its gzip ran and now a ``.json.gz`` is the same trace."""
    out: list[str] = []
    for v in verdicts:
        for s in v.sessions:
            if s.local_path is None:
                continue
            for f in s.files:
                if f.copy_path is not None or f.inode is None:
                    continue  # a copy the sidecar took, or listed before identities were recorded
                path = os.path.join(s.local_path, f.name)
                try:
                    st = os.lstat(path)
                except OSError:
                    if f.name.endswith(".json") and TRACE_FILE.match(os.path.basename(f.name)) \
                            and os.path.isfile(path + ".gz"):
                        continue  # gzipped after the verdict, as vLLM-Omni does after its reply
                    out.append(f"{os.path.basename(s.path.rstrip('/'))}/{f.name} (gone)")
                    continue
                if (st.st_size, st.st_mtime_ns, st.st_ino) != (f.size, f.mtime_ns, f.inode):
                    out.append(f"{os.path.basename(s.path.rstrip('/'))}/{f.name}")
    return out


def _scan_flat(watch: StageWatch, local: Path, window: Window | None, claims: ClaimRegistry | None,
               capture_id: str | None) -> Scan:
    baseline = watch.baseline or {}
    files: list[ArtifactFile] = []
    result = Scan(visible=True)
    with os.scandir(local) as it:
        for e in sorted(it, key=lambda e: e.name):
            trace = VLLM_TRACE_FILE.match(e.name)
            if not (trace or VLLM_TABLE_FILE.match(e.name)):
                continue
            if not e.is_file(follow_symlinks=False) or baseline.get(e.name) == _file_digest(e):
                continue  # there before start and untouched since
            if not _named_for(watch, e.name):
                result.skipped.append(f"{e.name} (not named with this capture's prefix {watch.prefix}_: "
                                      "another window's)")
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if window is not None:
                stamp = stamp_seconds(trace.group("stamp")) if trace else st.st_mtime
                if not window.stamp_ok(stamp):
                    result.skipped.append(f"{e.name} (written outside this capture's window)")
                    continue
            owner = claims.held_by_other(e.path, capture_id) if claims is not None else None
            if owner is not None:
                result.skipped.append(f"{e.name} (claimed by capture {owner})")
                continue
            files.append(_artifact_file(e.name, st))
    if any(VLLM_TRACE_FILE.match(f.name) for f in files):
        result.sessions.append(SessionFolder(path=watch.server_dir or str(local), local_path=str(local), files=files))
    return result


def scan(watch: StageWatch, window: Window | None = None, claims: ClaimRegistry | None = None,
         capture_id: str | None = None) -> Scan:
    """The stage's new session folders (or flat files) that this capture can call its own, and
    their files now (blocking; run in a thread). ``window`` None: no time check (tests, tools)."""
    if watch.local_dir is None or watch.profiler != "torch":
        return Scan(visible=False)
    try:
        with os.scandir(watch.local_dir) as it:
            entries = [e for e in it if e.is_dir(follow_symlinks=False)] if not watch.flat else []
    except FileNotFoundError:
        # Never created: the server makes it at the first start of that stage. If its parent is
        # visible we can see the server's files, so the stage made nothing (missing); if not, the
        # path is probably not mounted here (unverified).
        return Scan(visible=watch.local_dir.parent.is_dir(), dir_exists=False)
    except NotADirectoryError:
        # Seen, not hidden: the server cannot make its folder there either (vLLM warns "Can't create
        # directory" and still answers 200), so the stage wrote nothing (missing, not unverified).
        return Scan(visible=True, dir_exists=False, not_a_folder=True)
    except OSError:
        return Scan(visible=False)
    if watch.flat:
        try:
            return _scan_flat(watch, watch.local_dir, window, claims, capture_id)
        except OSError:
            return Scan(visible=False)
    baseline = watch.baseline or {}
    result = Scan(visible=True)
    for entry in sorted(entries, key=lambda e: e.name):
        if session_stage(entry.name, watch.kind) != watch.stage_id:
            continue
        if entry.name in baseline and (not baseline[entry.name] or _digest(entry.path) == baseline[entry.name]):
            continue  # there before start and untouched since
        if window is not None and not window.session_epoch_ok(_session_epoch(entry.name)):
            result.skipped.append(f"{entry.name} (its start stamp is outside this capture's start; "
                                  "another client's start, or a late folder of an earlier window)")
            continue
        owner = claims.held_by_other(entry.path, capture_id) if claims is not None else None
        if owner is not None:
            result.skipped.append(f"{entry.name} (claimed by capture {owner})")
            continue
        local = Path(entry.path)
        server_path = os.path.join(watch.server_dir, entry.name) if watch.server_dir else str(local)
        result.sessions.append(SessionFolder(path=server_path, local_path=str(local), files=list_files(local)))
    return result


def session_replica(session: SessionFolder) -> int | None:
    m = DIFFUSION_SESSION.match(os.path.basename(session.path.rstrip("/")))
    return int(m.group("rep")) if m else None


def session_rank(session: SessionFolder) -> int | None:
    m = LLM_SESSION.match(os.path.basename(session.path.rstrip("/")))
    return int(m.group("rank")) if m else None


def confined(folder: Path, relpath: str) -> tuple[Path | None, str | None]:
    """The one rule for every reader of a capture's files (downloads, summaries, timelines, diffs):
    ``folder/relpath`` as a real path that stays inside ``folder`` (links resolved; the folder
    itself no link) and is a regular file, else None and why. Decided from ``stat``, never by
    opening: opening a FIFO blocks."""
    try:
        root = folder.resolve()
        if folder.is_symlink() or root != folder.parent.resolve() / folder.name:
            return None, f"{folder} became a link since the capture"
        target = root.joinpath(*Path(relpath).parts).resolve()
        if not target.is_relative_to(root):
            return None, f"{folder.name}/{relpath} is a link out of its session folder: not read"
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return None, f"{folder.name}/{relpath} is gone"
    except (OSError, ValueError, RuntimeError) as exc:  # ENAMETOOLONG, a link loop
        return None, f"{folder.name}/{relpath} cannot be looked at ({exc})"
    why = not_regular(mode)
    if why is not None:
        return None, f"{folder.name}/{relpath} {why}"
    return target, None


def trace_files(verdicts: list[StageVerdict]) -> tuple[list[Path], list[str]]:
    """Local paths of every trace file of the given verdicts that exists now and passes
    ``confined`` (for summaries, timelines, diffs), and why each other listed trace was skipped.
    A trace listed as ``.json`` whose gzip finished later is returned as the ``.json.gz``."""
    out: list[Path] = []
    skipped: list[str] = []
    for v in verdicts:
        for s in v.sessions:
            if s.local_path is None:
                continue
            folder = Path(s.local_path)
            listed = {f.name for f in s.files} | {f.name + ".gz" for f in s.files}
            # a trace-named entry the listing left out (no regular file: a folder, a device, a
            # broken link, a loop) is said, so a lost rank shows in the summary and the timeline
            for entry, why in trace_entries(folder, is_trace)[1]:
                rel = entry.relative_to(folder).as_posix()
                if rel not in listed:
                    skipped.append(f"{folder.name}/{rel} {why}")
            for f in s.files:
                if not is_trace(f.name):
                    continue
                name = f.name
                if name.endswith(".json") and not os.path.lexists(folder / name):
                    name += ".gz"
                path, why = confined(folder, name)
                if path is None:
                    skipped.append(why or name)
                elif path not in out:
                    out.append(path)
    return out, skipped


def resolve_artifact(verdicts: list[StageVerdict], relpath: str, copies_root: Path | None = None) -> Path | None:
    """``<session folder name>/<file>`` → a local file inside that session folder (or this
    capture's copy of it under ``copies_root``), or None when it is not one (absolute, ``..``, a
    symlink that leaves the folder, a folder, absent, not a file the capture listed, a name the OS
    refuses). Resolved at serve time: a session folder replaced by a symlink since the capture is refused."""
    if not relpath or "\x00" in relpath or relpath.startswith(("/", "\\")):
        return None
    parts = Path(relpath).parts
    if len(parts) < 2 or any(p in ("..", ".", "") for p in parts):
        return None
    rest = "/".join(parts[1:])
    for v in verdicts:
        for s in v.sessions:
            if s.local_path is None or os.path.basename(s.local_path.rstrip("/")) != parts[0]:
                continue
            listed = next((f for f in s.files if f.name == rest), None)
            if listed is not None and listed.copy_path is not None:
                # What this capture saw, not what a later stop rewrote in place.
                copy = Path(listed.copy_path)
                try:
                    if copies_root is None or copy.is_symlink() or not copy.is_file():
                        return None
                    real = copy.resolve()
                except (OSError, ValueError):
                    return None
                return real if real.is_relative_to(copies_root.resolve()) else None
            if listed is None:
                return None  # only the files this capture listed, not whatever the folder holds now
            return confined(Path(s.local_path), rest)[0]
    return None
