"""No fleet call leaves a replica recording, checked from the servers' side: a start answered after
the fleet's deadline (and started all the same), stops queued behind ``max_concurrency`` past the
budget, a server whose stop never answers, Ctrl-C to the process group of a fleet (a trainer's
``Fleet.capture``, the ``fleet capture`` CLI over real sidecar processes); and the one rule for
``ok`` and exit codes (traces not checked yet are never exit 0). Stub servers (tests/fixtures/stubs.py)
behave as the real ones do where the fleet relies on it: a sidecar lists a capture ``starting``
while its start is in flight and keeps a stop sent meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sidecar.client import SidecarClient
from sidecar.control.controller import ControlSettings
from sidecar.control.models import Capture, CaptureState
from sidecar.control.outcome import EXIT_UNCHECKED, Outcome, capture_outcome, outcome_of
from sidecar.errors import FleetError
from sidecar.fleet import Fleet, Target, TargetOutcome
from tests.fixtures.stubs import StubFleet, write_deploys
from tests.fixtures.terminal import ctrl_c_as_in_a_terminal

ROOT = Path(__file__).resolve().parents[1]
LIVE = ("starting", "active")
FAST = ControlSettings(collect_timeout_s=30, close_timeout_s=3, summarize=False)


def _until(ok: Callable[[], Any], what: str, within: float = 120.0) -> Any:
    """Poll ``ok`` until it is truthy (a ceiling for a broken build, not a measurement)."""
    deadline = time.monotonic() + within
    while not (got := ok()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return got


def _live_captures(stubs: StubFleet) -> dict[int, list[str]]:
    """Per sidecar stub, the captures it still has starting or active (a recording it was never stopped)."""
    return {i: [cid for cid, c in r["captures"].items() if c["state"] in LIVE] for i, r in stubs.log().items()}


def _unstopped(stubs: StubFleet) -> list[int]:
    """Upstream stubs that received a start and no stop after it."""
    out = []
    for i, r in stubs.log().items():
        paths = [p for m, p, _ in r["calls"] if p in ("/start_profile", "/stop_profile")]
        if paths and paths[-1] == "/start_profile" or r["recording"]:
            out.append(i)
    return out


# --- a start answered after the fleet's deadline, which starts all the same --------------------


async def test_a_sidecar_start_answered_after_the_deadline_is_found_by_the_sweep_and_stopped(tmp_path):
    with StubFleet(2, mode="sidecar", root=tmp_path, faults={1: "slow_start=3"}) as stubs:
        targets = [Target.sidecar(u) for u in stubs.urls]
        async with Fleet(targets, start_timeout_s=1, stop_budget_s=10, poll_s=0.05) as fleet:
            with pytest.raises(FleetError) as info:
                await fleet.start(label="late")
        late = next(t for t in info.value.details["targets"] if t["target"] == targets[1].name)
        # the late start was still in flight (starting) when the sweep found it by the fleet's key
        assert (late["outcome"], late["error"]["code"], len(late["sweep"]["stopped"])) == (
            "start_failed", "start_timeout", 1), late
        _until(lambda: all(c["state"] not in ("starting",) for c in stubs.log()[1]["captures"].values()),
               "the late start landed")
        log = stubs.log()
        assert _live_captures(stubs) == {0: [], 1: []} and not any(r["recording"] for r in log.values())
        (cap,) = log[1]["captures"].values()
        assert cap["label"].endswith(f"[fleet:{fleet.key}]") and cap["lease_s"] == fleet.lease_s


async def test_an_upstream_start_answered_after_the_deadline_is_stopped_once_it_landed(tmp_path):
    # driven in-process: the controller's start is let land (cut short, its rollback stop would
    # reach the server before the start did), and the sweep's stop is sent once it answered
    with StubFleet(2, mode="upstream", root=tmp_path, faults={1: "slow_start=3"}) as stubs:
        targets = [Target.upstream(u, d) for u, d in zip(stubs.urls, write_deploys(tmp_path, 2))]
        async with Fleet(targets, start_timeout_s=1, stop_budget_s=10) as fleet:
            with pytest.raises(FleetError) as info:
                await fleet.start()
        outcomes = {t["target"]: t["outcome"] for t in info.value.details["targets"]}
        assert outcomes == {targets[0].name: "rolled_back", targets[1].name: "start_failed"}
        _until(lambda: stubs.received("/start_profile", key="handled")[1], "the late start landed")
        calls = [p for _, p, _ in stubs.log()[1]["calls"] if p in ("/start_profile", "/stop_profile")]
        assert calls == ["/start_profile", "/stop_profile"] and _unstopped(stubs) == []


# --- stops: every one sent, only the wait bounded ------------------------------------------------


async def test_stops_queued_behind_max_concurrency_past_the_budget_are_still_sent(tmp_path):
    # one send at a time, and the first target's server never answers its stop: the budget runs
    # out while the others still wait their turn; each is sent all the same
    with StubFleet(4, mode="sidecar", root=tmp_path, faults={0: "hang_stop"}) as stubs:
        targets = [Target.sidecar(u) for u in stubs.urls]
        async with Fleet(targets, max_concurrency=1, stop_budget_s=1, poll_s=0.05) as fleet:
            fc = await fleet.stop(await fleet.start(), wait_artifacts=False)
        outcomes = [r.outcome for r in fc.targets.values()]
        stops = {i: [p for m, p, _ in r["calls"] if m == "POST" and p.endswith("/stop")] for i, r in stubs.log().items()}
        assert all(len(s) == 1 for s in stops.values()), stops
        assert outcomes[0] is TargetOutcome.stop_timeout and TargetOutcome.stop_not_sent not in outcomes
        assert _live_captures(stubs) == {0: [], 1: [], 2: [], 3: []}


async def test_a_server_whose_stop_never_answers_is_sent_it_and_the_fleet_returns_at_its_budget(tmp_path):
    with StubFleet(2, mode="upstream", root=tmp_path, faults={0: "hang_stop"}) as stubs:
        targets = [Target.upstream(u, d) for u, d in zip(stubs.urls, write_deploys(tmp_path, 2))]
        async with Fleet(targets, stop_budget_s=2, control_settings=FAST) as fleet:
            fc = await fleet.stop(await fleet.start())
            hung = fc.targets[targets[0].name]
            stops = stubs.received("/stop_profile")
        assert (hung.outcome, hung.error.code, hung.ok) == (TargetOutcome.stop_timeout, "stop_timeout", False)
        # the hung one was sent its stop (and again: its controller holds it until the server answers)
        assert fc.targets[targets[1].name].ok and len(stops[0]) >= 1 and len(stops[1]) == 1
        assert _unstopped(stubs) == [0]


async def test_a_stop_its_target_gave_up_on_before_the_fan_outs_deadline_is_a_stop_timeout(tmp_path):
    """The target's own stop budget (0.5 s) ends before the fan-out's (30 s): it holds the stop,
    `stopping` with upstream_timeout. That was reported `stopped` (and `stop_timeout` only when the
    fan-out's deadline came first: the verl group's Ray test, both budgets 3 s, went either way)."""
    from sidecar.config import load_deploy_config
    from sidecar.fleet._drivers import UpstreamDriver

    with StubFleet(2, mode="upstream", root=tmp_path, faults={0: "hang_stop"}) as stubs:
        targets = [Target.ray(u, flavor="omni") for u in stubs.urls]
        deploys = {t.name: load_deploy_config(d) for t, d in zip(targets, write_deploys(tmp_path, 2))}

        def drivers(target: Target, *, stop_budget_s: float) -> UpstreamDriver:
            return UpstreamDriver(target, deploys[target.name], stop_budget_s=0.5, settings=FAST, state_dir=None)

        async with Fleet(targets, stages=[0], drivers=drivers, stop_budget_s=30) as fleet:
            fc = await fleet.stop(await fleet.start(), wait_artifacts=False)
            hung, other = (fc.targets[t.name] for t in targets)
            stubs.reset(faults={})  # the held stop is answered now: the fleet closes
    assert (hung.outcome, hung.error.code, hung.ok, other.outcome) == (
        TargetOutcome.stop_timeout, "stop_timeout", False, TargetOutcome.stopped)


async def test_a_dead_target_whose_stop_cannot_be_sent_names_its_lease(tmp_path):
    with StubFleet(2, mode="sidecar", root=tmp_path, faults={1: "die_after_start"}) as stubs:
        async with Fleet([Target.sidecar(u) for u in stubs.urls], stop_budget_s=5, lease_s=30) as fleet:
            fc = await fleet.stop(await fleet.start())
    dead = list(fc.targets.values())[1]
    assert dead.outcome is TargetOutcome.stop_not_sent and "at most 30s after" in dead.error.message


# --- the fleet's windows: leases renewed while held, the hosts end them -------------------------------


async def test_a_held_window_is_renewed_and_a_dropped_one_ends_by_its_lease(tmp_path):
    with StubFleet(1, mode="sidecar", root=tmp_path) as stubs:
        async with Fleet([Target.sidecar(u) for u in stubs.urls], lease_s=1) as fleet:
            await fleet.start()
            beats = lambda: [p for _, p, _ in stubs.log()[0]["calls"] if p.endswith("/heartbeat")]  # noqa: E731
            await asyncio.to_thread(_until, lambda: len(beats()) >= 3, "three renewals")
            assert _live_captures(stubs)[0]  # renewed past three leases: still recording
            await fleet.close(keep_live=True)  # held no more: the lease runs out on the stub's clock
            await asyncio.to_thread(_until, lambda: not _live_captures(stubs)[0], "the lease ended it")
        (cap,) = stubs.log()[0]["captures"].values()
        assert cap["stop_reason"] == "lease_expired"


async def test_each_sidecar_ends_its_own_window_at_its_duration(tmp_path):
    with StubFleet(3, mode="sidecar", root=tmp_path) as stubs:
        async with Fleet([Target.sidecar(u) for u in stubs.urls], poll_s=0.05) as fleet:
            fc = await fleet.capture(0.5, start_at=time.time() + 1)
        caps = [c for r in stubs.log().values() for c in r["captures"].values()]
    assert fc.ok
    assert [c["stop_reason"] for c in caps] == ["duration"] * 3  # ended where it ran, not by the fleet's stop


# --- Ctrl-C to the process group of a fleet ----------------------------------------------------------

TRAINER = """
import asyncio, faulthandler, inspect, json, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks of a trainer that hangs
from sidecar.fleet import Fleet, Target
spec = json.loads(sys.argv[1])
targets = [Target.upstream(u, d) for u, d in zip(spec["urls"], spec["deploys"])]
# where the build drives targets from worker processes, as it did from 512 targets on
opts = {"processes": 2} if "processes" in inspect.signature(Fleet).parameters else {}

async def main():
    async with Fleet(targets, stop_budget_s=30, **opts) as fleet:
        await fleet.capture(3600)

asyncio.run(main())
"""


def _sigint_group(proc: subprocess.Popen[str]) -> str:
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: every process of the group
    try:
        return proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired as exc:
        # Say where it hung: a trainer still running dumps its threads' stacks; one that exited left
        # its output pipe open in another process, which the process list shows.
        alive = proc.poll() is None
        if alive:
            proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(2)
        with contextlib.suppress(ProcessLookupError):  # a trainer that exited may have left its group empty
            os.killpg(proc.pid, signal.SIGKILL)
        partial = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
        out = proc.communicate(timeout=30)[0] if alive else partial
        ps = subprocess.run(["ps", "-eo", "pid,ppid,pgid,sid,stat,etime,args"], capture_output=True, text=True).stdout
        procs = "\n".join(ln for ln in ps.splitlines() if "python" in ln or "PID" in ln)
        raise AssertionError(f"120 s after Ctrl-C the trainer {'still ran' if alive else 'had ended, its output held open'}"
                             f"\n--- its output ---\n{out[-20000:]}\n--- processes ---\n{procs[-8000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_SIDECAR_")}
    return {**env, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def test_ctrl_c_to_the_process_group_of_a_trainers_fleet_stops_every_upstream_target(tmp_path):
    with StubFleet(2, mode="upstream", root=tmp_path) as stubs:
        spec = {"urls": stubs.urls, "deploys": [str(d) for d in write_deploys(tmp_path, 2)]}
        proc = subprocess.Popen([sys.executable, "-c", TRAINER, json.dumps(spec)], cwd=ROOT, env=_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=ctrl_c_as_in_a_terminal)
        _until(lambda: all(r["recording"] for r in stubs.log().values()) or proc.poll() is not None, "both recording")
        out = _sigint_group(proc)
        assert _unstopped(stubs) == [], out
        assert all(len(ts) == 1 for ts in stubs.received("/stop_profile").values()), out


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_of_fleet_capture_stops_every_sidecar(replica_factory, sidecar_factory, tmp_path):
    replicas = replica_factory(2, stages=(0, 1))
    sidecars = [sidecar_factory(r.url, r.deploy) for r in replicas]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "fleet", "capture", "--targets", ",".join(s.url for s in sidecars),
         "--stages", "0", "--state-dir", str(tmp_path / "st"), "--json"],
        cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=ctrl_c_as_in_a_terminal)
    clients = [SidecarClient(s.url, timeout=30) for s in sidecars]
    try:
        _until(lambda: all(any(c.state is CaptureState.active for c in cl.list_captures()) for cl in clients)
               or proc.poll() is not None, "both sidecars recording")
        for r in replicas:
            r.generate()  # the window records work
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=180)
        caps = [cl.list_captures()[0] for cl in clients]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for cl in clients:
            cl.close()
    result = json.loads(out)
    assert [c.stop_reason.value if c.stop_reason else None for c in caps] == ["explicit", "explicit"], err
    assert all(c.state is not CaptureState.active and c.state is not CaptureState.starting for c in caps)
    assert [r.profiling() for r in replicas] == [{0: False, 1: False}] * 2
    assert (proc.returncode, result["ok"], result["outcome"]) == (0, True, "ok"), err


@pytest.mark.slow
def test_fleet_capture_stops_a_sidecars_start_that_lands_after_the_deadline(replica_factory, sidecar_factory,
                                                                            tmp_path):
    replicas = replica_factory(2, stages=(0, 1))
    sidecars = [sidecar_factory(r.url, r.deploy) for r in replicas]
    replicas[1].emulator.set_faults(start_delay_s=4.0)  # the server answers its start in 4 s
    try:
        ran = subprocess.run(
            [sys.executable, "-m", "sidecar", "fleet", "capture", "--targets", ",".join(s.url for s in sidecars),
             "--stages", "0", "--start-timeout", "1", "--duration", "1", "--state-dir", str(tmp_path / "st")],
            cwd=ROOT, env=_env(), text=True, capture_output=True, timeout=180)
        with SidecarClient(sidecars[1].url, timeout=30) as late:
            cap = _until(lambda: next((c for c in late.list_captures() if c.state is not CaptureState.starting), None),
                         "the late start landed")
            cap = late.wait_capture(cap.id, timeout=120)
    finally:
        replicas[1].emulator.set_faults(start_delay_s=0.0)
    assert ran.returncode == 1 and "start_timeout" in ran.stdout + ran.stderr, ran.stdout + ran.stderr
    assert cap.terminal and cap.stop_reason is not None and cap.stop_reason.value == "explicit", cap
    assert [r.profiling() for r in replicas] == [{0: False, 1: False}] * 2


# --- one rule for ok and exit codes ------------------------------------------------------------------


@pytest.mark.parametrize(("state", "kind", "verdicts", "outcome"), [
    ("completed", "torch", ["ok"], Outcome.ok),
    ("degraded", "nsys", ["unverified"], Outcome.ok),      # nsys writes the report itself
    ("degraded", "nsys", ["unverified", "missing"], Outcome.failed),
    ("degraded", "torch", ["unverified"], Outcome.failed),
    ("collecting", "torch", [None], Outcome.unchecked),     # stopped, its traces not checked yet
    ("stopping", "torch", ["ok"], Outcome.unchecked),       # held stopping: the server never answered
    ("failed", "torch", [], Outcome.failed),
])
def test_a_capture_is_ok_only_once_its_traces_were_checked(state, kind, verdicts, outcome):
    from datetime import datetime, timezone

    from sidecar.control.models import StageVerdict

    cap = Capture(id="20261201-000000-abcdef", upstream="http://127.0.0.1:8091", stages=list(range(len(verdicts))),
                  kind=kind, state=state, created_at=datetime.now(timezone.utc),
                  verdicts=[StageVerdict(stage_id=i, verdict=v) for i, v in enumerate(verdicts)])
    assert capture_outcome(state, kind, verdicts) is outcome and outcome_of(cap) is outcome
    assert json.loads(cap.model_dump_json())["outcome"] == outcome.value  # what the API and the web page serve


def test_fleet_capture_whose_traces_are_not_checked_yet_never_exits_0(tmp_path):
    # the server's check takes 60 s and the caller waits 1 s: not ok, not failed, exit 3
    with StubFleet(2, mode="sidecar", root=tmp_path, faults={1: "slow_check=60"}) as stubs:
        ran = subprocess.run(
            [sys.executable, "-m", "sidecar", "fleet", "capture", "--targets", ",".join(stubs.urls), "--duration",
             "0.5", "--timeout", "1", "--state-dir", str(tmp_path / "st"), "--json"],
            cwd=ROOT, env=_env(), text=True, capture_output=True, timeout=120)
    result = json.loads(ran.stdout)
    states = [t["state"] for t in result["targets"]]
    assert (ran.returncode, result["ok"], result["outcome"], states) == (
        EXIT_UNCHECKED, False, "unchecked", ["completed", "collecting"]), ran.stderr


@pytest.mark.parametrize(("opts", "code"), [
    ({"key": "two words"}, "fleet_key_invalid"),
    ({"key": ""}, "fleet_key_invalid"),
    ({"key": "x" * 65}, "fleet_key_invalid"),
    ({"lease_s": 0}, "budget_invalid"),
    ({"max_concurrency": 0}, "concurrency_invalid"),
])
def test_a_bad_key_lease_or_concurrency_is_refused_before_anything_is_sent(opts, code):
    from sidecar.errors import FleetInvalid

    with pytest.raises(FleetInvalid) as info:
        Fleet([Target.sidecar("http://127.0.0.1:9")], **opts)
    assert info.value.code == code


def test_a_label_carries_the_fleet_key_within_the_apis_bound():
    from sidecar.fleet._leases import LABEL_MAX, key_of, keyed_label

    long = keyed_label("x" * 500, "k3y")
    assert (keyed_label(None, "k3y"), keyed_label("step3", "k3y")) == ("[fleet:k3y]", "step3 [fleet:k3y]")
    assert len(long) <= LABEL_MAX and key_of(long) == "k3y" and key_of("step3") is None
