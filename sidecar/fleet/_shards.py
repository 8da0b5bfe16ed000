"""Targets driven from worker processes (``Fleet(processes=P)``).

One Python process spends a few tenths of a millisecond of CPU per HTTP request it sends and reads
(httpx over aiohttp on an event loop), and more per in-process controller (journal, artifact checks): at a
thousand targets a fan-out's start and stop take that a thousand times, one after another.
``ShardPool`` spreads the sidecar and upstream targets over ``P`` worker processes, each an event
loop running the targets' own :class:`~sidecar.fleet._drivers.SidecarDriver` or
:class:`~sidecar.fleet._drivers.UpstreamDriver`; the fleet keeps one :class:`ShardDriver` per
target, a proxy with the same interface, so the protocol (all-or-nothing start, ``start_at``,
rollback, stop, clocks) stays the ``Fleet``'s.

The wire: a socket pair per worker, frames of pickled message lists, one frame per loop turn
each way (a thousand calls made in one turn travel as P frames). A target crosses once (``add``),
its calls name it, and a capture answered crosses as its JSON (``_wire``). A call's failure crosses as data
(class name, code, message, details: ``sidecar.fleet._wire``) and is raised again here as the same
class. A start's release gate stays in the fleet: the worker says when its target arrived at the
gate and waits for the fleet's go (or its abort). A cancelled call is cancelled in its worker too.
A worker that exits fails its calls in flight and every later one, naming it. Workers are fresh
interpreters (``python -c``: never a fork of a trainer's threads, never its main module run
again), started at ``open`` and stopped at ``close``; one whose fleet is gone ends with its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import pickle
import socket
import struct
import sys
from typing import Any

from sidecar._child import child_env, usable_cores
from sidecar.errors import FleetError
from sidecar.fleet._clocks import MORE, ClockOffset
from sidecar.fleet._targets import Target, TargetKind
from sidecar.fleet._wire import answer, failure, raise_reply

__all__ = ["CLOCK_CONCURRENCY", "ShardDriver", "ShardPool", "processes_for"]

SHARD_FROM = 512  # targets from which a fleet drives them from worker processes by default
PER_PROCESS = 128  # targets per worker process, by default
_HEADER = struct.Struct("!I")
_MAX_FRAME = 1 << 30
_WORKER = "import sys; from sidecar.fleet._shards import worker_main; worker_main(sys.argv[1:])"
# Clock exchanges in flight at once, in the fleet and in each worker process (bench/fanout.py
# --clocks measures why a bound is needed).
CLOCK_CONCURRENCY = 16


def processes_for(targets: int, requested: int | None) -> int:
    """Worker processes for ``targets`` sidecar and upstream targets (1: in the fleet's own
    process). ``requested`` None: one per ``PER_PROCESS`` targets from ``SHARD_FROM`` on, leaving
    the fleet a core."""
    if requested is not None:
        return max(1, min(requested, targets))
    if targets < SHARD_FROM:
        return 1
    return max(1, min(usable_cores() - 1, -(-targets // PER_PROCESS)))


async def _read_frame(reader: asyncio.StreamReader) -> list[Any] | None:
    try:
        (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if size > _MAX_FRAME:
            raise ValueError(f"frame of {size} bytes")
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class _Outbox:
    """Messages written as one frame per loop turn."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._items: list[Any] = []

    def put(self, msg: Any) -> None:
        if not self._items:
            asyncio.get_running_loop().call_soon(self._flush)
        self._items.append(msg)

    def _flush(self) -> None:
        items, self._items = self._items, []
        if items and not self.writer.is_closing():
            data = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
            self.writer.write(_HEADER.pack(len(data)) + data)


# --- worker side ---------------------------------------------------------------------------------


class _WorkerGate:
    """The fleet's release gate, seen from a worker: arrive, then wait for the fleet's go."""

    def __init__(self, cid: int, out: _Outbox, gates: dict[int, asyncio.Future[Any]], start_at: float | None,
                 clocks: asyncio.Semaphore | None) -> None:
        self.cid, self._out, self._gates = cid, out, gates
        self.start_at, self.clocks = start_at, clocks

    async def __call__(self) -> None:
        go = self._gates[self.cid] = asyncio.get_running_loop().create_future()
        self._out.put(("arrived", self.cid))
        try:
            raise_reply(await go)
        finally:
            self._gates.pop(self.cid, None)


async def _serve(sock: socket.socket, timeout_s: float, poll_s: float) -> None:
    from sidecar.fleet._drivers import FleetTransports, SidecarDriver, UpstreamDriver

    reader, writer = await asyncio.open_connection(sock=sock)
    out = _Outbox(writer)
    transports = FleetTransports()
    specs: dict[str, tuple[Target, dict[str, Any] | None]] = {}
    drivers: dict[str, Any] = {}
    tasks: dict[int, asyncio.Task[None]] = {}
    gates: dict[int, asyncio.Future[Any]] = {}
    clocks: asyncio.Semaphore | None = None

    def driver(name: str) -> Any:
        d = drivers.get(name)
        if d is None:
            target, upstream = specs[name]
            if upstream is None:
                d = SidecarDriver(target, timeout_s=timeout_s, poll_s=poll_s, transport=transports.for_target())
            else:
                d = UpstreamDriver(target, transport=transports.for_target(), **upstream)
            drivers[name] = d
        return d

    async def run(cid: int, name: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            d = driver(name)
            if method == "close":  # closed as the fleet asked (keep_live): not again at the exit
                drivers.pop(name, None)
            reply: tuple[str, Any] = answer(await getattr(d, method)(*args, **kwargs))
        except asyncio.CancelledError:
            reply = ("cancelled", None)
        except Exception as exc:
            reply = failure(exc)
        finally:
            tasks.pop(cid, None)
        out.put(("done", cid, reply))

    closing = False
    frozen = -1
    while not closing and (frame := await _read_frame(reader)) is not None:
        if len(drivers) > frozen:
            # The imports and the drivers live as long as this process: moved out of the collector's
            # reach, so a full collection does not walk them (128 upstream controllers and their
            # clients: a 70 ms pause, measured, in the middle of a fan-out's answers). Drivers are
            # made by the calls of the frame before; one made later is frozen at the next frame.
            gc.freeze()
            frozen = len(drivers)
        for msg in frame:
            op = msg[0]
            if op == "add":
                specs[msg[1].name] = (msg[1], msg[2])
            elif op == "call":
                _, cid, name, method, args, kwargs, gate = msg
                if gate is not None:
                    start_at, with_clocks = gate
                    if with_clocks and clocks is None:
                        clocks = asyncio.Semaphore(CLOCK_CONCURRENCY)
                    kwargs = {**kwargs, "release": _WorkerGate(cid, out, gates, start_at, clocks if with_clocks else None)}
                tasks[cid] = asyncio.ensure_future(run(cid, name, method, args, kwargs))
            elif op == "go":
                fut = gates.get(msg[1])
                if fut is not None and not fut.done():
                    fut.set_result(msg[2])
            elif op == "cancel":
                task = tasks.get(msg[1])
                if task is not None:
                    task.cancel()
            elif op == "close":
                closing = True
    for task in list(tasks.values()):
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    # drivers the fleet never closed (its process gone): their live captures are stopped
    await asyncio.gather(*(d.close() for d in drivers.values()), return_exceptions=True)
    writer.close()


def worker_main(argv: list[str]) -> None:
    """A worker process: ``argv`` = the socket's fd, the HTTP timeout, the poll interval. It ends
    when the fleet closes it or its socket (the fleet's process gone)."""
    fd, timeout_s, poll_s = int(argv[0]), float(argv[1]), float(argv[2])
    asyncio.run(_serve(socket.socket(fileno=fd), timeout_s, poll_s))


# --- fleet side ----------------------------------------------------------------------------------


class _Shard:
    def __init__(self, index: int, process: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.index, self.process = index, process
        self.reader, self.writer = reader, writer
        self.out = _Outbox(writer)
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.gates: dict[int, Any] = {}  # call id -> the fleet's release hook
        self.gone: str | None = None
        self._ids = itertools.count()
        self._gate_tasks: set[asyncio.Task[None]] = set()
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while (frame := await _read_frame(self.reader)) is not None:
            for msg in frame:
                if msg[0] == "done":
                    fut = self.pending.pop(msg[1], None)
                    self.gates.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg[2])
                elif msg[0] == "arrived":
                    task = asyncio.ensure_future(self._release(msg[1]))
                    self._gate_tasks.add(task)
                    task.add_done_callback(self._gate_tasks.discard)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.process.wait(), 5)
        code = self.process.returncode
        self.gone = (f"fleet worker process {self.index} (pid {self.process.pid}) "
                     + ("closed its socket" if code is None else f"exited with code {code}"))
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(FleetError(f"{self.gone} with this call in flight"))
        self.pending.clear()

    async def _release(self, cid: int) -> None:
        hook = self.gates.get(cid)
        try:
            if hook is not None:
                await hook()
            reply: tuple[str, Any] = ("ok", None)
        except Exception as exc:
            reply = failure(exc)
        self.out.put(("go", cid, reply))

    async def call(self, target: Target, method: str, *args: Any, release: Any = None, **kwargs: Any) -> Any:
        if self.gone is not None:
            raise FleetError(f"{self.gone}: {target.name} cannot be reached through it")
        cid = next(self._ids)
        fut = self.pending[cid] = asyncio.get_running_loop().create_future()
        gate = None
        if release is not None:
            self.gates[cid] = release
            gate = (getattr(release, "start_at", None), getattr(release, "clocks", None) is not None)
        self.out.put(("call", cid, target.name, method, args, kwargs, gate))  # the worker has it by name
        try:
            status, value = await fut
        except asyncio.CancelledError:
            if self.pending.pop(cid, None) is not None:  # cancelled here first: its answer is dropped
                self.out.put(("cancel", cid))
            raise
        if status == "cancelled":
            raise FleetError(f"{target.name}: the call {method} was cancelled in its worker process")
        return raise_reply((status, value))

    async def close(self) -> None:
        if self.gone is None:
            self.out.put(("close",))
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        self.writer.close()
        with contextlib.suppress(BaseException):
            await self.task


class ShardPool:
    """``processes`` worker processes for a fleet's sidecar and upstream targets (target ``i`` on
    worker ``i % processes``). ``open`` spawns them; ``driver`` gives a target's proxy; ``close`` stops them."""

    def __init__(self, processes: int, *, timeout_s: float, poll_s: float) -> None:
        self.processes = processes
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._shards: list[_Shard] = []
        self._next = 0

    async def open(self) -> None:
        # A fresh interpreter per worker, not multiprocessing: spawn would run the caller's main
        # module again (a trainer script without a __main__ guard), fork would copy its threads.
        env = child_env()
        for i in range(self.processes):
            mine, theirs = socket.socketpair()
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", _WORKER, str(theirs.fileno()), str(self.timeout_s), str(self.poll_s),
                    pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL, env=env)
            except BaseException:
                mine.close()
                raise
            finally:
                theirs.close()
            reader, writer = await asyncio.open_connection(sock=mine)
            self._shards.append(_Shard(i, proc, reader, writer))

    def driver(self, target: Target, upstream: dict[str, Any] | None = None) -> ShardDriver:
        """``target``'s proxy: a sidecar target's ``SidecarDriver`` in a worker, or with ``upstream``
        (``UpstreamDriver``'s arguments: deploy, stop_budget_s, settings, state_dir) an upstream
        target's controller there."""
        shard = self._shards[self._next % len(self._shards)]
        self._next += 1
        shard.out.put(("add", target, upstream))
        return ShardDriver(target, shard)

    async def close(self) -> None:
        shards, self._shards = self._shards, []
        await asyncio.gather(*(s.close() for s in shards), return_exceptions=True)


class ShardDriver:
    """A target's driver in a worker process (the Driver interface, by proxy)."""

    def __init__(self, target: Target, shard: _Shard) -> None:
        self.target = target
        self._shard = shard

    async def open(self) -> Any:
        return await self._shard.call(self.target, "open")

    async def start(self, stages, label, duration_s, lease_s, kind="torch", release=None, steps=None):  # type: ignore[no-untyped-def]
        return await self._shard.call(self.target, "start", stages, label, duration_s, lease_s, kind,
                                      release=release, steps=steps)

    async def stop(self, capture_id: str, reason: Any) -> Any:
        return await self._shard.call(self.target, "stop", capture_id, reason)

    async def get(self, capture_id: str) -> Any:
        return await self._shard.call(self.target, "get", capture_id)

    async def wait(self, capture_id: str, timeout: float | None) -> Any:
        return await self._shard.call(self.target, "wait", capture_id, timeout)

    async def heartbeat(self, capture_id: str) -> None:
        await self._shard.call(self.target, "heartbeat", capture_id)

    async def live(self) -> Any:
        return await self._shard.call(self.target, "live")

    async def record_clock(self, capture_id: str, phase: str, clock: ClockOffset) -> None:
        await self._shard.call(self.target, "record_clock", capture_id, phase, clock)

    async def clock(self, more: int = MORE) -> ClockOffset:
        if self.target.kind is TargetKind.upstream:
            # its controller runs in a worker on this host: the traces' clock is this host's, as
            # UpstreamDriver.clock says, with no call across (a thousand of them beside a stop)
            return ClockOffset.in_process()
        return await self._shard.call(self.target, "clock", more)

    async def close(self, keep_live: bool = False) -> None:
        with contextlib.suppress(FleetError):  # a worker already gone has closed its client
            await self._shard.call(self.target, "close", keep_live)
