"""Config layer: pure readers and rules. Reads files, returns typed models, raises typed errors."""

from sidecar.config.deploy import deploy_from_profiler_config, load_deploy_config, load_server_config
from sidecar.config.models import DeployConfig, Stage, StageKind
from sidecar.config.profiler import ProfilerConfig
from sidecar.config.placeholders import expand_dir_placeholders
from sidecar.config.profiles import (
    StageProfile,
    list_profiles,
    load_profile,
    nsys_command,
    nsys_report_pattern,
    render_overlay,
    render_stage_overrides,
)
from sidecar.config.rules import select_stages, validate_deploy
from sidecar.config.verl import VerlProfilerPlan, read_verl_config, verl_findings

__all__ = [
    "DeployConfig",
    "ProfilerConfig",
    "Stage",
    "StageKind",
    "StageProfile",
    "VerlProfilerPlan",
    "deploy_from_profiler_config",
    "expand_dir_placeholders",
    "list_profiles",
    "load_deploy_config",
    "load_profile",
    "load_server_config",
    "nsys_command",
    "nsys_report_pattern",
    "read_verl_config",
    "render_overlay",
    "render_stage_overrides",
    "select_stages",
    "validate_deploy",
    "verl_findings",
]
