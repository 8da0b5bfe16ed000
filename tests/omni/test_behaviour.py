"""The emulator's behaviour checks (tests/fixtures/omni_behaviour.py, run against the emulator in
tests/test_emulator_behaviour.py) against the real ``vllm serve --omni`` on CPU: the same test
bodies on both servers, so the emulator cannot drift from the real one unseen (docs/emulator.md's
table names each row's check)."""

from __future__ import annotations

import pytest

from tests.fixtures import omni_behaviour as behaviour
from tests.omni.conftest import Setup


@pytest.fixture(scope="module")
def real(two_stage: Setup) -> behaviour.OmniServer:
    # the two-stage AR server: CPU platform (no profiler_out for AR stages), pandas + openpyxl in
    # its venv (ops_rank0.xlsx), stacks off
    return behaviour.OmniServer(two_stage.url, trace_dirs=dict(two_stage.dirs), platform="cpu", xlsx=True)


def test_replies(real: behaviour.OmniServer) -> None:
    behaviour.check_replies(real)


@pytest.mark.parametrize("body", [{"stages": []}, {"stages": [7]}], ids=["empty", "unknown"])
def test_nothing_recorded(real: behaviour.OmniServer, body: dict) -> None:
    behaviour.check_nothing_recorded(real, body)


def test_session_layout(real: behaviour.OmniServer) -> None:
    behaviour.check_session_layout(real, 0)


def test_double_start(real: behaviour.OmniServer) -> None:
    behaviour.check_double_start(real, 0)


def test_partial_stop(real: behaviour.OmniServer) -> None:
    behaviour.check_partial_stop(real, 0, 1)


def test_max_iterations(bounded: Setup) -> None:
    # stage 0 of the bounded server has max_iterations: 3
    server = behaviour.OmniServer(bounded.url, trace_dirs={0: bounded.dirs[0]}, platform="cpu", xlsx=True)
    behaviour.check_max_iterations(server, 0)
