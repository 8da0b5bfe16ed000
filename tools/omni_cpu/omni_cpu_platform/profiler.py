"""``CpuTorchProfilerWrapper``: stands in for vLLM-Omni's CUDA profiler wrapper
(``OmniTorchProfilerWrapper`` with CPU + CUDA activities): the same session folders, gzip and
xlsx, recording CPU activity only.

For the diffusion worker it profiles all threads (Kineto's ``profile_all_threads``). A CPU-only Kineto session is held by
the thread that started it; the inline diffusion stage starts and stops its profiler from
different threads of the API server, and a stop on a thread that holds no session crashes the
process in ``ActivityTraceWrapper::save`` ("disableProfiler called but no active profiling
session found", then SIGSEGV): it starts on the ``inline-diffusion`` executor thread, runs the
request and stops on the orchestrator's busy-loop thread. With all threads profiled the session
is process-wide and the trace holds the request. Known gap: on that diffusion path the op table
(``key_averages``) then fails to decode an event name ("'utf-8' codec can't decode"), so vLLM-Omni
logs "Failed to stop profiler" and writes no ``ops_rank0.xlsx`` / ``profiler_out_0.txt``; the
trace itself is complete. AR stages with stacks on show the same decode failure at times (seen
here in 2 of 3 runs, with the stock profiler): then no xlsx and no ``stacks_cpu_rank0.txt``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_omni.profiler.omni_torch_profiler import (
    OmniTorchProfilerWrapper,
    TorchProfilerActivity,
    TorchProfilerActivityMap,
)


class CpuTorchProfilerWrapper(OmniTorchProfilerWrapper):
    def _get_default_activities(self) -> list[TorchProfilerActivity]:
        return ["CPU"]

    def _create_profiler(self, profiler_config: Any, activities: list[TorchProfilerActivity]) -> Any:
        if not self._all_threads:
            # AR stages: exactly as vLLM-Omni makes it (one thread does start, steps and stop).
            return super()._create_profiler(profiler_config, activities)
        return torch.profiler.profile(
            activities=[TorchProfilerActivityMap[a] for a in activities],
            record_shapes=profiler_config.torch_profiler_record_shapes,
            profile_memory=profiler_config.torch_profiler_with_memory,
            with_stack=profiler_config.torch_profiler_with_stack,
            with_flops=profiler_config.torch_profiler_with_flops,
            on_trace_ready=self._on_trace_ready,
            experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
        )

    @property
    def _all_threads(self) -> bool:
        # vLLM-Omni names the diffusion worker's profiler "diffusion_rank<N>", AR ones "stage<id>_rank<N>".
        return self._worker_name.startswith("diffusion")
