"""ProfilerConfig: our mirror of vLLM 0.30's ``vllm.config.ProfilerConfig`` (same fields,
defaults, ranges and error texts; extra keys forbidden). Contract tests diff it against the real
class. Pure: no vllm import.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ProfilerKind = Literal["torch", "cuda", "proton"]


class ProfilerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    profiler: ProfilerKind | None = None
    torch_profiler_dir: str | None = None
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    capture_torch_profiler: bool = False
    detailed_trace_annotation: bool = False
    ignore_frontend: bool = False
    delay_iterations: int = Field(default=0, ge=0)
    max_iterations: int = Field(default=0, ge=0)
    warmup_iterations: int = Field(default=0, ge=0)
    active_iterations: int = Field(default=5, ge=1)
    wait_iterations: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _vllm_rules(self) -> "ProfilerConfig":
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("torch_profiler_dir must be set when profiler is 'torch'")
        if self.profiler != "torch" and self.torch_profiler_dir:
            raise ValueError("torch_profiler_dir is only applicable when profiler is set to 'torch'")
        if self.profiler != "torch" and self.capture_torch_profiler:
            raise ValueError("capture_torch_profiler is only applicable when profiler is set to 'torch'")
        return self
