"""Control layer (DESIGN.md §2): the capture controller (state machine, watchdogs, leases,
journal, recovery) and the artifact finder/checker. Library only; the surfaces call it.
"""

from sidecar.control.controller import CaptureController, ControlSettings
from sidecar.control.models import (
    ArtifactFile,
    Capture,
    CaptureState,
    SessionFolder,
    StageVerdict,
    StopReason,
    Verdict,
)

__all__ = [
    "ArtifactFile",
    "Capture",
    "CaptureController",
    "CaptureState",
    "ControlSettings",
    "SessionFolder",
    "StageVerdict",
    "StopReason",
    "Verdict",
]
