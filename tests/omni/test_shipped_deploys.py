"""Every deploy YAML the installed vLLM-Omni ships (``vllm_omni/deploy/*.yaml``: 0.32.0rc1 adds
stage and top-level keys, and pipelines that split diffusion over several stages, as
``wan2_2_egd``: encode, denoise, decode), given the ``light`` preset on every stage by
``omni-sidecar render`` and checked by ``omni-sidecar validate`` for that release: each loads,
each stage is profilable, and nothing that release accepts is refused. The release is the one the
omni group runs (``OMNI_SIDECAR_OMNI_VERSION``); the files are read from its own venv."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.omni.conftest import VERSION

pytestmark = pytest.mark.omni


def _shipped(python: str) -> list[Path]:
    out = subprocess.run([python, "-c", "import pathlib, vllm_omni; "
                          "print(pathlib.Path(vllm_omni.__file__).parent / 'deploy')"],
                         capture_output=True, text=True, timeout=300, check=True).stdout.strip().splitlines()[-1]
    # not every file there is a deploy: qwen3_tts_forced_aligner.yaml holds knobs for a stage that
    # --forced-aligner appends (no `stages:`)
    return sorted(p for p in Path(out).glob("*.yaml") if "stages" in (yaml.safe_load(p.read_text()) or {}))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=300)


def test_every_shipped_deploy_renders_and_validates_for_its_release(omni_python: str, tmp_path: Path) -> None:
    deploys = _shipped(omni_python)
    assert len(deploys) >= 20, deploys
    refused: dict[str, list[str]] = {}
    stages: dict[str, int] = {}

    def check(deploy: Path) -> None:
        rendered = tmp_path / deploy.name
        r = _cli("render", str(deploy), "--profile", "light", "--dir", str(tmp_path / "traces"), "-o", str(rendered))
        if r.returncode != 0 or "Traceback" in r.stderr:
            refused[deploy.name] = [f"render: {r.stderr[-1000:]}"]
            return
        v = _cli("validate", str(rendered), "--omni-version", VERSION, "--json")
        report = json.loads(v.stdout)
        errors = [f"{f['code']}: {f['message']}" for f in report["findings"] if f["severity"] == "error"]
        if errors or v.returncode != 0:
            refused[deploy.name] = errors or [v.stderr[-500:]]
        stages[deploy.name] = sum(1 for s in report["stages"] if s["profiler"] == "torch")

    with ThreadPoolExecutor(4) as pool:  # each check is two CLI processes
        list(pool.map(check, deploys))
    assert refused == {}, refused
    assert all(n >= 1 for n in stages.values()), stages
    if VERSION.startswith("0.32"):  # diffusion split over several stages: every one of them profiled
        assert stages["wan2_2_egd.yaml"] == 3, stages
