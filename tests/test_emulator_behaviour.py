"""The emulator against what the real `vllm serve --omni` did (docs/design.md §3b, docs/emulator.md's
table): the shared checks of tests/fixtures/omni_behaviour.py (the real-server tests run the same
ones), run here on the emulator as the CPU platform, and a test per behaviour changed to match."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

import pytest

from sidecar.emulator.launcher import EmulatorProcess
from tests.fixtures.emulator import log_offset, log_since, make_deploy
from tests.fixtures.omni_behaviour import (
    OmniServer,
    check_double_start,
    check_max_iterations,
    check_nothing_recorded,
    check_partial_stop,
    check_replies,
    check_session_layout,
)

STAGES: dict[int, dict[str, Any] | None] = {
    0: {"profiler": "torch", "torch_profiler_with_stack": True},
    1: {"profiler": "torch"},
    2: {"profiler": "torch"},
}
DIFFUSION = [2]
THREAD = ["--workers", "thread", "--step-ms", "1", "--gzip-delay", "0.3"]
Factory = Callable[..., EmulatorProcess]


def as_server(emu: EmulatorProcess, tmp_path: Path, stages: dict[int, Any], platform: str) -> OmniServer:
    return OmniServer(
        emu.url,
        trace_dirs={sid: tmp_path / "traces" / f"stage{sid}" for sid, pc in stages.items() if pc},
        kinds={sid: "diffusion" for sid in DIFFUSION if sid in stages},
        platform=platform,
        stacks={sid for sid, pc in stages.items() if pc and pc.get("torch_profiler_with_stack")},
        timeout=120,
    )


@pytest.fixture
def cpu_server(tmp_path: Path, shared_emulator_factory: Factory) -> OmniServer:
    emu = shared_emulator_factory(make_deploy(tmp_path, STAGES, DIFFUSION), extra_args=[*THREAD, "--platform", "cpu"])
    return as_server(emu, tmp_path, STAGES, "cpu")


def test_replies_as_the_real_server(cpu_server: OmniServer) -> None:
    check_replies(cpu_server)


@pytest.mark.parametrize("body", [{"stages": []}, {"stages": [7]}], ids=["empty_list", "unknown_id"])
def test_an_empty_list_or_unknown_ids_record_nothing(cpu_server: OmniServer, body: dict[str, Any]) -> None:
    check_nothing_recorded(cpu_server, body)


@pytest.mark.parametrize("sid", [0, 1, 2], ids=["llm_with_stacks", "llm", "diffusion"])
def test_cpu_platform_session_files(cpu_server: OmniServer, sid: int) -> None:
    # changed: no profiler_out_0.txt for LLM stages on the CPU platform; diffusion still writes it
    check_session_layout(cpu_server, sid)


def test_double_start_leaves_an_empty_first_folder(cpu_server: OmniServer) -> None:
    check_double_start(cpu_server, 1)


def test_stopping_one_stage_leaves_the_other_recording(cpu_server: OmniServer) -> None:
    check_partial_stop(cpu_server, 0, 1)


def test_max_iterations_ends_the_window_before_the_stop(tmp_path: Path, shared_emulator_factory: Factory) -> None:
    stages = {0: {"profiler": "torch", "max_iterations": 3}, 1: None}
    emu = shared_emulator_factory(make_deploy(tmp_path, stages), extra_args=[*THREAD, "--platform", "cpu"])
    check_max_iterations(as_server(emu, tmp_path, stages, "cpu"), 0)


def test_cuda_platform_writes_the_gpu_files(tmp_path: Path, shared_emulator_factory: Factory) -> None:
    # changed: stacks_cuda_rank0.txt with stacks on, as a GPU worker writes it
    emu = shared_emulator_factory(make_deploy(tmp_path, STAGES, DIFFUSION), extra_args=THREAD)
    check_session_layout(as_server(emu, tmp_path, STAGES, "cuda"), 0)


def test_gzip_starts_right_after_the_export_before_the_tables(tmp_path: Path, shared_emulator_factory: Factory) -> None:
    # changed: as the real _on_trace_ready, gzip is started at the export; the tables (and the xlsx,
    # most of a stop's cost) follow inside the stop, so a small trace is gzipped before the reply
    emu = shared_emulator_factory(make_deploy(tmp_path, STAGES, DIFFUSION), extra_args=THREAD)
    server = as_server(emu, tmp_path, STAGES, "cuda")
    offset = log_offset(emu)
    check_session_layout(server, 0)
    log = log_since(emu, offset)
    steps = [log.find(s) for s in ("Trace exported to", "Triggered background compression", "Stop hook done")]
    assert -1 not in steps and steps == sorted(steps), log[-3000:]


@pytest.mark.parametrize("sid", [0, 2], ids=["llm", "diffusion"])
def test_real_torch_workers_session_files(omni_emulator: EmulatorProcess, tmp_path: Path, sid: int) -> None:
    # process workers (real torch.profiler), the default GPU layout; the xlsx where pandas + openpyxl are
    stages = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}
    server = as_server(omni_emulator, tmp_path, stages, "cuda")
    server.xlsx = all(importlib.util.find_spec(m) is not None for m in ("pandas", "openpyxl"))
    check_session_layout(server, sid)
