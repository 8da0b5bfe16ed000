"""When a ``steps`` window ends: a pure policy, fed the server's step-counter reads and the clock.

:class:`StepsWindow` is told the window (the steps asked, what bounds it, each stage's own end),
then fed :class:`Read` after :class:`Read`; each answer is a :class:`Decision`: go on, or stop now
and why (:class:`EndedBy`). It does no I/O and owns no task: the controller's loop reads the
counter and feeds it (sidecar/control/counting.py), and a unit test feeds it recorded reads
(tests/data/steps/). Every window ends: by the steps, by the server's own end, or by a bound in
time when the counter stops moving, stops answering, goes back, or the window runs too long.

A window is bounded one of three ways (:class:`Bound`):
- ``server_cap``: every stage's server ends its own window after ``max_iterations`` engine
  iterations (``omni-sidecar render --steps N`` writes the cap). The stop then only has to come
  after that end: it waits until each stage has counted its own end plus ``CAPPED_MARGIN`` past
  its count at the start's answer (its profiler started somewhere before that read).
- ``per_capture``: the start's own body asks the server for exactly the steps (``max_iterations``,
  ``delay_iterations``: vLLM >= 0.32), with no deploy cap; the stop then waits as for
  ``server_cap``, each stage's end being the steps (plus the delay).
- ``count``: asked for by name (best effort): the sidecar stops once the count reaches the steps.
  The stop travels while the engines step on, so the trace often holds more (on the real servers with
  no cap, 5 asked traced 33 on vLLM 0.30, 20 asked traced 225 on vLLM 0.32); but the count runs
  from the read before the start, so steps run while a slow start reaches the stages count too (on
  vLLM-Omni 0.32rc1, 10 asked and 13 counted at the first read after the answer: traces of 2 and 4).
  The capture then says how many steps each trace holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

Labels = tuple[tuple[str, str], ...]  # one engine's labels (sidecar.upstream.metrics.Labels)

# A window every stage's server ends itself: its stop waits this many steps past the count at which
# the profilers have surely run their iterations (the first, empty one counts too).
CAPPED_MARGIN = 2


class Bound(str, Enum):
    """What ends a ``steps`` window's recording."""

    server_cap = "server_cap"  # every stage's deploy max_iterations (render --steps)
    per_capture = "per_capture"  # the start body's max_iterations (vLLM >= 0.32): the server ends it, exactly
    count = "count"  # the sidecar's count (best effort, asked for by name)


class EndedBy(str, Enum):
    """Why a ``steps`` window's stop was sent."""

    steps = "steps"  # count: the count reached the steps asked
    server = "server"  # server_cap: every stage counted past its own end
    stage_stalled = "stage_stalled"  # server_cap: the others had ended; these stood still for stall_s
    stalled = "stalled"  # no stage moved for stall_s (no traffic, or the server stopped stepping)
    unreadable = "unreadable"  # no counter read came back for stall_s
    counter_reset = "counter_reset"  # a counter went back: the server restarted, its window is gone
    time_bound = "time_bound"  # the window ran max_s


@dataclass(frozen=True)
class Read:
    """One read of the counters: when the server counted (monotonic seconds, the read's middle)
    and each engine's count (None: the read failed)."""

    at: float
    counts: Mapping[Labels, int] | None
    error: str | None = None  # why the read failed, when it did


@dataclass(frozen=True)
class Decision:
    stop: bool
    ended_by: EndedBy | None = None
    counted: int = 0  # steps past the base, its most-advanced stage
    per_stage: Mapping[str, int] = field(default_factory=dict)  # steps past the base per stage label
    heads: Mapping[str, int] = field(default_factory=dict)  # server_cap: per stage, by the start's answer
    behind: tuple[str, ...] = ()  # server_cap: stages short of their end
    still_s: float = 0.0  # stalled, stage_stalled, unreadable: how long nothing came


def stage_label(key: Labels) -> str:
    """The stage an engine's counter belongs to (vLLM-Omni's ``stage`` label; plain vLLM's one engine: "")."""
    return dict(key).get("stage") or ""


class StepsWindow:
    """One ``steps`` window's end, decided from its counter reads.

    ``ends``: per stage id, the engine iterations after which its server ends its window itself
    (``server_cap``; a stage given its idle iterations ends later than the steps). ``base``: the
    read just before the start was sent (None or a failed read: the first good read is the base).
    ``answered_at``: when the start's answer came (monotonic). ``stall_s``: how long the counter
    may stand still (or go unread) before the window ends anyway; ``max_s``: the longest window."""

    def __init__(self, steps: int, stages: list[int], *, bound: Bound, ends: Mapping[int, int] | None = None,
                 base: Read | None, answered_at: float, stall_s: float, max_s: float,
                 margin: int = CAPPED_MARGIN) -> None:
        self.steps, self.stages, self.bound = steps, list(stages), bound
        self.reach = {str(s): max(steps, n) for s, n in (ends or {}).items()}
        self.margin, self.stall_s, self.max_s = margin, stall_s, max_s
        self.answered_at = answered_at
        self.base: dict[Labels, int] | None = dict(base.counts) if base is not None and base.counts is not None else None
        self._last: dict[Labels, int] | None = self.base
        self._last_read = answered_at  # the window's clock starts at the start's answer (a start can take seconds)
        self._heads: dict[str, int] | None = None
        self._moved: dict[str, tuple[int, float]] = {}  # per stage: its count, and when it last moved
        self._per: dict[str, int] = {}
        self.reads: list[Read] = [base] if base is not None else []

    @property
    def read_gap_s(self) -> float:
        """The longest time between two of the window's own reads (after the start's answer): what
        the engines ran in it was counted at once."""
        after = [r.at for r in self.reads if r.at >= self.answered_at]
        return max((b - a for a, b in zip(after, after[1:])), default=0.0)

    def _wanted(self, key: Labels) -> bool:
        label = stage_label(key)
        return not label or label in {str(s) for s in self.stages}

    def _reach(self, label: str) -> int:
        if label in self.reach:
            return self.reach[label]
        return max(self.reach.values(), default=self.steps)

    def _decide(self, ended_by: EndedBy | None, *, behind: tuple[str, ...] = (), still_s: float = 0.0) -> Decision:
        return Decision(stop=ended_by is not None, ended_by=ended_by, counted=max(self._per.values(), default=0),
                        per_stage=dict(self._per), heads=dict(self._heads or {}), behind=behind, still_s=still_s)

    def check(self, now: float) -> Decision:
        """The rules of time alone (no read came back by ``now``)."""
        if now - self.answered_at >= self.max_s:
            return self._decide(EndedBy.time_bound, still_s=now - self._last_read)
        if now - self._last_read >= self.stall_s:
            return self._decide(EndedBy.unreadable, still_s=now - self._last_read)
        if self._moved:
            last_move = max(at for _, at in self._moved.values())
        else:
            last_move = self.answered_at
        if now - last_move >= self.stall_s:
            return self._decide(EndedBy.stalled, still_s=now - last_move)
        return self._decide(None)

    def feed(self, read: Read) -> Decision:
        """The window after one more read."""
        self.reads.append(read)
        if read.counts is None:
            return self.check(read.at)
        if read.at < self._last_read:  # a read older than the last one counted: it adds nothing
            return self.check(self._last_read)
        counts = {k: n for k, n in read.counts.items() if self._wanted(k)}
        if self._last is not None and any(n < self._last.get(k, 0) for k, n in counts.items()):
            self._last, self._last_read = counts, read.at
            return self._decide(EndedBy.counter_reset)
        if self.base is None:
            self.base = counts
        self._last, self._last_read = counts, read.at
        per: dict[str, int] = {}
        for key, n in counts.items():
            label = stage_label(key)
            per[label] = max(per.get(label, 0), n - self.base.get(key, 0), 0)
        self._per = per
        for label, n in per.items():
            if label not in self._moved or self._moved[label][0] != n:
                self._moved[label] = (n, read.at if label in self._moved or n else self.answered_at)
        if self._heads is None and read.at >= self.answered_at:
            self._heads = dict(per)  # the first read after the start's answer: the profilers have started
        if self.bound is Bound.count:
            if max(per.values(), default=0) >= self.steps:
                return self._decide(EndedBy.steps)
            return self.check(read.at)
        if self._heads is None:
            return self.check(read.at)
        behind = tuple(s for s, n in sorted(per.items())
                       if n < self._heads.get(s, 0) + self._reach(s) + self.margin)
        if not behind and per:
            return self._decide(EndedBy.server)
        # A stage that runs only on what another hands it (vLLM-Omni's downstream stages) may stand
        # still while the others have run their window: once it has for stall_s, the stop goes.
        if behind and len(behind) < len(per):
            still = min(read.at - self._moved[s][1] for s in behind)
            if still >= self.stall_s:
                return self._decide(EndedBy.stage_stalled, behind=behind, still_s=still)
        return self.check(read.at)


def steps_traced(steps: int, traced: Mapping[int, int], idle: Mapping[int, tuple[int, int]], *,
                 capped: set[int]) -> list[dict[str, object]]:
    """Per stage whose trace holds other than the steps asked: its figures (steps traced, asked,
    idle iterations of how many, whether its server's cap counts them)."""
    return [{"stage_id": s, "steps_traced": n, "steps_asked": steps, "idle_iterations": idle.get(s, (0, 0))[0],
             "iterations": idle.get(s, (0, 0))[1], "capped": s in capped}
            for s, n in sorted(traced.items()) if n != steps]


def idle_fix(steps: int, short: Mapping[int, tuple[int, int]], ends: Mapping[int, int], *,
             idle_iterations: int, max_share: float, max_iterations_for: Callable[..., int]) -> list[dict[str, object]]:
    """The way to ``steps`` on the stages of a window the server ended itself that held fewer
    because they idled (``short``: stage -> (idle iterations, iterations recorded); ``ends``: every
    stage's own end): give each the share of its iterations it idles (``render --steps N --idle``),
    or, past ``max_share``, say that it is fed too little for a window counted in steps. The render
    keeps the stage that ends the window first within N + ``idle_iterations``: such a stage that
    idled short is told to send more requests at once instead. Facts (code and figures) only."""
    cap_for = max_iterations_for  # (steps, idle share) -> max_iterations
    shares = {s: i / n for s, (i, n) in short.items() if i and n}
    facts: list[dict[str, object]] = [
        {"code": "idle_fed_too_little", "stage_id": s, "idle_iterations": short[s][0], "iterations": short[s][1],
         "max_share": max_share} for s, share in sorted(shares.items()) if share > max_share]
    fixable = {s: share for s, share in shares.items() if share <= max_share}
    while fixable and min(cap_for(steps, fixable[s]) if s in fixable else n
                          for s, n in ends.items()) > cap_for(steps):
        first = min(fixable, key=lambda s: (ends.get(s, 0), fixable[s], s))
        del fixable[first]
        facts.append({"code": "idle_ends_first", "stage_id": first, "idle_iterations": short[first][0],
                      "iterations": short[first][1], "steps": steps, "idle_margin": idle_iterations})
    if fixable:
        facts.append({"code": "idle_render", "steps": steps,
                      "idle": {s: list(short[s]) for s in sorted(fixable)},
                      "caps": {s: cap_for(steps, fixable[s]) for s in sorted(fixable)}})
    return facts


__all__ = ["CAPPED_MARGIN", "Bound", "Decision", "EndedBy", "Read", "StepsWindow", "idle_fix", "stage_label",
           "steps_traced"]
