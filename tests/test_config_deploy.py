"""The deploy loader: schema, inheritance, platform overlays, legacy files, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config import load_deploy_config
from sidecar.config.models import StageKind
from sidecar.errors import ConfigError, ConfigUnreadable


def test_examples_load_with_torch_on_every_stage(example_deploys: list[Path]) -> None:
    assert len(example_deploys) >= 3
    for path in example_deploys:
        deploy = load_deploy_config(path)
        assert deploy.stages and all(s.profiler == "torch" for s in deploy.stages), path


def test_qwen25_example_has_three_absolute_stage_dirs(qwen25_deploy: Path) -> None:
    deploy = load_deploy_config(qwen25_deploy)
    assert [(s.stage_id, s.profiler_dir) for s in deploy.stages] == [
        (0, "/tmp/omni-sidecar/perf/stage0"),
        (1, "/tmp/omni-sidecar/perf/stage1"),
        (2, "/tmp/omni-sidecar/perf/stage2"),
    ]


def test_emulator_stage_kind_sets_diffusion(wan22_deploy: Path) -> None:
    stage = load_deploy_config(wan22_deploy).stages[0]
    assert (stage.kind, stage.extras["emulator_stage_kind"]) == (StageKind.diffusion, "diffusion")


def test_stage_kind_defaults_to_unknown(qwen25_deploy: Path) -> None:
    assert {s.kind for s in load_deploy_config(qwen25_deploy).stages} == {StageKind.unknown}


def test_engine_args_profiler_config_merges_over_flat(write_deploy) -> None:
    path = write_deploy(
        "stages:\n"
        "  - stage_id: 0\n"
        "    profiler_config: {profiler: torch, torch_profiler_dir: /tmp/a, max_iterations: 3}\n"
        "    engine_args:\n"
        "      profiler_config: {max_iterations: 7, torch_profiler_with_stack: false}\n"
    )
    pc = load_deploy_config(path).stages[0].profiler_config
    assert (pc.torch_profiler_dir, pc.max_iterations, pc.torch_profiler_with_stack) == ("/tmp/a", 7, False)


def test_runtime_block_sets_devices_and_replicas(write_deploy) -> None:
    path = write_deploy("stages:\n  - stage_id: 0\n    devices: '9'\n    runtime: {devices: '0,1', num_replicas: 2}\n")
    stage = load_deploy_config(path).stages[0]
    assert (stage.devices, stage.num_replicas) == ("0,1", 2)


def test_base_config_overlay_merges_stage_by_id(deploy_data: Path) -> None:
    deploy = load_deploy_config(deploy_data / "overlay.yaml")
    s1 = deploy.stage(1).profiler_config
    assert deploy.stage_ids == [0, 1, 2, 3]
    assert (s1.torch_profiler_dir, s1.torch_profiler_record_shapes, s1.max_iterations) == ("/tmp/p/base1", True, 4)
    assert deploy.base_chain == [deploy_data / "base.yaml"]


def test_overlay_stage_keeps_its_kind_and_replicas(deploy_data: Path) -> None:
    s3 = load_deploy_config(deploy_data / "overlay.yaml").stage(3)
    assert (s3.kind, s3.num_replicas, s3.devices) == (StageKind.diffusion, 2, "2")


def test_platform_overlay_replaces_profiler_config(deploy_data: Path) -> None:
    deploy = load_deploy_config(deploy_data / "base.yaml", platform="npu")
    assert (deploy.stage(0).profiler, deploy.stage(0).devices) == ("cuda", "3")
    assert (deploy.stage(2).profiler_dir, deploy.stage(2).devices, deploy.stage(2).num_replicas) == ("/tmp/p/npu2", "5", 2)


def test_other_platform_leaves_stages_alone(deploy_data: Path) -> None:
    deploy = load_deploy_config(deploy_data / "base.yaml", platform="cuda")
    assert (deploy.stage(0).profiler, deploy.stage(2).profiler) == ("torch", None)


def test_legacy_stage_args_read_with_warning(deploy_data: Path) -> None:
    deploy = load_deploy_config(deploy_data / "legacy_stage_args.yaml")
    (finding,) = [f for f in deploy.findings if f.code == "legacy_schema"]
    assert deploy.legacy_schema and not finding.is_error
    assert "`stages:`" in finding.message and finding.where.line == 2
    assert deploy.stage(0).profiler_dir == "/tmp/p/legacy0"
    assert (deploy.stage(0).devices, deploy.stage(1).kind) == ("0", StageKind.diffusion)


def test_relative_dir_is_made_absolute_with_a_warning(write_deploy, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    path = write_deploy("stages:\n  - stage_id: 0\n    profiler_config: {profiler: torch, torch_profiler_dir: perf/s0}\n")
    deploy = load_deploy_config(path)
    assert deploy.stages[0].profiler_dir == str(tmp_path / "perf" / "s0")
    assert [f.code for f in deploy.findings] == ["profiler_dir_relative"]


def test_stage_marks_point_at_profiler_keys(deploy_data: Path) -> None:
    stage = load_deploy_config(deploy_data / "base.yaml").stage(0)
    where = stage.marks["profiler_config.max_iterations"]
    assert (Path(where.file).name, where.line, where.column) == ("base.yaml", 10, 7)


# --- bad input: each gets a code and file:line ---------------------------------------------

BAD = [
    ("not_yaml.yaml", ConfigUnreadable, "yaml_invalid", 4),
    ("empty.yaml", ConfigUnreadable, "config_empty", 1),
    ("top_list.yaml", ConfigUnreadable, "config_not_mapping", 1),
    ("dup_stage.yaml", ConfigError, "stage_id_duplicate", 4),
    ("stage_id_str.yaml", ConfigError, "stage_id_invalid", 3),
    ("missing_base.yaml", ConfigError, "base_config_missing", 1),
    ("cycle_a.yaml", ConfigError, "base_config_cycle", 1),
    ("unknown_key.yaml", ConfigError, "profiler_config_invalid", 6),
    ("out_of_range.yaml", ConfigError, "profiler_config_invalid", 6),
    ("torch_no_dir.yaml", ConfigError, "profiler_config_invalid", 4),
]


@pytest.mark.parametrize(("name", "exc", "code", "line"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_has_code_and_line(deploy_data: Path, name: str, exc: type, code: str, line: int) -> None:
    with pytest.raises(exc) as info:
        load_deploy_config(deploy_data / name)
    err = info.value
    # one class per failure: the family decides the CLI's exit code (2 only for unreadable input)
    assert (isinstance(err, ConfigUnreadable), err.code, err.where.line) == (exc is ConfigUnreadable, code, line)
    assert Path(err.where.file).name in (name, "cycle_b.yaml")


def test_missing_file_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigUnreadable) as info:
        load_deploy_config(tmp_path / "nope.yaml")
    assert info.value.code == "file_not_found"


def test_unknown_key_suggests_the_right_one(deploy_data: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_deploy_config(deploy_data / "unknown_key.yaml")
    assert "did you mean `torch_profiler_with_stack`" in info.value.message
    assert info.value.key == "profiler_config.torch_profiler_with_stak"


def test_missing_dir_uses_vllm_text(deploy_data: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_deploy_config(deploy_data / "torch_no_dir.yaml")
    assert "torch_profiler_dir must be set when profiler is 'torch'" in info.value.message


def test_out_of_range_names_the_key(deploy_data: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_deploy_config(deploy_data / "out_of_range.yaml")
    assert info.value.key == "profiler_config.max_iterations" and "greater than or equal to 0" in info.value.message


def test_duplicate_yaml_key_is_refused(write_deploy) -> None:
    path = write_deploy("stages:\n  - stage_id: 0\n    stage_id: 1\n")
    with pytest.raises(ConfigUnreadable) as info:
        load_deploy_config(path)
    assert (info.value.code, info.value.where.line) == ("yaml_invalid", 3)


def test_cycle_message_lists_the_chain(deploy_data: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_deploy_config(deploy_data / "cycle_a.yaml")
    assert "cycle_a.yaml -> " in info.value.message and "cycle_b.yaml" in info.value.message


def test_profiler_config_not_a_mapping(write_deploy) -> None:
    path = write_deploy("stages:\n  - stage_id: 0\n    profiler_config: torch\n")
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    assert (info.value.code, info.value.where.line) == ("profiler_config_invalid", 3)
