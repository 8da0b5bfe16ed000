"""Run one analysis (a summary, a timeline, a diff) in a child process with a memory limit, so a
hostile trace can cost that child its life but never the server or a live capture.

``run_isolated(fn, *args, **kwargs)`` calls ``fn`` in a fresh interpreter (``sidecar._child``:
never a fork of the threaded server, never the caller's ``__main__`` imported again) whose
address space is capped with ``RLIMIT_AS`` (``memory_bytes``, default ``ANALYSIS_MEMORY_BYTES``)
and returns its result. A ``SidecarError`` raised there is raised here as the same class; a child
that runs out of memory or dies is ``TraceTooLarge``. The reader's own limits
(``sidecar.analysis.reader``) keep a trace within far less than this; the cap is the second wall.
At most ``MAX_WORKERS`` analyses run at once per process (a burst of diff requests waits its turn
rather than multiplying the cap). Sync: call it in a thread from async code.

A child that answered is kept, started, for the next analysis (``KEEP_IDLE``, each for
``IDLE_S``): a fresh interpreter costs 0.35 s of CPU before its first line of work, four times a
small trace's whole analysis (bench/isolated.py), and beside a CPU server's busy engines a summary
in a fresh one took 3 to 12 s (docs/summaries.md). One that failed, was stopped, or peaked above
``REUSE_MAX_RSS`` is never reused: the next analysis gets a fresh one, its own cap whole.

The children never outlive the sidecar: each exits when the process that asked for it is gone
(a ``kill -9``, or a SIGTERM that ends it before the summary does). ``stop_all()`` (the API's
shutdown) kills the analyses in flight and refuses those waiting for a slot, so that a shutdown
never waits for one: every analysis asked for before it gets ``SidecarClosing``; one asked for
after it runs as usual (another app in the same process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sidecar._child import Child, ChildExited, usable_cores
from sidecar.errors import SidecarClosing, TraceTooLarge

T = TypeVar("T")

ANALYSIS_MEMORY_BYTES = 1 << 30  # address space of one analysis worker (RSS stays far below)
MAX_WORKERS = max(1, min(4, usable_cores()))
_turns = threading.Condition()  # guards the three below
_busy = 0  # analyses holding a slot
_queued = 0  # analyses waiting for one
_running: dict[Child, int] = {}  # child -> the generation its analysis was asked in
_generation = 0  # moved on by stop_all(): every analysis asked before it is refused
KEEP_IDLE = 1  # children kept started between analyses
IDLE_S = 60.0  # how long one is kept unused
REUSE_MAX_RSS = 256 << 20  # a child whose resident memory peaked above this is not reused
_idle: list[tuple[Child, int, float]] = []  # kept children: (child, its memory cap, parked at)


def _closing() -> SidecarClosing:
    return SidecarClosing("the sidecar is shutting down: the analysis was stopped; ask again once it is back")


def _take_slot() -> int:
    """Wait for a free slot; the generation the analysis was asked in. ``SidecarClosing`` once
    ``stop_all()`` has run since."""
    global _busy, _queued
    with _turns:
        asked = _generation
        _queued += 1
        try:
            while _busy >= MAX_WORKERS and _generation == asked:
                _turns.wait()
        finally:
            _queued -= 1
        if _generation != asked:
            raise _closing()
        _busy += 1
        return asked


def _idle_child(memory_bytes: int) -> Child | None:
    """A kept child with this memory cap, still alive; None where there is none (under ``_turns``)."""
    for i, (child, cap, _) in enumerate(_idle):
        if cap == memory_bytes:
            del _idle[i]
            if child.alive():
                return child
            child.close()  # gone already (killed, its owner's cap): reaped at once
            return None
    return None


def _park(child: Child, memory_bytes: int, asked: int) -> bool:
    """Keep ``child`` for the next analysis where it may serve one; False: close it (under ``_turns``)."""
    if _generation != asked or len(_idle) >= KEEP_IDLE or not child.alive():
        return False
    peak = child.peak_rss()
    if peak is None or peak > REUSE_MAX_RSS:
        return False
    _idle.append((child, memory_bytes, time.monotonic()))
    timer = threading.Timer(IDLE_S, _expire)
    timer.daemon = True
    timer.start()
    return True


def _expire() -> None:
    """Close the children kept unused for ``IDLE_S`` or more."""
    now = time.monotonic()
    with _turns:
        old = [c for c, _, at in _idle if now - at >= IDLE_S - 0.01]
        _idle[:] = [e for e in _idle if e[0] not in old]
    for child in old:
        child.close()


def run_isolated(fn: Callable[..., T], *args: Any, memory_bytes: int = ANALYSIS_MEMORY_BYTES, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a memory-capped child process (``fn`` and its arguments are
    pickled: a function of an importable module, and plain data)."""
    global _busy
    asked = _take_slot()
    child: Child | None = None
    keep = False
    try:
        with _turns:
            if _generation != asked:
                raise _closing()
            child = _idle_child(memory_bytes)
            if child is None:
                child = Child(memory_bytes=memory_bytes).start()
            _running[child] = asked
        try:
            value = child.call(fn, *args, **kwargs)
        except (ChildExited, MemoryError):  # stop_all(), the kernel's OOM killer, a crash under the cap
            if _generation != asked:
                raise _closing() from None
            raise TraceTooLarge(
                f"the analysis needed more than its {memory_bytes >> 20} MB memory limit and was stopped; the trace "
                "is larger or stranger than the reader's limits expect (see docs/summaries.md, Limits)",
                details={"limit_bytes": memory_bytes},
            ) from None
        keep = True  # it answered: it may serve the next one
        return value
    except BaseException:
        if child is not None:
            child.kill()  # failed or interrupted: no use waiting for the child to end on its own
        raise
    finally:
        with _turns:
            if child is not None:
                _running.pop(child, None)  # stop_all() no longer kills it: it is reaped below
                keep = keep and _park(child, memory_bytes, asked)
        if child is not None and not keep:
            child.close()  # before the slot is free: never more than MAX_WORKERS children at work
        with _turns:
            _busy -= 1
            _turns.notify()


def stop_all() -> None:
    """Kill every analysis in flight in this process and refuse those waiting for a slot (the
    sidecar is shutting down): a shutdown never waits for a summary; their callers get
    ``SidecarClosing``."""
    global _generation
    with _turns:
        _generation += 1
        for child in _running:
            child.kill()
        kept = [c for c, _, _ in _idle]
        _idle.clear()
        _turns.notify_all()
    for child in kept:
        child.kill()
        child.close()


__all__ = ["ANALYSIS_MEMORY_BYTES", "IDLE_S", "KEEP_IDLE", "MAX_WORKERS", "REUSE_MAX_RSS", "run_isolated", "stop_all"]
