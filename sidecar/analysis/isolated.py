"""Run one analysis (a summary, a timeline, a diff) in a child process with a memory limit, so a
hostile trace can cost that child its life but never the server or a live capture.

``run_isolated(fn, *args, **kwargs)`` calls ``fn`` in a fresh child process (``forkserver``, never
a fork of the threaded server) whose address space is capped with ``RLIMIT_AS`` (``memory_bytes``,
default ``ANALYSIS_MEMORY_BYTES``) and returns its result. A ``SidecarError`` raised there is
raised here as the same class; a child that runs out of memory or dies is ``TraceTooLarge``. The
reader's own limits (``sidecar.analysis.reader``) keep a trace within far less than this; the cap
is the second wall. At most ``MAX_WORKERS`` analyses run at once per process (a burst of diff
requests waits its turn rather than multiplying the cap). Sync: call it in a thread from async code.

The children never outlive the sidecar. Each watches the process that asked for it (a pidfd, or
a poll where there is none) and exits when that process is gone: a sidecar killed mid-summary
(``kill -9``, or a SIGTERM that ends it before the summary does) would otherwise leave the child
running, and the forkserver waiting for it, both holding the sidecar's stdout and stderr (a
``concurrent.futures`` worker never notices its parent is gone: it holds its own call queue's
write end). ``stop_all()`` (the API's shutdown) kills the analyses in flight so that a shutdown
never waits for one; their callers get ``SidecarClosing``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from sidecar.errors import SidecarClosing, SidecarError, TraceTooLarge, class_for_code

T = TypeVar("T")

ANALYSIS_MEMORY_BYTES = 1 << 30  # address space of one analysis worker (RSS stays far below)
MAX_WORKERS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)))
_slots = threading.BoundedSemaphore(MAX_WORKERS)
_running: dict[Any, bool] = {}  # child process -> stopped by stop_all()
_running_lock = threading.Lock()
_OWNER_POLL_S = 0.5  # where there is no pidfd
# imported by the forkserver once, so that each analysis child starts with them loaded
PRELOAD = ("sidecar.analysis.summary", "sidecar.analysis.timeline", "sidecar.analysis.diff")


def _limit_memory(limit: int) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _watch_owner(owner: int) -> None:
    """In the child: exit at once when ``owner`` (the sidecar) is gone."""
    try:
        fd: int | None = os.pidfd_open(owner)
    except (AttributeError, OSError):  # no pidfd (an old kernel, not Linux): poll
        fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has exited
        os._exit(70)
    while True:
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            os._exit(70)
        except PermissionError:
            pass
        threading.Event().wait(_OWNER_POLL_S)


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """In the child: ``("ok", result)`` or ``("error", (class name, code, message, details))``."""
    try:
        return "ok", fn(*args, **kwargs)
    except SidecarError as err:
        return "error", (type(err).__name__, err.code, err.message, err.details)
    except MemoryError:
        return "memory", None
    except Exception as exc:  # a bug: raised in the caller as it was (a RuntimeError when it will not pickle)
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return "raised", exc


def _child(conn: Any, limit: int, owner: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    threading.Thread(target=_watch_owner, args=(owner,), daemon=True, name="owner-watch").start()
    _limit_memory(limit)
    try:
        conn.send(_call(fn, args, kwargs))
    except MemoryError:  # the result itself did not fit
        conn.send(("memory", None))
    finally:
        conn.close()


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" not in methods:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _error(name: str, code: str, message: str, details: dict[str, Any]) -> SidecarError:
    import sidecar.errors as errors

    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, SidecarError)):
        cls = class_for_code(code) or SidecarError
    return cls(message, details=details)


def run_isolated(fn: Callable[..., T], *args: Any, memory_bytes: int = ANALYSIS_MEMORY_BYTES, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a memory-capped child process (``fn`` and its arguments are
    pickled: a module-level function and plain data)."""
    with _slots:
        ctx = _context()
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(send, memory_bytes, os.getpid(), fn, args, kwargs),
                           daemon=True, name="omni-sidecar-analysis")  # fmt: skip
        with _running_lock:
            proc.start()
            _running[proc] = False
        send.close()  # the child's end: EOF here once the child is gone
        try:
            try:
                status, value = recv.recv()
            except EOFError:  # killed: the kernel's OOM killer, a crash under the cap, or stop_all()
                status, value = "memory", None
            proc.join()
        finally:
            recv.close()
            with _running_lock:
                stopped = _running.pop(proc, False)
    if stopped:
        raise SidecarClosing("the sidecar is shutting down: the analysis was stopped; ask again once it is back")
    if status == "ok":
        return value  # type: ignore[no-any-return]
    if status == "error":
        raise _error(*value)
    if status == "raised":
        raise value
    raise TraceTooLarge(
        f"the analysis needed more than its {memory_bytes >> 20} MB memory limit and was stopped; the trace is "
        "larger or stranger than the reader's limits expect (see docs/summaries.md, Limits)",
        details={"limit_bytes": memory_bytes},
    )


def stop_all() -> None:
    """Kill every analysis in flight in this process (the sidecar is shutting down): a shutdown
    never waits for a summary; their callers get ``SidecarClosing``."""
    with _running_lock:
        for proc in _running:
            _running[proc] = True
            proc.kill()


__all__ = ["ANALYSIS_MEMORY_BYTES", "MAX_WORKERS", "run_isolated", "stop_all"]
