"""The fault matrix: each fault of the upstream, the sidecar or the disk, through the real
processes (``omni-sidecar serve`` over the emulator), asserting the capture's final state, its
reason, and that no stage is left recording (the emulator's ``GET /emulator/state``).

| fault                           | final state | reason (error code / stop reason)          |
|---------------------------------|-------------|--------------------------------------------|
| upstream down before start      | failed      | upstream_unreachable (503, nothing sent)   |
| upstream killed mid-capture     | failed      | upstream_unreachable, quickly (not budget) |
| start answers 500               | failed      | upstream_failed (502), rolled back         |
| stop delayed                    | completed   | explicit                                   |
| stop hangs                      | stopping    | upstream_timeout past the budget, slot held |
|   ... then the server answers   | completed   | explicit                                   |
| dead stage (start/stop 200)     | degraded    | that stage missing: dead or restarted worker |
| worker dies after start         | degraded    | that stage missing: its worker most likely died |
| kill -9 in starting/active/...  | completed   | stopped_on_recovery at the next start-up   |
| full disk during a journal write| completed   | journal write_errors at /healthz           |

Each window that should end ``completed`` gets a request (``traffic``): an idle window is ``empty``.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.api.launcher import free_port
from sidecar.client import SidecarClient
from tests.fixtures.emulator import emulator_state, make_deploy

pytestmark = pytest.mark.slow

FAST = {
    "OMNI_SIDECAR_COLLECT_TIMEOUT_S": "8",
    "OMNI_SIDECAR_SETTLE_S": "0.3",
    "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "10",
    "OMNI_SIDECAR_STOP_BUDGET_S": "4",
    "OMNI_SIDECAR_STOP_TIMEOUT_S": "2",
}
NONE_RECORDING = {"0": False, "1": False, "2": False}


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    return make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})


@pytest.fixture
def stack(deploy: Path, emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any], tmp_path: Path):
    """``stack(emulator_args, env)`` → (emulator, sidecar, restart) with one state dir;
    ``restart()`` starts a new sidecar on it (after a kill -9)."""

    def make(emulator_args: list[str] | None = None, env: dict[str, str] | None = None):
        emu = emulator_factory(deploy, extra_args=emulator_args or [])
        state = tmp_path / "state"
        sc = sidecar_factory(emu.url, deploy, state_dir=state, env={**FAST, **(env or {})})

        def restart() -> Any:
            return sidecar_factory(emu.url, deploy, state_dir=state, env={**FAST, **(env or {})})

        return emu, sc, restart

    return make


def recording(emu: Any) -> dict[str, bool]:
    return {sid: st["profiling"] for sid, st in emulator_state(emu)["stages"].items()}


def poll(check: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def codes(cap: Any) -> list[str]:
    return [e.code for e in cap.errors]


def traffic(emu: Any) -> None:
    """One chat request through the stages, so the window records work; a dead stage answers 500
    (the stages before it still ran)."""
    httpx.post(f"{emu.url}/v1/chat/completions",
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=120)


# --- upstream faults ---------------------------------------------------------------------------


def test_upstream_down_before_start(deploy: Path, sidecar_factory: Callable[..., Any]) -> None:
    sc = sidecar_factory(f"http://127.0.0.1:{free_port('127.0.0.1')}", deploy, env=FAST)
    reply = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0, 2]}, timeout=120)
    with SidecarClient(sc.url, timeout=30) as client:
        (cap,) = client.list_captures()
    assert (reply.status_code, reply.json()["error"]["code"]) == (503, "upstream_unreachable")
    assert (cap.state.value, codes(cap)) == ("failed", ["upstream_unreachable"])


def test_upstream_killed_mid_capture(stack: Any) -> None:
    # the default stop budget (30 min): the capture must not wait it out once the server is gone
    emu, sc, _ = stack(env={"OMNI_SIDECAR_STOP_BUDGET_S": "1800", "OMNI_SIDECAR_STOP_TIMEOUT_S": "1800"})
    with SidecarClient(sc.url, timeout=30) as client:
        cap = client.start_capture([0, 2])
        emu.kill()
        client.stop_capture(cap.id)
        final = client.wait_capture(cap.id, timeout=45)
        again = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]}, timeout=60).status_code
    assert (final.state.value, "upstream_gone" in codes(final)) == ("failed", True)
    assert again == 503  # a start is possible again: refused for the server, not 409 for the capture


def test_start_500(stack: Any) -> None:
    emu, sc, _ = stack(emulator_args=["--fault-start-500"])
    reply = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]}, timeout=120)
    with SidecarClient(sc.url, timeout=30) as client:
        (cap,) = client.list_captures()
    assert (reply.status_code, cap.state.value, codes(cap)[0], cap.stop_reason.value) == (
        502, "failed", "upstream_failed", "rollback")
    assert recording(emu) == NONE_RECORDING


def test_stop_delayed(stack: Any) -> None:
    emu, sc, _ = stack(emulator_args=["--fault-stop-delay", "4"],
                       env={"OMNI_SIDECAR_STOP_TIMEOUT_S": "60", "OMNI_SIDECAR_STOP_BUDGET_S": "120"})
    with SidecarClient(sc.url, timeout=30) as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
        during = client.stop_capture(cap.id).state.value
        final = client.wait_capture(cap.id, timeout=90)
    assert (during, final.state.value, final.stop_reason.value, codes(final)) == ("stopping", "completed", "explicit", [])
    assert recording(emu) == NONE_RECORDING


def test_stop_hangs(stack: Any) -> None:
    emu, sc, _ = stack()
    emu.set_faults(hang_stop=True)  # at run time, so that a reset releases the stop and clears it
    with SidecarClient(sc.url, timeout=30) as client:
        cap = client.start_capture([0])
        traffic(emu)
        client.stop_capture(cap.id)
        assert poll(lambda: "upstream_timeout" in codes(client.get_capture(cap.id)), timeout=90)
        held = client.get_capture(cap.id)
        again = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]}, timeout=60)
        emu.reset()  # the server answers at last
        final = client.wait_capture(cap.id, timeout=90)
    # past the budget the server may still be writing this window: the slot stays taken, and the
    # reason says what to do
    assert (held.state.value, codes(held)[-1], held.verdicts[0].reason.startswith("stop timed out after")) == (
        "stopping", "upstream_timeout", True)
    assert "/stop_profile did not answer" in held.errors[-1].message
    assert (again.status_code, again.json()["error"]["code"]) == (409, "capture_stop_pending")
    assert (final.state.value, final.stop_reason.value) == ("completed", "explicit")
    assert recording(emu) == NONE_RECORDING


def test_dead_stage(stack: Any) -> None:
    # vLLM-Omni 0.30 swallows a dead worker's error: start and stop answer 200 SUCCESS
    emu, sc, _ = stack(emulator_args=["--fault-dead-stage", "2"])
    reply = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0, 2]}, timeout=120)
    with SidecarClient(sc.url, timeout=30) as client:
        (cap,) = client.list_captures()
        traffic(emu)
        final = client.stop_capture(cap.id, wait=True, timeout=90)
    verdicts = {v.stage_id: v.verdict.value for v in final.verdicts}
    assert (reply.status_code, final.state.value, final.stop_reason.value, verdicts) == (
        201, "degraded", "explicit", {0: "ok", 2: "missing"})
    assert "dead or restarted worker" in next(v.reason or "" for v in final.verdicts if v.stage_id == 2)
    assert recording(emu)["0"] is False


def test_worker_dies_after_start(stack: Any) -> None:
    emu, sc, _ = stack(emulator_args=["--fault-die-after-start", "2", "--gzip-delay", "0"])
    with SidecarClient(sc.url, timeout=30) as client:
        cap = client.start_capture([0, 2])
        assert poll(lambda: not emulator_state(emu)["stages"]["2"]["alive"])
        traffic(emu)  # stage 0 works; stage 2's worker is gone
        final = client.stop_capture(cap.id, wait=True, timeout=90)
    verdicts = {v.stage_id: v.verdict.value for v in final.verdicts}
    # the stop answers 200 (the dead worker's error is swallowed): no stop error, the stage is missing
    assert (final.state.value, verdicts, "stop_server_error" in codes(final)) == (
        "degraded", {0: "ok", 2: "missing"}, False)
    assert "worker most likely died" in next(v.reason or "" for v in final.verdicts if v.stage_id == 2)
    assert recording(emu)["0"] is False


# --- kill -9 of the sidecar in each live state --------------------------------------------------


def _recovered(restart: Callable[[], Any], cid: str) -> Any:
    again = restart()
    with SidecarClient(again.url, timeout=30) as client:
        return client.wait_capture(cid, timeout=90)


def test_kill9_in_starting(stack: Any, tmp_path: Path) -> None:
    # the journal as a kill -9 leaves it mid-start: `starting`, the start already delivered
    emu, sc, restart = stack()
    with SidecarClient(sc.url, timeout=30) as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
    sc.kill()
    path = tmp_path / "state" / "captures" / f"{cap.id}.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "state": "starting", "started_at": None}))
    final = _recovered(restart, cap.id)
    assert (final.state.value, final.stop_reason.value) == ("completed", "stopped_on_recovery")
    assert recording(emu) == NONE_RECORDING


def test_kill9_in_active(stack: Any) -> None:
    emu, sc, restart = stack()
    with SidecarClient(sc.url, timeout=30) as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
    sc.kill()
    assert recording(emu) == {"0": True, "1": False, "2": True}
    final = _recovered(restart, cap.id)
    assert (final.state.value, final.stop_reason.value) == ("completed", "stopped_on_recovery")
    assert recording(emu) == NONE_RECORDING


def test_kill9_in_stopping(stack: Any) -> None:
    emu, sc, restart = stack(emulator_args=["--fault-stop-delay", "5"],
                             env={"OMNI_SIDECAR_STOP_TIMEOUT_S": "60", "OMNI_SIDECAR_STOP_BUDGET_S": "120"})
    with SidecarClient(sc.url, timeout=30) as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
        client.stop_capture(cap.id)
        assert client.get_capture(cap.id).state.value == "stopping"
    sc.kill()
    final = _recovered(restart, cap.id)
    assert (final.terminal, final.stop_reason.value) == (True, "stopped_on_recovery")
    assert final.state.value in ("completed", "degraded")
    assert recording(emu) == NONE_RECORDING


def test_kill9_in_collecting(stack: Any) -> None:
    emu, sc, restart = stack(emulator_args=["--gzip-delay", "6"])
    with SidecarClient(sc.url, timeout=30) as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
        client.stop_capture(cap.id)
        assert poll(lambda: client.get_capture(cap.id).state.value == "collecting", timeout=30)
    sc.kill()
    final = _recovered(restart, cap.id)
    verdicts = {v.stage_id: v.verdict.value for v in final.verdicts}
    assert (final.state.value, final.stop_reason.value, verdicts) == (
        "completed", "stopped_on_recovery", {0: "ok", 2: "ok"})
    assert recording(emu) == NONE_RECORDING


# --- the disk ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _tiny_tmpfs(where: Path) -> Iterator[Path]:
    where.mkdir(parents=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_full_disk_during_a_journal_write(
    deploy: Path, emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any], tmp_path: Path
) -> None:
    with _tiny_tmpfs(tmp_path / "tiny") as state:
        emu = emulator_factory(deploy)
        sc = sidecar_factory(emu.url, deploy, state_dir=state, env=FAST, log_path=tmp_path / "sidecar.log")
        with SidecarClient(sc.url, timeout=30) as client:
            cap = client.start_capture([0, 2])
            traffic(emu)
            with contextlib.suppress(OSError), open(state / "filler", "wb") as fh:  # the disk fills up
                while True:
                    fh.write(b"\0" * 4096)
                    fh.flush()
            final = client.stop_capture(cap.id, wait=True, timeout=90)
            health = client.healthz()
        sc.stop(grace=15)
    # the capture goes on without its journal: the profiler is stopped, the loss is reported
    assert (final.state.value, health["journal"]["write_errors"] > 0) == ("completed", True)
    assert recording(emu) == NONE_RECORDING
