"""The one-stage diffusion server (a tiny random diffusers DDPM through vLLM-Omni's diffusers
adapter, ``--dtype float32``, inline in the API server) behind a real sidecar: the server's
``--profiler-config``, its ``<ts>_stage_0_rep_0_diffusion_<epoch>`` folder, verdict ``ok``.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar.api.launcher import SidecarProcess
from sidecar.client import SidecarClient
from tests.omni.conftest import OmniPool, Setup, end_open_captures, module_sidecar, server_env, torch_profiler

DIFFUSION_SESSION = re.compile(r"^\d{8}-\d{6}_stage_0_rep_0_diffusion_\d+$")


@pytest.fixture(scope="module")
def diffusion(omni_pool: OmniPool, omni_python: str, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    model = tmp_path_factory.mktemp("tiny-ddpm")
    subprocess.run([omni_python, str(Path(__file__).with_name("make_tiny_ddpm.py")), str(model)], check=True,
                   timeout=300, env=server_env(), capture_output=True)  # fmt: skip

    def profiler_args(root: Path) -> list[str]:
        return ["--profiler-config", json.dumps(torch_profiler(root / "perf"))]

    def setup(root: Path) -> tuple[None, list[str]]:
        return None, ["--diffusion-load-format", "diffusers", "--dtype", "float32", *profiler_args(root)]

    server = omni_pool.get("diffusion", setup, model=model)
    root = server.root  # type: ignore[attr-defined]
    # The server has no deploy YAML (vLLM-Omni's generic single-stage diffusion), but the sidecar's
    # omni flavour refuses --profiler-config without one (deploy_config_missing): it is given a
    # one-stage file standing for what the server resolved, and the server's profiler flag.
    deploy = root / "sidecar-deploy.yaml"
    deploy.write_text("stages:\n  - stage_id: 0\n")
    return Setup(server, deploy, profiler_args(root), {0: root / "perf"})


@pytest.fixture(scope="module")
def sidecar(diffusion: Setup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    with module_sidecar(diffusion, tmp_path_factory) as proc:
        yield proc
        end_open_captures(proc.url)


def generate(url: str) -> None:
    r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "n": 1, "size": "8x8", "num_inference_steps": 2},
                   timeout=300, trust_env=False)  # fmt: skip
    r.raise_for_status()


def test_a_busy_diffusion_window_is_ok_in_its_diffusion_folder(diffusion: Setup, sidecar: SidecarProcess) -> None:
    with SidecarClient(sidecar.url, timeout=120) as client:
        cap = client.start_capture(label="diffusion")
        assert cap.stages == [0]
        generate(diffusion.url)
        cap = client.stop_capture(cap.id, wait=True, timeout=600)
    (verdict,) = cap.verdicts
    assert verdict.verdict.value == "ok", verdict
    (session,) = verdict.sessions
    assert Path(session.path).parent == diffusion.dirs[0] and DIFFUSION_SESSION.match(Path(session.path).name)
    assert "trace_rank0.json.gz" in {f.name for f in session.files}
