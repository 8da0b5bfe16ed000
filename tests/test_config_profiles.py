"""Stage profiles and rendering them into an overlay or --stage-overrides JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sidecar.config import list_profiles, load_deploy_config, load_profile, render_overlay, render_stage_overrides
from sidecar.config.profiles import profiles_dir
from sidecar.errors import ConfigError, StageSelectionError

REPO = Path(__file__).resolve().parents[1]


def test_all_presets_ship() -> None:
    assert set(list_profiles()) >= {"light", "ops", "shapes", "memory", "stacks", "nsys"}


def test_top_level_presets_are_the_package_copy() -> None:
    # One source (STYLE.md): the top-level folder is a link to the packaged presets, not a copy.
    top = REPO / "stage_profiles"
    assert top.is_symlink() and top.resolve() == profiles_dir().resolve()


def test_light_is_bounded_without_stacks() -> None:
    pc = load_profile("light").profiler_config
    assert (pc["profiler"], pc["torch_profiler_with_stack"], pc["torch_profiler_use_gzip"]) == ("torch", False, True)
    assert pc["max_iterations"] > 0


def test_unknown_profile_lists_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load_profile("heavy")
    assert info.value.code == "profile_unknown" and "light" in info.value.message


def test_overlay_inherits_base_and_sets_chosen_stages(qwen25_deploy: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "overlay.yaml"
    out.parent.mkdir()
    out.write_text(render_overlay(qwen25_deploy, "ops", [0, 2], out_path=out, out_dir=tmp_path / "perf"))
    deploy = load_deploy_config(out)
    assert [s.profiler_dir for s in deploy.stages] == [
        str(tmp_path / "perf" / "stage0"),
        "/tmp/omni-sidecar/perf/stage1",
        str(tmp_path / "perf" / "stage2"),
    ]
    assert deploy.stage(0).profiler_config.torch_profiler_record_shapes is True
    assert deploy.stage(1).profiler_config.torch_profiler_record_shapes is False


def test_overlay_base_config_is_relative_to_its_folder(qwen25_deploy: Path, tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "o.yaml"
    doc = yaml.safe_load(render_overlay(qwen25_deploy, "light", [1], out_path=out))
    assert (out.parent / doc["base_config"]).resolve() == qwen25_deploy.resolve()


def test_profile_fully_replaces_base_profiler_fields(deploy_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.yaml"
    out.write_text(render_overlay(deploy_data / "base.yaml", "light", [1], out_path=out))
    pc = load_deploy_config(out).stage(1).profiler_config
    # base.yaml had record_shapes on for stage 1; light turns it off and keeps the stage's dir.
    assert (pc.torch_profiler_record_shapes, pc.torch_profiler_dir) == (False, "/tmp/p/base1")


def test_nsys_renders_cuda_without_dir(qwen25_deploy: Path) -> None:
    data = json.loads(render_stage_overrides(qwen25_deploy, "nsys", [1]))
    assert list(data) == ["1"] and (data["1"]["profiler_config"]["profiler"], data["1"]["profiler_config"]["torch_profiler_dir"]) == ("cuda", "")


def test_stage_overrides_json_per_stage(qwen25_deploy: Path, tmp_path: Path) -> None:
    data = json.loads(render_stage_overrides(qwen25_deploy, "memory", [0, 2], out_dir=tmp_path))
    assert {k: v["profiler_config"]["torch_profiler_dir"] for k, v in data.items()} == {
        "0": str(tmp_path / "stage0"),
        "2": str(tmp_path / "stage2"),
    }


def test_unprofiled_stage_needs_dir(deploy_data: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        render_overlay(deploy_data / "no_profiler.yaml", "light", [0], out_path=tmp_path / "o.yaml")
    assert info.value.code == "profile_dir_missing" and "--dir" in info.value.message


def test_unknown_stage_refused(qwen25_deploy: Path, tmp_path: Path) -> None:
    with pytest.raises(StageSelectionError) as info:
        render_overlay(qwen25_deploy, "light", [5], out_path=tmp_path / "o.yaml")
    assert info.value.code == "stage_unknown"
