"""``CPUARWorker``: stands in for vLLM-Omni's ``GPUARWorker`` (``worker/gpu_ar_worker.py``):
vLLM's ``CPUWorker`` with vLLM-Omni's worker mixin, ``GPUARModelRunner`` made to run on CPU the
way vLLM's ``CPUModelRunner`` runs ``GPUModelRunner``, and vLLM-Omni's profiler and trace naming
(``OmniGPUWorkerBase``) in place of vLLM's CPU profiler.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.base import OmniGPUWorkerBase
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

logger = init_logger(__name__)


class CPUARModelRunner(GPUARModelRunner, CPUModelRunner):
    """MRO: the Omni AR runner's steps first, then vLLM's CPU runner below them (its
    ``__init__`` swaps CUDA streams/events for placeholders and points the device buffers at the
    CPU ones; its ``load_model``, ``_sync_device``, ``_to_list`` end the Omni ``super()`` chains)."""


class CPUARWorker(OmniWorkerMixin, CPUWorker):
    """vLLM's CPU worker running the Omni AR model runner, profiled like ``OmniGPUWorkerBase``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        profiler_config = self.vllm_config.profiler_config
        if profiler_config and profiler_config.profiler == "torch":
            from vllm_omni.profiler import create_omni_profiler

            stage_id = getattr(self.vllm_config.model_config, "stage_id", 0)
            self.profiler = create_omni_profiler(
                profiler_config=profiler_config, worker_name=f"stage{stage_id}_rank{self.rank}",
                local_rank=self.local_rank,
            )

    profile = OmniGPUWorkerBase.profile

    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner:
            logger.warning("omni_cpu_platform: the v1 model runner carries the Omni hooks; using it")
            self.use_v2_model_runner = False
        self.model_runner = CPUARModelRunner(self.vllm_config, torch.device("cpu"))
