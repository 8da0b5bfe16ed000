"""Options of one emulator run (what ``omni-sidecar emulate`` parses) and its fault knobs. The
knobs are test aids: they make the emulator show failures a real server shows only under load or
breakage. The start-up values come from the CLI; ``POST /emulator/faults`` changes them at run
time and ``POST /emulator/reset`` puts them back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt


class Faults(BaseModel):
    """The fault knobs, one field per ``--fault-*`` flag (same names, without the prefix)."""

    model_config = ConfigDict(extra="forbid")

    # stop holds its reply this long after the workers are done
    stop_delay_s: float = Field(default=0.0, ge=0)
    # stop reaches the workers this long after it arrived, while they step on and record: the real
    # servers' stop travel (vLLM 0.30's front-end profiler stops first; vLLM-Omni's orchestrator and
    # stage queues), which on the two-stage vLLM-Omni server here let a 20-step window trace 31
    stop_travel_s: float = Field(default=0.0, ge=0)
    # start reaches the workers this long after it arrived, while they step on unrecorded: the
    # steps a ``steps`` window counts from its base read before the profilers start
    start_travel_s: float = Field(default=0.0, ge=0)
    # start holds its reply this long after the workers started (and record): a server's first
    # profiler start on CPU, or vLLM 0.30 waiting for its front-end profiler
    start_delay_s: float = Field(default=0.0, ge=0)
    # ``metrics_delay_count`` /metrics reads (0: every one) past the first ``metrics_delay_after``
    # since the last start are held this long: a server (or host) too busy to answer the step
    # counter in time (one read on the real vLLM took over a second in CI while the engine stepped on)
    metrics_delay_s: float = Field(default=0.0, ge=0)
    metrics_delay_after: int = Field(default=0, ge=0)
    metrics_delay_count: int = Field(default=0, ge=0)
    # this stage's workers die (at start-up, or at once when set at run time); 0.30 then answers
    # SUCCESS to start/stop and the stage writes no trace, /health is 503
    dead_stage: int | None = None
    # this stage's workers acknowledge their next profiler start, then exit: a death mid-window
    die_after_start: int | None = None
    # stop is delivered to the workers, then never replies (until a reset)
    hang_stop: bool = False
    # start / stop answer 500 "Failed to start/stop profiler: ..." and reach no worker
    start_500: bool = False
    stop_500: bool = False


class EmulatorOptions(BaseModel):
    model_config = ConfigDict(frozen=True)

    deploy_config: Path
    # As `vllm serve --omni` takes them: merged over the deploy file by the config layer's rules.
    stage_overrides: str | None = None
    profiler_config: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8091, ge=0, le=65535)
    fd: int | None = Field(default=None, ge=0, description="a listening socket handed over by a launcher")
    flavor: Literal["omni", "vllm"] = "omni"
    # Stage ids treated as diffusion stages (besides `emulator_stage_kind: diffusion` in the YAML).
    diffusion_stages: list[int] = Field(default_factory=list)
    model: str = "omni-emulator"
    step_ms: float = Field(default=5.0, ge=0, description="minimum wall time of one engine step")
    # stage -> idle iterations its engine runs after each request (nothing scheduled: vLLM steps once
    # more as a request ends with nothing else running); each counts towards max_iterations, none on
    # the step counter. A stage fed by another idles so between what it is handed.
    idle_after_request: dict[int, NonNegativeInt] = Field(default_factory=dict)
    gzip_delay_s: float = Field(default=0.5, ge=0, description="models the seconds a real trace takes to gzip")
    startup_timeout_s: float = Field(default=60.0, gt=0)
    # process: one process per stage replica, real torch.profiler traces;
    # thread: in the API process, torch-free synthetic traces (same files, made-up ops)
    workers: Literal["process", "thread"] = "process"
    # cuda: the files a GPU server writes (profiler_out_<N>.txt on every stage, stacks_cuda with
    # stacks); cpu: what vLLM-Omni on vLLM's CPU platform writes (no profiler_out for LLM stages)
    platform: Literal["cuda", "cpu"] = "cuda"
    # how process workers start: forked from a forkserver with torch preloaded, or spawned
    worker_start: Literal["forkserver", "spawn"] = "forkserver"
    # --- fault knobs at start-up (test aids; a real server has none of these) ---
    fault_stop_delay_s: float = Field(default=0.0, ge=0)
    fault_stop_travel_s: float = Field(default=0.0, ge=0)
    fault_start_travel_s: float = Field(default=0.0, ge=0)
    fault_start_delay_s: float = Field(default=0.0, ge=0)
    fault_metrics_delay_s: float = Field(default=0.0, ge=0)
    fault_metrics_delay_after: int = Field(default=0, ge=0)
    fault_metrics_delay_count: int = Field(default=0, ge=0)
    fault_dead_stage: int | None = None
    fault_die_after_start: int | None = None
    fault_hang_stop: bool = False
    fault_start_500: bool = False
    fault_stop_500: bool = False

    @property
    def faults(self) -> Faults:
        return Faults(
            stop_delay_s=self.fault_stop_delay_s,
            stop_travel_s=self.fault_stop_travel_s,
            start_travel_s=self.fault_start_travel_s,
            start_delay_s=self.fault_start_delay_s,
            metrics_delay_s=self.fault_metrics_delay_s,
            metrics_delay_after=self.fault_metrics_delay_after,
            metrics_delay_count=self.fault_metrics_delay_count,
            dead_stage=self.fault_dead_stage,
            die_after_start=self.fault_die_after_start,
            hang_stop=self.fault_hang_stop,
            start_500=self.fault_start_500,
            stop_500=self.fault_stop_500,
        )
