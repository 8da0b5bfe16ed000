"""Whether a capture's traces are ok: the one rule every surface asks. The CLI's exit codes
(``capture``, ``stop``, ``status``, ``fleet ...``), a fleet target's ``ok``, the rollout hook's step
results and the web page (through the capture's ``outcome`` field) all read :func:`capture_outcome`.

ok only once the traces were checked: a ``completed`` capture, or an nsys capture whose only
non-``ok`` verdicts are the expected ``unverified`` (nsys writes its report itself). A capture still
starting, active, stopping or collecting when the caller stops waiting is not checked yet: neither
ok nor failed, and never exit 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

__all__ = ["EXIT_CODES", "EXIT_UNCHECKED", "Outcome", "capture_outcome", "exit_code", "outcome_of", "worst"]


class Outcome(str, Enum):
    ok = "ok"  # the traces were checked and are what the window should have written
    failed = "failed"  # checked and wanting (degraded, failed), or the capture could not be run
    unchecked = "unchecked"  # not checked yet: still starting, active, stopping or collecting

    def __str__(self) -> str:
        return str(self.value)


# The CLI's exit code for each outcome: 3, not 0 or 1, for traces not checked yet (the caller's
# --timeout ran out first; `omni-sidecar status ID` later says how they ended).
EXIT_UNCHECKED = 3
EXIT_CODES = {Outcome.ok: 0, Outcome.failed: 1, Outcome.unchecked: EXIT_UNCHECKED}

_TERMINAL = ("completed", "degraded", "failed")
_EXPECTED_NSYS = ("ok", "unverified")


def capture_outcome(state: str, kind: str = "torch", verdicts: Iterable[str | None] = ()) -> Outcome:
    """The outcome of a capture in ``state`` (a ``CaptureState`` or its value) of ``kind`` whose
    stages have ``verdicts`` (``Verdict`` values, None while unchecked)."""
    state = str(getattr(state, "value", state))
    if state not in _TERMINAL:
        return Outcome.unchecked
    if state == "completed":
        return Outcome.ok
    seen = [str(getattr(v, "value", v)) for v in verdicts]
    nsys_as_expected = (str(getattr(kind, "value", kind)) == "nsys" and state == "degraded" and bool(seen)
                        and all(v in _EXPECTED_NSYS for v in seen))
    return Outcome.ok if nsys_as_expected else Outcome.failed


def outcome_of(cap: Any) -> Outcome:
    """:func:`capture_outcome` of a ``Capture`` (its state, kind and stage verdicts)."""
    return capture_outcome(cap.state, cap.kind, [v.verdict for v in cap.verdicts])


def worst(outcomes: Iterable[Outcome]) -> Outcome:
    """The outcome of several captures (a fleet, a rollout step): failed if any failed, else not
    checked if any is not, else ok. No capture at all is ok: the caller decides whether that is."""
    seen = set(outcomes)
    for o in (Outcome.failed, Outcome.unchecked):
        if o in seen:
            return o
    return Outcome.ok


def exit_code(outcome: Outcome) -> int:
    return EXIT_CODES[outcome]
