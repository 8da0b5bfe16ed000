"""A fleet's pacing of the many controllers it drives on one event loop (injected into each, see
sidecar/control/pacing.py): the blocking calls of one loop tick share one thread hop, and a stop's
follow-up work waits for the other stops sent on that loop. A sidecar's lone controller has none of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

class _ThreadBatch:
    """Blocking calls made in one event-loop tick run in one thread hop: a fan-out starting a
    thousand controllers at once takes one worker thread for their baselines, not a thousand
    hops queued on the default pool."""

    def __init__(self) -> None:
        self._pending: list[tuple[Callable[[], Any], asyncio.Future[Any]]] | None = None

    async def run(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self._pending is None:
            self._pending = []
            loop.call_soon(self._flush, loop)
        self._pending.append((fn, fut))
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending or [], None

        def work() -> list[tuple[bool, Any]]:
            out: list[tuple[bool, Any]] = []
            for fn, _ in batch:
                try:
                    out.append((True, fn()))
                except BaseException as exc:  # handed to its caller, like to_thread does
                    out.append((False, exc))
            return out

        def done(results: asyncio.Future[list[tuple[bool, Any]]]) -> None:
            if results.cancelled() or results.exception() is not None:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(results.exception() or asyncio.CancelledError())
                return
            for (_, fut), (ok, value) in zip(batch, results.result()):
                if fut.done():  # its caller was cancelled meanwhile
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

        loop.run_in_executor(None, work).add_done_callback(done)


# A stop's follow-up work waits at most this long for the other stops sent on its event loop.
FOLLOW_UP_WAIT_S = 1.0


class _StopsInFlight:
    """The upstream stops sent and not yet answered by the controllers of one event loop. A
    stop's follow-up work (the after-window scrape, the artifact looks) waits, at most
    ``FOLLOW_UP_WAIT_S``, until none is: in a process that drives many controllers (a fleet's
    worker, 128 upstream targets stopped in one turn) each answered stop's scrape and looks ran
    between the other stops' answers and delayed them (measured: 128 targets in one process
    stopped in 3.7x one target's time with them beside, 2.4x without). A stop counts as in
    flight until its answer is published (the capture's change that its waiters see), and the
    follow-ups start two loop turns after the last one is: the answer's waiter (a fleet worker
    sending it on) runs first. Released at once, the look threads and 128 follow-ups held the
    last answer of a fleet worker back 40 to 145 ms (device, 1,024 targets: each worker's last
    stop answered in time, its answer to the fleet late). A lone controller's own stop is
    answered when its follow-up starts, so it never waits."""

    def __init__(self) -> None:
        self.count = 0
        self.quiet = asyncio.Event()
        self.quiet.set()

    def sending(self) -> Callable[[], None]:
        """One stop sent; returns its ``answered`` callback (once is counted; call it again freely)."""
        self.count += 1
        self.quiet.clear()
        ended = False

        def answered() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.count -= 1
                if not self.count:
                    self.quiet.set()

        return answered

    async def answered(self) -> None:
        if not self.quiet.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.quiet.wait(), FOLLOW_UP_WAIT_S)
        for _ in range(2):  # the answers' waiters first (the change woke them a turn ago)
            await asyncio.sleep(0)


_T = TypeVar("_T")
_SNAPSHOTS: dict[asyncio.AbstractEventLoop, _ThreadBatch] = {}
_STOPS: dict[asyncio.AbstractEventLoop, _StopsInFlight] = {}


def _of_loop(table: dict[asyncio.AbstractEventLoop, _T], make: Callable[[], _T]) -> _T:
    """This event loop's entry of ``table`` (made on first use; closed loops' entries dropped)."""
    loop = asyncio.get_running_loop()
    entry = table.get(loop)
    if entry is None:
        for old in [lp for lp in table if lp.is_closed()]:
            del table[old]
        entry = table[loop] = make()
    return entry


class LoopPacing:
    """:class:`sidecar.control.pacing.Pacing` for the controllers of one fleet process: each event
    loop gets its own batch and its own stops in flight."""

    async def run_blocking(self, fn: Callable[[], Any]) -> Any:
        return await _of_loop(_SNAPSHOTS, _ThreadBatch).run(fn)

    def stop_sent(self) -> Callable[[], None]:
        return _of_loop(_STOPS, _StopsInFlight).sending()

    async def before_follow_up(self) -> None:
        await _of_loop(_STOPS, _StopsInFlight).answered()


FLEET_PACING = LoopPacing()

__all__ = ["FLEET_PACING", "FOLLOW_UP_WAIT_S", "LoopPacing"]
