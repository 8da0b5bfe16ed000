"""Who owns which trace folder: a registry shared by every ``CaptureController`` of one process
(the fleet's in-process upstream targets, a test's several controllers). A capture claims the
session folders (or plain-vLLM files) it reported; no other capture may take them. It also
records which folders each capture watched and when, so two servers writing into one folder at
the same time are seen (their folder names carry no server identity: docs/design.md §3).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

# Bounded: old captures' claims only matter while their folders could still be mistaken for new
# ones, and the baseline snapshot covers everything that existed before a start.
_MAX_CAPTURES = 4096


@dataclass
class _Watch:
    upstream: str
    dirs: frozenset[str]
    opened: float
    started: float | None = None
    closed: float | None = None

    def reusable_by(self, other: _Watch) -> bool:
        """Same server, finished, and ``other`` opened within the second of this one's start:
        only then can the server have reused this capture's folder name for ``other``'s start
        (names have second resolution). Anything later in its folder is this capture's late file."""
        if self.upstream != other.upstream or self.closed is None:
            return False
        return other.opened <= (self.started if self.started is not None else self.opened) + 1.0


class ClaimRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # scans run in worker threads
        self._owner: dict[str, str] = {}  # real path -> capture id
        self._claimed: OrderedDict[str, list[str]] = OrderedDict()  # capture id -> its paths
        self._watches: OrderedDict[str, _Watch] = OrderedDict()
        # real dir -> the captures that watched it: sharers() looks at those only, not at every
        # capture of the process (a fleet of a thousand in-process targets stopped together)
        self._watchers: dict[str, dict[str, None]] = {}  # (a dict: in the order they opened)

    @staticmethod
    def _key(path: str | os.PathLike[str]) -> str:
        return os.path.realpath(path)

    def open_window(self, capture_id: str, upstream: str, dirs: list[str], opened: float) -> None:
        keys = frozenset(self._key(d) for d in dirs)  # file system calls: outside the lock
        with self._lock:
            old = self._watches.get(capture_id)
            if old is not None:
                self._unwatch(capture_id, old)
            self._watches[capture_id] = _Watch(upstream, keys, opened)
            for key in keys:
                self._watchers.setdefault(key, {})[capture_id] = None
            self._trim()

    def _unwatch(self, capture_id: str, w: _Watch) -> None:
        for key in w.dirs:
            ids = self._watchers.get(key)
            if ids is not None:
                ids.pop(capture_id, None)
                if not ids:
                    del self._watchers[key]

    def mark_started(self, capture_id: str, started: float) -> None:
        with self._lock:
            w = self._watches.get(capture_id)
            if w is not None:
                w.started = started

    def close_window(self, capture_id: str, closed: float) -> None:
        with self._lock:
            w = self._watches.get(capture_id)
            if w is not None and w.closed is None:
                w.closed = closed

    def sharers(self, capture_id: str, directory: str) -> list[str]:
        """Upstream URLs of other servers' captures that watched ``directory`` while this one did."""
        key = self._key(directory)
        with self._lock:
            me = self._watches.get(capture_id)
            if me is None:
                return []
            out = []
            for cid in self._watchers.get(key, ()):
                w = self._watches[cid]
                if cid == capture_id or w.upstream == me.upstream:
                    continue
                me_end = me.closed if me.closed is not None else float("inf")
                w_end = w.closed if w.closed is not None else float("inf")
                if w.opened <= me_end and me.opened <= w_end and w.upstream not in out:
                    out.append(w.upstream)
            return out

    def owner(self, path: str | os.PathLike[str]) -> str | None:
        key = self._key(path)
        with self._lock:
            return self._owner.get(key)

    def held_by_other(self, path: str | os.PathLike[str], capture_id: str | None) -> str | None:
        """The capture that holds ``path`` against ``capture_id``, or None. A finished capture of the
        same server does not hold a folder that server reused for a start in the same second (the
        names have second resolution, and the new start rewrote it): that one passes on."""
        key = self._key(path)
        with self._lock:
            owner = self._owner.get(key)
            if owner is None or owner == capture_id:
                return None
            theirs, mine = self._watches.get(owner), self._watches.get(capture_id or "")
            if theirs is not None and mine is not None and theirs.reusable_by(mine):
                return None
            return owner

    def claim(self, capture_id: str, paths: list[str]) -> list[str]:
        """Claim ``paths`` for ``capture_id``; returns those another capture already holds (not taken)."""
        taken: list[str] = []
        keys = [self._key(p) for p in paths]  # file system calls: outside the lock
        with self._lock:
            mine = self._claimed.setdefault(capture_id, [])
            for p, key in zip(paths, keys):
                owner = self._owner.get(key)
                if owner is not None and owner != capture_id:
                    theirs, me = self._watches.get(owner), self._watches.get(capture_id)
                    if not (theirs is not None and me is not None and theirs.reusable_by(me)):
                        taken.append(p)
                        continue
                if owner != capture_id:
                    self._owner[key] = capture_id
                    mine.append(key)
            self._trim()
        return taken

    def _trim(self) -> None:
        while len(self._claimed) > _MAX_CAPTURES:
            _, paths = self._claimed.popitem(last=False)
            for key in paths:
                self._owner.pop(key, None)
        while len(self._watches) > _MAX_CAPTURES:
            self._unwatch(*self._watches.popitem(last=False))


# The one registry of this process (controllers take another for isolation in tests).
CLAIMS = ClaimRegistry()
