"""Typed results of reading a deploy YAML: ``DeployConfig`` holds ``Stage`` entries, each with
its effective ``ProfilerConfig`` (or none). Pure data; the loader lives in ``deploy.py``.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sidecar.config.profiler import ProfilerConfig
from sidecar.errors import Finding, Where


class StageKind(str, Enum):
    """How a stage's worker names its session folders (DESIGN.md §3 Artifacts, §5 Stage kinds)."""

    llm = "llm"  # <ts>_stage<sid>_rank<globalrank>_<epoch>
    diffusion = "diffusion"  # <ts>_stage_<sid>_rep_<replica>_diffusion_<epoch>
    unknown = "unknown"  # match both namings


class Stage(BaseModel):
    model_config = ConfigDict(frozen=True)

    stage_id: int
    kind: StageKind = StageKind.unknown
    profiler_config: ProfilerConfig | None = None
    devices: str | None = None
    num_replicas: int = 1
    where: Where | None = None
    # Keys vLLM-Omni keeps as engine extras (e.g. the emulator-only ``emulator_stage_kind``).
    extras: dict[str, Any] = Field(default_factory=dict)
    # Where each key was written ("stage_id", "profiler_config", "profiler_config.<field>"), for
    # findings that point at file:line:col. Not part of the stage's value.
    marks: dict[str, Where] = Field(default_factory=dict, repr=False, exclude=True)
    # Where the effective profiler_config came from: "yaml" (flat / engine_args / platform overlay),
    # "engine_extras" (wins upstream), "--stage-overrides" or "--profiler-config" (merged over the file's).
    profiler_source: str | None = None

    @property
    def profiler(self) -> str | None:
        return self.profiler_config.profiler if self.profiler_config else None

    @property
    def profiler_dir(self) -> str | None:
        # vLLM's default is "" (unset); callers test for None.
        return (self.profiler_config.torch_profiler_dir or None) if self.profiler_config else None


class DeployConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: Path | None = None
    platform: str = "cuda"
    stages: list[Stage]
    legacy_schema: bool = False
    base_chain: list[Path] = Field(default_factory=list)
    findings: list[Finding] = Field(default_factory=list)
    # The server's command line as parsed: ``--stage-overrides`` and the ``--profiler-config`` dict
    # vLLM-Omni merges (every field); None when not given. ``path`` is None for plain vLLM.
    stage_overrides: dict[str, dict[str, Any]] | None = None
    profiler_config_arg: dict[str, Any] | None = None

    def stage(self, stage_id: int) -> Stage | None:
        return next((s for s in self.stages if s.stage_id == stage_id), None)

    @property
    def stage_ids(self) -> list[int]:
        return [s.stage_id for s in self.stages]

    @property
    def profiled_stages(self) -> list[Stage]:
        """Stages with ``profiler_config.profiler`` set: the server mounts the endpoints iff any."""
        return [s for s in self.stages if s.profiler is not None]

    @property
    def torch_stages(self) -> list[Stage]:
        return [s for s in self.stages if s.profiler == "torch"]
