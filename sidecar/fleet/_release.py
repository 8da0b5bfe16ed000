"""The second phase of a fleet start: every target prepares its capture (stage selection,
baselines, journal) and then waits at one ``Release``; once all have arrived the starts are sent
together (at ``start_at``, a wall-clock time, when given), so the start skew across replicas is
the send, not the preparation. A target that fails before arriving aborts the release: the
others send nothing (``StartWithheld``).
"""

from __future__ import annotations

import asyncio
import time

from sidecar.control.schedule import START_AT_MAX_S, check_start_at, parse_start_at
from sidecar.errors import StartWithheld

__all__ = ["START_AT_MAX_S", "Release", "check_start_at", "parse_start_at"]


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
