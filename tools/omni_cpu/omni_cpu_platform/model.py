"""``OmniCpuLlamaForCausalLM``: stands in for a vLLM-Omni stage model (e.g. a Qwen-Omni
thinker): vLLM's Llama, taking and ignoring the keywords the Omni AR runner adds to ``forward``
(``sampling_metadata=``, ``logits_index=``, ``sampler=``, its per-step buffers).
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import LlamaForCausalLM

from omni_cpu_platform import MODEL_ARCH

_OMNI_KWARGS = ("sampling_metadata", "logits_index", "sampler", "model_intermediate_buffer",
                "runtime_additional_information", "request_token_spans", "request_sample_eligible")


class OmniCpuLlamaForCausalLM(LlamaForCausalLM):
    def forward(self, input_ids: Any, positions: Any, intermediate_tensors: Any = None,
                inputs_embeds: Any = None, **kwargs: Any) -> Any:
        for key in _OMNI_KWARGS:
            kwargs.pop(key, None)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)


def register() -> None:
    from vllm.model_executor.models import ModelRegistry
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    target = f"{__name__}:OmniCpuLlamaForCausalLM"
    for registry in (ModelRegistry, OmniModelRegistry):
        if MODEL_ARCH not in registry.get_supported_archs():
            registry.register_model(MODEL_ARCH, target)
