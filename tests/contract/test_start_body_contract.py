"""The start body the sidecar sends each plain vLLM, read by that version's own route: its
``StartProfileRequest`` (``vllm/entrypoints/serve/profile/api_router.py`` copied verbatim out of each
wheel into tests/data/vllm_profile_api/ by tools/vllm-profiler-configs.sh; 0.30's route takes no
body). The model ignores extra keys, so a key a version does not read would be dropped without a
word: every key sent must come back out of that version's model, and the version table
(sidecar/versions.py) must say a version takes a key exactly where its model has the field. A stage
preset's ``profiler_kwargs`` (0.33+) are merged by the worker over its ``_base_profiler_kwargs``
(``vllm/profiler/wrapper.py``) and passed into ``torch.profiler.profile`` unchecked: every key must
be one of those base keys and a parameter of the real torch's ``profile``."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from sidecar.config.profiles import list_profiles
from sidecar.control.limits import check_profile, start_options
from sidecar.control.steps import Bound
from sidecar.errors import ProfileNotPerCapture
from sidecar.versions import ServerVersion

pytestmark = pytest.mark.contract

API = Path(__file__).resolve().parents[1] / "data" / "vllm_profile_api"
LINES = sorted((p.stem for p in API.glob("0.*.py")), key=lambda v: tuple(int(x) for x in v.split(".")))
FIELDS = {"profile_prefix": "per_capture_prefix", "max_iterations": "per_capture_bounds",
          "delay_iterations": "per_capture_bounds", "profiler_kwargs": "per_capture_kwargs"}


def _request_model(line: str) -> type[BaseModel] | None:
    """That version's ``StartProfileRequest``, built from its own class body (None: no body read)."""
    source = (API / f"{line}.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "StartProfileRequest":
            ns: dict[str, Any] = {"BaseModel": BaseModel, "ConfigDict": ConfigDict, "Any": Any}
            exec(compile(ast.Module([node], []), f"vllm {line} api_router.py", "exec"), ns)  # noqa: S102
            model = ns["StartProfileRequest"]
            model.model_rebuild(_types_namespace=ns)
            return model
    return None


def _base_kwargs(line: str) -> set[str]:
    """The keys of the worker's ``_base_profiler_kwargs = dict(...)``, which profiler_kwargs update."""
    tree = ast.parse((API / f"wrapper-{line}.py").read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
                and node.targets[0].attr == "_base_profiler_kwargs" and isinstance(node.value, ast.Call)):
            return {kw.arg for kw in node.value.keywords if kw.arg}
    raise AssertionError(f"no _base_profiler_kwargs in wrapper-{line}.py")


def test_the_routes_of_the_supported_versions_are_here() -> None:
    assert LINES == ["0.30", "0.32", "0.33", "0.34"]
    assert _request_model("0.30") is None  # 0.30's start takes no body at all
    assert _base_kwargs("0.33") >= {"record_shapes", "profile_memory", "with_stack", "with_flops"}


@pytest.mark.parametrize("line", LINES)
def test_the_version_table_says_a_key_is_taken_exactly_where_that_versions_route_reads_it(line: str) -> None:
    model = _request_model(line)
    version = ServerVersion.of("vllm", f"{line}.0")
    fields = set(model.model_fields) if model is not None else set()
    assert {k for k, flag in FIELDS.items() if getattr(version, flag)} == fields & set(FIELDS)
    assert set(version.start_body) == fields


@pytest.mark.parametrize("preset", [None, *list_profiles()])
@pytest.mark.parametrize("line", LINES)
def test_every_start_body_sent_is_read_whole_by_that_versions_route(line: str, preset: str | None) -> None:
    torch = pytest.importorskip("torch")
    version = ServerVersion.of("vllm", f"{line}.0")
    model = _request_model(line)
    try:
        kwargs = check_profile(version, preset)
    except ProfileNotPerCapture:
        assert preset == "nsys" or model is None or "profiler_kwargs" not in model.model_fields
        return
    bound = Bound.per_capture if version.per_capture_bounds else None
    body = start_options(version, "3f9c2a61b0d44e7e", bound, 20, 5, kwargs)
    if model is None:
        assert body == {}
        return
    # strict, extra keys ignored: what comes back out is what that server acts on
    assert model.model_validate_json(json.dumps(body)).model_dump(exclude_none=True) == body
    if preset is not None:
        sent = set(body["profiler_kwargs"])
        assert sent and sent <= _base_kwargs("0.33")
        assert sent <= set(inspect.signature(torch.profiler.profile).parameters)
