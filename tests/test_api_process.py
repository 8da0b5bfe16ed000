"""The sidecar as users run it: ``omni-sidecar serve`` under uvicorn on a free port, in front of
the emulated vLLM-Omni server, driven over real sockets (curl-level)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.api.launcher import SidecarProcess
from sidecar.client import SidecarClient
from tests.fixtures.emulator import emulator_state, make_deploy

pytestmark = pytest.mark.slow

FAST = {  # small bounds so fault tests end quickly; the defaults are minutes
    "OMNI_SIDECAR_COLLECT_TIMEOUT_S": "5",
    "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "20",
}
SESSION = re.compile(r"^\d{8}-\d{6}_stage(\d+)_rank0_\d+$")


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    """Three stages like Qwen2.5-Omni: 0 and 2 profiled with torch, 1 without a profiler."""
    return make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})


@pytest.fixture
def stack(
    deploy: Path, emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., SidecarProcess]
) -> Callable[..., tuple[Any, SidecarProcess]]:
    """``stack(emulator_args=[...], env={...}, **sidecar opts)`` → (emulator, sidecar), both torn down."""

    def make(emulator_args: list[str] | None = None, env: dict[str, str] | None = None, **opts: Any) -> tuple[Any, SidecarProcess]:
        emu = emulator_factory(deploy, extra_args=emulator_args or [])
        sc = sidecar_factory(emu.url, deploy, env={**FAST, **(env or {})}, **opts)
        return emu, sc

    return make


def upstream_calls(emu: Any, path: str) -> list[dict[str, Any]]:
    return [c for c in emulator_state(emu)["calls"] if c["method"] == "POST" and c["path"] == path]


def profiling(emu: Any) -> dict[str, bool]:
    return {sid: st["profiling"] for sid, st in emulator_state(emu)["stages"].items()}


def busy(emu: Any) -> int:
    """One chat request through every stage, so the window records work (an idle one is ``empty``);
    the status (500 once a stage on the way is dead: the stages before it still ran)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{emu.url}/v1/chat/completions", json=body, timeout=120).status_code


def poll(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_start_overlap_stop_completes_with_traces(stack: Any) -> None:
    emu, sc = stack()
    first = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0, 2]}, timeout=60)
    overlap = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]}, timeout=60)
    assert busy(emu) == 200
    done = httpx.post(f"{sc.url}/v1/captures/{first.json()['id']}/stop?wait=true", timeout=60).json()
    names = {
        v["stage_id"]: (v["verdict"], Path(s["path"]).name, sorted(f["name"] for f in s["files"]))
        for v in done["verdicts"]
        for s in v["sessions"]
    }
    assert (first.status_code, overlap.status_code, overlap.json()["error"]["code"], done["state"]) == (
        201, 409, "capture_active", "completed"
    )
    for sid, (verdict, folder, files) in names.items():
        assert verdict == "ok" and SESSION.match(folder) and SESSION.match(folder).group(1) == str(sid)
        assert "trace_rank0.json.gz" in files
    assert sorted(names) == [0, 2]


@pytest.mark.parametrize("stages", [[], [9], [1]], ids=["empty", "unknown", "unprofiled"])
def test_bad_stages_are_422_and_never_reach_the_server(stack: Any, stages: list[int]) -> None:
    emu, sc = stack()
    reply = httpx.post(f"{sc.url}/v1/captures", json={"stages": stages})
    assert (reply.status_code, upstream_calls(emu, "/start_profile")) == (422, [])


def test_slow_stop_stays_stopping_and_api_answers(stack: Any) -> None:
    emu, sc = stack(emulator_args=["--fault-stop-delay", "6"])
    with SidecarClient(sc.url) as client:
        cap = client.start_capture([0])
        assert busy(emu) == 200
        client.stop_capture(cap.id)
        time.sleep(1.0)  # the upstream stop is now in flight for several more seconds
        health = httpx.get(f"{sc.url}/healthz", timeout=30).status_code  # a blocked loop answers after the stop: then `state` is no longer stopping
        state = client.get_capture(cap.id).state.value
        final = client.wait_capture(cap.id, timeout=60).state.value
    assert (health, state, final) == (200, "stopping", "completed")


def test_hung_stop_stays_stopping_and_a_new_start_is_409_stop_pending(stack: Any) -> None:
    # the server never answers the stop: past its budget the capture is held in `stopping` (the
    # profiler may still run), the error says so, and no new start may race it
    emu, sc = stack(
        emulator_args=["--fault-hang-stop"],
        env={"OMNI_SIDECAR_STOP_TIMEOUT_S": "1", "OMNI_SIDECAR_STOP_BUDGET_S": "2", "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "1"},
    )
    with SidecarClient(sc.url) as client:
        cap = client.start_capture([0])
        client.stop_capture(cap.id)
        assert poll(lambda: bool(client.get_capture(cap.id).verdicts), timeout=60)  # the budget ended
        held = client.get_capture(cap.id)
        again = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]}, timeout=60)
    assert (held.state.value, held.errors[-1].code, [v.stage_id for v in held.verdicts]) == (
        "stopping", "upstream_timeout", [0])
    assert (again.status_code, again.json()["error"]["code"], again.json()["error"]["details"].get("active_id")) == (
        409, "capture_stop_pending", cap.id)
    assert len(upstream_calls(emu, "/start_profile")) == 1


def test_dead_stage_starts_and_that_stage_is_missing_naming_the_dead_worker(stack: Any) -> None:
    # a dead worker: the server still answers start and stop 200 SUCCESS (it swallows the error);
    # the other stage records, the dead one writes nothing and its verdict says why
    emu, sc = stack(emulator_args=["--fault-dead-stage", "2"])
    assert poll(lambda: not emulator_state(emu)["stages"]["2"]["alive"])
    reply = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0, 2]}, timeout=120)
    busy(emu)  # 500 at stage 2; stage 0 ran
    done = httpx.post(f"{sc.url}/v1/captures/{reply.json()['id']}/stop?wait=true", timeout=120).json()
    verdicts = {v["stage_id"]: v["verdict"] for v in done["verdicts"]}
    reason = next(v["reason"] for v in done["verdicts"] if v["stage_id"] == 2) or ""
    assert (reply.status_code, done["state"], verdicts, "dead or restarted worker" in reason) == (
        201, "degraded", {0: "ok", 2: "missing"}, True)
    assert profiling(emu)["0"] is False


def test_stage_dead_mid_window_degrades_with_that_stage_missing(stack: Any) -> None:
    # stage 2's worker acknowledges the start, then exits: the stop still answers 200 SUCCESS
    emu, sc = stack(emulator_args=["--fault-die-after-start", "2", "--gzip-delay", "0"])
    created = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0, 2]}, timeout=120).json()
    poll(lambda: not emulator_state(emu)["stages"]["2"]["alive"])
    busy(emu)  # 500 at stage 2; stage 0 ran
    done = httpx.post(f"{sc.url}/v1/captures/{created['id']}/stop?wait=true", timeout=120).json()
    verdicts = {v["stage_id"]: v["verdict"] for v in done["verdicts"]}
    reason = next(v["reason"] for v in done["verdicts"] if v["stage_id"] == 2) or ""
    assert (done["state"], verdicts, "worker most likely died or failed during the window" in reason) == (
        "degraded", {0: "ok", 2: "missing"}, True
    )


def test_start_500_is_502_and_the_capture_failed(stack: Any) -> None:
    emu, sc = stack(emulator_args=["--fault-start-500"])
    reply = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]})
    captures = httpx.get(f"{sc.url}/v1/captures").json()["captures"]
    assert (reply.status_code, [c["state"] for c in captures]) == (502, ["failed"])
    assert upstream_calls(emu, "/stop_profile"), "start failure must roll back with a stop"


def test_sigterm_stops_the_active_capture_before_exit(stack: Any) -> None:
    emu, sc = stack()
    with SidecarClient(sc.url) as client:
        client.start_capture([0, 2])
    assert profiling(emu) == {"0": True, "1": False, "2": True}
    sc.stop(grace=30)  # uvicorn re-raises SIGTERM after its shutdown, so the exit code is -15
    assert (profiling(emu), len(upstream_calls(emu, "/stop_profile"))) == ({"0": False, "1": False, "2": False}, 1)


def test_kill9_then_restart_stops_on_recovery(stack: Any, sidecar_factory: Any, deploy: Path, tmp_path: Path) -> None:
    state_dir = tmp_path / "shared-state"
    emu, sc = stack(state_dir=state_dir)
    with SidecarClient(sc.url) as client:
        cap = client.start_capture([0, 2])
    sc.kill()
    still = profiling(emu)
    again = sidecar_factory(emu.url, deploy, state_dir=state_dir, env=FAST)
    with SidecarClient(again.url) as client:
        final = client.wait_capture(cap.id, timeout=60)
    assert still == {"0": True, "1": False, "2": True}
    assert (final.stop_reason.value if final.stop_reason else None, final.terminal) == ("stopped_on_recovery", True)
    assert profiling(emu) == {"0": False, "1": False, "2": False}


def test_fifty_concurrent_starts_make_one_capture(stack: Any) -> None:
    emu, sc = stack()

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=sc.url, timeout=60) as http:
            replies = await asyncio.gather(*(http.post("/v1/captures", json={"stages": [0]}) for _ in range(50)))
        return [r.status_code for r in replies]

    codes = asyncio.run(burst())
    assert (codes.count(201), codes.count(409), len(upstream_calls(emu, "/start_profile"))) == (1, 49, 1)


def test_token_required_on_mutating_routes(stack: Any, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-0123456789\n")
    _, sc = stack(token_file=token_file)
    without = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]})
    with SidecarClient(sc.url, token="tok-0123456789") as client:
        cap = client.start_capture([0])
    assert (without.status_code, without.json()["error"]["code"], cap.state.value) == (401, "unauthorized", "active")


def test_file_download_is_confined_to_the_capture(stack: Any, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("not yours")
    _, sc = stack()
    with SidecarClient(sc.url) as client:
        cap = client.start_capture([0])
        done = client.stop_capture(cap.id, wait=True, timeout=60)
    folder = Path(done.verdicts[0].sessions[0].path).name
    ok = httpx.get(f"{sc.url}/v1/captures/{cap.id}/files/{folder}/trace_rank0.json.gz")
    escapes = [
        httpx.get(f"{sc.url}/v1/captures/{cap.id}/files/{folder}/../../../secret.txt"),
        httpx.get(f"{sc.url}/v1/captures/{cap.id}/files/{folder}/..%2F..%2F..%2Fsecret.txt"),
    ]
    assert ok.status_code == 200 and ok.content[:2] == b"\x1f\x8b"
    assert [r.status_code for r in escapes] == [404, 404]


def test_artifact_root_maps_server_paths_to_local_ones(stack: Any, tmp_path: Path) -> None:
    # the server's stage-0 dir "mounted" at a path where nothing is: the sidecar cannot see it
    emu, sc = stack(artifact_roots={str(tmp_path / "traces" / "stage0"): str(tmp_path / "no" / "such" / "mount")})
    with SidecarClient(sc.url) as client:
        cap = client.start_capture([0, 2])
        assert busy(emu) == 200
        final = client.stop_capture(cap.id, wait=True, timeout=60)
    verdicts = {v.stage_id: v.verdict.value if v.verdict else None for v in final.verdicts}
    assert (final.state.value, verdicts) == ("degraded", {0: "unverified", 2: "ok"})


# --- start-up refusals: exit 1 naming the fix -------------------------------------------------


def _serve(deploy: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os
    import sys

    return subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--deploy-config", str(deploy), *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_an_unwritable_state_dir_stops_start_up(deploy: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = _serve(deploy, "--port", "0", "--state-dir", str(blocker / "state"))
    assert proc.returncode == 1 and str(blocker / "state") in proc.stderr and "state_dir_unusable" in proc.stderr


def test_an_upstream_without_scheme_stops_start_up(deploy: Path, tmp_path: Path) -> None:
    proc = _serve(deploy, "--upstream", "127.0.0.1:8000", "--state-dir", str(tmp_path / "s"))
    assert proc.returncode == 1 and "http://127.0.0.1:8000" in proc.stderr


def test_listening_beyond_loopback_needs_a_token(deploy: Path, tmp_path: Path) -> None:
    proc = _serve(deploy, "--host", "0.0.0.0", "--state-dir", str(tmp_path / "s"))
    assert proc.returncode == 1 and "--token-file" in proc.stderr


def test_upstream_credentials_are_never_shown(stack: Any, deploy: Path, emulator_factory: Any,
                                              sidecar_factory: Any) -> None:
    emu = emulator_factory(deploy)
    url = emu.url.replace("http://", "http://admin:pw-0123456789@")
    sc = sidecar_factory(url, deploy, env=FAST)
    cap = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0]}, timeout=60).text
    ready = httpx.get(f"{sc.url}/readyz", timeout=30).text
    log = sc.log_path.read_text() if sc.log_path.exists() else ""
    assert "pw-0123456789" not in cap + ready + log and "***@" in cap


def test_a_bad_journal_entry_is_quarantined_and_the_rest_recovered(
    stack: Any, sidecar_factory: Any, deploy: Path, tmp_path: Path
) -> None:
    state_dir = tmp_path / "shared-state"
    emu, sc = stack(state_dir=state_dir)
    with SidecarClient(sc.url) as client:
        cap = client.start_capture([0, 2])
    sc.kill()
    bad = state_dir / "captures" / "20260101-000000-aaaaaa.json"
    good = json.loads((state_dir / "captures" / f"{cap.id}.json").read_text())
    bad.write_text(json.dumps({**good, "id": bad.stem, "created_at": "2026-01-01T00:00:00"}))  # no timezone
    again = sidecar_factory(emu.url, deploy, state_dir=state_dir, env=FAST)
    with SidecarClient(again.url) as client:
        final = client.wait_capture(cap.id, timeout=60)
        health = client.healthz()
    assert (final.stop_reason.value if final.stop_reason else None, health["journal"]["quarantined"]) == (
        "stopped_on_recovery", 1)
    assert bad.with_name(bad.name + ".bad").exists() and profiling(emu) == {"0": False, "1": False, "2": False}
