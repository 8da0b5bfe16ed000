"""vLLM-Omni 0.30's own resolver, driven without a model: the real ``VllmOmniConfig.from_pipeline_config``
over a deploy file, with a stand-in pipeline topology (one LLM stage per deploy stage, chained), the
command line flattened by the real ``_flatten_stage_overrides`` and ``--profiler-config`` parsed by
vLLM's own ``TypeAdapter(ProfilerConfig)`` and ``_convert_dataclasses_to_dict``.

``vllm_omni.config.resolver`` and ``vllm_omni.entrypoints.utils`` import the model registry, which
needs torchvision (not installed with CPU torch), so their small pure functions are compiled from
the installed source files (by name, with ast), not copied here.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _compile_functions(path: Path, names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in wanted}
    assert not missing, f"{path} no longer defines {missing}"
    for node in wanted:
        node.decorator_list = []
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return {n: namespace[n] for n in names}


_NOT_LLM = re.compile(r"Stage (\d+) \(llm_\w+\) has explicit engine argument\(s\) with no structured config owner")


class OmniResolver:
    """``resolve(path, platform, stage_overrides=JSON, profiler_config=JSON) -> {sid: (pc_dict|None, devices, replicas)}``."""

    def __init__(self) -> None:
        from pydantic import TypeAdapter
        from vllm.config import ProfilerConfig
        from vllm_omni.config import omni_config, stage_config

        self.sc, self.oc, self.ProfilerConfig = stage_config, omni_config, ProfilerConfig
        root = Path(stage_config.__file__).resolve().parents[1]
        ns: dict[str, Any] = {
            "Any": Any, "Mapping": Mapping, "json": json, "logger": logging.getLogger("omni-contract"),
            "dataclasses": dataclasses, "fields": dataclasses.fields, "is_dataclass": dataclasses.is_dataclass,
        }
        fns = _compile_functions(root / "entrypoints" / "utils.py", ["parse_stage_overrides"], dict(ns))
        fns |= _compile_functions(
            root / "config" / "resolver.py",
            ["_flatten_stage_overrides", "_convert_dataclasses_to_dict", "_filter_dict_like_object"],
            dict(ns),
        )
        self.parse_stage_overrides = fns["parse_stage_overrides"]
        self.flatten = fns["_flatten_stage_overrides"]
        self.convert = fns["_convert_dataclasses_to_dict"]
        self._adapter = TypeAdapter(ProfilerConfig)

    def _pipeline(self, ids: list[int], diffusion: set[int]) -> Any:
        sc = self.sc
        stages = tuple(
            sc.StagePipelineConfig(
                stage_id=sid,
                model_stage=f"stage{sid}",
                execution_type=sc.StageExecutionType.DIFFUSION if sid in diffusion else sc.StageExecutionType.LLM_AR,
                input_sources=() if i == 0 else (ids[i - 1],),
                final_output=i == len(ids) - 1,
            )
            for i, sid in enumerate(ids)
        )
        return sc.PipelineConfig(model_type="omni_sidecar_contract", stages=stages)

    def resolve(
        self, path: Path, platform: str, *, stage_overrides: str | None = None, profiler_config: str | None = None
    ) -> dict[int, tuple[dict[str, Any] | None, Any, int]]:
        sc, oc = self.sc, self.oc
        deploy = sc.load_deploy_config(path)
        if not deploy.stages:
            return {}
        deploy.async_chunk = False  # the stand-in topology has no async-chunk processors
        # As resolve_omni_config builds it: explicit CLI kwargs (dataclasses made dicts), then stage_<id>_<key>.
        cli: dict[str, Any] = {}
        if profiler_config is not None:
            cli["profiler_config"] = self._adapter.validate_json(profiler_config)
        cli = self.convert(cli)
        self.flatten(cli, self.parse_stage_overrides(stage_overrides))
        ids = [s.stage_id for s in deploy.stages]
        config = None
        diffusion: set[int] = set()
        original = oc._apply_platform_overrides
        oc._apply_platform_overrides = functools.partial(sc._apply_platform_overrides, platform=platform)
        try:
            while config is None:
                try:
                    config = oc.VllmOmniConfig.from_pipeline_config(
                        self._pipeline(ids, diffusion), user_deploy_config=deploy, cli_overrides=dict(cli)
                    )
                except ValueError as err:
                    # The stand-in guessed LLM for a diffusion stage: the real resolver names it.
                    m = _NOT_LLM.search(str(err))
                    if m is None or int(m.group(1)) in diffusion:
                        raise
                    diffusion.add(int(m.group(1)))
        finally:
            oc._apply_platform_overrides = original
        out = {}
        for stage in config.stage_configs:
            pc = stage.profiler_config
            out[stage.stage_id] = (
                None if pc is None else dataclasses.asdict(pc),
                stage.runtime_config.devices,
                stage.runtime_config.num_replicas,
            )
        return out
