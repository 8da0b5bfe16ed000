"""The v1 trainer (the default), with its real profiling methods, the real ``LLMServerManager`` and the
real agent-loop manager loaded by name, on a local Ray cluster. Stand-ins only for what needs a
GPU (tests/verl/_standin.py): the rollout servers are emulators launched by a real
``RolloutReplica``; the training workers and weight sync are recorders. Steps [1, 3] of 1..4,
validation after every step: captures at steps 1 and 3 only, on every profiled replica, checked on
the replica's node; validation never inside a window; verl's own engine start/stop never sent.
The v0 trainer runs whole, through verl's own TaskRunner: tests/verl/test_v0_fit.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.verl.conftest import compose, recipe

pytestmark = pytest.mark.verl

FAST = ["+omni_sidecar.collect_timeout_s=60"]
STANDIN = ["actor_rollout_ref.rollout.name=emulator", "actor_rollout_ref.rollout.agent.num_workers=0"]


@pytest.fixture
def servers(ray_cluster):
    """``make(cfg, world_size)`` → the real LLMServerManager over emulated replicas."""
    import ray

    made: list[Any] = []

    def make(cfg: Any, world_size: int) -> Any:
        from verl.workers.rollout.llm_server import LLMServerManager

        import tests.verl._standin as standin

        wg = standin.WorkerGroup(world_size)
        manager = LLMServerManager.create(config=cfg, worker_group=wg)
        made.append(manager)
        return manager, wg

    yield make
    for manager in made:
        hook = getattr(manager, "_omni_sidecar", None)
        if hook is not None:
            hook.close()
        for rep in manager.get_replicas():
            for s in rep.servers:
                ray.get(s.shutdown.remote(), timeout=120)
                ray.kill(s)



def _engine_calls(manager: Any) -> list[list[str]]:
    import ray

    return [ray.get(r.servers[0].get_engine_calls.remote(), timeout=60) for r in manager.get_replicas()]


def _check_steps(hook: Any, save: Path, n_replicas: int) -> None:
    results = hook.wait(timeout=300)
    assert sorted(results) == [1, 3]
    for step, res in results.items():
        assert res.ok, res.model_dump_json(indent=1)
        assert len(res.targets) == n_replicas
        body = json.loads((save / "omni_sidecar" / f"step{step}.json").read_text())
        assert body["ok"] and body["step"] == step and body["top_ops"]
    assert sorted(p.name for p in (save / "omni_sidecar").iterdir()) == ["step1.json", "step3.json"]


def _gpu_free_trainer_sync() -> type:
    """verl's own ``PPOTrainerSync``, driven by its own ``fit()``, with only what runs on GPU
    workers replaced (each checked against verl's method of the same name, which is kept for the
    rest of the loop):

    - ``step``: the batch's rollout through the agent-loop workers, reward, log-probs and the
      actor update (GPU workers, batches in TransferQueue) → one chat request per replica, then
      verl's own ``on_sample_end`` where ``_step_once`` calls it (sleep_replicas → _stop_rollout_profiling);
    - ``_validate``: generation on the GPU workers → one short request per replica;
    - ``_compute_metrics``: reads the step's batch back from TransferQueue → nothing to read.
    """
    import transfer_queue as tq
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    import tests.verl._standin as standin

    class GpuFreeTrainerSync(PPOTrainerSync):
        def step(self, metrics: dict, timing_raw: dict) -> Any:
            self.on_sample_begin()
            for r in self.llm_server_manager.get_replicas():
                standin.generate(r.server_address)
            self.on_sample_end()
            # what the agent-loop workers leave in TransferQueue for the step (fit clears it)
            key = f"step{self.global_steps}-sample0"
            tq.kv_put(key=key, partition_id="train", tag={"step": self.global_steps})
            return KVBatchMeta(partition_id="train", keys=[key], tags=[{"step": self.global_steps}])

        def _validate(self, *args: Any, **kwargs: Any) -> dict:
            for r in self.llm_server_manager.get_replicas():
                standin.generate(r.server_address, max_tokens=2)
            return {"val-core/stand-in/score": 0.0}

        def _compute_metrics(self, *args: Any, **kwargs: Any) -> None:
            return None

    for name in ("step", "_validate", "_compute_metrics", "on_sample_end", "fit"):
        assert callable(getattr(PPOTrainerSync, name)), name  # what is replaced exists in verl
    return GpuFreeTrainerSync


def test_v1_default_trainer_through_its_own_fit_loop(servers, tmp_path):
    import ray
    import transfer_queue as tq
    from verl.trainer.main_ppo import TaskRunnerV1

    import tests.verl._standin as standin

    save = tmp_path / "profile"
    # steps 1 and 3 of 4 profiled, 2 and 4 not; validation after every step (test_freq=1)
    cfg = compose(*recipe(save), *STANDIN, *FAST, "trainer.test_freq=1", "trainer.val_before_train=False",
                  "trainer.save_freq=-1", "trainer.logger=[console]", "trainer.total_training_steps=4",
                  "actor_rollout_ref.rollout.tensor_model_parallel_size=1")
    manager, wg = servers(cfg, world_size=2)  # 2 replicas of tp=1
    replicas = manager.get_replicas()
    from omegaconf import OmegaConf

    # TaskRunnerV1.run starts TransferQueue (its fit loop clears each step's batch there): one storage unit
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))

    # The v1 trainer as TaskRunnerV1.run builds it; what its init builds on GPUs is given here.
    cls = _gpu_free_trainer_sync()
    trainer = object.__new__(cls)
    trainer.config = cfg
    trainer.actor_rollout_wg, trainer.use_reference_policy, trainer.use_critic = wg, False, False
    trainer.use_teacher_policy = False
    trainer.llm_server_manager = manager
    trainer.checkpoint_manager = standin.CheckpointManager(replicas)
    trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=None)
    trainer.trainer_mode = "sync"
    trainer.global_steps, trainer.total_training_steps, trainer.steps_per_epoch = 0, 4, 4
    trainer._init_dump_executor()
    runner_cls = TaskRunnerV1.__ray_metadata__.modified_class
    runner = object.__new__(runner_cls)
    runner.config, runner.trainer, runner.agent_loop_manager = cfg, trainer, None
    runner_cls.init_agent_loop_manager(runner)  # verl's own code: loads our class by name
    assert type(runner.agent_loop_manager).__name__ == "AgentLoopManagerTQ"  # verl's manager, unchanged
    hook = manager._omni_sidecar

    trainer.fit(runner.agent_loop_manager)  # verl's own loop: _start_profiling, step, _stop_profiling, validate

    assert trainer.global_steps == 5
    _check_steps(hook, save, n_replicas=2)
    assert _engine_calls(manager) == [[], []]  # verl's own engine-level start/stop never ran
    for r in replicas:
        # profiled: start, the step's rollout, stop, then validation; unprofiled: rollout, validation
        assert standin.posts(r.servers[0]) == ["start", "gen", "stop", "gen", "gen", "gen"] * 2
        assert list((save / f"agent_loop_rollout_replica_{r.replica_rank}").glob("*.pt.trace.json*"))
    assert wg.profile_calls == [("start", 1), ("stop", None), ("start", 3), ("stop", None)]  # verl's own, kept
    assert ray.is_initialized()
