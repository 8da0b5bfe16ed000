"""Our ProfilerConfig of each vLLM version against that version's own ``ProfilerConfig``: 0.30 to
0.34 from the file each wheel ships (tests/contract/_vllm_profiler.py: no vLLM installed), and the
installed vllm's class: same fields, defaults, constraints, and the same accept/reject verdict, value
and error text on a table of inputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from sidecar.config.profiler import profiler_config_class
from sidecar.versions import Release, vllm_dialect
from tests.contract import _vllm_profiler

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
    # torch_profiler_activities: vLLM 0.31 on (0.30 does not know the key)
    ("activities_cuda", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_activities": ["CUDA"]}),
    ("activities_cpu_cuda", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_activities": ["CPU", "CUDA"]}),
    ("activities_empty", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_activities": []}),
    ("activities_duplicate", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_activities": ["CPU", "CPU"]}),
    ("activities_unknown", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_activities": ["GPU"]}),
    ("activities_not_list", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_activities": "CUDA"}),
    ("activities_on_cuda", {"profiler": "cuda", "torch_profiler_activities": ["CUDA"]}),
    ("activities_without_profiler", {"torch_profiler_activities": ["CPU"]}),
    ("activities_null", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_activities": None}),
    ("activities_and_dir_wrong", {"profiler": "cuda", "torch_profiler_dir": "/p", "torch_profiler_activities": ["XPU"]}),
    ("activities_private", {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_activities": ["PrivateUse1", "XPU"]}),
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
    assert len(CASES) >= 40


def test_every_version_of_the_table_has_its_file() -> None:
    # tools/vllm-profiler-configs.sh copies one per supported version; sidecar/versions.py lists them
    from sidecar.versions import VLLM_DIALECTS

    assert _vllm_profiler.VERSIONS == tuple(f"{d.line[0]}.{d.line[1]}" for d in VLLM_DIALECTS)


@pytest.fixture(scope="module", params=[*_vllm_profiler.VERSIONS, "installed"])
def pair(request: pytest.FixtureRequest) -> tuple[type, type]:
    """(ours, theirs) for one version: a wheel's own file, or the installed vllm's class."""
    if request.param == "installed":
        theirs = request.getfixturevalue("vllm_profiler_config")
        import vllm

        version = Release.parse(vllm.__version__)
    else:
        theirs = _vllm_profiler.load(request.param)
        version = Release.parse(f"{request.param}.0")
    return profiler_config_class(vllm_dialect(version).profiler_fields_missing), theirs


@pytest.mark.parametrize("data", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_same_verdict_value_and_error(pair: tuple[type, type], data: dict[str, Any]) -> None:
    ours, theirs = pair
    assert _verdict(ours, data) == _verdict(theirs, data)


def test_same_fields_and_defaults(pair: tuple[type, type]) -> None:
    ours_cls, theirs_cls = pair
    theirs = {n: f.default for n, f in theirs_cls.__pydantic_fields__.items()}
    ours = {n: f.default for n, f in ours_cls.model_fields.items()}
    assert list(ours.items()) == list(theirs.items())  # same order too: dumps read the same


def test_same_types_and_constraints(pair: tuple[type, type]) -> None:
    ours_cls, theirs_cls = pair
    theirs = {n: (f.annotation, repr(f.metadata)) for n, f in theirs_cls.__pydantic_fields__.items()}
    ours = {n: (f.annotation, repr(f.metadata)) for n, f in ours_cls.model_fields.items()}
    assert ours == theirs


def test_extra_keys_forbidden_in_both(pair: tuple[type, type]) -> None:
    ours, theirs = pair
    assert (ours.model_config.get("extra"), theirs.__pydantic_config__.get("extra")) == ("forbid", "forbid")
