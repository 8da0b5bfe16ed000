"""Control layer (docs/design.md §2): the capture controller (state machine, watchdogs, leases,
journal, recovery) and the artifact finder/checker. Library only; the surfaces call it.
"""

from __future__ import annotations

from sidecar._lazy import lazy_exports

# each module -> the public names it defines, imported on first use (sidecar/_lazy.py): importing
# one submodule of sidecar.control does not import the others
_EXPORTS = {
    "sidecar.control.claims": ("CLAIMS", "ClaimRegistry"),
    "sidecar.control.controller": ("CaptureController", "ControlSettings"),
    "sidecar.control.models": (
        "ArtifactFile", "Capture", "CaptureKind", "CaptureState", "SessionFolder", "StageVerdict",
        "StopReason", "Verdict",
    ),
}

__all__, __getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
