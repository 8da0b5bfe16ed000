"""Python children of this process, each a fresh interpreter (``python -c``) that runs the calls it
is sent and answers each with its value or its error as data. Never a fork of the caller (its
threads), and never the caller's ``__main__`` imported again: multiprocessing's ``spawn`` and
``forkserver`` import it as ``__mp_main__`` in every child, so a script without a main guard ran
its top level twice. A child may cap its address space (``RLIMIT_AS``) and exits as soon as the
process that started it is gone. Imports the standard library and ``sidecar.errors`` only: a
child pays for them before its first call, and for the modules of the function it is sent.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # typing.Self is 3.11+; the package supports 3.10
    from typing_extensions import Self

from sidecar.errors import SidecarError, error_from_wire, error_to_wire

T = TypeVar("T")

_ROOT = str(Path(__file__).resolve().parents[1])  # the folder that holds the `sidecar` package
_ENTRY = "from sidecar._child import serve; serve()"
_HEADER = struct.Struct("!Q")
_OWNER_POLL_S = 0.5  # where there is no pidfd
_CLOSE_GRACE_S = 5.0
_in_child = False


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one, else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a Python child that must import the same `sidecar` as
    this process, installed or not (a checkout run from its folder, a script's ``sys.path``)."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    return env


def in_child() -> bool:
    """Whether this process is a :class:`Child` (its work stays in it: no children of its own)."""
    return _in_child


class ChildExited(RuntimeError):
    """The child was gone before it answered: killed (a kill, the kernel's OOM killer) or crashed."""

    def __init__(self, returncode: int | None) -> None:
        super().__init__(f"the child process exited with code {returncode} before it answered")
        self.returncode = returncode


class Child:
    """One fresh interpreter; ``call`` runs a function there. A context manager (start on enter,
    close on exit). ``memory_bytes`` caps the child's address space; ``kill`` may be called from
    any thread, and the call in flight then raises ``ChildExited``."""

    def __init__(self, *, memory_bytes: int | None = None) -> None:
        self.memory_bytes = memory_bytes
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._rfile: IO[bytes] | None = None
        self._wfile: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> Self:
        ours, theirs = socket.socketpair()
        try:
            # its own session: a terminal's Ctrl-C reaches the caller alone, which ends the child
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(theirs.fileno()), str(os.getpid()), str(self.memory_bytes or 0)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=child_env(), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        try:
            self._rfile, self._wfile = ours.makefile("rb"), ours.makefile("wb")
            # the caller's import path: the function sent is found where the caller found it
            self._send(pickle.dumps(list(sys.path)))
        except BaseException:
            self.kill()
            self.close()
            raise
        return self

    def alive(self) -> bool:
        """Started, and its process has not exited."""
        return self._proc is not None and self._sock is not None and self._proc.poll() is None

    def peak_rss(self) -> int | None:
        """The most resident memory its process has held, in bytes (Linux's ``VmHWM``); None where
        that cannot be read."""
        if self._proc is None:
            return None
        try:
            with open(f"/proc/{self._proc.pid}/status", encoding="ascii", errors="replace") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the child (pickled: a module-level function and plain data).
        A ``SidecarError`` is raised here as the same class, another exception as it was (or as a
        ``SidecarError`` relaying ``internal_error`` where it does not pickle); ``MemoryError``
        when the child ran out of memory and said so, ``ChildExited`` when it just died."""
        if getattr(fn, "__module__", None) == "__main__":
            raise TypeError(f"{fn!r} is defined in __main__, which a child never imports; "
                            "send a function of an importable module")
        task = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._send(task)
            status, value = pickle.loads(self._receive())
        except (EOFError, OSError):
            raise ChildExited(self._exit_code()) from None
        if status == "ok":
            return value  # type: ignore[no-any-return]
        if status == "error":
            raise error_from_wire(value)
        if status == "raised":
            raise value
        raise MemoryError("the child process ran out of memory")

    def kill(self) -> None:
        """SIGKILL the child's process group, without waiting (``close`` reaps it)."""
        if self._proc is not None and self._proc.returncode is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> int | None:
        """End the child: it exits when its socket closes (killed if it does not within a grace,
        busy with a call that no one waits for) and is reaped. Returns its exit code."""
        for f in (self._wfile, self._rfile, self._sock):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._rfile = self._wfile = self._sock = None
        if self._proc is None:
            return None
        try:
            return self._proc.wait(_CLOSE_GRACE_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return self._proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self.kill()  # interrupted or failed: the child's work is of no use any more
        self.close()

    def _send(self, data: bytes) -> None:
        assert self._wfile is not None, "the child was not started"
        _write(self._wfile, data)

    def _receive(self) -> bytes:
        assert self._rfile is not None, "the child was not started"
        return _read(self._rfile)

    def _exit_code(self) -> int | None:
        assert self._proc is not None
        try:
            return self._proc.wait(_CLOSE_GRACE_S)  # its socket closed: it has exited, or is exiting
        except subprocess.TimeoutExpired:
            return None


def map_in_children(fn: Callable[..., T], items: Sequence[Any], *, workers: int,
                    on_done: Callable[[int], None] | None = None) -> list[T]:
    """``[fn(item) for item in items]`` over ``workers`` children, each taking the next item as it
    is free (put the longest first). The first failure ends the others and is raised. ``on_done``
    is called with an item's index as its result comes (from a driver thread)."""
    if not items:
        return []
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(items)):
        todo.put(i)
    results: list[Any] = [None] * len(items)
    failed: list[BaseException] = []
    children = [Child() for _ in range(max(1, min(workers, len(items))))]

    def drive(child: Child) -> None:
        try:
            with child:
                while not failed:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    results[i] = child.call(fn, items[i])
                    if on_done is not None:
                        on_done(i)
        except BaseException as exc:
            failed.append(exc)
            for other in children:
                other.kill()

    threads = [threading.Thread(target=drive, args=(c,), name="omni-sidecar-child", daemon=True) for c in children]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException:  # interrupted (Ctrl-C): no child outlives the call
        for c in children:
            c.kill()
        raise
    if failed:
        # a child killed because another failed says ChildExited: the first failure is the cause
        raise next((e for e in failed if not isinstance(e, ChildExited)), failed[0])
    return results


def _write(out: IO[bytes], data: bytes) -> None:
    out.write(_HEADER.pack(len(data)))
    out.write(data)
    out.flush()


def _read(src: IO[bytes]) -> bytes:
    head = src.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(head)
    data = src.read(size)
    if len(data) < size:
        raise EOFError
    return data


# --- in the child ----------------------------------------------------------------------------


def serve() -> None:
    """The child (``python -c``; argv: its socket's fd, the owner's pid, the memory cap or 0):
    answer each call until the socket closes."""
    global _in_child
    _in_child = True
    fd, owner, limit = (int(a) for a in sys.argv[1:4])
    threading.Thread(target=_watch_owner, args=(owner,), daemon=True, name="owner-watch").start()
    if limit:
        _limit_memory(limit)
    with socket.socket(fileno=fd) as sock, sock.makefile("rb") as src, sock.makefile("wb") as out:
        try:
            sys.path[:] = pickle.loads(_read(src))
            while True:
                _write(out, _answer(_read(src)))
        except (EOFError, BrokenPipeError, ConnectionResetError):  # the caller closed, or is gone
            pass


def _answer(task: bytes) -> bytes:
    try:
        try:
            fn, args, kwargs = pickle.loads(task)
            reply: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        except MemoryError:
            raise
        except Exception as exc:
            reply = _failure(exc)
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except MemoryError:  # the work, or its answer, did not fit under the cap
        return pickle.dumps(("memory", None))
    except Exception as exc:  # the answer does not pickle
        return pickle.dumps(_failure(exc))


def _failure(exc: Exception) -> tuple[str, Any]:
    if isinstance(exc, SidecarError):
        return ("error", error_to_wire(exc))
    try:  # a bug: raised in the caller as it was, where it survives the trip
        pickle.loads(pickle.dumps(exc))
        return ("raised", exc)
    except Exception:
        return ("error", error_to_wire(exc))


def _limit_memory(limit: int) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _watch_owner(owner: int) -> None:
    """Exit at once when ``owner`` (the process that started this child) is gone: a caller killed
    mid-call (``kill -9``) would otherwise leave its child running, holding its stdout and stderr."""
    try:
        fd: int | None = os.pidfd_open(owner)
    except (AttributeError, OSError):  # no pidfd (an old kernel, not Linux), or the owner is gone
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


__all__ = ["Child", "ChildExited", "child_env", "in_child", "map_in_children", "usable_cores"]
