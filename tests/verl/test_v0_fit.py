"""verl's v0 trainer run by verl's own ``TaskRunner.run`` (``verl/trainer/main_ppo_v0.py``): its
dataset and tokenizer loading, ``RayPPOTrainer.__init__``, the real ``init_workers`` (resource
pools, worker groups, reward loop, ``LLMServerManager``, the agent-loop manager loaded by name from
docs/rl.md's recipe, weight-sync manager) and the real ``fit()`` over three steps, steps 1 and 3
profiled. The agent-loop and reward workers are verl's own (CPU actors); stand-ins only where verl
starts a GPU worker (tests/verl/_standin.py): the FSDP ``ActorRolloutRefWorker`` and the vLLM
server, on a local Ray cluster whose two "GPUs" are logical resources (Ray's scheduler counts them;
nothing touches a device). What is asserted is what the sidecar saw: its captures per step and
its ``step<N>.json`` files.
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


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[Any]:
    import ray

    # 2 logical GPUs: verl's ResourcePoolManager asks for GPU bundles (use_gpu=True); only the
    # stand-in workers are placed on them.
    ray.init(num_cpus=6, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama and word-level tokenizer (no download) and a 6-prompt gsm8k-shaped parquet."""
    import pandas as pd

    root = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, str(ROOT / "tests" / "live" / "make_tiny_model.py"), str(root / "model")],
                   check=True, capture_output=True)
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"what is one two three {i}"}],
             "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"index": i, "split": "train"}}
            for i in range(6)]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows[:2]).to_parquet(root / "val.parquet")
    return {"model": root / "model", "train": root / "train.parquet", "val": root / "val.parquet"}


def _config(save: Path, tiny: dict[str, Path]) -> Any:
    return compose(
        *recipe(save), "trainer.use_v1=False", "+omni_sidecar.collect_timeout_s=60",
        f"actor_rollout_ref.model.path={tiny['model']}", f"data.train_files={tiny['train']}",
        f"data.val_files={tiny['val']}", "data.train_batch_size=2", "data.max_prompt_length=32",
        "data.max_response_length=4", "data.dataloader_num_workers=0", "data.shuffle=False",
        "actor_rollout_ref.rollout.name=emulator", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.use_dynamic_bsz=False", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.device=cpu", "trainer.total_training_steps=3",
        "trainer.test_freq=-1", "trainer.val_before_train=False", "trainer.save_freq=-1", "trainer.logger=[console]",
        "trainer.balance_batch=False",
    )


def test_v0_task_runner_runs_init_workers_and_fit(gpu_cluster, tiny, tmp_path):
    import ray
    from verl.trainer.main_ppo_v0 import TaskRunner

    import tests.verl._standin as standin

    save = tmp_path / "profile"
    cfg = _config(save, tiny)

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

