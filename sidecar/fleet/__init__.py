"""Fan-out of one capture over many targets: sidecar URLs, or upstream servers driven in-process by
the same ``CaptureController``. One concept per module: ``_targets`` (what a replica is, parsing
target lists), ``_results`` (per-target outcomes and the roll-up), ``_drivers`` (one per target
kind), ``_release`` (the two-phase start and ``start_at``), ``_fleet`` (the concurrent, all-or-nothing
fan-out), ``_ray`` (the Ray driver: each controller in an actor on its server's node; Ray is
imported only when one is made), ``_clocks`` (each target's clock offset), ``_view`` (a finished
capture as one run: aligned traces, start skew, common window, timeline, Perfetto archive).
"""

from sidecar.fleet._clocks import ClockOffset
from sidecar.fleet._fleet import START_TIMEOUT_S, Fleet
from sidecar.fleet._ray import Placement, RayNodes
from sidecar.fleet._release import START_AT_MAX_S, check_start_at, parse_start_at
from sidecar.fleet._results import FanOutResult, FleetCapture, TargetError, TargetOutcome, TargetResult
from sidecar.fleet._targets import Target, TargetKind, parse_targets
from sidecar.fleet._view import (
    align_fleet,
    fleet_archive,
    fleet_sources,
    fleet_stragglers,
    fleet_timeline,
    load_fleet_result,
)

__all__ = [
    "START_AT_MAX_S",
    "START_TIMEOUT_S",
    "ClockOffset",
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
    "align_fleet",
    "fleet_archive",
    "fleet_sources",
    "fleet_stragglers",
    "fleet_timeline",
    "load_fleet_result",
    "check_start_at",
    "parse_start_at",
    "parse_targets",
]
