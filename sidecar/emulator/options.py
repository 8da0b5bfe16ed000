"""Options of one emulator run (what ``omni-sidecar emulate`` parses). The fault knobs are test
aids: they make the emulator show failures a real server shows only under load or breakage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EmulatorOptions(BaseModel):
    model_config = ConfigDict(frozen=True)

    deploy_config: Path
    host: str = "127.0.0.1"
    port: int = Field(default=8091, ge=0, le=65535)
    flavor: Literal["omni", "vllm"] = "omni"
    # Stage ids treated as diffusion stages (besides `emulator_stage_kind: diffusion` in the YAML).
    diffusion_stages: list[int] = Field(default_factory=list)
    model: str = "omni-emulator"
    step_ms: float = Field(default=5.0, ge=0, description="minimum wall time of one engine step")
    gzip_delay_s: float = Field(default=0.5, ge=0, description="models the seconds a real trace takes to gzip")
    startup_timeout_s: float = Field(default=60.0, gt=0)
    # --- fault knobs (test aids; a real server has none of these) ---
    fault_stop_delay_s: float = Field(default=0.0, ge=0)
    fault_dead_stage: int | None = None
    # This stage's worker acknowledges its next profiler start, then exits: a worker that dies mid-window.
    fault_die_after_start: int | None = None
    fault_hang_stop: bool = False
    fault_start_500: bool = False
