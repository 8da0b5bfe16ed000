"""A start scheduled on the sidecar (``POST /v1/captures`` with ``start_at``, epoch seconds on its
own clock): answered 202 as soon as the capture is prepared, its start sent to the server at that
time (never before: the emulator logs each call's arrival), at once when already past, cancelled
by a stop before then with nothing sent, and refused beyond ``start_at_max_s``. Real sidecar
process, real emulator, real sockets."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from sidecar.client import SidecarClient
from tests.fixtures.emulator import EmulatorPool, emulator_state, make_deploy
from tests.fixtures.sidecar import ModuleSidecar, error_of

ROOT = Path(__file__).resolve().parents[1]
STAGES = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    root = tmp_path_factory.mktemp("scheduled")
    yield from ModuleSidecar.for_module(emulator_pool, make_deploy(root, STAGES), emulator_args=["--workers", "thread"],
                                        state_dir=root / "state", env={"OMNI_SIDECAR_START_AT_MAX_S": "120"})


@pytest.fixture
def shared(_shared: ModuleSidecar) -> Iterator[ModuleSidecar]:
    yield from _shared.each_test()


def _sidecar_now(client: SidecarClient) -> float:
    return int(client._http.get("/v1/clock").json()["realtime_ns"]) / 1e9


def _starts(shared: ModuleSidecar) -> list[float]:
    return [c["t"] for c in emulator_state(shared.emulator)["calls"] if c["path"] == "/start_profile"]


def _traffic(shared: ModuleSidecar) -> None:
    shared.emulator.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2}).raise_for_status()


def test_a_scheduled_start_is_answered_at_once_and_sent_at_its_time(shared: ModuleSidecar) -> None:
    with shared.client() as client:
        at = _sidecar_now(client) + 3  # ahead of a loaded machine's preparation (else a "late" note)
        reply = client._http.post("/v1/captures", json={"stages": [0, 2], "start_at": at})
        assert reply.status_code == 202 and reply.json()["state"] == "starting", reply.text
        cap = client.wait_started(reply.json()["id"], timeout=60)
        assert cap.state.value == "active" and cap.start_at is not None and abs(cap.start_at.timestamp() - at) < 1e-6, cap
        (sent,) = _starts(shared)  # the emulator runs on this host: one clock
        assert at <= sent < at + 5, (sent - at)
        assert cap.started_at is not None and cap.started_at.timestamp() >= at
        _traffic(shared)
        done = client.stop_capture(cap.id, wait=True, timeout=60)
    assert done.state.value == "completed" and not done.fact("start_at_late"), (done.verdicts, done.facts)


def test_a_start_at_already_past_is_sent_at_once_and_says_how_late(shared: ModuleSidecar) -> None:
    with shared.client() as client:
        cap = client.start_capture([0], start_at=_sidecar_now(client) - 3)
        cap = client.wait_started(cap.id, timeout=60)
        assert cap.state.value == "active" and len(_starts(shared)) == 1, cap
        (late,) = cap.fact("start_at_late")
        assert late.figures["late_s"] >= 2.5, cap.facts
        client.stop_capture(cap.id, wait=True, timeout=60)


def test_a_stop_before_its_time_cancels_it_and_nothing_reaches_the_server(shared: ModuleSidecar) -> None:
    with shared.client() as client:
        cap = client.start_capture([0, 2], start_at=_sidecar_now(client) + 60)
        busy = client._http.post("/v1/captures", json={"stages": [0]})  # the slot is held meanwhile
        stopped = client.stop_capture(cap.id, wait=True, timeout=30)
        again = client.start_capture([0])  # and free again at once
        client.stop_capture(again.id, wait=True, timeout=60)
    assert (busy.status_code, error_of(busy)["code"]) == (409, "capture_active"), busy.text
    assert stopped.state.value == "failed" and [e.code for e in stopped.errors] == ["start_cancelled"], stopped
    assert "before its start_at: nothing was sent to the server" in stopped.errors[0].message, stopped.errors
    calls = [c["path"] for c in emulator_state(shared.emulator)["calls"] if c["path"].endswith("_profile")]
    assert calls == ["/start_profile", "/stop_profile"], calls  # the next capture's only


@pytest.mark.parametrize("ahead", [121, 1e9])
def test_a_start_further_ahead_than_allowed_is_refused_naming_the_bound(shared: ModuleSidecar, ahead: float) -> None:
    with shared.client() as client:
        at = min(_sidecar_now(client) + ahead, 253402300799.0)
        reply = client._http.post("/v1/captures", json={"stages": [0], "start_at": at})
        assert client.list_captures() == [] or all(c.terminal for c in client.list_captures())
    err = error_of(reply)
    assert (reply.status_code, err["code"]) == (422, "start_at_invalid"), reply.text
    assert "more than the 120s a start may be scheduled ahead" in err["message"], err
    assert _starts(shared) == []


async def _async_scheduled(url: str) -> tuple[str, str]:
    from sidecar.client import AsyncSidecarClient

    async with AsyncSidecarClient(url, timeout=60) as client:
        now = int((await client.clock())["realtime_ns"]) / 1e9
        cap = await client.start_capture([0, 2], start_at=now + 0.5, label="at")
        started = await client.wait_started(cap.id, timeout=60)
        await client.stop_capture(cap.id, wait=True, timeout=60)
    return cap.state.value, started.state.value


def test_the_async_client_schedules_and_waits_for_the_start(shared: ModuleSidecar) -> None:
    assert asyncio.run(_async_scheduled(shared.url)) == ("starting", "active")


def test_the_cli_schedules_a_start_on_the_sidecars_clock_and_a_stop_cancels_it(shared: ModuleSidecar) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sidecar", *args, "--sidecar", shared.url], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "COLUMNS": "200"}, cwd=ROOT)

    with shared.client() as client:
        before = _sidecar_now(client)
        out = cli("start", "--stages", "0", "--start-at", "+30")
        cap = client.list_captures()[0]  # newest first
        assert out.returncode == 0 and f"capture {cap.id} starting" in out.stdout and "cancels it" in out.stdout, out
        assert cap.start_at is not None and before + 30 <= cap.start_at.timestamp() <= _sidecar_now(client) + 30
        gone = cli("stop", cap.id)
        # the verdict printout says what happened, and exits non-zero as for any failed capture
        assert gone.returncode == 1 and "start_cancelled: stopped (explicit)" in gone.stdout, gone
        assert "before its start_at: nothing was sent to the server" in gone.stdout, gone
        assert client.get_capture(cap.id).state.value == "failed" and _starts(shared) == []


def test_a_request_held_until_started_answers_with_the_start_or_at_its_timeout(shared: ModuleSidecar) -> None:
    with shared.client() as client:
        soon = client.start_capture([0, 2], start_at=_sidecar_now(client) + 2)
        held = client._http.get(f"/v1/captures/{soon.id}", params={"until": "started", "timeout": 30})
        (sent,) = _starts(shared)  # answered once the start was, not before
        client.stop_capture(soon.id, wait=True, timeout=60)
        late = client.start_capture([0], start_at=_sidecar_now(client) + 60)
        waited = client._http.get(f"/v1/captures/{late.id}", params={"until": "started", "timeout": 0.2})
        too_long = client._http.get(f"/v1/captures/{late.id}", params={"until": "started", "timeout": 31})
        client.stop_capture(late.id, wait=True, timeout=60)
    assert held.status_code == 200 and held.json()["state"] == "active", held.text
    assert sent <= datetime.fromisoformat(held.json()["started_at"]).timestamp()
    assert waited.status_code == 200 and waited.json()["state"] == "starting", waited.text
    assert (too_long.status_code, error_of(too_long)["code"]) == (422, "request_invalid"), too_long.text
