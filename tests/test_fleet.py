"""Fleet fan-out: per-target results over both target kinds (emulators and a real sidecar);
all-or-nothing start, per-target stop budgets and the CLI over in-process fake upstreams (real
sockets and session folders: the in-process controller's paths; sidecar targets at scale are in
test_fleet_scale.py); input refused before anything is sent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sidecar.cli import app
from sidecar.control.controller import ControlSettings
from sidecar.control.models import CaptureState, Verdict
from sidecar.errors import FleetError, FleetInvalid
from sidecar.fleet import Fleet, Target, TargetKind, TargetOutcome, parse_targets
from tests.fixtures.emulator import make_deploy

FAST = ControlSettings(collect_timeout_s=30, close_timeout_s=3, summarize=False)


@pytest.mark.slow
async def test_sidecar_and_upstream_targets_report_capture_verdicts_and_folders(replica_factory, sidecar_factory):
    a, b = replica_factory(2)
    side = await asyncio.to_thread(sidecar_factory, a.url, a.deploy)
    targets = [Target.sidecar(side.url), Target.upstream(b.url, b.deploy)]
    async with Fleet(targets, stages=[1], control_settings=FAST) as fleet:
        fc = await fleet.start(label="both")
        await asyncio.to_thread(a.generate)
        await asyncio.to_thread(b.generate)
        fc = await fleet.stop(fc)
    assert fc.ok
    for replica, target in ((a, targets[0]), (b, targets[1])):
        res = fc.targets[target.name]
        assert res.capture_id and res.state is CaptureState.completed and res.stages == [1]
        assert [(v.stage_id, v.verdict) for v in res.verdicts] == [(1, Verdict.ok)]
        assert res.folders == [str(p) for p in replica.sessions(1)] and replica.sessions(0) == []


async def test_a_refused_start_stops_the_started_targets_and_lists_every_outcome(fake_replica_factory):
    good, bad = fake_replica_factory(2)
    bad.fake.start_status = 500
    targets = [Target.upstream(good.url, good.deploy), Target.upstream(bad.url, bad.deploy)]
    async with Fleet(targets, control_settings=FAST) as fleet:
        with pytest.raises(FleetError) as info:
            await fleet.start()
    outcomes = {t["target"]: t["outcome"] for t in info.value.details["targets"]}
    assert outcomes == {targets[0].name: "rolled_back", targets[1].name: "start_failed"}
    assert not any(good.profiling().values()) and len(good.calls("/stop_profile")) == 1


async def test_each_target_stops_within_its_own_budget(fake_replica_factory):
    hung, fine = fake_replica_factory(2, stages=(0,))
    hung.fake.stop_delay = 3600  # the stop is held: this upstream does not answer
    targets = [Target.upstream(hung.url, hung.deploy), Target.upstream(fine.url, fine.deploy)]
    async with Fleet(targets, control_settings=FAST, stop_budget_s=3) as fleet:
        fc = await fleet.stop(await fleet.start())
        hung.fake.stop_delay = 0  # the held stop answers now: the fleet closes at once
    assert fc.targets[targets[0].name].outcome is TargetOutcome.stop_timeout
    ok = fc.targets[targets[1].name]
    assert ok.outcome is TargetOutcome.stopped and ok.state is CaptureState.completed


def test_cli_capture_prints_each_targets_folders(fake_replica_factory, tmp_path):
    (r,) = fake_replica_factory(1, stages=(0,))
    out = CliRunner().invoke(app, ["fleet", "capture", "--targets", f"upstream={r.url}", "--deploy-config",
                                   str(r.deploy), "--state-dir", str(tmp_path / "st"), "--duration", "0.2", "--json"])
    assert out.exit_code == 0, out.output
    (target,) = json.loads(out.output)["targets"]
    assert target["state"] == "completed" and target["folders"] == [str(p) for p in r.sessions(0)] != []


def test_cli_split_start_stop_across_invocations(fake_replica_factory, tmp_path):
    (r,) = fake_replica_factory(1, stages=(0,))
    runner = CliRunner()
    common = ["--targets", f"upstream={r.url}", "--deploy-config", str(r.deploy), "--state-dir", str(tmp_path / "st")]
    started = runner.invoke(app, ["fleet", "start", *common, "--json"])
    assert started.exit_code == 0, started.output
    assert r.profiling() == {0: True}  # left running for `fleet stop`, journaled in --state-dir
    stopped = runner.invoke(app, ["fleet", "stop", *common, "--json"])
    assert stopped.exit_code == 0, stopped.output
    assert r.profiling() == {0: False} and len(r.calls("/stop_profile")) == 1
    (target,) = json.loads(stopped.output)["targets"]
    assert target["state"] == "completed" and target["folders"] == [str(p) for p in r.sessions(0)] != []



async def test_a_split_stop_finds_the_capture_its_recovery_already_stopped(fake_replica_factory, tmp_path):
    # `fleet stop` opens the journal `fleet start` left; opening it stops the live capture (recovery)
    # in the background. When that stop is over before the fleet reads the live capture (a loaded
    # run did this: "no live capture on this target"), it is still the capture the user stops.
    (r,) = fake_replica_factory(1, stages=(0,))
    targets = [Target.upstream(r.url, r.deploy)]
    fleet = Fleet(targets, control_settings=FAST, state_dir=tmp_path / "st")
    await fleet.open()
    started = await fleet.start()
    await fleet.close(keep_live=True)
    (cid,) = [t.capture_id for t in started.targets.values()]
    async with Fleet(targets, control_settings=FAST, state_dir=tmp_path / "st") as again:
        (driver,) = again._drivers.values()
        await driver.controller.wait(cid, timeout=30)  # the recovery's stop is over
        fc = await again.stop(await again.live())
    (res,) = fc.targets.values()
    assert (res.outcome, res.capture_id, res.state) == (TargetOutcome.stopped, cid, CaptureState.completed)
    assert len(r.calls("/stop_profile")) == 1 and res.folders == [str(p) for p in r.sessions(0)] != []

async def test_captures_left_live_by_a_closed_fleet_stay_live_until_a_later_fleet_stops_them(
    fake_replica_factory, tmp_path
):
    # `fleet start`: closing with keep_live leaves each capture recording (no sweep), journaled for
    # `fleet stop`
    replicas = fake_replica_factory(2, stages=(0,))
    targets = [Target.upstream(r.url, r.deploy) for r in replicas]
    async with Fleet(targets, control_settings=FAST, state_dir=tmp_path / "st") as fleet:
        started = await fleet.start(lease_s=None)
        await fleet.close(keep_live=True)
    assert [r.profiling() for r in replicas] == [{0: True}, {0: True}]
    async with Fleet(targets, control_settings=FAST, state_dir=tmp_path / "st") as again:
        fc = await again.stop(await again.live(), wait_artifacts=True)
    assert {t.capture_id for t in fc.targets.values()} == {t.capture_id for t in started.targets.values()}
    assert all(t.outcome is TargetOutcome.stopped for t in fc.targets.values()), fc.targets
    assert [r.profiling() for r in replicas] == [{0: False}, {0: False}]


# --- input refused before anything is sent -----------------------------------------------


def test_target_strings_name_their_kind():
    side, up, bare = parse_targets(
        ["sidecar=http://h1:8092/", "upstream=http://h2:8091", "http://h3:8092"], deploy_config="d.yaml"
    )
    assert (side.kind, side.url) == (TargetKind.sidecar, "http://h1:8092")
    assert (up.kind, up.deploy_config) == (TargetKind.upstream, Path("d.yaml"))
    assert bare.kind is TargetKind.sidecar


@pytest.mark.parametrize(
    ("targets", "code"),
    [
        ([], "targets_empty"),
        ("", "targets_empty"),
        (["sidecar=http://localhost:8092", "http://127.0.0.1:8092/"], "target_duplicate"),
        (["replica=http://h:1"], "target_invalid"),
        (["sidecar=h:8092"], "target_invalid"),
        (["upstream=http://h:8091"], "target_invalid"),  # no deploy YAML
        ([42], "target_invalid"),
    ],
)
def test_bad_target_lists_are_refused(targets, code):
    with pytest.raises(FleetInvalid) as info:
        Fleet(targets)
    assert info.value.code == code


def test_plain_vllm_targets_cannot_share_a_stage_list(tmp_path):
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    targets = [Target.upstream("http://h1:1", deploy), Target.upstream("http://h2:1", deploy, flavor="vllm")]
    with pytest.raises(FleetInvalid) as info:
        Fleet(targets, stages=[0])
    assert info.value.code == "flavors_mixed"


def test_a_stage_list_one_upstream_cannot_take_is_refused(tmp_path):
    two = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: {"profiler": "torch"}}, name="two.yaml")
    one = make_deploy(tmp_path, {0: {"profiler": "torch"}}, name="one.yaml")
    with pytest.raises(FleetInvalid) as info:
        Fleet([Target.upstream("http://h1:1", two), Target.upstream("http://h2:1", one)], stages=[0, 1])
    assert info.value.code == "stages_not_shared"
    assert list(info.value.details["targets"]) == ["upstream=http://h2:1"]


def test_cli_nsys_capture_whose_stages_are_unverified_exits_0_and_says_why(tmp_path):
    # nsys writes its report itself: `unverified` is what an nsys capture ends with (as `capture`)
    from sidecar.config.deploy import load_deploy_config
    from tests.fixtures.control import FakeOmni

    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: {"profiler": "cuda"}})
    with FakeOmni(load_deploy_config(deploy)) as fake:
        common = ["fleet", "capture", "--targets", f"upstream={fake.url}", "--deploy-config", str(deploy),
                  "--state-dir", str(tmp_path / "st"), "--duration", "0.2"]
        nsys = CliRunner().invoke(app, [*common, "--kind", "nsys"])
    said = " ".join(nsys.output.split())
    assert (nsys.exit_code, "unverified" in said, "exit 0" in said) == (0, True, True), nsys.output
    assert [c["path"] for c in fake.calls] == ["/start_profile", "/stop_profile"]  # one window, stopped


def test_a_capture_crosses_from_a_ray_node_as_its_json_unchanged() -> None:
    """Ray node actors answer with a capture's JSON (sidecar/fleet/_wire.py): what the fleet reads
    back equals what the controller had, odd file names, verdicts and clocks included."""
    from datetime import datetime, timezone

    from sidecar.control.models import (ArtifactFile, Capture, CaptureState, ClockRecord, ErrorRecord,
                                        SessionFolder, StageVerdict, Verdict)
    from sidecar.fleet._wire import answer, raise_reply

    now = datetime.now(timezone.utc)
    cap = Capture(
        id="20261203-1", upstream="http://127.0.0.1:1", stages=[0, 2], state=CaptureState.degraded, steps=20,
        steps_counted=21, created_at=now, stopped_at=now, notes=["stage 0: the trace holds 21 engine steps"],
        errors=[ErrorRecord(code="stop_server_error", message="boom", at=now)],
        clocks=[ClockRecord(phase="stop", offset_ns=-1_200_000_000, error_ns=300_000, at_ns=1)],
        verdicts=[StageVerdict(stage_id=0, verdict=Verdict.ok, steps_traced=21, sessions=[SessionFolder(
            path="/t/s0", files=[ArtifactFile(name="trace_\udcff.json.gz", size=3, inode=7)])]),
                  StageVerdict(stage_id=2, verdict=Verdict.missing, reason="no trace")])
    status, data = answer(cap)
    assert status == "capture" and isinstance(data, bytes)
    assert raise_reply((status, data)) == cap
    assert raise_reply(answer([cap.id])) == [cap.id]  # anything else crosses as it is
