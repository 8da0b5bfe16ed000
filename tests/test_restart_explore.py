"""A sidecar that dies (kill -9) or is stopped (SIGTERM) at each moment of a capture's life, then
restarted on the same state dir over the same emulator: the capture's end is truthful and nothing
is left recording upstream (the emulator's ``GET /emulator/state``).

The exploratory pass covered: kill -9 while a start is in flight (its reply held), while a
``delay_steps`` start waits for engine steps, while a ``start_at`` start waits for its time, in
``active`` (a lease, a counted ``steps`` window), ``stopping`` (the stop unanswered; a failed
start's rollback unanswered), ``collecting``; SIGTERM while a delayed start waits, while a start is
in flight and while a stop flushes; two sidecars on one state dir; a journal edited by hand (cut
off, an unknown state, unknown keys, a stray temp file); a restart against a server that is down.
The rows already covered elsewhere (tests/test_faults.py's kill -9 matrix, tests/test_races_process.py,
tests/test_serve_explore_signals.py, tests/test_journal.py's lock) are not repeated; the tests here
are the defects the pass found:

- a scheduled start killed before its time was recovered ``degraded`` (its stages "unverified" or
  "missing", blaming a dead worker), though nothing had been sent: now ``failed``,
  ``start_cancelled``, with no call to the server;
- a delayed start killed while it waited for engine steps, likewise: now ``failed``,
  ``start_interrupted``, saying the start most likely never reached the server;
- a failed start killed while its rollback stop was unanswered was recovered as a capture of its
  own (``stopped_on_recovery``, its traces checked as a window's: ``degraded``, ``completed`` had
  work run meanwhile): now it stays ``failed`` (``rollback``), as it ends without the kill;
- SIGTERM while a stop flushes waited in silence: now the log says what the exit waits for, and
  for how long at most.
- a kill -9 during a journal write left its temp file in the state dir for good (one per crash):
  the next sidecar on the dir now removes what the writer leaves, and nothing else.

Every wait is a poll or a request with a timeout, never a fixed sleep.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sidecar.client import SidecarClient
from sidecar.errors import SidecarError
from tests.fixtures.emulator import emulator_state, make_deploy
from tests.fixtures.sidecar import start_in_background
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow

STAGES = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}
THREAD = ["--workers", "thread"]  # trace contents do not matter here: thread workers start in ~1 s
FAST = {
    "OMNI_SIDECAR_COLLECT_TIMEOUT_S": "8",
    "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "20",
    "OMNI_SIDECAR_STOP_BUDGET_S": "4",
    "OMNI_SIDECAR_STOP_TIMEOUT_S": "2",
}
NONE_RECORDING = {"0": False, "1": False, "2": False}
HTTP_TIMEOUT = 120
WAIT = 90


@pytest.fixture
def stack(tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]) -> Any:
    """``stack(env={...})`` → (emulator, sidecar, restart): the pooled emulator and a sidecar whose
    ``restart()`` starts another on the same state dir (each with its own log)."""

    def make(env: dict[str, str] | None = None) -> tuple[Any, Any, Callable[[], Any]]:
        deploy = make_deploy(tmp_path, STAGES)
        emu = shared_emulator_factory(deploy, extra_args=THREAD)
        logs = iter(range(100))

        def restart() -> Any:
            return sidecar_factory(emu.url, deploy, state_dir=tmp_path / "state", env={**FAST, **(env or {})},
                                   log_path=tmp_path / f"sidecar-{next(logs)}.log")

        return emu, restart(), restart

    return make


def client_of(sc: Any) -> SidecarClient:
    return SidecarClient(sc.url, timeout=HTTP_TIMEOUT)


def journaled(sc: Any, cid: str) -> dict[str, Any] | None:
    """The capture as its journal file holds it now (written off the request path)."""
    try:
        return json.loads((Path(sc.state_dir) / "captures" / f"{cid}.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def recording(emu: Any) -> dict[str, bool]:
    return {sid: st["profiling"] for sid, st in emulator_state(emu)["stages"].items()}


def profile_calls(emu: Any) -> list[tuple[str, Any]]:
    return [(c["path"], c["status"]) for c in emulator_state(emu)["calls"]
            if c["method"] == "POST" and c["path"] in ("/start_profile", "/stop_profile")]


def traffic(emu: Any) -> None:
    emu.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def ended(cap: Any) -> tuple[str, str | None, list[str]]:
    return cap.state.value, cap.stop_reason.value if cap.stop_reason else None, [e.code for e in cap.errors]


def starting_id(sc: Any) -> str | None:
    """The id of the capture a start request in flight made, once it is journaled ``starting``."""
    with client_of(sc) as client:
        caps = [c for c in client.list_captures() if c.state.value == "starting"]
    return caps[0].id if caps and (journaled(sc, caps[0].id) or {}).get("state") == "starting" else None


def test_a_scheduled_start_killed_before_its_time_ends_failed_with_nothing_sent(stack: Any) -> None:
    emu, sc, restart = stack()
    with client_of(sc) as client:
        cid = client.start_capture([0, 2], start_at=time.time() + 60).id
    assert poll(lambda: (journaled(sc, cid) or {}).get("state") == "starting")
    sc.kill()
    again = restart()
    with client_of(again) as client:
        final = client.wait_capture(cid, timeout=WAIT, poll_s=0.1)
        # the slot is free, and the next start records its own window
        nxt = client.start_capture([0, 2])
        traffic(emu)
        client.stop_capture(nxt.id)
        after = client.wait_capture(nxt.id, timeout=WAIT, poll_s=0.1)
    assert ended(final) == ("failed", "stopped_on_recovery", ["start_cancelled"]), final.errors
    assert "nothing was sent to the server" in final.errors[0].message
    assert final.verdicts == []  # no stage is blamed for a start that never went out
    assert profile_calls(emu) == [("/start_profile", 200), ("/stop_profile", 200)]  # the next capture's only
    assert (after.state.value, recording(emu)) == ("completed", NONE_RECORDING)


def test_a_delayed_start_killed_while_waiting_for_engine_steps_ends_failed_saying_so(stack: Any) -> None:
    # the server is idle: the start waits for 50 engine steps that never come
    emu, sc, restart = stack()
    start_in_background(sc.url, timeout=HTTP_TIMEOUT, stages=[0, 2], delay_steps=50)
    assert poll(lambda: starting_id(sc) is not None)
    cid = starting_id(sc)
    assert cid is not None
    sc.kill()
    again = restart()
    with client_of(again) as client:
        final = client.wait_capture(cid, timeout=WAIT, poll_s=0.1)
        nxt = client.start_capture([0, 2], duration_s=1)
        traffic(emu)
        after = client.wait_capture(nxt.id, timeout=WAIT, poll_s=0.1)
    assert ended(final) == ("failed", "stopped_on_recovery", ["start_interrupted"]), [(v.verdict, v.reason) for v in final.verdicts]
    assert "waiting for the server to run 50 engine steps" in final.errors[0].message
    assert [c for c in profile_calls(emu) if c[0] == "/start_profile"] == [("/start_profile", 200)]  # the next one's
    assert (after.state.value, recording(emu)) == ("completed", NONE_RECORDING)


def test_a_failed_start_killed_during_its_rollback_stays_failed(stack: Any) -> None:
    # The start is held past the sidecar's start timeout (the server records meanwhile): a failed,
    # ambiguous start, rolled back with a stop the server never answers. The sidecar dies then.
    emu, sc, restart = stack(env={"OMNI_SIDECAR_START_TIMEOUT_S": "1"})
    emu.set_faults(start_delay_s=4, hang_stop=True)
    with client_of(sc) as client:
        with pytest.raises(SidecarError) as refused:
            client.start_capture([0, 2])
    cid = refused.value.details["capture_id"]
    assert poll(lambda: (journaled(sc, cid) or {}).get("stop_reason") == "rollback")
    assert poll(lambda: ("/stop_profile", None) in profile_calls(emu))  # the rollback's stop, unanswered
    sc.kill()
    emu.set_faults(start_delay_s=0, hang_stop=False)  # the held replies go to a sidecar that is gone
    again = restart()
    with client_of(again) as client:
        final = client.wait_capture(cid, timeout=WAIT, poll_s=0.1)
    # its start failed: recovering its rollback does not turn it into a window of its own
    assert ended(final)[:2] == ("failed", "rollback"), (final.state, final.errors, final.verdicts)
    assert "upstream_timeout" in ended(final)[2]
    assert recording(emu) == NONE_RECORDING


def test_sigterm_while_a_stop_flushes_says_in_the_log_what_the_exit_waits_for(stack: Any) -> None:
    emu, sc, _ = stack(env={"OMNI_SIDECAR_STOP_TIMEOUT_S": "15", "OMNI_SIDECAR_STOP_BUDGET_S": "15"})
    emu.set_faults(stop_delay_s=3)  # the server flushes its traces for 3 s before it answers the stop
    with client_of(sc) as client:
        cid = client.start_capture([0, 2]).id
        traffic(emu)
        client.stop_capture(cid)
    assert poll(lambda: ("/stop_profile", None) in profile_calls(emu))  # the stop is on the server
    sc.stop(grace=60)  # SIGTERM, and the exit
    log = sc.log_path.read_text()
    assert f"shutdown: waiting up to 20s for the stop of capture {cid}" in log, log[-2000:]
    # bounded and kept: the stop ended within the bound, the capture is journaled whole
    assert ((journaled(sc, cid) or {}).get("state"), recording(emu)) == ("completed", NONE_RECORDING)


def test_a_restart_removes_the_temp_files_a_write_killed_midway_left_and_nothing_else(stack: Any) -> None:
    # What kill -9 during an atomic write leaves: the writer's temp file (mkstemp's
    # ".<name>.XXXXXXXX.tmp") and the writability probe, beside the records; a file of the user's
    # that only looks alike is kept, and so is every record.
    emu, sc, restart = stack()
    with client_of(sc) as client:
        cid = client.start_capture([0, 2]).id
        traffic(emu)
        client.stop_capture(cid)
        client.wait_capture(cid, timeout=WAIT, poll_s=0.1)
    sc.kill()
    captures = Path(sc.state_dir) / "captures"
    left = [captures / f".{cid}.json.k3x_9q2a.tmp", captures / ".probe-4242"]
    kept = [captures / "notes.tmp", captures / f".{cid}.json.tmp", captures / ".probe-me"]
    for p in left + kept:
        p.write_text('{"id": "cut off')
    again = restart()
    assert [p.name for p in left if p.exists()] == []
    assert [p.name for p in kept if not p.exists()] == []
    with client_of(again) as client:
        assert client.get_capture(cid).state.value == "completed"
    log = again.log_path.read_text()
    assert "removed 2 temp files left by a sidecar that died mid-write" in log, log[-2000:]


def test_the_log_says_each_capture_start_and_end_once_formatted_recovered_ones_too(stack: Any) -> None:
    # An operator reads serve's log: the sidecar's own lines went out bare (no level) or not at all
    # (info), and a capture's end left no line; a recovered one had two that disagreed.
    emu, sc, restart = stack()
    with client_of(sc) as client:
        done = client.start_capture([0, 2], label="warm-up").id
        traffic(emu)
        client.stop_capture(done)
        assert client.wait_capture(done, timeout=WAIT, poll_s=0.1).state.value == "completed"
        left = client.start_capture([0, 2]).id
    assert poll(lambda: f"capture {done} (warm-up) completed (stop: explicit)" in sc.log_path.read_text())
    sc.kill()
    again = restart()
    with client_of(again) as client:
        final = client.wait_capture(left, timeout=WAIT, poll_s=0.1)
    first, second = sc.log_path.read_text(), again.log_path.read_text()
    assert f"INFO:     capture {done} (warm-up) started: stages 0, 2" in first, first[-3000:]
    assert f"INFO:     capture {left} started: stages 0, 2" in first
    assert poll(lambda: f"capture {left} {final.state.value} (stop: stopped_on_recovery)" in again.log_path.read_text())
    second = again.log_path.read_text()
    ends = [ln for ln in second.splitlines() if f"capture {left} {final.state.value}" in ln]
    assert len(ends) == 1 and ends[0].startswith("WARNING:" if final.state.value != "completed" else "INFO:"), second[-3000:]
    assert "was left active by a previous run" not in second
    assert "WARNING:  recovering captures left live by a previous run: " + left in second  # the controller's, formatted
    assert done not in second  # history loaded at start-up is not logged again


def test_the_log_level_has_its_environment_twin(stack: Any) -> None:
    # every other flag has one (docs/api.md); OMNI_SIDECAR_LOG_LEVEL=warning printed the INFO lines
    emu, sc, _ = stack(env={"OMNI_SIDECAR_LOG_LEVEL": "warning"})
    with client_of(sc) as client:
        cid = client.start_capture([0, 2]).id
        client.stop_capture(cid)
        client.wait_capture(cid, timeout=WAIT, poll_s=0.1)
    log = sc.log_path.read_text()
    assert "INFO:" not in log and "omni-sidecar: upstream" in log, log[-2000:]
