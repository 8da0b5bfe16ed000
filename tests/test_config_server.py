"""The server's real config: the deploy file as vLLM-Omni 0.30 resolves it with the server's
command line (--stage-overrides, --profiler-config), engine_extras and platform overlays, plain
vLLM without a YAML, platform names, per-replica dir placeholders and the nsys wrapper."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from sidecar.config import load_deploy_config
from sidecar.config.deploy import deploy_from_profiler_config, load_server_config
from sidecar.config.placeholders import expand_dir_placeholders
from sidecar.config.profiles import nsys_command, nsys_report_pattern, render_stage_overrides
from sidecar.config.rules import validate_deploy
from sidecar.errors import (
    ConfigError,
    DeployConfigMissing,
    LegacySchemaRefused,
    PlatformUnknown,
    ProfilerConfigArgInvalid,
    StageOverridesInvalid,
    StagesFlagMisplaced,
)

THREE = """
stages:
  - stage_id: 0
    profiler_config: {profiler: torch, torch_profiler_dir: /srv/p0, torch_profiler_with_stack: false, max_iterations: 8}
  - stage_id: 1
  - stage_id: 2
    profiler_config: {profiler: torch, torch_profiler_dir: /srv/p2}
"""


@pytest.fixture
def three(write_deploy) -> Path:
    return write_deploy(THREE)


def test_stage_override_deep_merges_over_the_file(three: Path) -> None:
    deploy = load_deploy_config(three, stage_overrides='{"0": {"profiler_config": {"torch_profiler_dir": "/o"}}}')
    pc = deploy.stage(0).profiler_config
    assert (pc.torch_profiler_dir, pc.torch_profiler_with_stack, pc.max_iterations) == ("/o", False, 8)
    assert deploy.stage(0).profiler_source == "--stage-overrides"


def test_stage_override_profiles_a_stage_the_file_does_not(three: Path) -> None:
    deploy = load_deploy_config(three, stage_overrides={"1": {"profiler_config": {"profiler": "torch", "torch_profiler_dir": "/o1"}}})
    assert [s.stage_id for s in deploy.torch_stages] == [0, 1, 2]


def test_global_profiler_config_reaches_every_stage_with_every_field(three: Path) -> None:
    deploy = load_deploy_config(three, profiler_config='{"profiler": "torch", "torch_profiler_dir": "/g"}')
    assert {s.profiler_dir for s in deploy.stages} == {"/g"}
    # vLLM-Omni passes the whole ProfilerConfig: the file's own values fall back to vLLM's defaults
    assert (deploy.stage(0).profiler_config.torch_profiler_with_stack, deploy.stage(0).profiler_config.max_iterations) == (True, 0)


def test_stage_override_replaces_the_global_one_for_its_stage(three: Path) -> None:
    deploy = load_deploy_config(
        three,
        profiler_config='{"profiler": "torch", "torch_profiler_dir": "/g"}',
        stage_overrides='{"2": {"profiler_config": {"max_iterations": 3}}}',
    )
    assert (deploy.stage(2).profiler_dir, deploy.stage(2).profiler_config.max_iterations) == ("/srv/p2", 3)
    assert deploy.stage(1).profiler_dir == "/g"


def test_engine_extras_profiler_config_wins_over_the_flat_key(write_deploy) -> None:
    path = write_deploy("""
stages:
  - stage_id: 0
    profiler_config: {profiler: torch, torch_profiler_dir: /flat}
    engine_extras: {profiler_config: {profiler: torch, torch_profiler_dir: /extras}}
""")
    stage = load_deploy_config(path).stage(0)
    assert (stage.profiler_dir, stage.profiler_source) == ("/extras", "engine_extras")


def test_platform_overlay_devices_land_in_devices_not_extras(write_deploy) -> None:
    path = write_deploy("""
stages:
  - {stage_id: 0, devices: "0", profiler_config: {profiler: torch, torch_profiler_dir: /p}}
platforms:
  npu:
    stages:
      - stage_id: 0
        engine_args: {devices: "4,5", max_num_seqs: 2}
""")
    stage = load_deploy_config(path, platform="npu").stage(0)
    assert (stage.devices, "devices" in stage.extras, stage.extras["max_num_seqs"]) == ("4,5", False, 2)


def test_stage_override_sets_devices_and_replicas(three: Path) -> None:
    stage = load_deploy_config(three, stage_overrides='{"2": {"devices": "6,7", "num_replicas": 2}}').stage(2)
    assert (stage.devices, stage.num_replicas) == ("6,7", 2)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ("{not json", "stage_overrides"),
        ('["0"]', "stage_overrides"),
        ('{"zero": {}}', "stage_overrides['zero']"),
        ('{"7": {"profiler_config": {"max_iterations": 1}}}', 'stage_overrides["7"]'),
        ('{"0": {"profiler_config": {"torch_profiler_with_stak": false}}}', "profiler_config.torch_profiler_with_stak"),
        ('{"0": {"profiler_config": {"max_iterations": -1}}}', "profiler_config.max_iterations"),
        ('{"0": {"profiler_config": "torch"}}', 'stage_overrides["0"].profiler_config'),
    ],
    ids=["not_json", "not_object", "bad_id", "unknown_stage", "unknown_key", "out_of_range", "not_mapping"],
)
def test_bad_stage_overrides_name_the_key(three: Path, overrides: str, key: str) -> None:
    with pytest.raises(StageOverridesInvalid) as info:
        load_deploy_config(three, stage_overrides=overrides)
    assert info.value.key == key and "--stage-overrides" in info.value.message


def test_unknown_key_gets_did_you_mean(three: Path) -> None:
    with pytest.raises(StageOverridesInvalid, match="did you mean `torch_profiler_with_stack`"):
        load_deploy_config(three, stage_overrides='{"0": {"profiler_config": {"torch_profiler_with_stak": false}}}')


def test_global_json_that_resets_the_files_dir_is_refused_with_the_reason(three: Path) -> None:
    # {"torch_profiler_with_stack": false} arrives as a full config with torch_profiler_dir "", over `profiler: torch`
    with pytest.raises(ProfilerConfigArgInvalid, match="every field of that JSON") as info:
        load_deploy_config(three, profiler_config='{"torch_profiler_with_stack": false}')
    assert info.value.key == "profiler_config.torch_profiler_dir"


def test_bad_global_profiler_config_is_refused(three: Path) -> None:
    with pytest.raises(ProfilerConfigArgInvalid, match="torch_profiler_dir must be set"):
        load_deploy_config(three, profiler_config='{"profiler": "torch"}')
    with pytest.raises(ProfilerConfigArgInvalid, match="not valid JSON"):
        load_deploy_config(three, profiler_config="profiler=torch")


def test_plain_vllm_is_one_stage_from_the_json_alone() -> None:
    deploy = load_server_config(
        None, flavor="vllm", profiler_config={"profiler": "torch", "torch_profiler_dir": "/v", "max_iterations": 5}
    )
    assert (deploy.path, deploy.stage_ids, deploy.stage(0).profiler_dir) == (None, [0], "/v")
    assert deploy.stage(0).profiler_config.max_iterations == 5


def test_plain_vllm_refuses_stage_overrides() -> None:
    with pytest.raises(StageOverridesInvalid, match="plain vLLM"):
        deploy_from_profiler_config('{"profiler": "cuda"}', stage_overrides="{}")


def test_no_yaml_needs_the_stages_or_flavor_vllm() -> None:
    with pytest.raises(DeployConfigMissing, match="--stages 0,1.*--flavor vllm") as info:
        load_server_config(None, flavor="omni", profiler_config='{"profiler": "cuda"}')
    assert info.value.key == "stages"
    with pytest.raises(ConfigError, match="--deploy-config"):
        load_server_config(None, flavor="vllm")


def test_omni_without_a_yaml_gives_every_listed_stage_the_global_config() -> None:
    deploy = load_server_config(
        None, flavor="omni", stages=[0, 1], profiler_config={"profiler": "torch", "torch_profiler_dir": "/g"},
        stage_overrides={"1": {"profiler_config": {"profiler": None}}},
    )  # fmt: skip
    assert (deploy.path, deploy.stage_ids, [s.stage_id for s in deploy.torch_stages]) == (None, [0, 1], [0])
    assert (deploy.stage(0).profiler_dir, deploy.stage(0).profiler_source) == ("/g", "--profiler-config")
    assert deploy.stage_overrides == {"1": {"profiler_config": {"profiler": None}}}


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        ({"stage_overrides": '{"2": {"profiler_config": {"max_iterations": 1}}}'}, StageOverridesInvalid,
         r"stages \[2\] that --stages does not list \(\[0, 1\]\)"),
        ({"deploy_config": "x.yaml"}, StagesFlagMisplaced, "the deploy file defines its stages"),
        ({"flavor": "vllm"}, StagesFlagMisplaced, "plain `vllm serve` has one engine"),
    ],
)  # fmt: skip
def test_stages_flag_is_refused_where_the_stages_are_known(call: dict, error: type, words: str) -> None:
    args = {"deploy_config": None, "flavor": "omni", "profiler_config": '{"profiler": "torch", "torch_profiler_dir": "/g"}',
            **call}  # fmt: skip
    with pytest.raises(error, match=words):
        load_server_config(args.pop("deploy_config"), stages=[0, 1], **args)


def test_server_config_refuses_legacy_unless_allowed(deploy_data: Path) -> None:
    with pytest.raises(LegacySchemaRefused, match="rename the top-level `stage_args:`"):
        load_server_config(deploy_data / "legacy_stage_args.yaml")
    assert load_server_config(deploy_data / "legacy_stage_args.yaml", allow_legacy=True).legacy_schema


def test_platform_typo_is_refused_naming_the_choices(three: Path) -> None:
    with pytest.raises(PlatformUnknown, match="cuda, rocm, npu, xpu, musa") as info:
        load_deploy_config(three, platform="cdua")
    assert "did you mean `cuda`" in info.value.message


def test_all_cuda_deploy_validates_clean(write_deploy) -> None:
    path = write_deploy("stages:\n  - {stage_id: 0, profiler_config: {profiler: cuda}}\n  - {stage_id: 1}\n")
    assert not [f for f in validate_deploy(load_deploy_config(path)) if f.is_error]


def test_placeholders_expand_per_replica() -> None:
    assert expand_dir_placeholders("/d/{host}/replica{replica}", replica=1, host="n7") == "/d/n7/replica1"
    assert expand_dir_placeholders("/d/{host}", replica=None) == f"/d/{socket.gethostname()}"
    with pytest.raises(ConfigError, match="--replica N"):
        expand_dir_placeholders("/d/replica{replica}")
    with pytest.raises(ConfigError, match="unknown placeholder"):
        expand_dir_placeholders("/d/{rank}", replica=0)


def test_render_expands_placeholders(qwen25_deploy: Path) -> None:
    text = render_stage_overrides(qwen25_deploy, "light", [0], out_dir="/perf/{host}/r{replica}", replica=2, host="n1")
    assert json.loads(text)["0"]["profiler_config"]["torch_profiler_dir"] == "/perf/n1/r2/stage0"


def test_unexpanded_placeholder_is_refused_by_validate(three: Path) -> None:
    deploy = load_deploy_config(three, stage_overrides={"2": {"profiler_config": {"torch_profiler_dir": "/d/replica{replica}"}}})
    (finding,) = [f for f in validate_deploy(deploy) if f.code == "profiler_dir_placeholder"]
    assert finding.is_error and finding.stage_id == 2 and "render" in finding.message


def test_nsys_command_wraps_the_servers_own_command_line(three: Path) -> None:
    overrides = '{"1": {"profiler_config": {"profiler": "cuda"}}}'
    cmd = nsys_command(load_deploy_config(three, stage_overrides=overrides), model="Qwen/Qwen2.5-Omni-7B", output="/r/omni_%p")
    assert cmd.startswith("nsys profile ") and "--capture-range=cudaProfilerApi" in cmd and "--capture-range-end=repeat" in cmd
    assert f"vllm serve Qwen/Qwen2.5-Omni-7B --omni --deploy-config {three}" in cmd
    assert "--stage-overrides '" + json.dumps(json.loads(overrides), separators=(",", ":")) + "'" in cmd
    assert nsys_report_pattern("/r/omni_%p") == "/r/omni_*.nsys-rep"


def test_nsys_command_for_plain_vllm_passes_only_what_was_given() -> None:
    cmd = nsys_command(deploy_from_profiler_config('{"profiler": "cuda", "delay_iterations": 2}'), model="m")
    assert cmd.endswith("""vllm serve m --profiler-config '{"profiler":"cuda","delay_iterations":2}'""")
