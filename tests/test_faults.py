"""The fault matrix: each fault of the upstream, the sidecar or the disk, through the real
processes (``omni-sidecar serve`` over the emulator), asserting the capture's final state, its
reason, and that no stage is left recording (the emulator's ``GET /emulator/state``). This is the
one process-level layer for faults; the rules behind each row are tested in process
(tests/test_controller.py, tests/test_api.py).

| fault                            | final state | reason (error code / stop reason)                    |
|----------------------------------|-------------|------------------------------------------------------|
| upstream killed mid-capture      | failed      | upstream_gone, quickly (not the budget)              |
|   ... then a start (server down) | failed      | upstream_unreachable (503)                           |
| start answers 500                | failed      | upstream_failed (502), rolled back with a stop       |
| stop delayed                     | completed   | explicit; `stopping`, /healthz answering meanwhile   |
| stop hangs                       | stopping    | upstream_timeout past the budget; a start is 409     |
|                                  |             | capture_stop_pending, the slot held                  |
|   ... then the server answers    | completed   | explicit                                             |
| stop answers 500 (no worker hit) | degraded    | stop_server_error; the stages noted unconfirmed      |
|   ... a start, the server still 500s | -        | 409 stop_unconfirmed, nothing started                |
|   ... a start once the stop works | completed  | its stages stopped first: its trace is its window    |
| dead stage (start/stop 200)      | degraded    | that stage missing: dead or restarted worker         |
| worker dies after start          | degraded    | that stage missing: its worker most likely died      |
| kill -9 in starting/active/...   | completed   | stopped_on_recovery at the next start-up             |
|   ... a bad journal entry beside | -           | quarantined (``.bad``, counted at /healthz)          |
| full disk during a journal write | completed   | journal write_errors at /healthz                     |

Each window that should end ``completed`` gets a request (``traffic``): an idle window is ``empty``.
The emulator is the session pool's (thread workers, faults set at run time) except where a row
kills it.
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

from sidecar.client import SidecarClient
from tests.fixtures.emulator import EmulatorPool, emulator_state, make_deploy
from tests.fixtures.sidecar import ModuleSidecar
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow

FAST = {
    "OMNI_SIDECAR_COLLECT_TIMEOUT_S": "8",
    "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "10",
    "OMNI_SIDECAR_STOP_BUDGET_S": "4",
    "OMNI_SIDECAR_STOP_TIMEOUT_S": "2",
}
# the sidecar's reaction to a fault does not depend on what the traces hold: thread workers
# (synthetic traces, the same files) start in about a second instead of one torch process per stage
THREAD = ["--workers", "thread"]
NONE_RECORDING = {"0": False, "1": False, "2": False}
HTTP_TIMEOUT = 120  # generous: a loaded machine is slow, and a hang is caught by the deadlines below
WAIT = 90


STAGES = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    return make_deploy(tmp_path, STAGES)


def trace_dirs(deploy: Path) -> dict[int, Path]:
    """Where ``make_deploy`` put each profiled stage's traces (for ``emu.reset(profiler_dirs=...)``)."""
    return {sid: deploy.parent / "traces" / f"stage{sid}" for sid in (0, 2)}


@pytest.fixture
def stack(
    deploy: Path,
    shared_emulator_factory: Callable[..., Any],
    emulator_factory: Callable[..., Any],
    sidecar_factory: Callable[..., Any],
    tmp_path: Path,
):
    """``stack(env={...}, emulator_args=[...], fresh=False)`` → (emulator, sidecar, restart) with
    one state dir, for the rows the module's sidecar cannot serve; ``restart()`` starts a new
    sidecar on it (after a kill -9). The emulator comes from the session pool; ``fresh=True``
    gives one of its own, for a test that kills it."""

    def make(env: dict[str, str] | None = None, emulator_args: list[str] | None = None, fresh: bool = False):
        factory = emulator_factory if fresh else shared_emulator_factory
        emu = factory(deploy, extra_args=[*THREAD, *(emulator_args or [])])
        state = tmp_path / "state"

        def restart() -> Any:
            return sidecar_factory(emu.url, deploy, state_dir=state, env={**FAST, **(env or {})})

        return emu, restart(), restart

    return make


# The rows on the pooled emulator share one sidecar (a sidecar start is most of a row's cost; a
# kill row starts its successor), with stop bounds that fit both a delayed stop (answers within
# them) and a hung one (outlives them).
SHARED_ENV = {**FAST, "OMNI_SIDECAR_STOP_TIMEOUT_S": "8", "OMNI_SIDECAR_STOP_BUDGET_S": "8"}


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    root = tmp_path_factory.mktemp("matrix")
    yield from ModuleSidecar.for_module(
        emulator_pool, make_deploy(root, STAGES), emulator_args=THREAD, timeout=HTTP_TIMEOUT,
        state_dir=root / "state", env=SHARED_ENV, log_path=root / "sidecar.log",
    )  # fmt: skip


@pytest.fixture
def shared(_shared: ModuleSidecar) -> Iterator[ModuleSidecar]:
    """The module's sidecar over the pooled emulator, faults cleared; every capture ended after."""
    yield from _shared.each_test(settle_timeout=WAIT)


def client_of(sc: Any) -> SidecarClient:
    return SidecarClient(sc.url, timeout=HTTP_TIMEOUT)


def recording(emu: Any) -> dict[str, bool]:
    return {sid: st["profiling"] for sid, st in emulator_state(emu)["stages"].items()}


def upstream_calls(emu: Any, path: str) -> list[dict[str, Any]]:
    return [c for c in emulator_state(emu)["calls"] if c["method"] == "POST" and c["path"] == path]


def codes(cap: Any) -> list[str]:
    return [e.code for e in cap.errors]


def traffic(emu: Any) -> None:
    """One chat request through the stages, so the window records work; a dead stage answers 500
    (the stages before it still ran)."""
    httpx.post(f"{emu.url}/v1/chat/completions",
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=HTTP_TIMEOUT)


def settled(client: SidecarClient, cid: str) -> Any:
    """The capture once terminal (polled every 0.1 s, for at most ``WAIT`` seconds)."""
    return client.wait_capture(cid, timeout=WAIT, poll_s=0.1)


def stopped(client: SidecarClient, cid: str) -> Any:
    client.stop_capture(cid)
    return settled(client, cid)


# --- upstream faults ---------------------------------------------------------------------------


def test_upstream_killed_mid_capture_then_a_start(stack: Any) -> None:
    # the default stop budget (30 min): the capture must not wait it out once the server is gone
    # (gone after 2 s of the server unreachable, not the default 10: what is checked is that it is not 1800)
    emu, sc, _ = stack(fresh=True, env={"OMNI_SIDECAR_STOP_BUDGET_S": "1800", "OMNI_SIDECAR_STOP_TIMEOUT_S": "1800",
                                        "OMNI_SIDECAR_GONE_AFTER_S": "2"})
    with client_of(sc) as client:
        cap = client.start_capture([0, 2])
        emu.kill()
        final = stopped(client, cap.id)
        # the server is down now: a start is refused for the server (not 409 for the old capture)
        again = httpx.post(f"{sc.url}/v1/captures", json={"stages": [0, 2]}, timeout=HTTP_TIMEOUT)
        refused = client.get_capture(again.json()["error"]["details"]["capture_id"])
    assert (final.state.value, "upstream_gone" in codes(final)) == ("failed", True)
    assert (again.status_code, again.json()["error"]["code"]) == (503, "upstream_unreachable")
    assert (refused.state.value, codes(refused)) == ("failed", ["upstream_unreachable"])


def test_start_500(shared: ModuleSidecar) -> None:
    emu = shared.emulator
    emu.set_faults(start_500=True)
    reply = httpx.post(f"{shared.url}/v1/captures", json={"stages": [0]}, timeout=HTTP_TIMEOUT)
    with shared.client() as client:
        cap = client.get_capture(reply.json()["error"]["details"]["capture_id"])
    assert (reply.status_code, cap.state.value, codes(cap)[0], cap.stop_reason.value) == (
        502, "failed", "upstream_failed", "rollback")
    assert [c["stages"] for c in upstream_calls(emu, "/stop_profile")] == [[0]]  # the rollback
    assert recording(emu) == NONE_RECORDING


def test_stop_delayed(shared: ModuleSidecar) -> None:
    # the server takes its time to answer the stop: the capture stays `stopping`, the API keeps
    # answering meanwhile (the stop runs beside the event loop), then it completes
    emu = shared.emulator
    emu.set_faults(hang_stop=True)  # held until turned off: the look below cannot miss it, under load
    with shared.client() as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
        client.stop_capture(cap.id)
        # the stop is on the server and not answered yet
        assert poll(lambda: [c["status"] for c in upstream_calls(emu, "/stop_profile")] == [None])
        health = httpx.get(f"{shared.url}/healthz", timeout=HTTP_TIMEOUT).status_code
        during = client.get_capture(cap.id).state.value
        in_flight = [c["status"] for c in upstream_calls(emu, "/stop_profile")] == [None]
        emu.set_faults(hang_stop=False)  # now the server answers
        final = settled(client, cap.id)
    assert (health, during, in_flight) == (200, "stopping", True)
    assert (final.state.value, final.stop_reason.value, codes(final)) == ("completed", "explicit", [])
    assert recording(emu) == NONE_RECORDING


def test_stop_hangs(shared: ModuleSidecar) -> None:
    emu = shared.emulator
    emu.set_faults(hang_stop=True)  # only a reset releases the stop
    with shared.client() as client:
        cap = client.start_capture([0])
        traffic(emu)
        client.stop_capture(cap.id)
        assert poll(lambda: "upstream_timeout" in codes(client.get_capture(cap.id)), timeout=WAIT)
        held = client.get_capture(cap.id)
        again = httpx.post(f"{shared.url}/v1/captures", json={"stages": [0]}, timeout=HTTP_TIMEOUT)
        starts = len(upstream_calls(emu, "/start_profile"))
        emu.reset(profiler_dirs=trace_dirs(shared.deploy))  # the server answers at last
        final = settled(client, cap.id)
    # past the budget the server may still be writing this window: the slot stays taken, and the
    # reason says what to do
    assert (held.state.value, codes(held)[-1], held.verdicts[0].reason.startswith("stop timed out after")) == (
        "stopping", "upstream_timeout", True)
    assert "/stop_profile did not answer" in held.errors[-1].message
    error = again.json()["error"]
    assert (again.status_code, error["code"], error["details"].get("active_id"), starts) == (
        409, "capture_stop_pending", cap.id, 1)  # refused before it reached the server
    assert (final.state.value, final.stop_reason.value) == ("completed", "explicit")
    assert recording(emu) == NONE_RECORDING


def test_stop_500_leaves_the_stages_unconfirmed_and_the_next_start_stops_them_first(shared: ModuleSidecar) -> None:
    """A stop the server answers 500 may not have reached the workers (this fault reaches none):
    they record on. Before, the slot was freed, the next start went to stages still recording, and
    its trace, which held the failed capture's window, was called ok."""
    emu = shared.emulator
    emu.set_faults(stop_500=True)
    with shared.client() as client:
        first = client.start_capture([0])
        traffic(emu)
        failed = stopped(client, first.id)
        after_first = time.time()
        left = recording(emu)["0"]
        refused = httpx.post(f"{shared.url}/v1/captures", json={"stages": [0]}, timeout=HTTP_TIMEOUT)
        starts = len(upstream_calls(emu, "/start_profile"))
        emu.set_faults(stop_500=False)
        second = client.start_capture([0])
        traffic(emu)
        done = stopped(client, second.id)
        window = client.summary(second.id).window
    assert (failed.state.value, "stop_server_error" in codes(failed), [n.code for n in failed.facts].count(
        "stop_unconfirmed"), left) == ("degraded", True, 1, True)
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["details"]["stages"], error["details"]["after"], starts) == (
        409, "stop_unconfirmed", [0], first.id, 1), error  # the start never reached the server
    assert ({n.code: n.figures for n in done.facts}.get("stopped_first"), done.state.value,
            [v.verdict.value for v in done.verdicts]) == ({"stages": [0], "after": first.id}, "completed", ["ok"])
    # the trace ok'd is this capture's own window, not the failed one's
    assert window.end_epoch_us is not None and window.end_epoch_us - window.span_us >= after_first * 1e6, window
    assert recording(emu) == NONE_RECORDING


def test_dead_stage(shared: ModuleSidecar) -> None:
    # vLLM-Omni 0.30 swallows a dead worker's error: start and stop answer 200 SUCCESS
    emu = shared.emulator
    emu.set_faults(dead_stage=2)
    assert poll(lambda: not emulator_state(emu)["stages"]["2"]["alive"])
    reply = httpx.post(f"{shared.url}/v1/captures", json={"stages": [0, 2]}, timeout=HTTP_TIMEOUT)
    with shared.client() as client:
        traffic(emu)
        final = stopped(client, reply.json()["id"])
    verdicts = {v.stage_id: v.verdict.value for v in final.verdicts}
    assert (reply.status_code, final.state.value, final.stop_reason.value, verdicts) == (
        201, "degraded", "explicit", {0: "ok", 2: "missing"})
    assert "dead or restarted worker" in next(v.reason or "" for v in final.verdicts if v.stage_id == 2)
    assert recording(emu)["0"] is False


def test_worker_dies_after_start(shared: ModuleSidecar) -> None:
    emu = shared.emulator
    emu.set_faults(die_after_start=2)
    with shared.client() as client:
        cap = client.start_capture([0, 2])
        assert poll(lambda: not emulator_state(emu)["stages"]["2"]["alive"])
        traffic(emu)  # stage 0 works; stage 2's worker is gone
        final = stopped(client, cap.id)
    verdicts = {v.stage_id: v.verdict.value for v in final.verdicts}
    # the stop answers 200 (the dead worker's error is swallowed): no stop error, the stage is missing
    assert (final.state.value, verdicts, "stop_server_error" in codes(final)) == (
        "degraded", {0: "ok", 2: "missing"}, False)
    assert "worker most likely died or failed during the window" in next(
        v.reason or "" for v in final.verdicts if v.stage_id == 2)
    assert recording(emu)["0"] is False


# --- kill -9 of the sidecar in each live state --------------------------------------------------


def journaled(state_dir: Path, cid: str) -> str | None:
    """The capture's state in the journal, as the next start-up will read it (written off the
    request path, so it may trail the API by a moment)."""
    try:
        return json.loads((state_dir / "captures" / f"{cid}.json").read_text())["state"]
    except (OSError, ValueError, KeyError):
        return None


def _recovered(restart: Callable[[], Any], cid: str) -> tuple[Any, dict[str, Any]]:
    """The capture as the next sidecar on the same state dir ends it, and that sidecar's /healthz."""
    again = restart()
    with client_of(again) as client:
        return settled(client, cid), client.healthz()


# The module's sidecar is killed and its successor on the same state dir recovers the journal;
# later rows use the successor (one sidecar start per kill, not two).


def test_kill9_in_starting(shared: ModuleSidecar) -> None:
    # the journal as a kill -9 leaves it mid-start: `starting`, the start already delivered
    emu, sc = shared.emulator, shared.sidecar
    with shared.client() as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
    assert poll(lambda: journaled(sc.state_dir, cap.id) == "active")
    sc.kill()
    path = sc.state_dir / "captures" / f"{cap.id}.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "state": "starting", "started_at": None}))
    final, _ = _recovered(shared.restart, cap.id)
    assert (final.state.value, final.stop_reason.value) == ("completed", "stopped_on_recovery")
    assert recording(emu) == NONE_RECORDING


def test_kill9_in_active_and_a_bad_journal_entry_beside_it(shared: ModuleSidecar) -> None:
    emu, sc = shared.emulator, shared.sidecar
    with shared.client() as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
    assert poll(lambda: journaled(sc.state_dir, cap.id) == "active")
    sc.kill()
    still = recording(emu)
    # beside it, an entry the next start-up cannot load (a timestamp without timezone)
    journal = sc.state_dir / "captures"
    bad = journal / "20260101-000000-aaaaaa.json"
    good = json.loads((journal / f"{cap.id}.json").read_text())
    bad.write_text(json.dumps({**good, "id": bad.stem, "created_at": "2026-01-01T00:00:00"}))
    final, health = _recovered(shared.restart, cap.id)
    assert still == {"0": True, "1": False, "2": True}  # a kill -9 stops nothing
    assert (final.state.value, final.stop_reason.value) == ("completed", "stopped_on_recovery")
    # the bad entry is set aside and counted; the rest is recovered
    assert (health["journal"]["quarantined"], bad.with_name(bad.name + ".bad").exists(), bad.exists()) == (
        1, True, False)
    assert recording(emu) == NONE_RECORDING


def test_kill9_in_stopping(shared: ModuleSidecar) -> None:
    # the stop is on the server, unanswered, when the sidecar dies: the server holds its reply
    # until the knob is turned off (a delay could run out before the look, under load)
    emu, sc = shared.emulator, shared.sidecar
    emu.set_faults(hang_stop=True)
    with shared.client() as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
        client.stop_capture(cap.id)
    assert poll(lambda: journaled(sc.state_dir, cap.id) == "stopping")
    assert poll(lambda: [c["status"] for c in upstream_calls(emu, "/stop_profile")] == [None])
    in_flight = [c["status"] for c in upstream_calls(emu, "/stop_profile")] == [None]
    sc.kill()
    emu.set_faults(hang_stop=False)  # the held stop replies, to a sidecar that is gone
    final, _ = _recovered(shared.restart, cap.id)
    assert (in_flight, final.terminal, final.stop_reason.value) == (True, True, "stopped_on_recovery")
    assert final.state.value in ("completed", "degraded")
    assert recording(emu) == NONE_RECORDING


def test_kill9_in_collecting(stack: Any, tmp_path: Path) -> None:
    # the server answered the stop and is still gzipping its traces when the sidecar dies; a
    # gzip delay is a start-up option: an emulator (and so a sidecar pair) of its own
    emu, sc, restart = stack(emulator_args=["--gzip-delay", "4"])
    with client_of(sc) as client:
        cap = client.start_capture([0, 2])
        traffic(emu)
        client.stop_capture(cap.id)
    assert poll(lambda: journaled(tmp_path / "state", cap.id) == "collecting")
    sc.kill()
    final, _ = _recovered(restart, cap.id)
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
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True, timeout=30)


def test_full_disk_during_a_journal_write(
    deploy: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any], tmp_path: Path
) -> None:
    with _tiny_tmpfs(tmp_path / "tiny") as state:
        emu = shared_emulator_factory(deploy, extra_args=THREAD)
        sc = sidecar_factory(emu.url, deploy, state_dir=state, env=FAST, log_path=tmp_path / "sidecar.log")
        with client_of(sc) as client:
            cap = client.start_capture([0, 2])
            traffic(emu)
            with contextlib.suppress(OSError), open(state / "filler", "wb") as fh:  # the disk fills up
                while True:
                    fh.write(b"\0" * 4096)
                    fh.flush()
            final = stopped(client, cap.id)
            health = client.healthz()
        sc.stop(grace=15)
    # the capture goes on without its journal: the profiler is stopped, the loss is reported
    assert (final.state.value, health["journal"]["write_errors"] > 0) == ("completed", True)
    assert recording(emu) == NONE_RECORDING
