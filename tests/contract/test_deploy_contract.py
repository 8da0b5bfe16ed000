"""Our deploy loader against vllm_omni.config.stage_config.load_deploy_config (vLLM-Omni 0.30)
on every deploy YAML bundled in the wheel, our examples, our test inputs and a rendered overlay:
same stage ids, same profiler_config per stage (as vLLM's ProfilerConfig sees it), same devices
and replicas, with the cuda platform overlay applied on both sides."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import load_deploy_config, render_overlay
from tests.contract.conftest import bundled_deploy_dir, installed_vllm_dump

pytestmark = pytest.mark.contract

_DIR = bundled_deploy_dir()
BUNDLED = sorted(_DIR.glob("*.yaml")) if _DIR else []
REPO = Path(__file__).resolve().parents[2]
OURS = sorted((REPO / "configs").glob("*.yaml")) + [
    REPO / "tests" / "data" / "deploy" / n for n in ("base.yaml", "overlay.yaml", "mixed.yaml", "no_profiler.yaml")
]

# Files where the real loader itself fails on this CPU-only machine, with the reason. Empty
# today: every bundled file loads. Keep the mechanism so a new wheel's file is recorded, not hidden.
REAL_LOADER_FAILS: dict[str, str] = {}


def _real(sc: Any, path: Path, platform: str) -> dict[int, dict[str, Any]]:
    deploy = sc.load_deploy_config(path)
    # Explicit platform, so the real code never probes the (absent) accelerator.
    deploy = sc._apply_platform_overrides(deploy, platform)
    return {
        s.stage_id: {
            "profiler_config": copy.deepcopy(s.profiler_config),
            "devices": s.devices,
            "num_replicas": s.num_replicas,
        }
        for s in deploy.stages
    }


def _effective(vllm_pc: type, raw: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if raw is None else dataclasses.asdict(vllm_pc(**raw))


def assert_same_as_real_loader(sc: Any, vllm_pc: type, path: Path, platform: str = "cuda") -> None:
    theirs = _real(sc, path, platform)
    ours = load_deploy_config(path, platform=platform)
    assert ours.stage_ids == list(theirs)
    for stage in ours.stages:
        t = theirs[stage.stage_id]
        assert (installed_vllm_dump(stage.profiler_config.model_dump()) if stage.profiler_config else None) == _effective(
            vllm_pc, t["profiler_config"]
        ), f"stage {stage.stage_id}"
        assert (stage.devices, stage.num_replicas) == (
            None if t["devices"] is None else str(t["devices"]),
            t["num_replicas"],
        ), f"stage {stage.stage_id}"


def test_wheel_ships_the_deploy_files() -> None:
    if _DIR is None:
        pytest.skip("vllm-omni not installed")
    assert len(BUNDLED) >= 100


@pytest.mark.parametrize("path", BUNDLED, ids=[p.name for p in BUNDLED])
def test_bundled_deploy_matches_real_loader(omni_stage_config, vllm_profiler_config, path: Path) -> None:
    if path.name in REAL_LOADER_FAILS:
        pytest.xfail(REAL_LOADER_FAILS[path.name])
    assert_same_as_real_loader(omni_stage_config, vllm_profiler_config, path)


@pytest.mark.parametrize("path", OURS, ids=[p.name for p in OURS])
def test_our_files_match_real_loader(omni_stage_config, vllm_profiler_config, path: Path) -> None:
    assert_same_as_real_loader(omni_stage_config, vllm_profiler_config, path)


@pytest.mark.parametrize("platform", ["npu", "xpu", "rocm"])
def test_platform_overlays_match(omni_stage_config, vllm_profiler_config, platform: str) -> None:
    for path in [REPO / "tests" / "data" / "deploy" / "base.yaml", *(p for p in BUNDLED if "qwen" in p.name)]:
        assert_same_as_real_loader(omni_stage_config, vllm_profiler_config, path, platform)


@pytest.mark.parametrize("profile", ["light", "ops", "shapes", "memory", "stacks", "nsys"])
def test_rendered_overlay_loads_in_vllm_omni(omni_stage_config, vllm_profiler_config, tmp_path: Path, profile: str) -> None:
    out = tmp_path / "nested" / "overlay.yaml"
    out.parent.mkdir()
    out.write_text(render_overlay(REPO / "configs" / "qwen2_5_omni.yaml", profile, [0, 2], out_path=out, out_dir=tmp_path / "perf"))
    assert_same_as_real_loader(omni_stage_config, vllm_profiler_config, out)


def _with_profilers(bundled: Path, tmp_path: Path) -> Path:
    """An overlay of a bundled file that profiles every stage: even ids flat, odd ids under
    engine_args, so both merge paths (and the file's own base_config chain) are exercised."""
    ids = [s.stage_id for s in load_deploy_config(bundled, platform=None).stages]
    stages = []
    for sid in ids:
        pc = {"profiler": "torch", "torch_profiler_dir": f"perf/s{sid}", "max_iterations": sid + 1}
        stages.append({"stage_id": sid, "profiler_config": pc} if sid % 2 == 0 else {"stage_id": sid, "engine_args": {"profiler_config": pc}})
    out = tmp_path / "overlay.yaml"
    out.write_text(yaml.safe_dump({"base_config": str(bundled), "stages": stages}))
    return out


@pytest.mark.parametrize("path", BUNDLED, ids=[p.name for p in BUNDLED])
def test_bundled_with_profilers_matches_real_loader(
    omni_stage_config, vllm_profiler_config, tmp_path: Path, monkeypatch, path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # relative dirs resolve against the cwd on both sides
    assert_same_as_real_loader(omni_stage_config, vllm_profiler_config, _with_profilers(path, tmp_path))


def test_legacy_schema_is_rejected_by_real_loader(omni_stage_config) -> None:
    with pytest.raises(ValueError, match="removed `stage_args` schema"):
        omni_stage_config.load_deploy_config(REPO / "tests" / "data" / "deploy" / "legacy_stage_args.yaml")
