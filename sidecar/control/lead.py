"""How early a ``steps`` window's stop is sent, learned from the server's own last windows.

A stop travels before the engines stop recording: through the server's API process (vLLM 0.30
stops its front-end profiler first), vLLM-Omni's orchestrator and each stage's queue, to engines
that finish the step they are in. They run on meanwhile and their traces hold those steps; the
steps they ran while the *start* travelled are counted and not traced. Both are properties of the
server and the host, window after window: on the real two-stage vLLM-Omni server under steady
load here a 20-step window counted 20 and its traces held 31 and 32 (docs/captures.md).

So each ``steps`` window whose stop was sent on time by the count teaches the controller one
figure: steps traced - steps counted when the stop was sent, the steps the engines ran while it
travelled. The next window of the same stages sends its stop that many steps before the count
reaches the steps asked (the median of the last ``LEAD_WINDOWS``, once there are two), and says
so in a note.

In steps, not seconds: a window of 20 steps at 50 steps/s is 0.4 s, and a lead in seconds would
be turned into steps by a rate taken from its first two or three reads (tried on the emulator
with a 0.25 s travel: one window then stopped at its first count, 1 of 20, and traced 14). Never
later than the count: a trace short of it is the start's travel (a server's first profiler start
holds its engines for seconds on CPU, later ones do not), and a stop held back for it would let
the window run past. Nor by a median of 2 steps or fewer: a server whose counter is read late by
a varying 1 to 10 steps (vLLM-Omni's on a busy host) stops a few steps either side of its count by chance (on
the real two-stage server, windows stopped at counts of 20, 20, 18 and 21 traced 19, 24, 16 and
24; a lead of 4 learned from one window made the next trace 16), and a lead learned from that
noise moves the next window by as much. A window that says why it ran past (a first count
already past, a sidecar not scheduled, a server that bounds its own window with
``max_iterations``) teaches nothing.

Never more than half the window (``MAX_SHARE``): a lead learned from windows that ran past for
another reason (a server's first profiler start holds its engines, then they run the queue in a
burst) can be longer than the window, and a stop sent at the start's answer ends the window before
the engines record anything. On the real two-stage vLLM-Omni server in CI (2026-12-04) two windows
of 20 traced 42 past their counts, and the third, sent 42 ahead, at a count of 0, traced 0 steps on
both stages.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["LEAD_WINDOWS", "MAX_SHARE", "MIN_WINDOWS", "NOISE_STEPS", "Lead", "StopLead"]

LEAD_WINDOWS = 5  # the last windows per stage set whose lateness is kept
NOISE_STEPS = 2  # a median lateness this small is no lead (a steps window's own precision)
MIN_WINDOWS = 2  # windows a lead is learned from before it is taken
MAX_SHARE = 0.5  # of the steps asked: the most a stop is sent ahead


class Lead(NamedTuple):
    ahead: float  # steps before the count reaches the steps asked that the stop is sent
    windows: int  # the windows it is learned from
    late: float  # their median steps traced past the count (``ahead`` before the cap)


class StopLead:
    """Per stage set, the steps traced past the count in the latest windows."""

    def __init__(self) -> None:
        self._late: dict[tuple[int, ...], collections.deque[float]] = {}

    def lead(self, stages: list[int], steps: int) -> Lead:
        """How many steps early the next stop of a ``steps`` window of ``stages`` is sent."""
        seen = self._late.get(tuple(sorted(stages)))
        if not seen or len(seen) < MIN_WINDOWS:
            return Lead(0.0, len(seen or ()), 0.0)
        late = float(statistics.median(seen))
        return Lead(min(late, steps * MAX_SHARE) if late > NOISE_STEPS else 0.0, len(seen), late)

    def learn(self, stages: list[int], traced: Mapping[int, int], counted: int) -> float | None:
        """Record one window: ``traced`` steps per stage, ``counted`` when its stop was sent (the
        lead already taken off). Returns the steps it traced past that count, or None."""
        held = [traced[s] for s in stages if s in traced]
        if not held:
            return None
        late = float(statistics.median(held) - counted)
        self._late.setdefault(tuple(sorted(stages)), collections.deque(maxlen=LEAD_WINDOWS)).append(late)
        return late
