"""Clock offsets: how far each target's wall clock is from the fleet's, measured NTP-style.

One exchange = a few samples; each sample reads the fleet's clock (``time.time_ns``), asks the
target for its clocks (a sidecar's ``GET /v1/clock``, a Ray node actor's ``clock()``), and reads
the fleet's clock again. The target's reading is taken somewhere inside that round trip, so
``offset = target − fleet at the midpoint`` is off by at most half the round trip: ``error_ns =
rtt / 2`` is a bound, not an estimate. The sample with the shortest round trip is kept.
A target driven in-process reads the fleet's own clock: offset 0, error 0, ``method`` says so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from pydantic import BaseModel

# A few samples: the shortest round trip of 3 is within a few hundred µs of the best of 10 on an
# idle loopback, and a thousand targets pay 3 requests each, not 10 (bench/fanout.py --clocks).
# While the best round trip still bounds the error above GOOD_NS (a loaded host), up to ``more``
# samples more are taken (MORE for one exchange alone; a fleet shares FLEET_MORE over its
# targets: a thousand targets take none, two take 32), PAUSE_S and more apart: back to back, they
# would meet the same busy moment.
SAMPLES = 3
MORE = 6
FLEET_MORE = 64
GOOD_NS = 2_000_000
PAUSE_S = 0.002

# Clock exchanges in flight at once in a fleet (bench/fanout.py --clocks measures why a bound is
# needed: a thousand at once queue on one event loop, and each round trip, the error bound, grows).
CLOCK_CONCURRENCY = 16

# What a target answers: its realtime and monotonic clocks, in ns.
ClockReading = tuple[int, int]


class ClockOffset(BaseModel):
    """One target's clock against the fleet's, at one exchange (start or stop)."""

    offset_ns: int  # the target's realtime − the fleet's, at the best sample's midpoint
    error_ns: int  # |true offset − offset_ns| ≤ this (half the best sample's round trip)
    rtt_ns: int
    samples: int
    at_ns: int  # the fleet's realtime at that midpoint
    target_monotonic_ns: int | None = None  # the target's monotonic clock then (None in-process)
    method: Literal["exchange", "in_process"] = "exchange"

    @classmethod
    def in_process(cls) -> ClockOffset:
        """A target driven by this process reads this host's clock: no offset, stated."""
        now = time.time_ns()
        return cls(offset_ns=0, error_ns=0, rtt_ns=0, samples=0, at_ns=now, method="in_process")

    @property
    def offset_s(self) -> float:
        return self.offset_ns / 1e9


async def exchange(read: Callable[[], Awaitable[ClockReading]], *, samples: int = SAMPLES, more: int = MORE,
                   good_ns: int = GOOD_NS) -> ClockOffset:
    """``samples`` round trips to ``read`` (and up to ``more`` while the error bound is above
    ``good_ns``); the offset of the shortest one (see the module doc)."""
    best: tuple[int, int, int, int] | None = None  # rtt, offset, midpoint, target monotonic
    taken = 0
    while taken < max(1, samples) or (taken < max(1, samples) + more and best is not None and best[0] > 2 * good_ns):
        if taken >= max(1, samples):  # the pause grows (to 20 ms): a busy spell can last a while
            await asyncio.sleep(min(PAUSE_S * 2 ** ((taken - samples) // 4), 0.02))
        taken += 1
        t0 = time.time_ns()
        real, mono = await read()
        t1 = time.time_ns()
        rtt = t1 - t0
        if best is None or rtt < best[0]:
            mid = t0 + rtt // 2
            best = (rtt, int(real) - mid, mid, int(mono))
    assert best is not None
    rtt, offset, mid, mono = best
    return ClockOffset(offset_ns=offset, error_ns=(rtt + 1) // 2, rtt_ns=rtt, samples=taken,
                       at_ns=mid, target_monotonic_ns=mono)


def clock_record(phase: str, clock: ClockOffset) -> dict[str, object]:
    """What a capture keeps of an exchange (``ClockRecord``, ``POST /v1/captures/{id}/clock``)."""
    return {"phase": phase, "offset_ns": clock.offset_ns, "error_ns": clock.error_ns, "at_ns": clock.at_ns,
            "reference": "fleet" if clock.method == "exchange" else "fleet (in process: the same clock)"}


def read_clocks() -> ClockReading:
    """This process's clocks, as a target reports them (``GET /v1/clock``, the Ray node actor)."""
    return time.time_ns(), time.monotonic_ns()


__all__ = ["CLOCK_CONCURRENCY", "FLEET_MORE", "GOOD_NS", "MORE", "SAMPLES", "ClockOffset", "ClockReading", "clock_record", "exchange", "read_clocks"]
