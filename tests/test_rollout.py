"""RolloutProfiler: only the chosen steps are profiled, on every selected replica and stage;
failures are best effort by default and raised in strict mode; an exception in the block still
stops every target. The rules run against in-process fake upstreams (``fake_replica_factory``:
real sockets and session folders); one end-to-end test runs them against emulators (the trace
folders a server writes, checked on disk).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from sidecar import RolloutProfiler
from sidecar.control.controller import ControlSettings
from sidecar.control.models import CaptureState, Verdict
from sidecar.errors import FleetError, FleetInvalid, ValidationFailed
from sidecar.fleet import Target, TargetOutcome
from tests.fixtures.waits import poll

FAST = ControlSettings(collect_timeout_s=30, close_timeout_s=5, summarize=False)


def _profiler(replicas, **kwargs) -> RolloutProfiler:
    """One Target per replica, each with its own deploy file (its own trace folders)."""
    kwargs.setdefault("control_settings", FAST)
    return RolloutProfiler([Target.upstream(r.url, r.deploy) for r in replicas], **kwargs)


def _name(replica) -> str:
    return f"upstream={replica.url}"


class Boom(Exception):
    pass


# --- end to end: emulators --------------------------------------------------------------


def _next_second(since: float) -> None:
    """Servers name session folders by the second: a later profiled step gets its own folder
    once the clock has moved past the second the previous step ended in (a real rollout step
    takes minutes)."""
    assert poll(lambda: int(time.time()) > int(since), timeout=10), "the clock did not reach the next second"


@pytest.mark.slow
def test_profiles_exactly_the_chosen_steps_on_every_replica_and_stage(replica_factory):
    replicas = replica_factory(2, stages=(0, 1))
    with _profiler(replicas, steps=[1, 3], stages=[0, 1], all_ranks=True) as prof:
        for step in range(1, 5):
            with prof.step(step):
                for r in replicas:
                    r.generate()
            if step == 1:
                _next_second(time.time())
        results = prof.results()

    assert sorted(results) == [1, 3]
    for step, res in results.items():
        assert res.label == f"step{step}" and res.ok
        assert len(res.targets) == 2
        for target in res.targets.values():
            assert {v.stage_id: v.verdict for v in target.verdicts} == {0: Verdict.ok, 1: Verdict.ok}
    # On disk: one session folder per profiled step, replica and stage; none for steps 2 and 4.
    for r in replicas:
        assert len(r.calls("/start_profile")) == 2
        for stage in (0, 1):
            on_disk = {str(p) for p in r.sessions(stage)}
            reported = {f for res in results.values() for f in res.targets[_name(r)].folders if f"stage{stage}_" in f}
            assert len(on_disk) == 2 and on_disk == reported


# --- the rules: in-process fake upstreams -----------------------------------------------


def test_outside_the_steps_nothing_is_sent_and_no_thread_starts(fake_replica_factory):
    (replica,) = fake_replica_factory(1)
    before = set(threading.enumerate())
    prof = _profiler([replica], steps=[5])
    with prof.step(1) as res:
        replica.generate()
    assert res is None
    assert prof._loop is None and set(threading.enumerate()) - before == set()
    assert replica.calls("/start_profile") == [] and replica.calls("/stop_profile") == []
    prof.close()


def test_one_replica_refusing_start_stops_the_others_and_training_goes_on(fake_replica_factory, caplog):
    replicas = fake_replica_factory(3)
    replicas[1].fake.start_status = 500
    ran = []
    with caplog.at_level(logging.WARNING, logger="sidecar.rollout"), _profiler(replicas, steps=[1], all_ranks=True) as prof:
        with prof.step(1):
            ran.append(True)
        res = prof.results()[1]
    assert ran == [True]  # best effort: the block ran unprofiled
    assert res.error is not None and res.error.code == "fleet_failed" and not res.ok
    outcomes = {name: t.outcome for name, t in res.targets.items()}
    assert outcomes[_name(replicas[1])] is TargetOutcome.start_failed
    assert {outcomes[_name(replicas[i])] for i in (0, 2)} == {TargetOutcome.rolled_back}
    for i in (0, 2):
        assert len(replicas[i].calls("/stop_profile")) == 1
    assert not any(v for r in replicas for v in r.profiling().values())
    assert any("did not start" in rec.message for rec in caplog.records)


def test_strict_mode_raises_when_a_replica_refuses_start(fake_replica_factory):
    replicas = fake_replica_factory(2)
    replicas[0].fake.start_status = 500
    ran = []
    prof = _profiler(replicas, steps=[1], all_ranks=True, strict=True)
    with prof, pytest.raises(FleetError) as info, prof.step(1):
        ran.append(True)
    assert ran == []  # strict: the start failure is raised before the block
    assert {t["outcome"] for t in info.value.details["targets"]} == {"start_failed", "rolled_back"}
    assert len(replicas[1].calls("/stop_profile")) == 1 and not any(replicas[1].profiling().values())


def test_an_exception_in_the_block_stops_every_target_and_propagates_unchanged(fake_replica_factory):
    replicas = fake_replica_factory(2)
    boom = Boom("generation failed")
    with _profiler(replicas, steps=[2], stages=[0], all_ranks=True) as prof:
        with pytest.raises(Boom) as info, prof.step(2):
            assert all(r.profiling()[0] for r in replicas)
            raise boom
        res = prof.results()[2]
    assert info.value is boom
    assert not any(v for r in replicas for v in r.profiling().values())
    assert all(len(r.calls("/stop_profile")) == 1 for r in replicas)
    assert {t.outcome for t in res.targets.values()} == {TargetOutcome.stopped}


async def test_async_hook_and_sync_hook_inside_a_running_loop(fake_replica_factory):
    (replica,) = fake_replica_factory(1)
    prof = _profiler([replica], steps=[1, 2])
    async with prof.astep(1):
        await asyncio.to_thread(replica.generate)
    with prof.step(2):  # a sync trainer called from a thread whose loop is running
        replica.generate()
    prof.close()
    assert [r.ok for r in prof.results().values()] == [True, True]
    assert len(replica.calls("/start_profile")) == 2 and len(replica.calls("/stop_profile")) == 2


def test_without_waiting_for_artifacts_the_check_finishes_in_the_background(fake_replica_factory):
    (replica,) = fake_replica_factory(1, stages=(0,))
    replica.fake.gzip_delay = 3600  # the server's gzip is held until the test lowers it
    prof = _profiler([replica], steps=[1], wait_artifacts=False)
    with prof.step(1):
        replica.generate()
    right_after = prof.results()[1]
    (target,) = right_after.targets.values()
    assert target.outcome is TargetOutcome.stopped and target.state is not CaptureState.stopping
    assert not right_after.done  # the trace is still being written: the block did not wait for it
    replica.fake.gzip_delay = 0  # the server's gzip lands now
    final = prof.wait(timeout=60)[1]
    prof.close()
    assert final.done and final.ok


def test_targets_given_by_hand_are_all_profiled(fake_replica_factory):
    replicas = fake_replica_factory(2)
    with _profiler(replicas, steps=[1]) as prof:
        with prof.step(1):
            pass
        res = prof.results()[1]
    assert list(res.targets) == [_name(r) for r in replicas] and res.ok
    assert [len(r.calls("/start_profile")) for r in replicas] == [1, 1]


def test_ranks_pick_among_the_targets_given(fake_replica_factory):
    replicas = fake_replica_factory(2)
    with _profiler(replicas, steps=[1], ranks=[1]) as prof:
        with prof.step(1):
            pass
        res = prof.results()[1]
    assert list(res.targets) == [_name(replicas[1])] and res.ok
    assert replicas[0].calls("/start_profile") == [] and len(replicas[1].calls("/start_profile")) == 1


def test_from_verl_config_keeps_verls_rule_of_replica_zero():
    prof = RolloutProfiler.from_verl_config(_verl_cfg(ranks=[]), UNREACHABLE)
    assert prof.ranks == [0] and [t.name for t in prof.targets] == [UNREACHABLE[0]]


def test_a_step_result_is_handed_to_on_result_once_final(fake_replica_factory):
    replicas = fake_replica_factory(1)
    seen = []
    with _profiler(replicas, steps=[1, 2], wait_artifacts=False, on_result=seen.append) as prof:
        with prof.step(1):
            pass
        with prof.step(2):
            pass
        prof.wait(timeout=60)
        assert [(r.step, r.done) for r in seen] == [(1, True), (2, True)]


def test_an_unreachable_replica_is_logged_and_recorded_in_best_effort_mode(caplog):
    prof = RolloutProfiler(["sidecar=http://127.0.0.1:9"], steps=[1])
    ran = []
    with caplog.at_level(logging.WARNING, logger="sidecar.rollout"), prof.step(1) as res:
        ran.append(True)
    prof.close()
    assert ran == [True] and res.error is not None and res.error.code == "fleet_failed"
    assert prof.results()[1].error.code == "fleet_failed"
    assert any("did not start" in rec.message for rec in caplog.records)


def test_an_unreachable_replica_raises_in_strict_mode():
    prof = RolloutProfiler(["sidecar=http://127.0.0.1:9"], steps=[1], strict=True)
    with pytest.raises(FleetError), prof.step(1):
        pass
    prof.close()


# --- bad input: refused before anything is sent (no server needed) ------------------------

UNREACHABLE = ["sidecar=http://127.0.0.1:9", "sidecar=http://127.0.0.1:10"]


@pytest.mark.parametrize("steps", [["1"], [1.5], [True], [0], [], "1,2", None])
def test_bad_steps_are_refused(steps):
    with pytest.raises(FleetInvalid) as info:
        RolloutProfiler(UNREACHABLE, steps=steps)
    assert info.value.code in ("steps_invalid", "steps_empty")


@pytest.mark.parametrize("step", ["1", 2.0, None])
def test_a_step_of_the_wrong_type_is_refused_at_the_hook(step):
    prof = RolloutProfiler(UNREACHABLE, steps=[1])
    with pytest.raises(FleetInvalid):
        prof.step(step)


def test_ranks_outside_the_target_list_are_refused():
    with pytest.raises(FleetInvalid) as info:
        RolloutProfiler(UNREACHABLE, steps=[1], ranks=[0, 2])
    assert info.value.code == "ranks_invalid"


# --- from a verl config -------------------------------------------------------------------


def _verl_cfg(**rollout_profiler):
    """Shaped like verl's composed ppo_trainer config (the keys the hook reads)."""
    prof = {"tool": "torch", "enable": True, "all_ranks": False, "ranks": [], "save_path": "/tmp/p",
            "tool_config": {"torch": {"contents": [], "discrete": True}}}
    prof.update(rollout_profiler)
    return {
        "global_profiler": {"tool": None, "steps": [1, 3], "profile_continuous_steps": False, "save_path": "outputs/profile"},
        "actor_rollout_ref": {"rollout": {"profiler": prof}},
        "trainer": {"resume_mode": "disable"},
    }


def test_from_verl_config_takes_steps_and_ranks():
    prof = RolloutProfiler.from_verl_config(_verl_cfg(ranks=[1]), UNREACHABLE)
    assert prof.steps == {1, 3} and prof.ranks == [1]


def test_from_verl_config_refuses_what_verl_would_skip_with_the_rule_message():
    with pytest.raises(ValidationFailed) as info:
        RolloutProfiler.from_verl_config(
            _verl_cfg(tool_config={"torch": {"discrete": False}}), UNREACHABLE)
    assert "discrete is false" in info.value.message and info.value.code == "verl_not_discrete"


def test_from_verl_config_warns_when_a_resume_would_skip_the_step(caplog):
    cfg = _verl_cfg(all_ranks=True)
    cfg["trainer"]["resume_mode"] = "auto"
    with caplog.at_level(logging.WARNING, logger="sidecar.rollout"):
        prof = RolloutProfiler.from_verl_config(cfg, UNREACHABLE)
    assert prof.ranks == [0, 1]
    assert any("resume_mode" in r.message for r in caplog.records)


def _with_tp(cfg, tp):
    cfg["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] = tp
    return cfg


@pytest.mark.parametrize(("ranks", "tp", "rank_mode", "replicas"), [
    ([0, 8], 8, "global", [0, 1]),   # verl 0.9.1: global GPU ranks 0 and 8 live on replicas 0 and 1
    ([1], 2, "global", [0]),         # GPU 1 is replica 0's second GPU
    ([1], 2, "replica", [1]),        # older verl (verl-omni's): replica indices
])
def test_from_verl_config_maps_ranks_as_verl_does(ranks, tp, rank_mode, replicas):
    prof = RolloutProfiler.from_verl_config(_with_tp(_verl_cfg(ranks=ranks), tp), UNREACHABLE, rank_mode=rank_mode)
    assert prof.ranks == replicas


def test_from_verl_config_refuses_ranks_past_the_replicas():
    with pytest.raises(ValidationFailed) as info:
        RolloutProfiler.from_verl_config(_with_tp(_verl_cfg(ranks=[16]), 8), UNREACHABLE)
    assert info.value.code == "verl_ranks_past_replicas" and "only 2 rollout replicas" in info.value.message
