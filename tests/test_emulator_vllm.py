"""``--flavor vllm``: plain vLLM 0.30 as seen on a real CPU server: one implicit stage, bodies
ignored, empty 200s for double start / double stop / stop-before-start, no session folders: each
stop writes the worker trace ``<instance_id>-rank-<r>.<ns>.pt.trace.json.gz``, the front-end trace
``<host>_<pid>.async_llm.<ns>.pt.trace.json.gz`` and ``profiler_out_<r>.txt`` (rewritten) flat in
``torch_profiler_dir``; with ``max_iterations`` the worker trace is written mid-window. Pooled
emulators, reset before each test and writing into its tmp_path.
"""

from __future__ import annotations

import gzip
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.emulator.launcher import EmulatorProcess
from tests.fixtures.emulator import emulator_state, make_deploy

TIMEOUT = 60
WORKER = re.compile(r"^(\d{19})-rank-0\.(\d+)\.pt\.trace\.json\.gz$")


def frontend_re(emu: EmulatorProcess) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(socket.gethostname())}_{emu.pid}\.async_llm\.(\d+)\.pt\.trace\.json\.gz$")


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    return tmp_path / "t"


@pytest.fixture
def emu(trace_dir: Path, shared_emulator_factory: Any) -> EmulatorProcess:
    # real torch workers: the worker trace and table are torch's own
    deploy = make_deploy(trace_dir.parent, {0: {"profiler": "torch", "torch_profiler_dir": str(trace_dir)}, 1: None})
    return shared_emulator_factory(deploy, flavor="vllm", extra_args=["--step-ms", "1"])


def post(emu: EmulatorProcess, path: str, **kw: Any) -> httpx.Response:
    return emu.http.post(path, timeout=TIMEOUT, **kw)


def chat(emu: EmulatorProcess, max_tokens: int) -> None:
    post(emu, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens})


def listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} if d.exists() else set()


def cycle(emu: EmulatorProcess, d: Path, max_tokens: int = 3) -> list[str]:
    """start, a request (unless 0 tokens), stop: the names new in the dir."""
    before = listing(d)
    post(emu, "/start_profile")
    if max_tokens:
        chat(emu, max_tokens)
    post(emu, "/stop_profile")
    return sorted(listing(d) - before)


def trace(path: Path) -> dict[str, Any]:
    return json.loads(gzip.decompress(path.read_bytes()))


def test_double_start_double_stop_and_stop_before_start_answer_empty_200(emu: EmulatorProcess) -> None:
    replies = [post(emu, p) for p in ("/stop_profile", "/start_profile", "/start_profile", "/stop_profile", "/stop_profile")]
    assert [(r.status_code, r.content) for r in replies] == [(200, b"")] * 5


def test_each_stop_writes_a_worker_and_a_front_end_trace_flat_in_the_dir(emu: EmulatorProcess, trace_dir: Path) -> None:
    new = [n for n in cycle(emu, trace_dir) if n != "profiler_out_0.txt"]
    worker = [n for n in new if WORKER.match(n)]
    frontend = [n for n in new if frontend_re(emu).match(n)]
    assert (len(worker), len(frontend), len(new), all((trace_dir / n).is_file() for n in new)) == (1, 1, 2, True)


def test_worker_name_is_the_server_instance_id_and_stays(emu: EmulatorProcess, trace_dir: Path) -> None:
    ids = [WORKER.match(n).group(1) for _ in range(2) for n in cycle(emu, trace_dir, 1) if WORKER.match(n)]  # type: ignore[union-attr]
    assert len(ids) == 2 and ids[0] == ids[1]


def test_profiler_out_is_one_file_rewritten_by_every_stop(emu: EmulatorProcess, trace_dir: Path) -> None:
    cycle(emu, trace_dir, 2)
    out = trace_dir / "profiler_out_0.txt"
    first = out.stat().st_mtime_ns
    time.sleep(0.05)
    new = cycle(emu, trace_dir, 2)
    text = out.read_text()
    assert ("profiler_out_0.txt" not in new, out.stat().st_mtime_ns > first) == (True, True)
    assert "Self CPU time total" in text and "aten::linear" in text


def test_worker_trace_holds_the_workload_and_the_vllm_version(emu: EmulatorProcess, trace_dir: Path) -> None:
    (name,) = [n for n in cycle(emu, trace_dir, 3) if WORKER.match(n)]
    doc = trace(trace_dir / name)
    ops = {e["name"] for e in doc["traceEvents"] if e.get("cat") == "cpu_op"}
    assert (doc.get("vllm_version"), "aten::linear" in ops) == ("0.30.0", True)


def test_idle_window_writes_valid_traces_with_zero_ops(emu: EmulatorProcess, trace_dir: Path) -> None:
    new = [n for n in cycle(emu, trace_dir, 0) if n.endswith(".json.gz")]
    counts = [sum(e.get("cat") == "cpu_op" for e in trace(trace_dir / n)["traceEvents"]) for n in new]
    assert counts == [0, 0]


def test_body_is_ignored(emu: EmulatorProcess) -> None:
    r = post(emu, "/start_profile", json={"stages": "nonsense"})
    assert (r.status_code, emulator_state(emu)["stages"]["0"]["profiling"]) == (200, True)


def test_one_implicit_stage_and_empty_health(emu: EmulatorProcess) -> None:
    health = emu.http.get("/health", timeout=TIMEOUT)
    assert (list(emulator_state(emu)["stages"]), health.status_code, health.content) == (["0"], 200, b"")


# --- max_iterations, ignore_frontend -----------------------------------------------------------


@pytest.fixture
def bounded(tmp_path: Path, shared_emulator_factory: Any) -> tuple[EmulatorProcess, Path]:
    # thread workers: the bounded window and the front-end switch are the profiler's, whichever
    # backend records (the synthetic one annotates every step as the torch one does)
    d = tmp_path / "t"
    cfg = {"profiler": "torch", "torch_profiler_dir": str(d), "max_iterations": 3, "ignore_frontend": True}
    e = shared_emulator_factory(
        make_deploy(tmp_path, {0: cfg}), flavor="vllm", extra_args=["--workers", "thread", "--step-ms", "1"]
    )
    return e, d


def test_max_iterations_writes_the_worker_trace_mid_window(bounded: tuple[EmulatorProcess, Path]) -> None:
    e, d = bounded
    before = listing(d)
    post(e, "/start_profile")
    chat(e, 10)
    mid = sorted(listing(d) - before)
    post(e, "/stop_profile")
    after = sorted(listing(d) - before)
    steps = [ev for ev in trace(d / mid[0])["traceEvents"] if ev.get("name") == "execute_model"]
    assert (len(mid), bool(WORKER.match(mid[0])), mid[1:], after, len(steps)) == (
        2, True, ["profiler_out_0.txt"], mid, 3)  # fmt: skip


def test_ignore_frontend_writes_no_front_end_trace(bounded: tuple[EmulatorProcess, Path]) -> None:
    e, d = bounded
    post(e, "/start_profile")
    chat(e, 1)
    post(e, "/stop_profile")
    assert [n for n in listing(d) if ".async_llm." in n] == []
