"""``omni-sidecar serve`` and the signals that end it, through the real process in front of the
emulator: the active capture's stop begins as soon as the shutdown does (not after uvicorn's grace
for requests in flight), so a client waiting on that capture gets its end; a second Ctrl-C cuts the
grace short but never that stop; SIGHUP (a closed terminal) shuts down like SIGTERM. Every wait is
a poll or a request with a timeout, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from tests.fixtures.emulator import emulator_state, make_deploy
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow

STAGES = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}
THREAD = ["--workers", "thread"]
ENV = {"OMNI_SIDECAR_COLLECT_TIMEOUT_S": "5", "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "30"}
HTTP_TIMEOUT = 90
TERMINAL = ("completed", "degraded", "failed")
LOG_DEFECTS = ("Exception in ASGI application", "Task was destroyed but it is pending", "Traceback")


@pytest.fixture
def own(tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]) -> Any:
    """(emulator, sidecar): a sidecar of this test's own (the test ends it) on the pooled emulator."""
    return _own(tmp_path, shared_emulator_factory, sidecar_factory)


def _own(tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]) -> Any:
    deploy = make_deploy(tmp_path, STAGES)
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    sidecar = sidecar_factory(emu.url, deploy, state_dir=tmp_path / "state", env=ENV, log_path=tmp_path / "sidecar.log")
    return emu, sidecar


def profiler_calls(emu: Any) -> list[str]:
    return [c["path"] for c in emulator_state(emu)["calls"]
            if c["method"] == "POST" and c["path"] in ("/start_profile", "/stop_profile")]


def profiling(emu: Any) -> bool:
    return any(st["profiling"] for st in emulator_state(emu)["stages"].values())


def journaled(sidecar: Any, cid: str) -> dict[str, Any]:
    return json.loads((Path(sidecar.state_dir) / "captures" / f"{cid}.json").read_text())  # type: ignore[no-any-return]


async def live_capture(http: httpx.AsyncClient) -> str:
    """The id of the capture a start in flight made (it exists only while its start request runs)."""
    while True:
        caps = (await http.get("/v1/captures")).json()["captures"]
        if caps and caps[0]["state"] == "starting":
            return str(caps[0]["id"])
        await asyncio.sleep(0.05)


async def in_flight(sidecar: Any, request: bytes) -> asyncio.Task[tuple[int, dict[str, Any]]]:
    """``request`` sent on a connection of its own, whose bytes the server has read when this returns:
    a later request (on a new connection) answered means the server accepted and read this one
    first, so it is in flight when the test signals. The task is its reply (status, JSON body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    writer.write(request)
    await writer.drain()

    async def reply() -> tuple[int, dict[str, Any]]:
        raw = await reader.read()
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)

    task = asyncio.create_task(reply())
    async with httpx.AsyncClient(base_url=sidecar.url, timeout=HTTP_TIMEOUT) as http:
        assert (await http.get("/healthz")).status_code == 200
    return task


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()


def half_sent_post(path: str) -> bytes:
    """A POST whose body never arrives whole: in flight until the grace ends (a stalled client)."""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{").encode()


def test_sigterm_answers_clients_waiting_on_the_active_capture_with_its_end(own: Any) -> None:
    # A start waiting for 5 engine steps (none run: the server is idle) and a GET held until that
    # capture leaves `starting`. The shutdown stops the capture at once, and both get its end; they
    # were held through uvicorn's 5 s grace and answered 503 sidecar_closing, the stop coming after.
    emu, sidecar = own

    async def through_sigterm() -> tuple[str, httpx.Response, tuple[int, dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=sidecar.url, timeout=HTTP_TIMEOUT) as http:
            start = asyncio.create_task(http.post("/v1/captures", json={"stages": [0, 2], "delay_steps": 5}))
            cid = await live_capture(http)
            held = await in_flight(sidecar, get(f"/v1/captures/{cid}?until=started&timeout=30"))
            os.kill(sidecar.pid, signal.SIGTERM)
            return cid, await start, await held

    cid, start, (held_status, held_body) = asyncio.run(asyncio.wait_for(through_sigterm(), HTTP_TIMEOUT * 2))
    assert (start.status_code, start.json()["error"]["code"]) == (409, "start_cancelled"), start.text
    assert (held_status, held_body["id"], held_body["state"]) == (200, cid, "failed"), held_body
    assert poll(lambda: sidecar.returncode is not None)
    assert journaled(sidecar, cid)["state"] == "failed"
    assert profiler_calls(emu) == []  # nothing was sent: the start never went out
    log = sidecar.log_path.read_text()
    assert [d for d in LOG_DEFECTS if d in log] == [], log[-3000:]


def test_a_second_ctrl_c_cuts_the_grace_short_and_still_stops_the_capture_without_a_traceback(own: Any) -> None:
    # An active capture and a request in flight (a client whose body stalls): Ctrl-C, then a second
    # one during the grace (uvicorn's force quit). uvicorn skipped the lifespan's shutdown then: the
    # capture was stopped only as a side effect of the loop cancelling the lifespan task at exit, and
    # the log got that cancelled lifespan's traceback (KeyboardInterrupt, CancelledError).
    emu, sidecar = own

    async def through_two_ctrl_c() -> str:
        async with httpx.AsyncClient(base_url=sidecar.url, timeout=HTTP_TIMEOUT) as http:
            cid = (await http.post("/v1/captures", json={"stages": [0, 2]})).json()["id"]
            stalled = await in_flight(sidecar, half_sent_post("/v1/captures"))
            os.kill(sidecar.pid, signal.SIGINT)
            assert await asyncio.to_thread(poll, lambda: "Waiting for connections to close" in sidecar.log_path.read_text())
            os.kill(sidecar.pid, signal.SIGINT)
            await asyncio.gather(stalled, return_exceptions=True)
            return str(cid)

    cid = asyncio.run(asyncio.wait_for(through_two_ctrl_c(), HTTP_TIMEOUT * 2))
    assert poll(lambda: sidecar.returncode is not None, timeout=HTTP_TIMEOUT)
    assert (profiling(emu), profiler_calls(emu)) == (False, ["/start_profile", "/stop_profile"])
    final = journaled(sidecar, cid)
    assert (final["state"] in TERMINAL, final["stop_reason"]) == (True, "shutdown")
    log = sidecar.log_path.read_text()
    assert [d for d in LOG_DEFECTS if d in log] == [], log[-3000:]


def test_sighup_stops_the_active_capture_before_exit(tmp_path: Path, shared_emulator_factory: Callable[..., Any],
                                                    sidecar_factory: Callable[..., Any]) -> None:
    # A closed terminal or ssh session sends SIGHUP: it killed the sidecar at once, the profiler
    # left recording on the server (until a next sidecar's recovery, if any).
    # Started with SIGHUP as a terminal leaves it: under nohup (how CI here is launched) the child
    # would inherit SIG_IGN, which the sidecar rightly leaves alone.
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        emu, sidecar = _own(tmp_path, shared_emulator_factory, sidecar_factory)
    finally:
        signal.signal(signal.SIGHUP, previous)
    with httpx.Client(base_url=sidecar.url, timeout=HTTP_TIMEOUT) as http:
        cid = http.post("/v1/captures", json={"stages": [0, 2]}).json()["id"]
    assert profiling(emu)
    os.kill(sidecar.pid, signal.SIGHUP)
    assert poll(lambda: sidecar.returncode is not None, timeout=HTTP_TIMEOUT)
    assert (profiling(emu), profiler_calls(emu)) == (False, ["/start_profile", "/stop_profile"])
    final = journaled(sidecar, cid)
    assert (final["state"] in TERMINAL, final["stop_reason"]) == (True, "shutdown")
    assert sidecar.returncode == -signal.SIGHUP  # re-raised after the shutdown, as uvicorn does with SIGTERM

