"""Run one analysis (a summary, a timeline, a diff) in a child process with a memory limit, so a
hostile trace can cost that child its life but never the server or a live capture.

``run_isolated(fn, *args, **kwargs)`` calls ``fn`` in a fresh worker (``forkserver``, never a fork
of the threaded server) whose address space is capped with ``RLIMIT_AS`` (``memory_bytes``,
default ``ANALYSIS_MEMORY_BYTES``) and returns its result. A ``SidecarError`` raised there is
raised here as the same class; a child that runs out of memory or dies is ``TraceTooLarge``. The
reader's own limits (``sidecar.analysis.reader``) keep a trace within far less than this; the cap
is the second wall. At most ``MAX_WORKERS`` analyses run at once per process (a burst of diff
requests waits its turn rather than multiplying the cap). Sync: call it in a thread from async code.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from sidecar.errors import SidecarError, TraceTooLarge, class_for_code

T = TypeVar("T")

ANALYSIS_MEMORY_BYTES = 1 << 30  # address space of one analysis worker (RSS stays far below)
MAX_WORKERS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)))
_slots = threading.BoundedSemaphore(MAX_WORKERS)


def _limit_memory(limit: int) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """In the worker: ``("ok", result)`` or ``("error", (class name, code, message, details))``."""
    try:
        return "ok", fn(*args, **kwargs)
    except SidecarError as err:
        return "error", (type(err).__name__, err.code, err.message, err.details)
    except MemoryError:
        return "memory", None


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" not in methods:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["sidecar.analysis.summary", "sidecar.analysis.timeline", "sidecar.analysis.diff"])
    return ctx


def _error(name: str, code: str, message: str, details: dict[str, Any]) -> SidecarError:
    import sidecar.errors as errors

    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, SidecarError)):
        cls = class_for_code(code) or SidecarError
    return cls(message, details=details)


def run_isolated(fn: Callable[..., T], *args: Any, memory_bytes: int = ANALYSIS_MEMORY_BYTES, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a memory-capped worker process (``fn`` and its arguments are
    pickled: a module-level function and plain data)."""
    with _slots:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=_context(), initializer=_limit_memory,
                                   initargs=(memory_bytes,))  # fmt: skip
        try:
            status, value = pool.submit(_call, fn, args, kwargs).result()
        except BrokenProcessPool:  # killed: the kernel's OOM killer, or a crash under the cap
            status, value = "memory", None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    if status == "ok":
        return value  # type: ignore[no-any-return]
    if status == "error":
        raise _error(*value)
    raise TraceTooLarge(
        f"the analysis needed more than its {memory_bytes >> 20} MB memory limit and was stopped; the trace is "
        "larger or stranger than the reader's limits expect (see docs/summaries.md, Limits)",
        details={"limit_bytes": memory_bytes},
    )


__all__ = ["ANALYSIS_MEMORY_BYTES", "MAX_WORKERS", "run_isolated"]
