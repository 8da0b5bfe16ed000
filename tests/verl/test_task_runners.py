"""Both trainers run by verl's own task runners, on a tiny dataset and tokenizer made in the session.

- v0: ``TaskRunner.run`` (``verl/trainer/main_ppo_v0.py``): dataset and tokenizer loading,
  ``RayPPOTrainer.__init__``, the real ``init_workers`` (resource pools, worker groups, reward loop,
  ``LLMServerManager``, the agent-loop manager loaded by name from docs/rl.md's recipe, weight-sync
  manager) and the real ``fit()`` over three steps, 1 and 3 profiled, with verl's own agent-loop
  and reward workers (CPU actors).
- v1 (the default): ``TaskRunnerV1.run`` (``verl/trainer/main_ppo.py``): TransferQueue, the
  trainer class verl's ``get_trainer_cls`` picks (``PPOTrainerSync``), its real ``init()`` (the
  same resource pools and worker group, ``RewardLoopManager``, ``LLMServerManager``,
  ``CheckpointEngineManager``, the replicas put to sleep, the checkpoint load), the agent-loop
  manager loaded by name, and the real ``fit()`` over four steps, 1 and 3 profiled, validation
  after each.

Stand-ins only where verl starts a GPU worker or runs GPU work (tests/verl/_standin.py): the FSDP
``ActorRolloutRefWorker`` and the vLLM server, on a local Ray cluster whose two "GPUs" are logical
resources (Ray's scheduler counts them; nothing touches a device); in v1 also the step's GPU work
(``step``, ``_validate``, ``_compute_metrics``: see ``_gpu_free_trainer_sync``). What is asserted
is what the sidecar and the servers saw: captures per step and replica, ``step<N>.json``, and
each server's profiler and generation requests in order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.verl.conftest import ROOT, compose, recipe

pytestmark = pytest.mark.verl


@pytest.fixture  # one per test: a trainer's worker groups keep their GPU placement groups to the end
def gpu_cluster() -> Iterator[Any]:
    import ray

    # 2 logical GPUs: verl's ResourcePoolManager asks for GPU bundles (use_gpu=True); only the
    # stand-in workers are placed on them. 12 logical CPUs (scheduling only): besides the bundles,
    # TransferQueue's controller and storage unit and the reward workers each hold one.
    ray.init(num_cpus=12, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama and word-level tokenizer (no download) and an 8-prompt gsm8k-shaped parquet."""
    import pandas as pd

    root = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, str(ROOT / "tests" / "live" / "make_tiny_model.py"), str(root / "model")],
                   check=True, capture_output=True)
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"what is one two three {i}"}],
             "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"index": i, "split": "train"}}
            for i in range(8)]  # 4 batches of 2: v1's four steps in one epoch
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows[:2]).to_parquet(root / "val.parquet")
    return {"model": root / "model", "train": root / "train.parquet", "val": root / "val.parquet"}


def _config(save: Path, tiny: dict[str, Path], *extra: str, steps: int = 3, test_freq: int = -1,
            agent_workers: int = 1) -> Any:
    return compose(
        *recipe(save), "+omni_sidecar.collect_timeout_s=60",
        f"actor_rollout_ref.model.path={tiny['model']}", f"data.train_files={tiny['train']}",
        f"data.val_files={tiny['val']}", "data.train_batch_size=2", "data.max_prompt_length=32",
        "data.max_response_length=4", "data.dataloader_num_workers=0", "data.shuffle=False",
        "actor_rollout_ref.rollout.name=emulator", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.agent.num_workers={agent_workers}", "reward.num_workers=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.use_dynamic_bsz=False", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.device=cpu", f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}", "trainer.val_before_train=False", "trainer.save_freq=-1", "trainer.logger=[console]",
        "trainer.balance_batch=False", *extra,
    )


def test_v0_task_runner_runs_init_workers_and_fit(gpu_cluster, tiny, tmp_path):
    import ray
    from verl.trainer.main_ppo_v0 import TaskRunner

    import tests.verl._standin as standin

    save = tmp_path / "profile"
    cfg = _config(save, tiny, "trainer.use_v1=False")

    base = TaskRunner.__ray_metadata__.modified_class

    class GpuFreeTaskRunner(base):  # type: ignore[misc, valid-type]
        def add_actor_rollout_worker(self, config: Any) -> Any:
            # verl's own, then its GPU worker class swapped for the stand-in (same role, same pool)
            cls, group_cls = super().add_actor_rollout_worker(config)
            for role in list(self.role_worker_mapping):
                self.role_worker_mapping[role] = ray.remote(standin.ActorRolloutRefWorker)
            return standin.ActorRolloutRefWorker, group_cls

    runner = GpuFreeTaskRunner()
    standin.LAUNCHED.clear()  # servers of other tests' clusters are gone
    try:
        runner.run(cfg)  # verl's own: datasets, RayPPOTrainer, init_workers, fit
        posts = {i: standin.posts(server) for i, server in enumerate(standin.LAUNCHED)}
        engine = [ray.get(server.get_engine_calls.remote(), timeout=60) for server in standin.LAUNCHED]
    finally:
        for server in standin.LAUNCHED:
            ray.get(server.shutdown.remote(), timeout=120)
        standin.LAUNCHED.clear()

    # What the sidecar saw: one capture per replica at steps 1 and 3, each checked ok with its
    # trace folder under verl's replica folder; nothing for step 2.
    steps = save / "omni_sidecar"
    assert sorted(p.name for p in steps.iterdir()) == ["step1.json", "step3.json"]
    captures = set()
    for n in (1, 3):
        body = json.loads((steps / f"step{n}.json").read_text())
        assert body["ok"] and body["step"] == n and body["result"]["label"] == f"step{n}", body
        targets = body["result"]["targets"]
        assert len(targets) == 2 and all(t["outcome"] == "stopped" for t in targets.values())
        assert all([v["verdict"] for v in t["verdicts"]] == ["ok"] for t in targets.values())
        captures |= {t["capture_id"] for t in targets.values()}
        replica_dirs = {part for folders in body["folders"].values() for f in folders for part in Path(f).parts
                        if part.startswith("agent_loop_rollout_replica_")}
        assert all(body["folders"].values()) and replica_dirs == {f"agent_loop_rollout_replica_{r}" for r in (0, 1)}
    assert len(captures) == 4
    # The servers saw a profiler window around steps 1 and 3 only, the rollout's requests between
    # (verl's load balancer spreads the 3 steps x 2 prompts), and verl's engine-level calls never.
    assert [[p for p in seq if p != "gen"] for seq in posts.values()] == [["start", "stop"] * 2] * 2
    assert sum(seq.count("gen") for seq in posts.values()) == 6
    assert engine == [[], []]



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


def test_v1_task_runner_runs_init_and_fit(gpu_cluster, tiny, tmp_path, monkeypatch):
    import ray
    import verl.trainer.ppo.v1 as v1
    from verl.trainer.main_ppo import TaskRunnerV1

    import tests.verl._standin as standin

    save = tmp_path / "profile"
    # steps 1 and 3 of 4 profiled, 2 and 4 not; validation after every step. The agent-loop workers
    # would generate inside `step`, which the stand-in does itself: none are started.
    # One TransferQueue storage unit (verl's default 8 each take a CPU of the 6-CPU local cluster).
    cfg = _config(save, tiny, "trainer.use_v1=True", "trainer.v1.trainer_mode=sync", "trainer.total_epochs=1",
                  "transfer_queue.backend.SimpleStorage.num_data_storage_units=1", steps=4, test_freq=1, agent_workers=0)
    picked = v1.get_trainer_cls(cfg.trainer.v1.trainer_mode)
    base = _gpu_free_trainer_sync()
    assert issubclass(base, picked) and picked.__name__ == "PPOTrainerSync"  # what verl itself would run

    class GpuFreeTrainer(base):  # type: ignore[misc, valid-type]
        def _init_resource_pool_mgr(self) -> None:
            # verl's own, then its GPU worker class swapped for the stand-in (same role, same pool)
            super()._init_resource_pool_mgr()
            for role in list(self.role_worker_mapping):
                self.role_worker_mapping[role] = ray.remote(standin.ActorRolloutRefWorker)

    def get_trainer_cls(mode: str) -> type:  # TaskRunnerV1.run asks verl which class to build: this one
        assert mode == "sync", mode
        return GpuFreeTrainer

    monkeypatch.setattr(v1, "get_trainer_cls", get_trainer_cls)
    runner = TaskRunnerV1.__ray_metadata__.modified_class()
    standin.LAUNCHED.clear()  # servers of other tests' clusters are gone
    try:
        runner.run(cfg)  # verl's own: TransferQueue, trainer init(), agent-loop manager by name, fit
        trainer = runner.trainer
        posts = [standin.posts(server) for server in standin.LAUNCHED]
        engine = [ray.get(server.get_engine_calls.remote(), timeout=60) for server in standin.LAUNCHED]
        worker_calls = trainer.actor_rollout_wg.get_profile_calls()
    finally:
        for server in standin.LAUNCHED:
            ray.get(server.shutdown.remote(), timeout=120)
        standin.LAUNCHED.clear()

    assert type(runner.agent_loop_manager).__name__ == "AgentLoopManagerTQ"  # verl's manager, unchanged
    assert trainer.global_steps == 5 and len(posts) == 2
    steps = save / "omni_sidecar"
    assert sorted(p.name for p in steps.iterdir()) == ["step1.json", "step3.json"]
    for n in (1, 3):
        body = json.loads((steps / f"step{n}.json").read_text())
        assert body["ok"] and body["step"] == n and len(body["result"]["targets"]) == 2, body
        assert body["top_ops"]
    # profiled: start, the step's rollout, stop, then validation; unprofiled: rollout, validation.
    # Validation is never inside a window; verl's own engine-level start/stop never ran.
    assert posts == [["start", "gen", "stop", "gen", "gen", "gen"] * 2] * 2
    assert engine == [[], []]
    # verl's own worker profiling (the FSDP side) is kept: both ranks, at steps 1 and 3
    assert worker_calls == [[("start", 1), ("stop", None), ("start", 3), ("stop", None)]] * 2
