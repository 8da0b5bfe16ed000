"""Fast emulators for tests: ``--workers thread`` writes the same files as real workers (synthetic
traces: ops when requests ran, none when idle), and ``shared_emulator_factory`` hands one pooled
emulator to several tests, reset in between and pointed at each test's trace dirs.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.emulator.launcher import EmulatorProcess
from tests.fixtures.emulator import EmulatorPool, emulator_state, make_deploy
from tests.fixtures.waits import poll

TIMEOUT = 60
THREAD = ["--workers", "thread", "--gzip-delay", "0", "--step-ms", "1"]


def post(emu: EmulatorProcess, path: str, body: Any = None) -> httpx.Response:
    return emu.http.post(path, json=body, timeout=TIMEOUT)


def chat(emu: EmulatorProcess, max_tokens: int) -> None:
    post(emu, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens})


def read_trace(folder: Path) -> dict[str, Any]:
    gz = folder / "trace_rank0.json.gz"
    deadline = time.monotonic() + 30
    # gzip creates the .gz first and removes the .json once the .gz is whole: wait for both
    while not (gz.exists() and not (folder / "trace_rank0.json").exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(gzip.decompress(gz.read_bytes()))


def capture(emu: EmulatorProcess, stages: list[int], max_tokens: int) -> dict[str, list[Path]]:
    before = {sid: set(s["sessions"]) for sid, s in emulator_state(emu)["stages"].items()}
    post(emu, "/start_profile", {"stages": stages})
    if max_tokens:
        chat(emu, max_tokens)
    post(emu, "/stop_profile", {"stages": stages})
    after = emulator_state(emu)["stages"]
    return {sid: [Path(p) for p in s["sessions"] if p not in before[sid]] for sid, s in after.items()}


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    return make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: {"profiler": "torch"}}, diffusion=[1])


# --- thread workers ------------------------------------------------------------------------------


def test_thread_workers_write_the_omni_layout(deploy: Path, shared_emulator_factory: Any) -> None:
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    new = capture(emu, [0, 1], 4)
    names = [p.name for sid in ("0", "1") for p in new[sid]]
    assert re.fullmatch(r"\d{8}-\d{6}_stage0_rank0_\d+", names[0])
    assert re.fullmatch(r"\d{8}-\d{6}_stage_1_rep_0_diffusion_\d+", names[1])
    folders = (new["0"][0], new["1"][0])
    # the gzip runs after the stop's reply, as vLLM-Omni's does: wait for it, then read the layout
    assert poll(lambda: all((p / "trace_rank0.json.gz").exists() and not (p / "trace_rank0.json").exists()
                            for p in folders)), [sorted(f.name for f in p.iterdir()) for p in folders]
    assert [sorted(f.name for f in p.iterdir()) for p in folders] == [["profiler_out_0.txt", "trace_rank0.json.gz"]] * 2


def test_thread_worker_traces_have_ops_per_step_and_none_when_idle(
    deploy: Path, tmp_path: Path, shared_emulator_factory: Any
) -> None:
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    busy = read_trace(capture(emu, [0], 4)["0"][0])
    emu.reset(profiler_dirs={0: tmp_path / "idle"})  # a dir of its own: no folder-name clash
    idle = read_trace(capture(emu, [0], 0)["0"][0])

    def count(doc: dict[str, Any], **match: str) -> int:
        return sum(all(e.get(k) == v for k, v in match.items()) for e in doc["traceEvents"])

    assert (count(busy, name="execute_model"), count(busy, cat="cpu_op") > 0, count(idle, cat="cpu_op")) == (4, True, 0)
    assert busy["emulator_synthetic"] is True
    # one thread runs one op at a time, inside its step: no op overlaps the next (which would
    # nest them and give the outer one a negative self time) or outlives its step
    ops = sorted((e for e in busy["traceEvents"] if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], e["ts"]))
    steps = [e for e in busy["traceEvents"] if e.get("name") == "execute_model"]
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(ops, ops[1:]) if a["tid"] == b["tid"])
    assert all(any(s["ts"] <= o["ts"] and o["ts"] + o["dur"] <= s["ts"] + s["dur"] for s in steps) for o in ops)


# --- the pool ------------------------------------------------------------------------------------


def test_pool_reuses_an_emulator_for_the_same_deploy_and_replaces_it_for_other_options(tmp_path: Path) -> None:
    pool = EmulatorPool(size=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        a = pool.get(make_deploy(tmp_path / "a", {0: {"profiler": "torch"}}), extra_args=THREAD)
        b = pool.get(make_deploy(tmp_path / "b", {0: {"profiler": "torch"}}), extra_args=THREAD)
        (folder,) = capture(b, [0], 1)["0"]  # the same emulator, pointed at b's trace dir
        pool.unpin_all()  # a next test: what the last one was handed may go
        c = pool.get(make_deploy(tmp_path / "b", {0: {"profiler": "torch"}}), extra_args=[*THREAD, "--step-ms", "2"])
        assert (a is b, folder.parent) == (True, tmp_path / "b" / "traces" / "stage0")
        assert (c is a, a.returncode is not None, c.returncode) == (False, True, None)  # the oldest is stopped
    finally:
        pool.stop_all()


def test_the_pool_never_evicts_an_emulator_the_running_test_was_handed(tmp_path: Path) -> None:
    pool = EmulatorPool(size=1)
    for name in "abc":
        (tmp_path / name).mkdir()
    try:
        a = pool.get(make_deploy(tmp_path / "a", {0: {"profiler": "torch"}}), extra_args=[*THREAD, "--model", "a"])
        b = pool.get(make_deploy(tmp_path / "b", {0: {"profiler": "torch"}}), extra_args=[*THREAD, "--model", "b"])
        assert (a.returncode, b.returncode) == (None, None)  # two replicas of one test: both alive
        pool.unpin_all()
        c = pool.get(make_deploy(tmp_path / "c", {0: {"profiler": "torch"}}), extra_args=[*THREAD, "--model", "c"])
        assert (a.returncode is not None, b.returncode is not None, c.returncode) == (True, True, None)
    finally:
        pool.stop_all()


def test_shared_factory_hands_a_reset_emulator(deploy: Path, shared_emulator_factory: Any) -> None:
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    emu.set_faults(dead_stage=1, start_500=True)
    post(emu, "/start_profile", {"stages": [0]})
    again = shared_emulator_factory(deploy, extra_args=THREAD)
    state = emulator_state(again)
    assert (again is emu, any(state["faults"].values()), state["calls"]) == (True, False, [])
    assert [s["alive"] for s in state["stages"].values()] == [True, True]
