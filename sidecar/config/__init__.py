"""Config layer: pure readers and rules. Reads files, returns typed models, raises typed errors."""

from sidecar.config.models import DeployConfig, Stage, StageKind
from sidecar.config.profiler import ProfilerConfig

__all__ = ["DeployConfig", "ProfilerConfig", "Stage", "StageKind"]
