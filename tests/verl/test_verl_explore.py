"""An RL engineer's pass over the verl integration, on verl 0.9.1's own classes and a local Ray
cluster: the trainer config as Hydra composes it (docs/rl.md's recipe), verl's real
``LLMServerManager`` holding real ``RolloutReplica``s (tests/verl/_standin.py's ``EmulatedReplica``:
an emulated vLLM server per replica, launched as verl launches its servers), the hook attached the
way verl's trainers attach it, and verl's own ``start_profile``/``stop_profile`` calls on the manager
at the steps verl's fit loop makes them. Covered here:

- steps the run never reaches (past ``total_training_steps``, or at or before the step a trainer
  resumed from): said at trainer start naming ``global_profiler.steps``; none reachable is refused;
  the last step the run does reach is the one whose result is on disk when verl's stop returns;
- a node profiler actor dying while its servers record: no server is left recording, the step
  says why, and the next profiled step is profiled again;
- after the last profiled step nothing of the sidecar is left running (node actors ended), and a
  profiler closed after ``ray.shutdown()`` does not start a new local Ray cluster.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from sidecar.errors import ValidationFailed
from sidecar.integrations.verl import attach
from tests.verl.conftest import compose, recipe

pytestmark = pytest.mark.verl

ROLLOUT = ("actor_rollout_ref.rollout.name=emulator", "actor_rollout_ref.rollout.tensor_model_parallel_size=1")


@pytest.fixture(scope="module")
def replicas(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """Two verl rollout replicas (real ``RolloutReplica`` subclasses) with their servers launched
    on this node; ``stop()`` shuts the servers down (also at the end)."""
    import tests.verl._standin as standin

    cfg = compose(*recipe(tmp_path_factory.mktemp("launch")), *ROLLOUT)
    reps = [standin.EmulatedReplica(replica_rank=i, config=cfg.actor_rollout_ref.rollout, model_config=None,
                                    gpus_per_node=1) for i in range(2)]

    async def launch() -> None:
        await asyncio.gather(*[r.launch_servers() for r in reps])

    standin.LAUNCHED.clear()
    servers: list[Any] = []

    def stop() -> None:
        while servers:
            ray_cluster.get(servers.pop().shutdown.remote(), timeout=120)

    try:
        asyncio.run(launch())
        servers.extend(standin.LAUNCHED)
        yield SimpleNamespace(replicas=reps, servers=list(servers), stop=stop)
    finally:
        stop()
        standin.LAUNCHED.clear()


def _recording(replicas: SimpleNamespace) -> list[bool]:
    """Whether each replica's server is recording a profile now (its own state)."""
    out = []
    for r in replicas.replicas:
        stages = httpx.get(f"http://{r.server_address}/emulator/state", timeout=30).json()["stages"]
        out.append(any(s["profiling"] for s in stages.values()))
    return out


class Trainer:
    """What verl's trainer holds when it builds the agent-loop manager: its config, verl's real
    ``LLMServerManager`` over the launched replicas, ``global_steps`` (v1: the checkpoint's step,
    loaded before) and ``total_training_steps``; ``fit`` makes verl's rollout calls per step."""

    def __init__(self, cfg: Any, replicas: SimpleNamespace, *, global_steps: int = 0, total: int = 4) -> None:
        from verl.workers.rollout.llm_server import LLMServerManager

        self.config = cfg
        self.global_steps = global_steps
        self.total_training_steps = total
        self.llm_server_manager = LLMServerManager(cfg, worker_group=object())
        self.llm_server_manager.rollout_replicas = replicas.replicas

    def init_agent_loop_manager(self) -> Any:
        return attach(SimpleNamespace(), self.config, self)

    def fit(self, after_start: Callable[[int], None] | None = None,
            after_stop: Callable[[int], None] | None = None) -> None:
        import tests.verl._standin as standin

        manager = self.llm_server_manager
        while self.global_steps < self.total_training_steps:
            self.global_steps += 1
            profiled = self.global_steps in self.config.global_profiler.steps
            if profiled:
                manager.start_profile()
                if after_start:
                    after_start(self.global_steps)
            for r in manager.get_replicas():
                standin.generate(r.server_address)
            if profiled:
                manager.stop_profile()
                if after_stop:
                    after_stop(self.global_steps)


def _cfg(save: Path, steps: str, *extra: str) -> Any:
    return compose(*recipe(save, steps=steps), *ROLLOUT, "+omni_sidecar.collect_timeout_s=60", *extra)


def test_steps_past_the_run_are_said_and_the_last_reached_step_is_on_disk_when_its_stop_returns(
        replicas, tmp_path, caplog):
    save = tmp_path / "profile"
    trainer = Trainer(_cfg(save, "[1,3,9]"), replicas, total=4)
    with caplog.at_level(logging.WARNING, logger="sidecar.integrations.verl"):
        hook = trainer.init_agent_loop_manager()
    said = [r.getMessage() for r in caplog.records if "never reached" in r.getMessage()]
    assert len(said) == 1 and "global_profiler.steps [9]" in said[0] and "total_training_steps=4" in said[0]

    on_disk: dict[int, list[str]] = {}
    trainer.fit(after_stop=lambda n: on_disk.setdefault(n, sorted(p.name for p in (save / "omni_sidecar").glob("*.json"))))
    # step 3 is the last this 4-step run profiles: its result is written before verl's stop returns
    assert on_disk[3] == ["step1.json", "step3.json"]
    assert json.loads((save / "omni_sidecar" / "step3.json").read_text())["ok"]
    assert hook.profiler.results().keys() == {1, 3}


@pytest.mark.parametrize("strict", [True, False])
def test_a_trainer_resumed_past_every_profiled_step_is_refused_at_start(replicas, tmp_path, caplog, strict):
    # v1 loads the checkpoint before it builds the manager: global_steps is the resumed step
    cfg = _cfg(tmp_path, "[1,3]", "trainer.resume_mode=auto", *(["+omni_sidecar.strict=True"] if strict else []))
    trainer = Trainer(cfg, replicas, global_steps=5, total=8)
    verl_start = trainer.llm_server_manager.start_profile
    if strict:
        with pytest.raises(ValidationFailed) as info:
            trainer.init_agent_loop_manager()
        assert info.value.code == "verl_steps_unreachable"
        message = info.value.message
    else:
        with caplog.at_level(logging.WARNING, logger="sidecar.integrations.verl"):
            assert trainer.init_agent_loop_manager() is None
        message = next(r.getMessage() for r in caplog.records if "NOT profiled" in r.getMessage())
        # the config's own warning (resume past the profiled step) is said too, not dropped
        assert any("trainer.resume_mode is 'auto'" in r.getMessage() for r in caplog.records)
    assert "global_profiler.steps [1, 3]" in message and "resumed from a checkpoint at step 5" in message
    assert "trainer.resume_mode=disable" in message
    assert trainer.llm_server_manager.start_profile == verl_start  # nothing taken over


def test_a_node_actor_dying_mid_window_leaves_no_server_recording(replicas, tmp_path, caplog):
    import ray

    save = tmp_path / "profile"
    trainer = Trainer(_cfg(save, "[1,3]"), replicas, total=3)
    hook = trainer.init_agent_loop_manager()
    seen: dict[str, Any] = {}

    def kill_node_actor(step: int) -> None:
        if step == 1:
            seen["recording"] = _recording(replicas)
            ray.kill(next(iter(hook.nodes.drivers.values())).actor)  # the one actor of this node

    def after_stop(step: int) -> None:
        if step == 1:
            seen["after"] = _recording(replicas)

    with caplog.at_level(logging.WARNING, logger="sidecar.integrations.verl"):
        trainer.fit(after_start=kill_node_actor, after_stop=after_stop)
    assert seen["recording"] == [True, True]
    assert seen["after"] == [False, False]  # stopped by the actor that replaced the dead one
    step1 = json.loads((save / "omni_sidecar" / "step1.json").read_text())
    errors = [t["error"] for t in step1["result"]["targets"].values()]
    assert not step1["ok"] and {e["code"] for e in errors} == {"node_profiler_died"}, step1
    assert "stopped what the dead one had left recording" in errors[0]["message"]
    # the next profiled step runs on the new actor
    assert json.loads((save / "omni_sidecar" / "step3.json").read_text())["ok"]
    assert _recording(replicas) == [False, False]


def test_after_the_last_profiled_step_nothing_is_left_running(replicas, tmp_path):
    import ray
    from ray.exceptions import RayActorError

    trainer = Trainer(_cfg(tmp_path / "profile", "[1,2]"), replicas, total=3)
    hook = trainer.init_agent_loop_manager()
    trainer.fit()
    actors = {id(d.actor): d.actor for d in hook.nodes.drivers.values()}
    assert actors and hook.profiler.results().keys() == {1, 2}
    for actor in actors.values():  # the node actors were ended with the profiler at step 2
        with pytest.raises(RayActorError):
            ray.get(actor.ready.remote(), timeout=60)


def test_a_profiler_closed_after_ray_shutdown_does_not_start_another_cluster(replicas, tmp_path):
    # Last in this module: it shuts the module's cluster down (its fixture's shutdown is then a no-op).
    import ray

    trainer = Trainer(_cfg(tmp_path / "profile", "[1,3]"), replicas, total=4)
    hook = trainer.init_agent_loop_manager()
    trainer.total_training_steps = 1
    trainer.fit()  # step 1 profiled; the run ends before step 3
    replicas.stop()
    ray.shutdown()
    hook.close(timeout=30)
    assert not ray.is_initialized()  # no new local cluster was started to reach the gone actors
