"""omni-sidecar: a profiling controller that runs beside ``vllm serve <model> --omni``.

The public surface is re-exported here lazily, so ``import sidecar`` stays cheap and never
pulls FastAPI, torch or vllm.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # config
    "ProfilerConfig": "sidecar.config.profiler",
    "DeployConfig": "sidecar.config.models",
    "Stage": "sidecar.config.models",
    "StageKind": "sidecar.config.models",
    "load_deploy_config": "sidecar.config.deploy",
    # errors
    "SidecarError": "sidecar.errors",
    "Finding": "sidecar.errors",
    # upstream / control
    "UpstreamServer": "sidecar.upstream.server",
    "CaptureController": "sidecar.control.controller",
    "Capture": "sidecar.control.models",
    "StageVerdict": "sidecar.control.models",
    # surfaces
    "SidecarClient": "sidecar.client",
    "AsyncSidecarClient": "sidecar.client",
    "Fleet": "sidecar.fleet",
    "RolloutProfiler": "sidecar.rollout",
    # analysis
    "summarize_trace": "sidecar.analysis",
    "summarize_paths": "sidecar.analysis",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sidecar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
