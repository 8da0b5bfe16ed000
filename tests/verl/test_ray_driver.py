"""The fleet's protocol through its Ray driver, on a local Ray cluster: the same all-or-nothing
start and per-fan-out stop deadline as over HTTP (tests/test_fleet*.py), with each target's
controller in a node actor. Stub vLLM-Omni servers (tests/fixtures/stubs.py) stand in for the
rollout servers; their faults make a start refused and a stop that never answers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sidecar.control.controller import ControlSettings
from sidecar.errors import FleetError
from sidecar.fleet import Fleet, Placement, RayNodes, Target
from tests.fixtures.stubs import StubFleet, write_deploys

pytestmark = pytest.mark.verl

CONTROL = ControlSettings(collect_timeout_s=30, close_timeout_s=5, summarize=False).model_dump(mode="json")


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ray-stubs")
    with StubFleet(3, mode="upstream", root=root) as fleet:
        fleet.deploys = write_deploys(root, 3)
        yield fleet


def _fleet(ray_cluster, stubs: StubFleet, **kw) -> tuple[Fleet, list[Target]]:
    node = ray_cluster.get_runtime_context().get_node_id()
    targets = [Target.ray(u, flavor="omni") for u in stubs.urls]
    nodes = RayNodes({t.name: Placement(node, str(d)) for t, d in zip(targets, stubs.deploys)}, control=CONTROL)
    nodes.launch(targets, stop_budget_s=kw.get("stop_budget_s", 30))
    return Fleet(targets, stages=[0], drivers=nodes, **kw), targets


async def test_a_refused_start_rolls_the_others_back_through_their_node_actors(ray_cluster, stubs: StubFleet):
    stubs.reset(faults={1: "refuse_start"})
    fleet, targets = _fleet(ray_cluster, stubs)
    async with fleet:
        with pytest.raises(FleetError) as info:
            await fleet.start(label="step1")
    outcomes = {t["target"]: t["outcome"] for t in info.value.details["targets"]}
    assert outcomes == {targets[0].name: "rolled_back", targets[1].name: "start_failed",
                        targets[2].name: "rolled_back"}
    assert [i for i, r in stubs.log().items() if r["recording"]] == []


async def test_a_hung_stop_ends_at_the_fan_outs_deadline_and_the_others_are_checked(ray_cluster, stubs: StubFleet):
    stubs.reset(faults={2: "hang_stop"})
    fleet, targets = _fleet(ray_cluster, stubs, stop_budget_s=3)
    async with fleet:
        fc = await fleet.start(label="step1")
        fc = await fleet.stop(fc, artifact_timeout_s=60)
    outcome = {n: r.outcome.value for n, r in fc.targets.items()}
    assert outcome == {targets[0].name: "stopped", targets[1].name: "stopped", targets[2].name: "stop_timeout"}
    for t in targets[:2]:
        r = fc.targets[t.name]
        assert r.ok and [v.verdict.value for v in r.verdicts] == ["ok"] and r.folders
        assert all(Path(f).is_relative_to(Path(stubs.deploys[0]).parents[1]) for f in r.folders)


@pytest.mark.parametrize(("per_actor", "processes"), [(None, 1), (2, 2)])  # one node: all in one actor, or 2 + 1
async def test_the_servers_of_a_node_share_one_actor_process(ray_cluster, stubs: StubFleet, per_actor, processes):
    import os

    stubs.reset(faults={})
    node = ray_cluster.get_runtime_context().get_node_id()
    targets = [Target.ray(u, flavor="omni") for u in stubs.urls]
    nodes = RayNodes({t.name: Placement(node, str(d)) for t, d in zip(targets, stubs.deploys)}, control=CONTROL,
                     per_actor=per_actor)
    nodes.launch(targets, stop_budget_s=30)
    async with Fleet(targets, stages=[0], drivers=nodes) as fleet:
        at = time.time() + 5  # the nodes send at start_at themselves, once every one is prepared
        fc = await fleet.stop(await fleet.start(label="step1", start_at=at), wait_artifacts=True,
                              artifact_timeout_s=60)
        pids = {await d.actor.__ray_call__.remote(lambda self: os.getpid()) for d in nodes.drivers.values()}
    assert fc.ok, fc.rollup()
    assert all(ts and ts[0] / 1e9 >= at for ts in stubs.received("/start_profile").values())
    assert len(pids) == processes  # 3 servers on one node: one process (or ceil(3 / per_actor))
    assert [[c[1] for c in r["calls"] if c[1] in ("/start_profile", "/stop_profile")] for r in stubs.log().values()] == [
        ["/start_profile", "/stop_profile"]] * 3


async def test_a_start_answered_after_the_deadline_on_a_node_is_swept_and_stopped(ray_cluster, stubs: StubFleet):
    # the node's controller carries on with the start the trainer stopped waiting for; the sweep
    # reads the node's captures, finds it by the fleet's key and stops it once it is answered
    stubs.reset(faults={2: "slow_start=3"})
    fleet, targets = _fleet(ray_cluster, stubs, start_timeout_s=1)
    async with fleet:
        with pytest.raises(FleetError) as info:
            await fleet.start(label="step1")
    late = next(t for t in info.value.details["targets"] if t["target"] == targets[2].name)
    assert (late["outcome"], late["error"]["code"], len(late["sweep"]["stopped"])) == ("start_failed", "start_timeout", 1)
    deadline = time.monotonic() + 60
    while not stubs.received("/start_profile", key="handled")[2]:  # until the late start landed
        assert time.monotonic() < deadline
        time.sleep(0.05)
    calls = {i: [c[1] for c in r["calls"] if c[1] in ("/start_profile", "/stop_profile")] for i, r in stubs.log().items()}
    assert calls == {i: ["/start_profile", "/stop_profile"] for i in range(3)}
    assert [i for i, r in stubs.log().items() if r["recording"]] == []


async def test_each_node_starts_and_ends_the_window_itself(ray_cluster, stubs: StubFleet):
    stubs.reset(faults={})
    fleet, targets = _fleet(ray_cluster, stubs)
    async with fleet:
        at = time.time() + 5  # told to each node on its own clock: it schedules the start there
        fc = await fleet.capture(0.5, label="step1", start_at=at, artifact_timeout_s=60)
        # each ended by its node's own watchdog at its duration, not by the trainer's stop
        reasons = [(await fleet._drivers[n].get(r.capture_id)).stop_reason for n, r in fc.targets.items()]
    assert fc.ok, fc.rollup()
    assert all(ts and ts[0] / 1e9 >= at for ts in stubs.received("/start_profile").values())
    assert [r.value if r else None for r in reasons] == ["duration"] * len(targets)
