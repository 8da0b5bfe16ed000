"""The second phase of a fleet start: every target prepares its capture (stage selection,
baselines, journal) and then waits at one ``Release``; once all have arrived the starts are sent
together (at ``start_at``, a wall-clock time, when given), so the start skew across replicas is
the send, not the preparation. A target that fails before arriving aborts the release: the
others send nothing (``StartWithheld``).
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import datetime, timezone

from sidecar.errors import StartAtInvalid, StartWithheld

# How far ahead a start may be scheduled: every target's slot is held (prepared, not started)
# until then, so a typo of an hour must not block a fleet for an hour.
START_AT_MAX_S = 600.0


def check_start_at(start_at: float | datetime | None, *, max_ahead_s: float = START_AT_MAX_S,
                   now: float | None = None) -> float | None:
    """``start_at`` as epoch seconds, refused (``StartAtInvalid``) when it is not a finite time,
    not in the future, or more than ``max_ahead_s`` ahead."""
    if start_at is None:
        return None
    if isinstance(start_at, datetime):
        if start_at.tzinfo is None:
            raise StartAtInvalid(f"start_at {start_at.isoformat()} has no time zone; give one (e.g. +00:00) "
                                 "or epoch seconds", details={"start_at": start_at.isoformat()})
        start_at = start_at.timestamp()
    if isinstance(start_at, bool) or not isinstance(start_at, (int, float)) or not math.isfinite(start_at):
        raise StartAtInvalid(f"start_at must be a wall-clock time in epoch seconds (or an aware datetime), "
                             f"got {start_at!r}", details={"start_at": repr(start_at)})
    now = time.time() if now is None else now
    ahead = float(start_at) - now
    shown = datetime.fromtimestamp(start_at, timezone.utc).isoformat(timespec="milliseconds")
    if ahead <= 0:
        raise StartAtInvalid(
            f"start_at {shown} is {-ahead:.3f}s in the past; give a time ahead, leaving the fleet time to open "
            "and prepare every target (seconds for a thousand), e.g. --start-at +5",
            details={"start_at": start_at, "now": now})
    if ahead > max_ahead_s:
        raise StartAtInvalid(
            f"start_at {shown} is {ahead:.0f}s ahead, more than the {max_ahead_s:g}s a fleet holds its targets "
            "prepared; start nearer the time",
            details={"start_at": start_at, "now": now, "max_ahead_s": max_ahead_s})
    return float(start_at)


def parse_start_at(text: str, *, now: float | None = None) -> float:
    """The CLI's ``--start-at``: ``+S`` (seconds from now), epoch seconds, or an ISO 8601 time
    with its zone (``2026-12-01T14:05:00Z``). Refused (``StartAtInvalid``) otherwise; the range
    is checked by :func:`check_start_at`."""
    raw = text.strip()
    now = time.time() if now is None else now
    try:
        if raw.startswith("+"):
            return now + float(raw[1:])
        if raw.replace(".", "", 1).isdigit():
            return float(raw)
        when = datetime.fromisoformat(raw)
    except ValueError:
        raise StartAtInvalid(f"--start-at {text!r} is not a time; write +2 (seconds from now), epoch seconds, "
                             "or an ISO time with its zone such as 2026-12-01T14:05:00Z",
                             details={"start_at": text}) from None
    if when.tzinfo is None:
        raise StartAtInvalid(f"--start-at {text!r} has no time zone; add one (Z or +00:00), or write +S seconds",
                             details={"start_at": text})
    return when.timestamp()


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
