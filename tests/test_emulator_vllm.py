"""``--flavor vllm``: a plain vLLM 0.30 server (one implicit stage, body ignored, empty 200s,
double start/stop silently accepted, tensorboard-style trace files in torch_profiler_dir).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar.emulator.launcher import EmulatorProcess
from tests.fixtures.emulator import emulator_state, make_deploy


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def emu(trace_dir: Path) -> Iterator[EmulatorProcess]:
    deploy = make_deploy(trace_dir, {0: {"profiler": "torch", "torch_profiler_dir": str(trace_dir / "t")}, 1: None})
    with EmulatorProcess(deploy, flavor="vllm") as e:
        yield e


def test_plain_vllm_profile_cycle_writes_tensorboard_trace(emu: EmulatorProcess, trace_dir: Path) -> None:
    codes = [httpx.post(f"{emu.url}/start_profile", timeout=60) for _ in range(2)]
    httpx.post(f"{emu.url}/v1/chat/completions", json={"messages": [], "max_tokens": 2}, timeout=60)
    codes += [httpx.post(f"{emu.url}/stop_profile", timeout=60) for _ in range(2)]
    names = sorted(p.name for p in (trace_dir / "t").iterdir())
    assert [(r.status_code, r.content) for r in codes] == [(200, b"")] * 4
    assert names[-1] == "profiler_out_0.txt"
    assert len(names) == 2 and re.fullmatch(r"dp0_pp0_tp0_dcp0_ep0_rank0\.\d+\.pt\.trace\.json\.gz", names[0])


def test_body_is_ignored(emu: EmulatorProcess) -> None:
    r = httpx.post(f"{emu.url}/start_profile", json={"stages": "nonsense"}, timeout=60)
    profiling = emulator_state(emu)["stages"]["0"]["profiling"]
    httpx.post(f"{emu.url}/stop_profile", timeout=60)
    assert (r.status_code, profiling) == (200, True)


def test_one_implicit_stage(emu: EmulatorProcess) -> None:
    assert list(emulator_state(emu)["stages"]) == ["0"]
