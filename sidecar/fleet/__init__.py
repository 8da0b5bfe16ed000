"""Fan-out of one capture over many targets: sidecar URLs, or upstream servers driven in-process by
the same ``CaptureController``. One concept per module: ``_targets`` (what a replica is, parsing
target lists), ``_results`` (per-target outcomes and the roll-up), ``_drivers`` (one per target
kind), ``_release`` (the two-phase start and ``start_at``), ``_fleet`` (the concurrent, all-or-nothing
fan-out), ``_ray`` (the Ray driver: each controller in an actor on its server's node; Ray is
imported only when one is made).
"""

from sidecar.fleet._fleet import START_TIMEOUT_S, Fleet
from sidecar.fleet._ray import Placement, RayNodes
from sidecar.fleet._release import START_AT_MAX_S, check_start_at, parse_start_at
from sidecar.fleet._results import FanOutResult, FleetCapture, TargetError, TargetOutcome, TargetResult
from sidecar.fleet._targets import Target, TargetKind, parse_targets

__all__ = [
    "START_AT_MAX_S",
    "START_TIMEOUT_S",
    "FanOutResult",
    "Fleet",
    "Placement",
    "RayNodes",
    "FleetCapture",
    "Target",
    "TargetError",
    "TargetKind",
    "TargetOutcome",
    "TargetResult",
    "check_start_at",
    "parse_start_at",
    "parse_targets",
]
