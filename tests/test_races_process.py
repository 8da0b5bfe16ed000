"""Races over real sockets: many clients at once (httpx.AsyncClient, asyncio.gather) against a real
``omni-sidecar serve`` in front of the emulator (thread workers), checked by what the emulator was
sent (each start matched by a stop of the same stage list, never two starts without a stop), the
captures' final states, the journal on disk and the sidecar's log. Every wait is a poll or a request
with a timeout, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from tests.fixtures.emulator import EmulatorPool, emulator_state, make_deploy
from tests.fixtures.sidecar import ModuleSidecar
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow

STAGES = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}
THREAD = ["--workers", "thread"]
FAST = {"OMNI_SIDECAR_COLLECT_TIMEOUT_S": "5", "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "20"}
HTTP_TIMEOUT = 90  # every request ends: a hang fails the test instead of holding it
TERMINAL = ("completed", "degraded", "failed")
LOG_DEFECTS = ("Exception in ASGI application", "Task was destroyed but it is pending", "Traceback")


def profile_calls(emu: Any) -> list[tuple[str, Any, Any]]:
    """The emulator's profiler calls, in order: (start|stop, stages, status)."""
    return [(c["path"].strip("/").split("_")[0], c["stages"], c["status"]) for c in emulator_state(emu)["calls"]
            if c["method"] == "POST" and c["path"] in ("/start_profile", "/stop_profile")]


def paired(calls: list[tuple[str, Any, Any]]) -> bool:
    """Every start is followed by a stop of its own stage list before any other start."""
    open_stages = None
    for what, stages, _ in calls:
        if what == "start":
            if open_stages is not None:
                return False
            open_stages = stages
        elif open_stages is not None and stages != open_stages:
            return False
        else:
            open_stages = None
    return open_stages is None


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, HTTP_TIMEOUT * 2))


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    root = tmp_path_factory.mktemp("races")
    yield from ModuleSidecar.for_module(emulator_pool, make_deploy(root, STAGES), emulator_args=THREAD,
                                        state_dir=root / "state", env=FAST, log_path=root / "sidecar.log",
                                        timeout=HTTP_TIMEOUT)


@pytest.fixture
def shared(_shared: ModuleSidecar) -> Iterator[ModuleSidecar]:
    yield from _shared.each_test(settle_timeout=HTTP_TIMEOUT)


def test_starts_at_once_over_both_surfaces_make_one_capture(shared: ModuleSidecar) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=shared.url, timeout=HTTP_TIMEOUT) as http:
            starts = [http.post("/v1/captures", json={"stages": [0]}) for _ in range(6)]
            starts += [http.post("/start_profile", json={"stages": [0, 2]}) for _ in range(6)]
            replies = list(await asyncio.gather(*starts))
            replies.append(await http.post("/stop_profile"))
            return replies

    replies = run(burst())
    codes = sorted(r.status_code for r in replies[:-1])
    assert (codes.count(409), len([c for c in codes if c in (200, 201)]), replies[-1].status_code) == (11, 1, 200)
    assert {r.json()["error"]["code"] for r in replies[:-1] if r.status_code == 409} == {"capture_active"}
    calls = profile_calls(shared.emulator)
    assert [c[0] for c in calls] == ["start", "stop"] and paired(calls), calls


def test_stops_racing_their_own_start_send_one_stop_after_it(shared: ModuleSidecar) -> None:
    # the server holds the start's reply; meanwhile several clients stop the capture (found
    # `starting`), over both surfaces: one stop reaches the server, after the start's answer
    shared.emulator.set_faults(start_delay_s=1.0)

    async def race() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=shared.url, timeout=HTTP_TIMEOUT) as http:
            start = asyncio.create_task(http.post("/v1/captures", json={"stages": [0, 2]}))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                caps = (await http.get("/v1/captures")).json()["captures"]
                if caps and caps[0]["state"] == "starting":
                    break
                await asyncio.sleep(0.02)
            cid = caps[0]["id"]
            stops = [http.post(f"/v1/captures/{cid}/stop", params={"wait": "true"}) for _ in range(4)]
            stops.append(http.post("/stop_profile", json={"stages": [2, 0]}))
            stopped = list(await asyncio.gather(*stops))
            return await start, stopped

    start, stops = run(race())
    assert (start.status_code, start.json()["state"]) == (201, "stopping")
    assert {(r.status_code, r.json().get("state") or r.json()["capture"]["state"]) for r in stops} == {
        (200, "degraded")}  # an idle window, checked: terminal for every client
    calls = profile_calls(shared.emulator)
    assert [c[0] for c in calls] == ["start", "stop"] and paired(calls), calls


def test_a_scheduled_start_stopped_by_others_sends_nothing(shared: ModuleSidecar) -> None:
    async def race() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=shared.url, timeout=HTTP_TIMEOUT) as http:
            made = await http.post("/v1/captures", json={"stages": [0, 2], "start_at": time.time() + 30})
            cid = made.json()["id"]
            others = [http.post(f"/v1/captures/{cid}/stop", params={"wait": "true"}) for _ in range(3)]
            others += [http.get(f"/v1/captures/{cid}", params={"until": "started"}), http.post("/stop_profile")]
            return made, list(await asyncio.gather(*others))

    made, others = run(race())
    assert made.status_code == 202
    assert [r.status_code for r in others] == [200] * 5
    assert {r.json()["state"] for r in others[:4]} == {"failed"}
    assert profile_calls(shared.emulator) == []


def test_many_summaries_at_once_are_one_analysis(shared: ModuleSidecar) -> None:
    async def run_it() -> tuple[str, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=shared.url, timeout=HTTP_TIMEOUT) as http:
            cid = (await http.post("/v1/captures", json={"stages": [0, 2]})).json()["id"]
            shared.emulator.http.post("/v1/chat/completions",
                                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            done = await http.post(f"/v1/captures/{cid}/stop", params={"wait": "true"})
            assert done.json()["state"] == "completed", done.text
            reads = [http.get(f"/v1/captures/{cid}/summary", params={"top": 1 + i % 7}) for i in range(16)]
            return cid, list(await asyncio.gather(*reads))

    cid, reads = run(run_it())
    assert [r.status_code for r in reads] == [200] * 16
    cached = Path(shared.sidecar.state_dir) / "summaries" / f"{cid}.json"
    first = cached.stat()
    again = httpx.get(f"{shared.url}/v1/captures/{cid}/summary", params={"top": 3}, timeout=HTTP_TIMEOUT)
    assert again.status_code == 200 and (cached.stat().st_ino, cached.stat().st_mtime_ns) == (
        first.st_ino, first.st_mtime_ns)  # written once (atomically, so a second analysis would replace it)


# --- SIGTERM while clients wait: each sidecar is its own (the test ends it) ---------------------


@pytest.fixture
def own(tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]) -> Any:
    deploy = make_deploy(tmp_path, STAGES)
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    env = {**FAST, "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "2"}

    def start() -> Any:
        return sidecar_factory(emu.url, deploy, state_dir=tmp_path / "state", env=env,
                               log_path=tmp_path / f"sidecar-{len(list(tmp_path.glob('sidecar-*.log')))}.log")

    return emu, start


def test_sigterm_answers_clients_waiting_on_a_stop_and_the_journal_recovers_it(own: Any) -> None:
    emu, start = own
    sidecar = start()
    emu.set_faults(hang_stop=True)  # the stop is delivered and never answered: it outlives the shutdown

    async def wait_through_sigterm() -> tuple[str, list[Any]]:
        async with httpx.AsyncClient(base_url=sidecar.url, timeout=HTTP_TIMEOUT) as http:
            cid = (await http.post("/v1/captures", json={"stages": [0, 2]})).json()["id"]
            waits = [asyncio.create_task(http.post(f"/v1/captures/{cid}/stop", params={"wait": "true"}))
                     for _ in range(3)]
            waits.append(asyncio.create_task(http.post("/stop_profile")))
            while not any(c[0] == "stop" for c in profile_calls(emu)):  # the stop has reached the server
                await asyncio.sleep(0.05)
            os.kill(sidecar.pid, signal.SIGTERM)
            return cid, list(await asyncio.gather(*waits, return_exceptions=True))

    cid, replies = run(wait_through_sigterm())
    answered = [repr(r) if not isinstance(r, httpx.Response) else (r.status_code, r.json()["error"]["code"])
                if r.headers.get("content-type") == "application/json" else (r.status_code, r.text[:40]) for r in replies]
    assert answered == [(503, "sidecar_closing")] * 4
    assert poll(lambda: sidecar.returncode is not None)
    log = sidecar.log_path.read_text()
    assert [d for d in LOG_DEFECTS if d in log] == [], log[-3000:]
    journaled = json.loads((Path(sidecar.state_dir) / "captures" / f"{cid}.json").read_text())
    assert journaled["state"] == "stopping"  # left for recovery, with its stage set

    emu.set_faults(hang_stop=False)
    again = start()  # the same state dir: start-up stops it on recovery
    with httpx.Client(base_url=again.url, timeout=HTTP_TIMEOUT) as http:
        final = http.post(f"/v1/captures/{cid}/stop", params={"wait": "true"}).json()
    assert (final["state"] in TERMINAL, final["stop_reason"]) == (True, "stopped_on_recovery")
    calls = profile_calls(emu)
    assert [c[0] for c in calls][:2] == ["start", "stop"] and {tuple(c[1]) for c in calls} == {(0, 2)}
    assert [c[0] for c in calls].count("start") == 1
