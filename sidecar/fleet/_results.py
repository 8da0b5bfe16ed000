"""Results: what each target did (``TargetResult``: outcome, capture id, state, verdicts) and the
roll-up over a fan-out (``FanOutResult``, ``FleetCapture``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from enum import Enum
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from sidecar.control.models import Capture, CaptureKind, CaptureState, StageVerdict, Verdict
from sidecar.control.outcome import Outcome, capture_outcome, worst
from sidecar.errors import FleetError, SidecarError
from sidecar.fleet._clocks import ClockOffset
from sidecar.fleet._targets import TargetKind


class TargetOutcome(str, Enum):
    started = "started"  # the upstream accepted start
    start_failed = "start_failed"
    not_started = "not_started"  # nothing sent: another target failed its pre-flight
    rolled_back = "rolled_back"  # started, then stopped because another target failed to start
    rollback_failed = "rollback_failed"
    stopped = "stopped"  # the upstream answered stop (artifacts may still be being checked)
    stop_failed = "stop_failed"
    stop_timeout = "stop_timeout"  # the stop was sent and not answered within the stop budget
    stop_not_sent = "stop_not_sent"  # the stop never left the fleet (interrupted first): the lease ends it


class TargetError(BaseModel):
    code: str
    message: str


class Sweep(BaseModel):
    """What the sweep at the end of a fleet call found on one target (``sidecar/fleet/_leases.py``): the captures
    carrying the fleet's key still starting or active there, each sent a stop (a start that landed
    after its deadline, a window whose stop was lost), or that the target could not be asked, and
    then what ends whatever may still record there."""

    stopped: list[str] = Field(default_factory=list)  # capture ids found live with the key and stopped
    error: TargetError | None = None  # the target could not be listed, or a stop not sent
    ends_by: str | None = None  # with ``error``: the lease, or the next sweep of the key, that ends it


class TargetResult(BaseModel):
    """One target's part of a fleet capture: its capture id, state, verdicts and folders."""

    target: str
    kind: TargetKind
    outcome: TargetOutcome
    capture_id: str | None = None
    state: CaptureState | None = None
    capture_kind: CaptureKind | None = None  # torch or nsys (None: no capture known)
    stages: list[int] = Field(default_factory=list)
    verdicts: list[StageVerdict] = Field(default_factory=list)
    error: TargetError | None = None
    start_s: float | None = None  # how long this target's start took (from the fan-out's start)
    stop_s: float | None = None  # how long until its upstream answered stop (from the fan-out's stop)
    # Its clock against the fleet's, exchanged before its start and after its stop (None: not
    # measured, e.g. a sidecar older than GET /v1/clock); docs/fleet-clocks.md.
    clock_start: ClockOffset | None = None
    clock_stop: ClockOffset | None = None
    sweep: Sweep | None = None  # set where the end-of-call sweep found something, or could not look

    @property
    def clock(self) -> ClockOffset | None:
        """The tighter of the start and stop exchanges (its traces are mapped through this)."""
        known = [c for c in (self.clock_start, self.clock_stop) if c is not None]
        return min(known, key=lambda c: c.error_ns) if known else None

    @property
    def folders(self) -> list[str]:
        """Session folders found for this target (local paths where the sidecar maps them)."""
        return [s.local_path or s.path for v in self.verdicts for s in v.sessions]

    @property
    def traces(self) -> Outcome:
        """The one rule (sidecar/control/outcome.py): ``ok`` once this target's traces were checked,
        ``unchecked`` while its capture is live or still being checked, ``failed`` otherwise (its
        start or stop failed, or the check found them wanting)."""
        if self.error is not None or self.outcome not in (TargetOutcome.started, TargetOutcome.stopped):
            return Outcome.failed
        if any(v.verdict is Verdict.ambiguous for v in self.verdicts):
            return Outcome.failed
        if self.state is None:
            return Outcome.unchecked
        return capture_outcome(self.state, self.capture_kind or CaptureKind.torch, [v.verdict for v in self.verdicts])

    @property
    def ok(self) -> bool:
        """Started and stopped cleanly, and its traces checked ok (:attr:`traces`)."""
        return self.traces is Outcome.ok

    @property
    def done(self) -> bool:
        """The artifact check is over (or nothing is left to check)."""
        return self.state is None or self.state.terminal

    def with_capture(self, cap: Capture, **changes: Any) -> TargetResult:
        return self.model_copy(
            update={"capture_id": cap.id, "state": cap.state, "capture_kind": cap.kind, "stages": list(cap.stages),
                    "verdicts": list(cap.verdicts), **changes}
        )


def mark_ambiguous(r: TargetResult, reasons: dict[int, str]) -> TargetResult:
    """A target whose stages share a dir with another target's (run with ``allow_shared_dirs``):
    each checked stage in ``reasons`` becomes ``ambiguous`` with the reason, never ``ok``, and a
    finished capture that looked completed is degraded."""
    if not reasons or not any(v.stage_id in reasons and v.verdict is not None for v in r.verdicts):
        return r
    verdicts = []
    for v in r.verdicts:
        fleet_reason = reasons.get(v.stage_id)
        if fleet_reason is not None and v.verdict is not None and not (v.reason or "").startswith(fleet_reason):
            # The fleet's reason comes first even when the controller already saw the sharing
            # itself (its claim registry: "also written by <url>"): it names the other targets.
            seen = f"; the folder check alone said {v.verdict.value}" + (f" ({v.reason})" if v.reason else "")
            v = v.model_copy(update={"verdict": Verdict.ambiguous, "reason": fleet_reason + seen})
        verdicts.append(v)
    state = CaptureState.degraded if r.state is CaptureState.completed else r.state
    return r.model_copy(update={"verdicts": verdicts, "state": state})


def error_of(exc: BaseException) -> TargetError:
    if isinstance(exc, SidecarError):
        return TargetError(code=exc.code, message=exc.message)
    if isinstance(exc, asyncio.TimeoutError):
        return TargetError(code="timeout", message="no answer within the budget")
    return TargetError(code="internal_error", message=f"{type(exc).__name__}: {exc}")


class FanOutResult:
    """The per-target roll-up of a fan-out (``FleetCapture``, the rollout hook's ``StepResult``):
    a mixin over the model's own ``targets`` field, so each model keeps its field order."""

    if TYPE_CHECKING:
        targets: dict[str, TargetResult]

    @property
    def traces(self) -> Outcome:
        """The targets' outcomes rolled up by the one rule: failed if any failed, else not checked
        if any is not, else ok."""
        return worst(r.traces for r in self.targets.values())

    @property
    def ok(self) -> bool:
        return self.traces is Outcome.ok

    @property
    def done(self) -> bool:
        """Every artifact check is over (or nothing is left to check)."""
        return all(r.done for r in self.targets.values())

    @property
    def folders(self) -> dict[str, list[str]]:
        """Session folders per target."""
        return {name: r.folders for name, r in self.targets.items()}

    def failures(self) -> list[TargetResult]:
        return [r for r in self.targets.values() if not r.ok]

    def rollup(self, *, slowest: int = 5, failures: int = 20) -> dict[str, Any]:
        """The fan-out in one screen, however many targets: counts by outcome, by capture state
        and by stage verdict, the slowest targets (start and stop), and the failures with reasons
        (the first ``failures``; ``failures_total`` counts them all)."""
        rs = list(self.targets.values())
        outcomes = Counter(r.outcome.value for r in rs)
        states = Counter(r.state.value if r.state else "-" for r in rs)
        verdicts = Counter(f"stage {v.stage_id}: {v.verdict.value if v.verdict else 'unchecked'}"
                           for r in rs for v in r.verdicts)

        def top(attr: str) -> list[dict[str, Any]]:
            timed = sorted((r for r in rs if getattr(r, attr) is not None), key=lambda r: -getattr(r, attr))
            return [{"target": r.target, "seconds": round(getattr(r, attr), 4)} for r in timed[:slowest]]

        bad = [r for r in rs if not r.ok]
        return {
            "targets": len(rs),
            "ok": len(rs) - len(bad),
            "unchecked": sum(r.traces is Outcome.unchecked for r in rs),
            "outcomes": dict(sorted(outcomes.items())),
            "states": dict(sorted(states.items())),
            "verdicts": dict(sorted(verdicts.items())),
            "slowest_start": top("start_s"),
            "slowest_stop": top("stop_s"),
            "failures_total": len(bad),
            "failures": [{"target": r.target, "outcome": r.outcome.value,
                          "state": r.state.value if r.state else None, "reason": _reason(r)} for r in bad[:failures]],
        }

    def to_error(self, what: str) -> FleetError:
        bad = self.failures()
        names = ", ".join(f"{r.target} ({_short(r)})" for r in bad[:10])
        if len(bad) > 10:
            names += f" and {len(bad) - 10} more (details['targets'] lists every one)"
        return FleetError(
            f"{what} failed on {len(bad)} of {len(self.targets)} targets: {names}",
            details={"targets": [r.model_dump(mode="json") for r in self.targets.values()]},
        )


def _short(r: TargetResult) -> str:
    if r.error is not None:
        return r.error.code
    if r.outcome not in (TargetOutcome.started, TargetOutcome.stopped):
        return r.outcome.value
    return r.state.value if r.state else r.outcome.value


def _reason(r: TargetResult) -> str:
    if r.error is not None:
        return f"{r.error.code}: {r.error.message}"
    why = [f"stage {v.stage_id} {v.verdict.value}: {v.reason or ''}".rstrip(": ")
           for v in r.verdicts if v.verdict is not None and v.verdict is not Verdict.ok]
    return "; ".join(why) or (r.state.value if r.state else r.outcome.value)


class FleetCapture(BaseModel, FanOutResult):
    """A started fan-out: one capture per target, keyed by target name (in target order)."""

    label: str | None = None
    stages: list[int] | None = None  # as asked; each target's own list is in its result
    targets: dict[str, TargetResult]
    start_at: float | None = None  # the wall-clock time the starts were asked for (epoch s)
    released_at: float | None = None  # when the prepared starts were sent (epoch s)
    # the fleet's key, carried by each target's capture (its label ends ``[fleet:KEY]``): what the
    # sweep at the end of each fleet call stops (docs/fleet.md, "When the fleet process dies")
    key: str | None = None
    # each capture's lease (s), renewed by the fleet while it holds the window: what ends a target's
    # capture at most this long after the fleet process is gone (None: no lease, ``fleet start``)
    lease_s: float | None = None
