"""A start scheduled at a wall-clock time (``start_at``, epoch seconds): the rule for what is
accepted, shared by a sidecar's own scheduled start (``POST /v1/captures`` with ``start_at``) and
a fleet's (``Fleet.start(start_at=...)``, ``--start-at``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from datetime import datetime, timezone

from sidecar.errors import StartAtInvalid

# How far ahead a start may be scheduled: every target's slot is held (prepared, not started)
# until then, so a typo of an hour must not block a fleet for an hour.
START_AT_MAX_S = 600.0
# The most a request waiting for a scheduled start (``?until=started``) is held open before it is
# answered as it stands: proxies and clients time out. The API's bound, its setting's, the clients'.
HOLD_MAX_S = 30.0


def check_start_at(start_at: float | datetime | None, *, max_ahead_s: float = START_AT_MAX_S,
                   now: float | None = None, past_ok: bool = False) -> float | None:
    """``start_at`` as epoch seconds, refused (``StartAtInvalid``) when it is not a finite time,
    not in the future (unless ``past_ok``: a sidecar told a time its request arrived after starts
    at once and says how late), or more than ``max_ahead_s`` ahead."""
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
    try:
        shown = datetime.fromtimestamp(start_at, timezone.utc).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):  # years past 9999 (or before 1)
        shown = f"{start_at:g}"
    if ahead <= 0 and not past_ok:
        raise StartAtInvalid(
            f"start_at {shown} is {-ahead:.3f}s in the past; give a time ahead, leaving the fleet time to open "
            "and prepare every target (seconds for a thousand), e.g. --start-at +5",
            details={"start_at": start_at, "now": now})
    if ahead > max_ahead_s:
        raise StartAtInvalid(
            f"start_at {shown} is {ahead:.6g}s ahead, more than the {max_ahead_s:g}s a start may be scheduled "
            "ahead (its slot is held until then); start nearer the time",
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


async def wait_until(start_at: float, wake: asyncio.Event, cancelled: Callable[[], bool]) -> None:
    """Until ``start_at`` on this host's wall clock, or until ``cancelled()`` once ``wake`` is set.
    The loop's timers run on the monotonic clock: the wall clock is read again after each wait."""
    while (ahead := start_at - time.time()) > 0 and not cancelled():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), ahead)


__all__ = ["HOLD_MAX_S", "START_AT_MAX_S", "check_start_at", "parse_start_at", "wait_until"]
