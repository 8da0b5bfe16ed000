"""omni-sidecar: a profiling controller that runs beside ``vllm serve <model> --omni``.

The public surface is re-exported here lazily, so ``import sidecar`` stays cheap and never
pulls FastAPI, torch or vllm.
"""

from __future__ import annotations

from sidecar._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "sidecar.config.profiler": ("ProfilerConfig",),
    "sidecar.config.models": ("DeployConfig", "Stage", "StageKind"),
    "sidecar.config.deploy": ("load_deploy_config",),
    "sidecar.errors": ("SidecarError", "Finding"),
    "sidecar.upstream.server": ("UpstreamServer",),
    "sidecar.control.controller": ("CaptureController",),
    "sidecar.control.models": ("Capture", "StageVerdict"),
    "sidecar.client": ("SidecarClient", "AsyncSidecarClient"),
    "sidecar.fleet": ("Fleet",),
    "sidecar.rollout": ("RolloutProfiler",),
    "sidecar.analysis": ("summarize_trace", "summarize_paths"),
}

__all__, __getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
__all__ += ["__version__"]
