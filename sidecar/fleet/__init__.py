"""Fan-out of one capture over many targets: sidecar URLs, or upstream servers driven in-process by
the same ``CaptureController``. One concept per module: ``_targets`` (what a replica is, parsing
target lists), ``_results`` (per-target outcomes and the roll-up), ``_drivers`` (one per target
kind), ``_release`` (the two-phase start and ``start_at``), ``_fleet`` (the concurrent, all-or-nothing
fan-out), ``_ray`` (the Ray driver: each controller in an actor on its server's node; Ray is
imported only when one is made), ``_clocks`` (each target's clock offset), ``_view`` (a finished
capture as one run: aligned traces, start skew, common window, timeline, Perfetto archive).
"""

from __future__ import annotations

from sidecar._lazy import lazy_exports

# each module -> the public names it defines, imported on first use (sidecar/_lazy.py): importing
# one submodule of sidecar.fleet does not import the others
_EXPORTS = {
    "sidecar.fleet._clocks": ("ClockOffset",),
    "sidecar.fleet._fleet": ("Fleet", "START_TIMEOUT_S"),
    "sidecar.fleet._ray": ("Placement", "RayNodes"),
    "sidecar.fleet._release": ("START_AT_MAX_S", "check_start_at", "parse_start_at"),
    "sidecar.fleet._results": (
        "FanOutResult", "FleetCapture", "TargetError", "TargetOutcome", "TargetResult",
    ),
    "sidecar.fleet._targets": ("Target", "TargetKind", "parse_targets"),
    "sidecar.fleet._view": (
        "FleetStragglers", "align_fleet", "fleet_archive", "fleet_sources", "fleet_stragglers", "fleet_timeline",
        "load_fleet_result",
    ),
}

__all__, __getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
