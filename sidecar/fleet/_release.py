"""The one start gate of a fan-out, for every driver. Each target prepares its capture (stage
selection, baselines, journal) and then waits at one :class:`Release`; once all have arrived the
starts are sent together (at ``start_at``, a wall-clock time, when given), so the start skew across
replicas is the send, not the preparation. A target that fails before arriving aborts the release:
the others send nothing (``StartWithheld``).

A driver gets a :class:`Gate` (its target's place at the release). An in-process controller awaits
it as its ``release`` hook. A target in another process (a sidecar over HTTP, a Ray node actor)
goes through :func:`gated_start`: with ``start_at`` it is told the time on its own clock ahead and
starts itself then (its start is scheduled where the server is, not timed by the fan-out); an
abort meanwhile cancels that scheduled start, and a start that went ahead all the same is stopped,
here and only here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from sidecar.control.models import CaptureState, StopReason
from sidecar.control.schedule import START_AT_MAX_S, check_start_at, parse_start_at
from sidecar.errors import SidecarError, StartWithheld

if TYPE_CHECKING:
    from sidecar.control.models import Capture
    from sidecar.fleet._clocks import ClockOffset

__all__ = ["START_AT_MAX_S", "Gate", "Release", "check_start_at", "gated_start", "parse_start_at"]


class Release:
    """One barrier for ``count`` targets. Each target calls :meth:`arrive` once (its controller's
    ``release`` hook, or its start ending before it) and waits in :meth:`wait`; the last arrival
    releases everyone, not before ``start_at``. With ``barrier=False`` (a fleet that starts at
    most ``max_concurrency`` at once cannot hold all of them) each target goes at ``start_at``
    or when it is ready, whichever is later."""

    def __init__(self, count: int, *, start_at: float | None = None, barrier: bool = True) -> None:
        self.start_at = start_at
        self.released_at: float | None = None  # wall clock when the starts were let go
        self._left = count if barrier else 0
        self._go = asyncio.Event()
        self._abort: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        if self._left == 0:
            self._open()

    def gate(self, clocks: asyncio.Semaphore | None = None) -> Gate:
        """One target's place at this release."""
        return Gate(self, clocks)

    def arrive(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._open()

    def abort(self, why: str) -> None:
        """Nobody still waiting sends (each gets ``StartWithheld`` with ``why``)."""
        if self._go.is_set():
            return
        self._abort = why
        if self._timer is not None:
            self._timer.cancel()
        self._go.set()

    def _open(self) -> None:
        delay = 0.0 if self.start_at is None else self.start_at - time.time()
        if delay <= 0:
            self._set()
        else:
            self._timer = asyncio.get_running_loop().call_later(delay, self._set)

    def _set(self) -> None:
        if not self._go.is_set():
            self.released_at = time.time()
            self._go.set()

    async def wait(self) -> None:
        if not self._go.is_set():
            await self._go.wait()
        if self._abort is not None:
            raise StartWithheld(f"start prepared but not sent: {self._abort}")
        if self.start_at is not None:
            # call_later fires on the loop's monotonic clock; the targets honour the wall clock.
            late = self.start_at - time.time()
            if late > 0:
                await asyncio.sleep(late)


class Gate:
    """One target's place at a :class:`Release`, handed to its driver's start: awaited once the
    start is prepared, just before it is sent (arrive, then wait for the go; ``StartWithheld`` on
    an abort). ``start_at``: the release's time (the fleet's clock); ``clocks``: the bound on clock
    exchanges in flight for a start told ``start_at`` on its target's clock (None: the exchange is
    off, the clocks are taken as one)."""

    def __init__(self, release: Release, clocks: asyncio.Semaphore | None) -> None:
        self.release = release
        self.start_at = release.start_at
        self.clocks = clocks
        self.arrived = False
        self.clock: ClockOffset | None = None  # the target's clock, where an exchange mapped start_at

    async def __call__(self) -> None:
        if not self.arrived:
            self.arrived = True
            self.release.arrive()
        await self.release.wait()

    def failed(self, why: str) -> None:
        """This target's start ended before it arrived: nobody sends (all or nothing)."""
        if not self.arrived:
            self.arrived = True
            self.release.arrive()
            self.release.abort(why)


async def gated_start(
    gate: Gate | None, *,
    send: Callable[[], Awaitable[Capture]],
    schedule: Callable[[float], Awaitable[Capture | None]],
    started: Callable[[str], Awaitable[Capture]],
    cancel: Callable[[str], Awaitable[Any]],
    clock: Callable[[], Awaitable[ClockOffset]],
) -> Capture:
    """A start on a target in another process, through ``gate``. ``send()``: the start now (its
    answer once the server started); ``schedule(at)``: the start told ``at`` on the target's clock,
    answered once prepared (state ``starting``), or None where the target cannot take a time;
    ``started(id)``: that capture once it left ``starting``; ``cancel(id)``: its stop; ``clock()``:
    the target's clock against the fleet's (``not_found`` where the target has no clock route)."""
    if gate is None:
        return await send()
    if gate.start_at is not None:
        offset = await _offset(gate, clock)
        cap = None if offset is None else await schedule(gate.start_at + offset)
        if cap is not None:
            return await _held(gate, cap, started, cancel)
    # Not scheduled (no start_at, or a target that cannot take one): the gate times the request.
    await gate()
    return await send()


async def _offset(gate: Gate, clock: Callable[[], Awaitable[ClockOffset]]) -> float | None:
    """The target's clock minus the fleet's (s), by an exchange taken now, in the lead before
    ``start_at`` (kept as ``gate.clock``: the fleet's record of the target's clock at its start);
    None where the target has no clock route (a build before ``start_at`` too)."""
    if gate.clocks is None:
        return 0.0
    try:
        async with gate.clocks:
            measured = await clock()
    except SidecarError as err:
        if err.code != "not_found":
            raise
        return None
    gate.clock = measured
    # within its own error bound the offset is not measured, only noise: the clocks agree as far as
    # the exchange can tell (same host, NTP), and a start never leaves early for it
    return measured.offset_s if abs(measured.offset_ns) > measured.error_ns else 0.0


async def _held(gate: Gate, cap: Capture, started: Callable[[str], Awaitable[Capture]],
                cancel: Callable[[str], Awaitable[Any]]) -> Capture:
    """A start scheduled on its target: the target sends it at its time by itself; the gate only
    withholds it. Aborted (another target failed first, the fan-out cancelled), the scheduled start
    is cancelled on the target, which stops it instead if it had gone already (a late abort)."""
    waiting = asyncio.ensure_future(started(cap.id))
    try:
        await gate()
    except BaseException:
        waiting.cancel()
        with contextlib.suppress(Exception):
            await asyncio.shield(cancel(cap.id))
        raise
    cap = await waiting
    if cap.state is CaptureState.active or (cap.state is CaptureState.stopping
                                            and cap.stop_reason is not StopReason.rollback):
        return cap
    # its start failed (rolled back) or was cancelled: the target's record says why
    err = cap.errors[-1] if cap.errors else None
    raise SidecarError.relay(err.code if err else "start_failed",
                             err.message if err else f"capture {cap.id} ended {cap.state.value} before it started",
                             details={"capture_id": cap.id})
