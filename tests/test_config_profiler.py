"""ProfilerConfig on its own (the contract tests diff it against vLLM when vLLM is installed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sidecar.config import ProfilerConfig


def test_vllm_defaults() -> None:
    pc = ProfilerConfig()
    assert (pc.profiler, pc.torch_profiler_dir, pc.torch_profiler_with_stack, pc.active_iterations) == (None, "", True, 5)


@pytest.mark.parametrize(
    ("data", "text"),
    [
        ({"profiler": "torch"}, "torch_profiler_dir must be set when profiler is 'torch'"),
        ({"profiler": "cuda", "torch_profiler_dir": "/p"}, "torch_profiler_dir is only applicable when profiler is set to 'torch'"),
        ({"profiler": "cuda", "capture_torch_profiler": True}, "capture_torch_profiler is only applicable when profiler is set to 'torch'"),
        ({"proton_data": "trace"}, "proton_data only applicable when profiler is set to 'proton'"),
    ],
)
def test_vllm_error_texts(data: dict, text: str) -> None:
    with pytest.raises(ValidationError, match=text):
        ProfilerConfig(**data)


def test_dir_is_made_absolute_but_uris_are_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert ProfilerConfig(profiler="torch", torch_profiler_dir="x").torch_profiler_dir == str(tmp_path / "x")
    assert ProfilerConfig(profiler="torch", torch_profiler_dir="gs://b/x").torch_profiler_dir == "gs://b/x"


def test_extra_keys_forbidden() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        ProfilerConfig(profiler="torch", torch_profiler_dir="/p", with_stack=False)


def test_torch_dict_lists_every_torch_field() -> None:
    d = ProfilerConfig(profiler="torch", torch_profiler_dir="/p").torch_dict()
    assert len(d) == 16 and not any(k.startswith("proton") for k in d)
