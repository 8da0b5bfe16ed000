"""Stage selection (the one rule every surface uses) and the discrete-torch findings."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config import load_deploy_config, select_stages, validate_deploy
from sidecar.config.models import DeployConfig
from sidecar.errors import StageSelectionError


@pytest.fixture
def mixed(deploy_data: Path) -> DeployConfig:
    """Stage 0 torch (vLLM defaults), 1 cuda, 2 unprofiled."""
    return load_deploy_config(deploy_data / "mixed.yaml")


def test_none_means_every_torch_stage_listed(qwen25_deploy: Path) -> None:
    assert select_stages(load_deploy_config(qwen25_deploy), None) == [0, 1, 2]


def test_none_with_allow_cuda_adds_cuda_stages(mixed: DeployConfig) -> None:
    assert select_stages(mixed, None, allow_cuda=True) == [0, 1]


def test_explicit_list_is_kept_in_order(qwen25_deploy: Path) -> None:
    assert select_stages(load_deploy_config(qwen25_deploy), [2, 0]) == [2, 0]


@pytest.mark.parametrize(
    ("stages", "code", "offending"),
    [
        ([], "stages_empty", []),
        ([0, 0], "stage_duplicate", [0]),
        ([0, 7], "stage_unknown", [7]),
        ([2], "stage_not_profiled", [2]),
        ([1], "stage_not_torch", [1]),
    ],
)
def test_bad_selection_codes(mixed: DeployConfig, stages: list[int], code: str, offending: list[int]) -> None:
    with pytest.raises(StageSelectionError) as info:
        select_stages(mixed, stages)
    assert (info.value.code, info.value.details["stages"], info.value.details["valid"]) == (code, offending, [0])


def test_cuda_stage_allowed_for_nsys(mixed: DeployConfig) -> None:
    assert select_stages(mixed, [1], allow_cuda=True) == [1]


def test_no_profiled_stage_is_an_error(deploy_data: Path) -> None:
    with pytest.raises(StageSelectionError) as info:
        select_stages(load_deploy_config(deploy_data / "no_profiler.yaml"), None)
    assert info.value.code == "stage_not_profiled" and "profiler: torch" in info.value.message


def test_examples_validate_clean(example_deploys: list[Path]) -> None:
    for path in example_deploys:
        # emulator_only_key: configs/wan2_2_ti2v.yaml still carries `emulator_stage_kind` (see the lead's report)
        assert [f for f in validate_deploy(load_deploy_config(path)) if f.code != "emulator_only_key"] == [], path


def test_vllm_defaults_warn_on_stack_and_unbounded(mixed: DeployConfig) -> None:
    findings = validate_deploy(mixed)
    assert sorted(f.code for f in findings) == ["max_iterations_unbounded", "stack_enabled"]
    assert all(not f.is_error and f.stage_id == 0 for f in findings)


def test_stack_warning_points_at_the_stage(mixed: DeployConfig) -> None:
    (f,) = [f for f in validate_deploy(mixed) if f.code == "stack_enabled"]
    assert (Path(f.where.file).name, f.where.line) == ("mixed.yaml", 4)


def test_selection_errors_become_findings(mixed: DeployConfig) -> None:
    codes = [(f.code, f.is_error) for f in validate_deploy(mixed, stages=[2])]
    assert codes == [("stage_not_profiled", True)]


def test_delay_above_max_iterations_is_no_warning(write_deploy) -> None:
    # vLLM counts max_iterations from the end of the delay: this window traces iterations 10 to 15
    path = write_deploy(
        "stages:\n  - stage_id: 0\n    profiler_config: {profiler: torch, torch_profiler_dir: /tmp/d, "
        "torch_profiler_with_stack: false, delay_iterations: 10, max_iterations: 5, ignore_frontend: true}\n"
    )
    assert validate_deploy(load_deploy_config(path)) == []


def test_delay_checked_against_given_window(write_deploy) -> None:
    path = write_deploy(
        "stages:\n  - stage_id: 0\n    profiler_config: {profiler: torch, torch_profiler_dir: /tmp/d, "
        "torch_profiler_with_stack: false, delay_iterations: 10, max_iterations: 50, ignore_frontend: true}\n"
    )
    deploy = load_deploy_config(path)
    assert [f.code for f in validate_deploy(deploy, window_iterations=8)] == ["delay_exceeds_window"]
    assert validate_deploy(deploy, window_iterations=20) == []


def test_schedule_fields_are_flagged_as_ignored(write_deploy) -> None:
    path = write_deploy(
        "stages:\n  - stage_id: 0\n    profiler_config: {profiler: torch, torch_profiler_dir: /tmp/d, "
        "torch_profiler_with_stack: false, max_iterations: 5, ignore_frontend: true, warmup_iterations: 2}\n"
    )
    (f,) = validate_deploy(load_deploy_config(path))
    assert (f.code, f.key) == ("schedule_ignored", "profiler_config.warmup_iterations")


def test_frontend_overhead_warning_is_plain_vllms(write_deploy) -> None:
    # plain `vllm serve` profiles its front end unless ignore_frontend; vLLM-Omni profiles its stages only
    from sidecar.config.deploy import deploy_from_profiler_config

    pc = {"profiler": "torch", "torch_profiler_dir": "/tmp/d", "torch_profiler_with_stack": False, "max_iterations": 5}
    path = write_deploy(
        "stages:\n  - stage_id: 0\n    profiler_config: {profiler: torch, torch_profiler_dir: /tmp/d, "
        "torch_profiler_with_stack: false, max_iterations: 5}\n"
    )
    assert [f.code for f in validate_deploy(load_deploy_config(path))] == []
    assert [f.code for f in validate_deploy(deploy_from_profiler_config(pc))] == ["frontend_overhead"]


def test_legacy_file_keeps_its_warning_in_validation(deploy_data: Path) -> None:
    findings = validate_deploy(load_deploy_config(deploy_data / "legacy_stage_args.yaml"))
    assert [f.code for f in findings] == ["legacy_schema"]


def test_nsys_validation_accepts_cuda_stage(mixed: DeployConfig) -> None:
    assert validate_deploy(mixed, stages=[1], allow_cuda=True) == []
