"""Results: what each target did (``TargetResult``: outcome, capture id, state, verdicts) and the
roll-up over a fan-out (``FanOutResult``, ``FleetCapture``)."""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from sidecar.control.models import Capture, CaptureState, StageVerdict
from sidecar.errors import FleetError, SidecarError
from sidecar.fleet._targets import TargetKind


class TargetOutcome(str, Enum):
    started = "started"  # the upstream accepted start
    start_failed = "start_failed"
    not_started = "not_started"  # nothing sent: another target failed its pre-flight
    rolled_back = "rolled_back"  # started, then stopped because another target failed to start
    rollback_failed = "rollback_failed"
    stopped = "stopped"  # the upstream answered stop (artifacts may still be being checked)
    stop_failed = "stop_failed"
    stop_timeout = "stop_timeout"  # no answer within the stop budget; the stop goes on in the background


class TargetError(BaseModel):
    code: str
    message: str


class TargetResult(BaseModel):
    """One target's part of a fleet capture: its capture id, state, verdicts and folders."""

    target: str
    kind: TargetKind
    outcome: TargetOutcome
    capture_id: str | None = None
    state: CaptureState | None = None
    stages: list[int] = Field(default_factory=list)
    verdicts: list[StageVerdict] = Field(default_factory=list)
    error: TargetError | None = None

    @property
    def folders(self) -> list[str]:
        """Session folders found for this target (local paths where the sidecar maps them)."""
        return [s.local_path or s.path for v in self.verdicts for s in v.sessions]

    @property
    def ok(self) -> bool:
        """Started and stopped cleanly, and — once checked — every stage has its trace."""
        if self.error is not None or self.outcome not in (TargetOutcome.started, TargetOutcome.stopped):
            return False
        return self.state not in (CaptureState.degraded, CaptureState.failed)

    @property
    def done(self) -> bool:
        """The artifact check is over (or nothing is left to check)."""
        return self.state is None or self.state.terminal

    def with_capture(self, cap: Capture, **changes: Any) -> TargetResult:
        return self.model_copy(
            update={"capture_id": cap.id, "state": cap.state, "stages": list(cap.stages),
                    "verdicts": list(cap.verdicts), **changes}
        )


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
    def ok(self) -> bool:
        return all(r.ok for r in self.targets.values())

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

    def to_error(self, what: str) -> FleetError:
        bad = self.failures()
        names = ", ".join(f"{r.target} ({r.error.code if r.error else r.state.value if r.state else r.outcome.value})"
                          for r in bad)
        return FleetError(
            f"{what} failed on {len(bad)} of {len(self.targets)} targets: {names}",
            details={"targets": [r.model_dump(mode="json") for r in self.targets.values()]},
        )


class FleetCapture(BaseModel, FanOutResult):
    """A started fan-out: one capture per target, keyed by target name (in target order)."""

    label: str | None = None
    stages: list[int] | None = None  # as asked; each target's own list is in its result
    targets: dict[str, TargetResult]
