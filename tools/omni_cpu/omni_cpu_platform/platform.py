"""``CpuOmniPlatform``: stands in for vLLM-Omni's ``CudaOmniPlatform`` (``platforms/cuda``),
built like its XPU one (``platforms/xpu/platform.py``): ``OmniPlatform`` + vLLM's own
``CpuPlatform``, with the CPU AR worker, a CPU-only profiler and one "device".
"""

from __future__ import annotations

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "omni_cpu_platform.worker.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError("omni_cpu_platform runs AR and diffusion stages only")

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/model_executor/stage_configs"

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                       allow_trtllm_default: bool = False) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1  # stage device locking needs one "device" to lock

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return cls.get_device_memory(device)[0]

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @classmethod
    def get_profiler_cls(cls) -> str:
        return "omni_cpu_platform.profiler.CpuTorchProfilerWrapper"

    # The diffusion runner measures peaks around its warm-up; CPU has no caching allocator.
    @classmethod
    def reset_peak_memory_stats(cls, device: object = None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device: object = None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device: object = None) -> int:
        return 0

    @classmethod
    def empty_cache(cls) -> None:
        return None
