"""The server's EFFECTIVE profiler_config per stage (deploy YAML + platform overlay + engine_extras
+ ``--stage-overrides`` + ``--profiler-config``): ours (``load_deploy_config``) against vLLM-Omni
0.30's own resolver (``VllmOmniConfig.from_pipeline_config``, see ``_omni_resolver.py``) on every
deploy file bundled in the wheel, with the command line in several shapes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import load_deploy_config
from sidecar.errors import ConfigError
from tests.contract.conftest import bundled_deploy_dir, installed_vllm_dump

pytestmark = pytest.mark.contract

_DIR = bundled_deploy_dir()
BUNDLED = sorted(_DIR.glob("*.yaml")) if _DIR else []


@pytest.fixture(scope="module")
def omni() -> Any:
    pytest.importorskip("vllm_omni.config.omni_config", reason="vllm-omni 0.30 not installed (pip install -e '.[vllm]')")
    from tests.contract._omni_resolver import OmniResolver

    return OmniResolver()


def _ids(path: Path) -> list[int]:
    return load_deploy_config(path, platform=None).stage_ids


def shapes(path: Path, perf: Path) -> dict[str, dict[str, str | None]]:
    """The command lines tried on ``path``: (stage_overrides JSON, profiler_config JSON)."""
    ids = _ids(path)
    first, last = (ids[0], ids[-1]) if ids else (0, 0)
    torch_dir = lambda name: {"profiler": "torch", "torch_profiler_dir": str(perf / name)}  # noqa: E731
    every = {
        "stage_override_one": {
            "stage_overrides": json.dumps({str(first): {"profiler_config": {**torch_dir("s0"), "max_iterations": 4}}}),
            "profiler_config": None,
        },
        "stage_override_devices": {
            "stage_overrides": json.dumps(
                {str(last): {"profiler_config": torch_dir("last"), "devices": "3", "num_replicas": 2}}
            ),
            "profiler_config": None,
        },
        "global_only": {
            "stage_overrides": None,
            "profiler_config": json.dumps({**torch_dir("g"), "torch_profiler_with_stack": False}),
        },
        # The stage's own entry replaces the global one (no merge): a partial entry leaves it unprofiled.
        "global_and_partial_stage": {
            "stage_overrides": json.dumps({str(last): {"profiler_config": {"max_iterations": 7}}}),
            "profiler_config": json.dumps({**torch_dir("g"), "delay_iterations": 2}),
        },
        "every_stage": {
            "stage_overrides": json.dumps({str(s): {"profiler_config": torch_dir(f"s{s}")} for s in ids}),
            "profiler_config": json.dumps({"profiler": "cuda"}),
        },
    }
    if not ids:  # a file with no stages (an add-on's knobs): only the shapes that name no stage
        # (an override of a stage the file lacks is refused by us, ignored by the server)
        return {name: cli for name, cli in every.items() if cli["stage_overrides"] in (None, "{}")}
    return every


def _ours(path: Path, platform: str, **cli: str | None) -> dict[int, tuple[dict[str, Any] | None, Any, int]]:
    deploy = load_deploy_config(path, platform=platform, **cli)
    return {
        s.stage_id: (installed_vllm_dump(s.profiler_config.model_dump()) if s.profiler_config else None, s.devices,
                     s.num_replicas)
        for s in deploy.stages
    }


def assert_same(omni: Any, path: Path, platform: str = "cuda", **cli: str | None) -> None:
    try:
        theirs = omni.resolve(path, platform, **cli)
    except Exception as err:  # the real server refuses this command line: so must we
        with pytest.raises(ConfigError):
            load_deploy_config(path, platform=platform, **cli)
            pytest.fail(f"vLLM-Omni refuses it ({type(err).__name__}: {str(err)[:300]}); we accept it")
        return
    ours = _ours(path, platform, **cli)
    assert sorted(ours) == sorted(theirs)
    for sid, (pc, devices, replicas) in theirs.items():
        assert ours[sid][0] == pc, f"stage {sid}: profiler_config"
        assert (ours[sid][1], ours[sid][2]) == (None if devices is None else str(devices), replicas), f"stage {sid}"


def test_wheel_ships_the_deploy_files() -> None:
    if _DIR is None:
        pytest.skip("vllm-omni not installed")
    assert len(BUNDLED) >= 100


@pytest.mark.parametrize("path", BUNDLED, ids=[p.name for p in BUNDLED])
def test_effective_profiler_config_matches_vllm_omni(omni: Any, tmp_path: Path, path: Path) -> None:
    for name, cli in shapes(path, tmp_path / "perf").items():
        try:
            assert_same(omni, path, **cli)
        except AssertionError as err:
            raise AssertionError(f"shape {name}: {err}") from None


def _with_extras(bundled: Path, tmp_path: Path) -> Path:
    """An overlay of a bundled file with a profiler_config on every stage in each place the file
    may hold one: flat, under engine_args, under engine_extras (which wins), and a platform overlay."""
    ids = _ids(bundled)
    stages, plat = [], []
    for sid in ids:
        pc = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / f"flat{sid}"), "max_iterations": sid + 1}
        entry: dict[str, Any] = {"stage_id": sid, "profiler_config": pc}
        if sid % 3 == 1:
            entry["engine_args"] = {"profiler_config": {"torch_profiler_with_stack": False}}
        if sid % 3 == 2:
            entry["engine_extras"] = {"profiler_config": {"profiler": "torch", "torch_profiler_dir": str(tmp_path / f"x{sid}")}}
        stages.append(entry)
        plat.append({"stage_id": sid, "devices": str(sid), "engine_extras": {"profiler_config": {"profiler": "cuda"}}} if sid % 2 else
                    {"stage_id": sid, "profiler_config": {"profiler": "torch", "torch_profiler_dir": str(tmp_path / f"p{sid}")}})
    out = tmp_path / "overlay.yaml"
    out.write_text(yaml.safe_dump({"base_config": str(bundled), "stages": stages, "platforms": {"cuda": {"stages": plat}}}))
    return out


@pytest.mark.parametrize("path", BUNDLED[::7], ids=[p.name for p in BUNDLED[::7]])
def test_extras_platform_and_command_line_together(omni: Any, tmp_path: Path, path: Path) -> None:
    overlay = _with_extras(path, tmp_path)
    assert_same(omni, overlay)
    assert_same(omni, overlay, platform="npu")
    for cli in shapes(overlay, tmp_path / "perf").values():
        assert_same(omni, overlay, **cli)


@pytest.mark.parametrize(
    ("cli", "server_says", "ours", "we_say"),
    [
        ({"stage_overrides": '{"0": {"profiler_config": {"torch_profiler_with_stak": false}}}'},
         "torch_profiler_with_stak\n  Unexpected keyword argument", "StageOverridesInvalid",
         "unknown key `torch_profiler_with_stak`; did you mean `torch_profiler_with_stack`?"),
        ({"stage_overrides": '{"1": {"profiler_config": {"profiler": "torch"}}}'},
         "torch_profiler_dir must be set when profiler is 'torch'", "StageOverridesInvalid",
         "stage 1: profiler_config: torch_profiler_dir must be set when profiler is 'torch'"),
        ({"profiler_config": '{"torch_profiler_with_stack": false}'},  # resets the file's dir to ""
         "torch_profiler_dir must be set when profiler is 'torch'", "ProfilerConfigArgInvalid",
         "stage 0: profiler_config: torch_profiler_dir must be set when profiler is 'torch'"),
        ({"stage_overrides": '{"0": {"profiler_config": {"profiler": null}}}'},
         "torch_profiler_dir is only applicable when profiler is set to 'torch'", "StageOverridesInvalid",
         "stage 0: profiler_config: torch_profiler_dir is only applicable when profiler is set to 'torch'"),
    ],
    ids=["unknown_key", "torch_without_dir", "global_resets_dir", "null_profiler"],
)
def test_refused_where_the_server_refuses(omni: Any, tmp_path: Path, cli: dict[str, str], server_says: str,
                                          ours: str, we_say: str) -> None:
    import pydantic

    deploy = tmp_path / "d.yaml"
    deploy.write_text(yaml.safe_dump({"stages": [
        {"stage_id": 0, "profiler_config": {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "p")}},
        {"stage_id": 1},
    ]}))
    # vLLM-Omni 0.30's stage config is a pydantic model: its refusal is a ValidationError.
    with pytest.raises(pydantic.ValidationError, match=re.escape(server_says)):
        omni.resolve(deploy, "cuda", **cli)
    with pytest.raises(ConfigError) as err:
        load_deploy_config(deploy, **cli)
    assert (type(err.value).__name__, we_say in err.value.message) == (ours, True)


def test_stage_override_shape_errors_match_vllm_omni(omni: Any) -> None:
    for bad in ('[1]', '{"x": {}}', '{"0": 3}', 'not json'):
        with pytest.raises(ValueError):
            omni.parse_stage_overrides(bad)
        with pytest.raises(ConfigError):
            load_deploy_config(Path(__file__).parents[2] / "configs" / "qwen2_5_omni.yaml", stage_overrides=bad)


def test_real_resolver_refuses_the_emulator_only_key(omni: Any, tmp_path: Path) -> None:
    # Why `emulator_only_key` is a warning: 0.30 validates every stage key against its config owners.
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({"stages": [{"stage_id": 0, "emulator_stage_kind": "llm"}]}))
    with pytest.raises(ValueError, match="emulator_stage_kind"):  # as LLM stage and as diffusion stage
        omni.resolve(path, "cuda")
    assert "emulator_only_key" in {f.code for f in load_deploy_config(path).findings}
