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
    """How a stage's worker names its session folders (docs/design.md §3 Artifacts, §5 Stage kinds)."""

    llm = "llm"  # <ts>_stage<sid>_rank<globalrank>_<epoch>
    diffusion = "diffusion"  # <ts>_stage_<sid>_rep_<replica>_diffusion_<epoch>
    unknown = "unknown"  # match both namings


class Stage(BaseModel):
    """One stage of a deploy YAML as the sidecar reads it: its id, what it runs, and its profiler config."""

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

    # --- how many traces one start/stop of this stage writes (docs/design.md §3 Artifacts) ----------

    @property
    def replicas(self) -> int:
        return max(int(self.num_replicas or 1), 1)

    @property
    def ranks_per_replica(self) -> int:
        """Workers per replica, each writing its own trace. LLM: tensor x pipeline parallel (every
        worker rank writes ``<ts>_stage<sid>_rank<rank>_<epoch>/``); diffusion: the product of the
        ``parallel_config`` degrees (every rank writes ``trace_rank<N>`` into the replica's folder).
        Unknown or unparsable sizes count as 1: never expect more than the deploy proves."""
        if self.kind is StageKind.diffusion:
            pc = self.extras.get("parallel_config")
            keys = ("tensor_parallel_size", "cfg_parallel_size", "ulysses_degree", "ring_degree")
            return _product(pc.get(k) for k in keys) if isinstance(pc, dict) else 1
        return _product(self.extras.get(k) for k in ("tensor_parallel_size", "pipeline_parallel_size"))

    @property
    def expected_traces(self) -> int:
        return self.replicas * self.ranks_per_replica

    @property
    def trace_names_collide(self) -> bool:
        """vLLM-Omni 0.30 names an LLM worker's folder ``stage<sid>_rank<rank>_<epoch>``: every
        replica is rank 0 of its own engine and starts within the same second, so the replicas
        of an LLM stage write one folder name and one trace file (all but one trace is lost).
        Diffusion folders carry ``rep_<replica>`` and do not collide."""
        return self.replicas > 1 and self.kind is not StageKind.diffusion


def _product(values: Any) -> int:
    out = 1
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out *= v
    return out


class DeployConfig(BaseModel):
    """A vLLM-Omni deploy YAML (or a plain vLLM server's one stage) as the sidecar reads it: its stages,
    each with its profiler config (``sidecar.config.load_deploy_config`` reads and validates one)."""

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
    # plain `vllm serve` (one engine): its API process profiles its front end too, unless
    # ignore_frontend; vLLM-Omni profiles its stages only and never reads ignore_frontend
    plain_vllm: bool = False

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
