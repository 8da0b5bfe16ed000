"""A two-stage AR pipeline (``pipeline: omni_cpu_tiny_ar`` in a deploy YAML): stands in for a
real vLLM-Omni pipeline such as Qwen2.5-Omni's thinker → talker. Stage 1 has no input function,
so it gets stage 0's output token ids as its prompt; no connector is needed.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

from omni_cpu_platform import MODEL_ARCH, PIPELINE_MODEL_TYPE

REGISTRY_MODULE = "vllm_omni.config.pipeline_registry"


def pipeline() -> Any:
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    def stage(stage_id: int, name: str, **kw: Any) -> StagePipelineConfig:
        return StagePipelineConfig(stage_id=stage_id, model_stage=name, execution_type=StageExecutionType.LLM_AR,
                                   model_arch=MODEL_ARCH, engine_output_type="text", **kw)

    return PipelineConfig(
        model_type=PIPELINE_MODEL_TYPE,
        model_arch=MODEL_ARCH,
        stages=(
            stage(0, "thinker", input_sources=(), owns_tokenizer=True,
                  sampling_constraints={"detokenize": True}),
            stage(1, "talker", input_sources=(0,), final_output=True, final_output_type="text",
                  sampling_constraints={"detokenize": True}),
        ),
    )


def _register(module: Any) -> None:
    if PIPELINE_MODEL_TYPE not in module.OMNI_PIPELINES:
        module.register_pipeline(pipeline())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers the pipeline as soon as vLLM-Omni's pipeline registry module has executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module: Any) -> None:
            exec_module(module)
            _register(module)

        spec.loader.exec_module = exec_and_register  # type: ignore[method-assign]
        return spec


def register_when_imported() -> None:
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None and hasattr(module, "OMNI_PIPELINES"):
        _register(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
