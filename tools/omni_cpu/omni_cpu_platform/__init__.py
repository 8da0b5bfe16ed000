"""omni-sidecar test support: runs the real vLLM-Omni server (0.30.0, 0.32.0rc1) on CPU (docs/omni-cpu.md).

Stands in for what a GPU build brings: vLLM-Omni's ``CudaOmniPlatform`` (through its
``vllm_omni.platform_plugins`` entry point), the CUDA AR worker, and a real model pipeline
(a tiny two-stage AR pipeline over a local random Llama). Never a dependency of ``sidecar``.
"""

from __future__ import annotations

import os

PIPELINE_MODEL_TYPE = "omni_cpu_tiny_ar"
MODEL_ARCH = "OmniCpuLlamaForCausalLM"


def platform_plugin() -> str | None:
    """``vllm_omni.platform_plugins`` entry: the CPU OmniPlatform, unless switched off."""
    if os.environ.get("OMNI_CPU_PLATFORM", "1") == "0":
        return None
    from omni_cpu_platform.pipeline import register_when_imported

    # The plugin runs while vllm_omni is still importing: the pipeline registry is not there yet.
    register_when_imported()
    return "omni_cpu_platform.platform.CpuOmniPlatform"


def register_models() -> None:
    """``vllm.general_plugins`` entry (runs in every vLLM process): the model wrapper's
    architecture in vLLM's and vLLM-Omni's registries, and the pipeline."""
    from omni_cpu_platform.model import register
    from omni_cpu_platform.pipeline import register_when_imported

    register()
    register_when_imported()
