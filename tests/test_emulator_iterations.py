"""delay_iterations / max_iterations as vLLM's WorkerProfiler honours them (counted in engine
steps), and ``profiler: cuda`` writing nothing. Stage 0: LLM, torch, delay 2, max 3; stage 1: cuda.
A pooled emulator with thread workers, reset before each test and writing into its tmp_path.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.emulator.launcher import EmulatorProcess
from tests.fixtures.emulator import emulator_state, make_deploy


@pytest.fixture
def emu(tmp_path: Path, shared_emulator_factory: Any) -> EmulatorProcess:
    # thread workers: the state machine is the profiler's, whichever backend records (the
    # synthetic one annotates every step as the torch one does)
    deploy = make_deploy(
        tmp_path,
        {0: {"profiler": "torch", "delay_iterations": 2, "max_iterations": 3}, 1: {"profiler": "cuda"}},
    )
    return shared_emulator_factory(deploy, extra_args=["--workers", "thread", "--gzip-delay", "0", "--step-ms", "1"])


def post(emu: EmulatorProcess, path: str, body: Any = None) -> httpx.Response:
    return emu.http.post(path, json=body, timeout=60)


def chat(emu: EmulatorProcess, max_tokens: int) -> None:
    post(emu, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens})


def stage(emu: EmulatorProcess, sid: str) -> dict[str, Any]:
    return emulator_state(emu)["stages"][sid]


def test_recording_starts_after_delay_iterations_steps(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    seen = [stage(emu, "0")["profiling"]]
    chat(emu, 1)
    seen.append(stage(emu, "0")["profiling"])
    chat(emu, 1)
    seen.append(stage(emu, "0")["profiling"])
    assert seen == [False, False, True]


def test_max_iterations_stops_inside_a_step_and_writes_artifacts(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    chat(emu, 10)
    s = stage(emu, "0")
    (session,) = (Path(p) for p in s["sessions"])
    assert (s["profiling"], s["active"], (session / "profiler_out_0.txt").exists()) == (False, False, True)


def test_max_iterations_records_exactly_that_many_steps(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    chat(emu, 10)
    (session,) = (Path(p) for p in stage(emu, "0")["sessions"])
    gz = session / "trace_rank0.json.gz"
    deadline = time.monotonic() + 30
    while not gz.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    events = json.loads(gzip.decompress(gz.read_bytes()))["traceEvents"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == "execute_model"]
    assert len(steps) == 3


def test_stop_after_auto_stop_is_a_noop(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    chat(emu, 10)
    (session,) = (Path(p) for p in stage(emu, "0")["sessions"])
    files = sorted(session.iterdir())
    r = post(emu, "/stop_profile", {"stages": [0]})
    assert (r.json(), sorted(session.iterdir())) == ({"status": "SUCCESS"}, files)


def test_cuda_profiler_stage_writes_nothing(emu: EmulatorProcess, tmp_path: Path) -> None:
    r1 = post(emu, "/start_profile", {"stages": [1]})
    chat(emu, 2)
    r2 = post(emu, "/stop_profile", {"stages": [1]})
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "deploy.yaml"]
    assert (r1.json(), r2.json(), stage(emu, "1")["sessions"], written) == (
        {"status": "SUCCESS"},
        {"status": "SUCCESS"},
        [],
        [],
    )


def test_diffusion_stages_option_and_replicas_name_one_folder_per_replica(
    tmp_path: Path, shared_emulator_factory: Any
) -> None:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}}, extra={0: {"num_replicas": 2}})
    emu = shared_emulator_factory(deploy, extra_args=["--diffusion-stages", "0", "--gzip-delay", "0", "--workers", "thread"])
    post(emu, "/start_profile", {"stages": [0]})
    post(emu, "/stop_profile", {"stages": [0]})
    names = sorted(Path(p).name.split("_", 1)[1].rsplit("_", 1)[0] for p in stage(emu, "0")["sessions"])
    assert names == ["stage_0_rep_0_diffusion", "stage_0_rep_1_diffusion"]
