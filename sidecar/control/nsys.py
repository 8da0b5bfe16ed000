"""nsys captures: ``profiler: cuda`` stages only open and close CUDA capture ranges; the report is
written by an ``nsys profile`` wrapper around the server. This words the stage's ``unverified``
verdict from the config layer's one rule for that wrapper (``sidecar.config.profiles``).
"""

from __future__ import annotations

from sidecar.config.models import DeployConfig
from sidecar.config.profiles import nsys_command, nsys_report_pattern


def nsys_hint(stage_id: int, deploy: DeployConfig) -> str:
    cmd = nsys_command(deploy, deploy_config=deploy.path)
    return (
        f"nsys capture: stage {stage_id} (profiler: cuda) only opens and closes a CUDA capture range; the "
        f"report is written by nsys, which the server must run under: `{cmd}`. With "
        "--capture-range-end=repeat nsys writes one report per start/stop window, as "
        f"{nsys_report_pattern()} on the server's host; the sidecar cannot check it. A server not run "
        "under nsys records nothing"
    )


__all__ = ["nsys_command", "nsys_hint"]
