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


def server(version: Any) -> dict[str, Any] | None:
    """What the upstream server was found to be at connect (sidecar/versions.py), or None (not yet)."""
    if version is None:
        return None
    return {**version.figures(), "summary": version.describe(), "warnings": version.warnings()}


@router.get("/v1/stages", summary="Stages of the deploy, their profiler and findings, and the server's version")
async def stages(api: Api) -> dict[str, Any]:
    return {**api.stages, "server": server(getattr(getattr(api.controller, "upstream", None), "version", None))}
