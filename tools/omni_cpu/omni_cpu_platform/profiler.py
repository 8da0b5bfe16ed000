"""``CpuTorchProfilerWrapper``: stands in for vLLM-Omni's CUDA profiler wrapper
(``OmniTorchProfilerWrapper`` with CPU + CUDA activities): the same session folders, gzip and
xlsx, recording CPU activity only.
"""

from __future__ import annotations

from vllm_omni.profiler.omni_torch_profiler import OmniTorchProfilerWrapper, TorchProfilerActivity


class CpuTorchProfilerWrapper(OmniTorchProfilerWrapper):
    def _get_default_activities(self) -> list[TorchProfilerActivity]:
        return ["CPU"]
