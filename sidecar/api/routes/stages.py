"""``GET /v1/stages``: the deploy's stages as the sidecar read them (profiler, dirs, replicas, the
effective profiler config) and the validation findings. The deploy is fixed for the app's
lifetime, so the report is built once (``report``, by the app factory), not per request."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from sidecar.api.state import Api
from sidecar.config.models import DeployConfig
from sidecar.scrub import Scrubber

router = APIRouter(tags=["stages"])


def report(deploy: DeployConfig, scrubber: Scrubber) -> dict[str, Any]:
    from sidecar.config.rules import validate_deploy

    findings = [f.model_dump(mode="json") for f in validate_deploy(deploy)]
    return scrubber.data(
        {
            "deploy_config": str(deploy.path) if deploy.path else None,
            "platform": deploy.platform,
            "stages": [
                {
                    "stage_id": s.stage_id,
                    "kind": s.kind.value,
                    "profiler": s.profiler,
                    "profiler_dir": s.profiler_dir,
                    "num_replicas": s.num_replicas,
                    "profiler_config": s.profiler_config.model_dump(mode="json") if s.profiler_config else None,
                    "findings": [f for f in findings if f.get("stage_id") == s.stage_id],
                }
                for s in deploy.stages
            ],
            "findings": findings,
        }
    )


def server(version: Any, deploy: DeployConfig, platform: str | None = None) -> dict[str, Any] | None:
    """What the upstream server was found to be at connect (sidecar/versions.py), and what that
    version says of the deploy (``findings``: a key it refuses, an option it ignores); None: not yet."""
    if version is None:
        return None
    from sidecar.config.deploy import version_findings
    from sidecar.versions import PLATFORM_DEVICE

    findings = version_findings(deploy, version.dialect, version.omni_dialect, PLATFORM_DEVICE.get(platform or ""))
    return {**version.figures(), "summary": version.describe(), "warnings": version.warnings(),
            "findings": [f.model_dump(mode="json") for f in findings]}


@router.get("/v1/stages", summary="Stages of the deploy, their profiler and findings, and the server's version")
async def stages(api: Api) -> dict[str, Any]:
    version = getattr(getattr(api.controller, "upstream", None), "version", None)
    found = server(version, api.deploy, api.stages.get("platform")) if version is not None else None
    return {**api.stages, "server": api.scrubber.data(found) if found is not None else None}
