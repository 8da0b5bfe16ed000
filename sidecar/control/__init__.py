"""Control layer (docs/design.md §2): the capture controller (state machine, watchdogs, leases,
journal, recovery) and the artifact finder/checker. Library only; the surfaces call it.
"""

from sidecar.control.claims import CLAIMS, ClaimRegistry
from sidecar.control.controller import CaptureController, ControlSettings
from sidecar.control.models import (
    ArtifactFile,
    Capture,
    CaptureKind,
    CaptureState,
    SessionFolder,
    StageVerdict,
    StopReason,
    Verdict,
)

__all__ = [
    "CLAIMS",
    "ArtifactFile",
    "Capture",
    "CaptureController",
    "CaptureKind",
    "ClaimRegistry",
    "CaptureState",
    "ControlSettings",
    "SessionFolder",
    "StageVerdict",
    "StopReason",
    "Verdict",
]
