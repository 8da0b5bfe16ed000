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

The children never outlive the sidecar: each exits when the process that asked for it is gone
(a ``kill -9``, or a SIGTERM that ends it before the summary does). ``stop_all()`` (the API's
shutdown) kills the analyses in flight and refuses those waiting for a slot, so that a shutdown
never waits for one: every analysis asked for before it gets ``SidecarClosing``; one asked for
after it runs as usual (another app in the same process).
"""

from __future__ import annotations

import threading
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


def run_isolated(fn: Callable[..., T], *args: Any, memory_bytes: int = ANALYSIS_MEMORY_BYTES, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a memory-capped child process (``fn`` and its arguments are
    pickled: a function of an importable module, and plain data)."""
    global _busy
    asked = _take_slot()
    child = Child(memory_bytes=memory_bytes)
    try:
        with _turns:
            if _generation != asked:
                raise _closing()
            child.start()
            _running[child] = asked
        try:
            return child.call(fn, *args, **kwargs)
        except (ChildExited, MemoryError):  # stop_all(), the kernel's OOM killer, a crash under the cap
            if _generation != asked:
                raise _closing() from None
            raise TraceTooLarge(
                f"the analysis needed more than its {memory_bytes >> 20} MB memory limit and was stopped; the trace "
                "is larger or stranger than the reader's limits expect (see docs/summaries.md, Limits)",
                details={"limit_bytes": memory_bytes},
            ) from None
    except BaseException:
        child.kill()  # failed or interrupted: no use waiting for the child to end on its own
        raise
    finally:
        with _turns:
            _running.pop(child, None)  # stop_all() no longer kills it: it is reaped below
        child.close()  # before the slot is free: never more than MAX_WORKERS children
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
        _turns.notify_all()


__all__ = ["ANALYSIS_MEMORY_BYTES", "MAX_WORKERS", "run_isolated", "stop_all"]
