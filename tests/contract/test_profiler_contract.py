"""Our ProfilerConfig against vllm.config.ProfilerConfig (vLLM 0.30): same fields, defaults,
constraints, and the same accept/reject verdict, value and error text on a table of inputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from sidecar.config.profiler import ProfilerConfig

pytestmark = pytest.mark.contract

# (id, input). Each row runs through both classes.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("empty", {}),
    ("torch_dir", {"profiler": "torch", "torch_profiler_dir": "/tmp/p"}),
    ("torch_no_dir", {"profiler": "torch"}),
    ("torch_empty_dir", {"profiler": "torch", "torch_profiler_dir": ""}),
    ("dir_without_profiler", {"torch_profiler_dir": "/tmp/p"}),
    ("cuda", {"profiler": "cuda"}),
    ("cuda_with_dir", {"profiler": "cuda", "torch_profiler_dir": "/tmp/p"}),
    ("proton_no_dir", {"profiler": "proton"}),
    ("proton_dir", {"profiler": "proton", "proton_profiler_dir": "/tmp/q"}),
    ("proton_uri_dir", {"profiler": "proton", "proton_profiler_dir": "gs://b/q"}),
    ("proton_opts_on_torch", {"profiler": "torch", "torch_profiler_dir": "/tmp/p", "proton_data": "trace"}),
    ("proton_chrome_tree", {"profiler": "proton", "proton_profiler_dir": "/q", "proton_output_format": "chrome_trace"}),
    ("proton_chrome_trace", {"profiler": "proton", "proton_profiler_dir": "/q", "proton_data": "trace", "proton_output_format": "chrome_trace"}),
    ("proton_hatchet_trace", {"profiler": "proton", "proton_profiler_dir": "/q", "proton_data": "trace", "proton_output_format": "hatchet"}),
    ("proton_graph_trace", {"profiler": "proton", "proton_profiler_dir": "/q", "proton_data": "trace", "proton_graph_attribution": True}),
    ("proton_graph_flush", {"profiler": "proton", "proton_profiler_dir": "/q", "proton_graph_attribution": True, "proton_mode": "periodic_flushing:10"}),
    ("unknown_profiler", {"profiler": "nsys"}),
    ("unknown_key", {"profiler": "torch", "torch_profiler_dir": "/tmp/p", "torch_profiler_with_stak": False}),
    ("capture_on_cuda", {"profiler": "cuda", "capture_torch_profiler": True}),
    ("capture_on_torch", {"profiler": "torch", "torch_profiler_dir": "/tmp/p", "capture_torch_profiler": True}),
    ("negative_delay", {"delay_iterations": -1}),
    ("negative_max", {"profiler": "torch", "torch_profiler_dir": "/p", "max_iterations": -3}),
    ("zero_active", {"active_iterations": 0}),
    ("negative_warmup", {"warmup_iterations": -1}),
    ("negative_wait", {"wait_iterations": -2}),
    ("bounded", {"profiler": "torch", "torch_profiler_dir": "/p", "delay_iterations": 3, "max_iterations": 9}),
    ("string_int", {"profiler": "torch", "torch_profiler_dir": "/p", "max_iterations": "12"}),
    ("float_int", {"max_iterations": 5.0}),
    ("fractional_int", {"max_iterations": 5.5}),
    ("string_bool", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_with_stack": "false"}),
    ("bad_bool", {"torch_profiler_use_gzip": "maybe"}),
    ("relative_dir", {"profiler": "torch", "torch_profiler_dir": "perf/s0"}),
    ("home_dir", {"profiler": "torch", "torch_profiler_dir": "~/perf"}),
    ("uri_dir", {"profiler": "torch", "torch_profiler_dir": "s3://bucket/perf"}),
    ("all_flags", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_with_flops": True, "torch_profiler_record_shapes": True, "torch_profiler_with_memory": True, "detailed_trace_annotation": True, "ignore_frontend": True}),
    ("null_profiler", {"profiler": None}),
    ("list_dir", {"profiler": "torch", "torch_profiler_dir": ["/p"]}),
]


# Intended difference: vLLM's class is a pydantic *dataclass*, whose unknown-key error is
# "unexpected_keyword_argument"; ours is a BaseModel ("extra_forbidden"). Same verdict, same key.
_SAME_ERROR = {("unexpected_keyword_argument", "Unexpected keyword argument"): ("extra_forbidden", "Extra inputs are not permitted")}


def _verdict(cls: type, data: dict[str, Any]) -> tuple[str, Any]:
    try:
        obj = cls(**data)
    except ValidationError as err:
        first = err.errors()[0]
        key = (first["type"], first["msg"])
        return "reject", (_SAME_ERROR.get(key, key), tuple(first["loc"]))
    values = obj.model_dump() if hasattr(obj, "model_dump") else dataclasses.asdict(obj)
    return "accept", values


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize("data", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_same_verdict_value_and_error(vllm_profiler_config: type, data: dict[str, Any]) -> None:
    assert _verdict(ProfilerConfig, data) == _verdict(vllm_profiler_config, data)


def test_same_fields_and_defaults(vllm_profiler_config: type) -> None:
    theirs = {n: f.default for n, f in vllm_profiler_config.__pydantic_fields__.items()}
    ours = {n: f.default for n, f in ProfilerConfig.model_fields.items()}
    assert list(ours.items()) == list(theirs.items())  # same order too: dumps read the same


def test_same_types_and_constraints(vllm_profiler_config: type) -> None:
    theirs = {n: (f.annotation, repr(f.metadata)) for n, f in vllm_profiler_config.__pydantic_fields__.items()}
    ours = {n: (f.annotation, repr(f.metadata)) for n, f in ProfilerConfig.model_fields.items()}
    assert ours == theirs


def test_extra_keys_forbidden_in_both(vllm_profiler_config: type) -> None:
    assert (ProfilerConfig.model_config.get("extra"), vllm_profiler_config.__pydantic_config__.get("extra")) == (
        "forbid",
        "forbid",
    )
