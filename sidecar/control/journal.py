"""Capture journal: one JSON file per capture under ``<state_dir>/captures/<id>.json``, written
atomically (temp file, fsync, ``os.replace``, fsync of the folder) in a writer thread off the event
loop, so history and a capture left active survive a crash. A file that cannot be used is
quarantined, not fatal. Secrets are scrubbed from every string before it is written. A state dir
belongs to one live sidecar at a time: ``StateDirLock`` (``flock`` on ``<state_dir>/lock``).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sidecar.control.models import Capture
from sidecar.errors import StateDirLocked, StateDirUnusable
from sidecar.scrub import Scrubber

log = logging.getLogger(__name__)

_CAPTURE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# what a writer killed mid-write leaves: atomic_write_text's temp file (mkstemp's ".<name>.XXXXXXXX.tmp"),
# the folder a cache file is built in (``building``: ".building-XXXXXXXX") and check_writable's probe
# (".probe-<pid>"), in the folders the journal writes (also one level down: a fleet's state dir
# holds one per server)
_LEFTOVER = re.compile(r"^\.(?:.+\.[a-z0-9_]{8}\.tmp|probe-\d+|building-[0-9a-f]{8})$")
_WRITTEN_MAX = 4096
_WRITTEN_FOLDERS = ("captures", "summaries", "*/captures", "*/summaries")


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress_oserror():
            os.unlink(tmp)
        raise
    # The rename itself must be durable too, or a crash can bring back the old file.
    with _suppress_oserror():
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)


def set_aside(path: Path, exc: BaseException, *, what: str, after: str = "") -> None:
    """A state-dir file that cannot be used (a journal record, a cached summary), renamed
    ``<name>.bad`` with a warning naming why (``after``: what happens instead), never fatal."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    log.warning("%s: %s cannot be used (%s); quarantined as %s.bad%s", what, path, reason, path.name, after)
    with _suppress_oserror():
        os.replace(path, path.with_name(path.name + ".bad"))


def unusable(state_dir: Path, target: Path, exc: OSError, *, folder: bool = True) -> StateDirUnusable:
    """Why ``target`` (the state dir, or a folder or file in it: ``folder`` says which belongs
    there) could not be made or written, naming the path at fault and its fix. Decided from one
    ``stat`` per path, from the top down: the first that is a file where a folder belongs (or a
    folder where the lock file belongs) is the fault; else the deepest folder there is cannot be
    written by this user."""
    uid = os.getuid()
    at_fault = state_dir
    what = f"cannot be written by this user ({exc.strerror or exc})"
    fix = (f"make it writable for this user (uid {uid}), e.g. `mkdir -p {state_dir} && chown -R {uid} "
           f"{state_dir}`, or pass another --state-dir")
    for p in [*reversed(target.parents), target]:
        try:
            is_dir = stat.S_ISDIR(os.stat(p).st_mode)
        except FileNotFoundError:
            break  # nothing below it exists: its parent is the deepest folder there is
        except OSError as err:  # a folder above it cannot be searched
            at_fault, what = p, f"cannot be read by this user ({err.strerror or err})"
            break
        if p == target and not folder:
            if is_dir:
                at_fault, what = p, "a folder where the sidecar's lock file belongs"
                fix = f"remove that folder (`rmdir {p}`) or pass another --state-dir"
            else:
                at_fault = p
            break
        if not is_dir:
            at_fault, what = p, "a file where a folder belongs"
            fix = ("--state-dir names a folder: pass one (it is created if missing)" if p == state_dir
                   else f"move {p} away (the sidecar makes it a folder) or pass another --state-dir")
            break
        at_fault = p
    return StateDirUnusable(
        f"--state-dir {state_dir} is not usable: {at_fault} {'is ' if what.startswith('a ') else ''}{what}; "
        f"the sidecar keeps its capture journal and lock there. Fix: {fix}",
        key="state_dir",
        details={"state_dir": str(state_dir), "path": str(at_fault)},
    )


class StateDirLock:
    """The claim of one live sidecar on its state dir: an exclusive ``flock`` on
    ``<state_dir>/lock``, a file that names the owner (pid, host, upstream, port). The kernel
    drops the lock when the owner dies, even by kill -9, so a crashed sidecar's dir is taken over
    (and its live captures recovered) by the next one, while a second sidecar on the dir of a live
    one is refused (``StateDirLocked``, naming the owner's pid): it would recover, and so stop,
    the captures the first is running."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir).expanduser() / "lock"
        self._fd: int | None = None
        self.swept: list[str] = []  # temp files the last acquire removed (see _sweep)

    def owner(self) -> dict[str, Any]:
        """What the lock file says about its owner ({} when it says nothing readable)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def acquire(self, **owner: Any) -> None:
        """Take the dir for this process (``owner`` is written into the lock file beside pid and
        host), or raise ``StateDirLocked`` naming the live owner."""
        if self._fd is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise unusable(self.path.parent, self.path, exc, folder=False) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refusal() from None
        except BaseException:
            os.close(fd)
            raise
        text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), **owner}, sort_keys=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
        os.fsync(fd)
        self._fd = fd
        self._sweep()

    def _sweep(self) -> None:
        """Remove the temp files a writer killed mid-write left (the dir is this process's now, so
        none is being written): never a record, only the names ``atomic_write_text`` makes. What
        went is kept in ``swept`` (relative paths) and worded by ``swept_note``."""
        state_dir = self.path.parent
        for folder in _WRITTEN_FOLDERS:
            for d in state_dir.glob(folder):
                with _suppress_oserror():
                    for entry in os.scandir(d):
                        if not _LEFTOVER.match(entry.name) or entry.is_symlink():
                            continue
                        with _suppress_oserror():
                            if entry.is_dir():
                                shutil.rmtree(entry.path)
                            else:
                                os.unlink(entry.path)
                            self.swept.append(os.path.relpath(entry.path, state_dir))

    def swept_note(self) -> str | None:
        """What ``acquire`` removed, in a line for the start-up output, or None."""
        if not self.swept:
            return None
        n, names = len(self.swept), sorted(self.swept)
        return (f"state dir {self.path.parent}: removed {n} temp file{'' if n == 1 else 's'} left by a sidecar that "
                f"died mid-write ({', '.join(names[:5])}{', ...' if n > 5 else ''}); every record is kept")

    def release(self) -> None:
        if self._fd is None:
            return
        with _suppress_oserror():
            os.ftruncate(self._fd, 0)  # the file stays: unlinking it races a sidecar opening it
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None

    def _refusal(self) -> StateDirLocked:
        owner = self.owner()
        pid = owner.get("pid", "unknown")
        state_dir = self.path.parent
        said = ", ".join(f"{k} {owner[k]}" for k in ("host", "upstream", "port", "command") if owner.get(k) is not None)
        return StateDirLocked(
            f"state dir {state_dir} is in use by another live omni-sidecar (pid {pid}"
            f"{', ' + said if said else ''}): one journal belongs to one sidecar, or each would recover "
            f"the other's captures. Stop that sidecar (`kill {pid}`), or give this one its own "
            "--state-dir (the default is per upstream and port)",
            key="state_dir",
            details={"state_dir": str(state_dir), "owner_pid": pid, "owner": owner},
        )

    def __enter__(self) -> StateDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class JournalEntry:
    """A capture as journaled, with the controller's private recovery data (``extra``)."""

    __slots__ = ("capture", "extra")

    def __init__(self, capture: Capture, extra: dict[str, Any] | None = None) -> None:
        self.capture = capture
        self.extra = extra or {}


def _check_entry(path: Path, data: Any) -> JournalEntry:
    """The entry in ``path``, or ``ValueError``/``ValidationError`` saying why it cannot be used.
    Everything recovery relies on is checked here, so one bad file cannot stop the others."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    extra = data.pop("_recovery", None)
    cap = Capture.model_validate(data)
    if not _CAPTURE_ID.match(cap.id) or f"{cap.id}.json" != path.name:
        raise ValueError(f"capture id {cap.id!r} does not match the file name")
    for field in ("created_at", "started_at", "stop_requested_at", "stopped_at", "finished_at"):
        value = getattr(cap, field, None)
        if value is not None and value.utcoffset() is None:
            raise ValueError(f"{field} has no timezone")
    if extra is not None:
        if not isinstance(extra, dict) or not isinstance(extra.get("watches", []), list):
            raise ValueError("recovery data is not {\"watches\": [...]}")
        from sidecar.control.artifacts import StageWatch

        for w in extra.get("watches", []):
            StageWatch.from_json(w)  # raises on malformed recovery data
    return JournalEntry(cap, extra)


# fsyncs wait on the disk, not the CPU: a few threads keep many journals' writes moving
_WRITERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="journal")


class CaptureJournal:
    """The journal of one sidecar. Writes are handed to the process's journal writer threads
    (``_WRITERS``, shared by every journal, so a fleet of a thousand in-process controllers holds
    a few threads, not a thousand; per file the newest write wins; ``flush`` waits for them), so
    fsyncs never block the event loop. A file that cannot be used is
    quarantined (renamed ``*.bad``) and counted, and the rest loads. ``keep`` / ``keep_days``
    bound the history of finished captures."""

    def __init__(self, state_dir: Path, *, keep: int | None = None, keep_days: float | None = None) -> None:
        self.state_dir = Path(state_dir).expanduser()
        self.dir = self.state_dir / "captures"
        self.keep = keep
        self.keep_days = keep_days
        self.quarantined: list[str] = []  # file names set aside at load
        self.write_errors = 0
        self.last_write_error: str | None = None
        self._pending: list[Future[None]] = []  # writes handed over and not yet known done
        self._lock = threading.Lock()
        self._io = threading.Lock()  # this journal's files are written one at a time
        self._seq = 0
        # per file, the newest write on disk (or deletion), for the newest _WRITTEN_MAX files: a write
        # queued behind a newer one of its file is never 4,096 files old; one entry per capture ever
        # written grew by ~300 bytes a capture for the sidecar's life
        self._written: OrderedDict[Path, int] = OrderedDict()

    def path(self, capture_id: str) -> Path:
        if not _CAPTURE_ID.match(capture_id):
            raise ValueError(f"not a capture id: {capture_id!r}")
        return self.dir / f"{capture_id}.json"

    def check_writable(self) -> None:
        """Refuse a state dir that cannot hold the journal (``StateDirUnusable``, naming the fix):
        without it there is no history and no recovery of a capture left active."""
        probe = self.dir / f".probe-{os.getpid()}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(probe, "ok")
            probe.unlink()
        except OSError as exc:
            raise unusable(self.state_dir, self.dir, exc) from None

    def health(self) -> dict[str, Any]:
        return {
            "quarantined": len(self.quarantined),
            "write_errors": self.write_errors,
            "last_write_error": self.last_write_error,
        }

    # --- writes --------------------------------------------------------------------------

    def write(self, capture: Capture, extra: dict[str, Any] | None = None) -> Future[None]:
        """Journal ``capture`` as it is now: serialized here, written in the writer thread."""
        scrubber = Scrubber()  # the environment is read once per write, not per string
        data = scrubber.data(capture.model_dump(mode="json"))
        if extra:
            data["_recovery"] = scrubber.data(extra)
        path = self.path(capture.id)
        text = json.dumps(data, indent=1, sort_keys=True)
        with self._lock:
            self._seq += 1
            fut = _WRITERS.submit(self._write_file, path, text, self._seq)
            self._pending = [f for f in self._pending if not f.done()] + [fut]
        return fut

    def _write_file(self, path: Path, text: str, seq: int) -> None:
        try:
            with self._io:
                if self._written.get(path, 0) > seq:
                    return  # a newer state of this capture is on disk already
                atomic_write_text(path, text)
                self._note_written(path, seq)
        except OSError as exc:
            # The capture goes on; losing history is better than leaving a profiler running.
            self.write_errors += 1
            self.last_write_error = f"{path.name}: {exc.strerror or exc}"
            log.error("journal: cannot write %s: %s", path, exc)

    def _note_written(self, path: Path, seq: int) -> None:
        self._written[path] = seq
        self._written.move_to_end(path)
        while len(self._written) > _WRITTEN_MAX:
            self._written.popitem(last=False)

    async def flush(self) -> None:
        """Until every write handed over so far is on disk (or failed and counted)."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            await asyncio.wrap_future(fut)

    def drain(self) -> None:
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            fut.result()

    # --- reads ---------------------------------------------------------------------------

    def load(self) -> list[JournalEntry]:
        """Every usable capture, oldest first, after retention. A file that cannot be used (not
        JSON, not a capture, an id that is not its file name, a date without a timezone,
        malformed recovery data) is renamed ``<name>.bad`` with a warning and counted."""
        self.drain()
        if not self.dir.is_dir():
            return []
        out: list[JournalEntry] = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                out.append(_check_entry(p, json.loads(p.read_text(encoding="utf-8"))))
            except (OSError, ValueError, TypeError, KeyError, ValidationError) as exc:
                set_aside(p, exc, what="journal")
                self.quarantined.append(p.name)
        out.sort(key=lambda e: (e.capture.created_at, e.capture.id))
        dropped = set(self.expired([e.capture for e in out]))
        return [e for e in out if e.capture.id not in dropped]

    # --- retention -----------------------------------------------------------------------

    def expired(self, captures: list[Capture], now: datetime | None = None) -> list[str]:
        """Ids of finished captures past retention (beyond the newest ``keep`` finished ones, or
        finished more than ``keep_days`` ago); their journal and summary files are deleted. Live
        captures are never dropped."""
        if self.keep is None and self.keep_days is None:
            return []
        done = sorted((c for c in captures if c.terminal), key=lambda c: (c.created_at, c.id), reverse=True)
        drop: list[Capture] = []
        if self.keep is not None:
            drop.extend(done[self.keep :])
        if self.keep_days is not None:
            cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=self.keep_days)
            drop.extend(c for c in done[: self.keep] if (c.finished_at or c.created_at) < cutoff)
        ids = [c.id for c in drop]
        if ids:
            with self._lock:
                self._seq += 1
                fut = _WRITERS.submit(self._delete_files, ids, self._seq)
                self._pending = [f for f in self._pending if not f.done()] + [fut]
        return ids

    def _delete_files(self, ids: list[str], seq: int) -> None:
        """A dropped capture's record, the files cached for it in ``summaries/`` (``<id>.*``: its
        summary, timeline, a ``.bad`` one) and its copies in ``artifacts/<id>/`` (the tables plain
        vLLM rewrites at every stop). ``summaries/`` is listed once for the whole batch: a start-up
        that drops thousands listed it once per capture."""
        dropped = set(ids)
        with self._io:
            for cid in ids:
                self._note_written(self.path(cid), seq)  # an older write still queued does not bring it back
                with _suppress_oserror():
                    self.path(cid).unlink()
                shutil.rmtree(self.state_dir / "artifacts" / cid, ignore_errors=True)
            with _suppress_oserror():
                for entry in os.scandir(self.state_dir / "summaries"):
                    if _owner(entry.name, dropped) is not None:
                        with _suppress_oserror():
                            os.unlink(entry.path)

    # Summaries are cached beside the journal, not in it: they can be large and are recomputable.
    def summary_path(self, capture_id: str) -> Path:
        self.path(capture_id)  # validates the id
        return self.state_dir / "summaries" / f"{capture_id}.json"

    def building(self, capture_id: str, name: str) -> Path:
        """Where to build the file a capture's ``summaries/<name>`` caches (under its own name, which
        a gzip header names, in a hidden folder of ``summaries/`` that retention passes over and a
        restart's sweep removes if left) before ``adopt`` moves it there."""
        self.path(capture_id)  # validates the id
        folder = self.state_dir / "summaries" / f".building-{secrets.token_hex(4)}"
        folder.mkdir(parents=True)
        return folder / name

    def adopt(self, capture_id: str, built: Path) -> Path | None:
        """``built`` (from ``building``) moved to ``summaries/``, unless retention dropped the capture
        meanwhile: None then, and ``built`` stays the caller's (to serve once, then ``discard``).
        Under the I/O lock retention deletes under: the record is there, or its files are gone."""
        target = self.state_dir / "summaries" / built.name
        with self._io:
            if not self.path(capture_id).is_file():
                return None
            os.replace(built, target)
        self.discard(built)
        return target

    @staticmethod
    def discard(built: Path) -> None:
        """The folder ``built`` was made in (``building``), with whatever is left in it."""
        shutil.rmtree(built.parent, ignore_errors=True)

    def write_summary(self, capture_id: str, text: str) -> bool:
        """Cache a capture's summary (blocking), unless retention dropped the capture meanwhile (its
        record is gone): a summary that outlived its capture's record was never deleted. False then."""
        built = self.building(capture_id, self.summary_path(capture_id).name)
        try:
            atomic_write_text(built, text)
            return self.adopt(capture_id, built) is not None
        finally:
            self.discard(built)


def _owner(name: str, ids: set[str]) -> str | None:
    """The capture of ``ids`` a file in ``summaries/`` belongs to (``<id>.<anything>``), or None."""
    dot = name.find(".")
    while dot > 0:
        if name[:dot] in ids:
            return name[:dot]
        dot = name.find(".", dot + 1)
    return None
