"""Config layer: pure readers and rules. Reads files, returns typed models, raises typed errors."""

from __future__ import annotations

from sidecar._lazy import lazy_exports

# each module -> the public names it defines, imported on first use (sidecar/_lazy.py): importing
# one submodule of sidecar.config does not import the others
_EXPORTS = {
    "sidecar.config.deploy": ("deploy_from_profiler_config", "load_deploy_config", "load_server_config"),
    "sidecar.config.models": ("DeployConfig", "Stage", "StageKind"),
    "sidecar.config.placeholders": ("expand_dir_placeholders",),
    "sidecar.config.profiler": ("ProfilerConfig",),
    "sidecar.config.profiles": (
        "StageProfile", "list_profiles", "load_profile", "nsys_command", "nsys_report_pattern",
        "render_overlay", "render_stage_overrides",
    ),
    "sidecar.config.rules": ("select_stages", "validate_deploy"),
    "sidecar.config.verl": ("VerlProfilerPlan", "read_verl_config", "verl_findings"),
}

__all__, __getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
