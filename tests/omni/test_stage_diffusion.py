"""The one-stage diffusion server (a tiny random diffusers DDPM through vLLM-Omni's diffusers
adapter, ``--dtype float32``, inline in the API server, no deploy YAML) behind a real sidecar
told only the server's ``--profiler-config`` and ``--stages 0``: its ``<ts>_stage_0_rep_0_diffusion_<epoch>`` folder, verdict ``ok``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar.api.launcher import SidecarProcess
from sidecar.client import SidecarClient
from tests.omni.conftest import Setup, end_open_captures, module_sidecar

DIFFUSION_SESSION = re.compile(r"^\d{8}-\d{6}_stage_0_rep_0_diffusion_\d+$")


@pytest.fixture(scope="module")
def sidecar(diffusion: Setup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    # No deploy YAML: the sidecar is told the server's --profiler-config and its pipeline's one stage.
    with module_sidecar(diffusion, tmp_path_factory, extra_args=["--stages", "0"]) as proc:
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
    # vLLM-Omni's own op tables, written by its diffusion worker inside the stop
    assert {"trace_rank0.json.gz", "ops_rank0.xlsx", "profiler_out_0.txt"} <= {f.name for f in session.files}, session
    table = (Path(session.path) / "profiler_out_0.txt").read_text()
    assert "Self CPU time total" in table, table[:2000]
