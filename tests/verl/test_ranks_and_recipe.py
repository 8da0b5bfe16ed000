"""The one rank rule (sidecar.config.verl) against verl's own ``build_rollout_dist_profiler``, and
docs/rl.md's recipe composed with verl's real Hydra config: what verl loads by name, and what
``omni-sidecar validate --verl-config`` prints for it."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf
from typer.testing import CliRunner

from sidecar.config.verl import (
    format_replicas,
    installed_rank_mode,
    read_verl_config,
    verl_findings,
)
from tests.fixtures.emulator import make_deploy
from tests.verl.conftest import FQN, compose, docs_recipe, recipe

pytestmark = pytest.mark.verl

# (ranks, all_ranks, tp, dp, pp, replicas)
CASES = [
    ([], False, 1, 1, 1, 4),
    ([0, 8], False, 8, 1, 1, 2),
    ([1], False, 2, 1, 1, 4),
    ([3, 4], False, 2, 2, 1, 2),
    ([5], False, 1, 2, 3, 2),
    ([2, 3], False, 1, 1, 1, 4),
    ([7], False, 4, 1, 2, 1),
    ([], True, 2, 1, 1, 3),
]


def _verl_profiled(ranks, all_ranks, tp, dp, pp, n):
    from verl.utils.profiler import ProfilerConfig, build_rollout_dist_profiler
    from verl.utils.profiler.config import TorchProfilerToolConfig

    cfg = ProfilerConfig(tool="torch", enable=True, all_ranks=all_ranks, ranks=list(ranks),
                         tool_config={"torch": TorchProfilerToolConfig(discrete=True)})
    out = []
    for replica in range(n):
        prof = build_rollout_dist_profiler(replica, tp * dp * pp, config=cfg, tool_config=TorchProfilerToolConfig(discrete=True))
        if prof.check_enable() and prof.check_this_rank():
            out.append(replica)
    return out


@pytest.mark.parametrize(("ranks", "all_ranks", "tp", "dp", "pp", "n"), CASES)
def test_the_sidecar_profiles_the_replicas_verl_profiles(ranks, all_ranks, tp, dp, pp, n):
    plan = read_verl_config(compose(*recipe("/tmp/p"),
                                    f"actor_rollout_ref.rollout.profiler.all_ranks={all_ranks}",
                                    f"actor_rollout_ref.rollout.profiler.ranks={ranks}",
                                    f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                                    f"actor_rollout_ref.rollout.data_parallel_size={dp}",
                                    f"actor_rollout_ref.rollout.pipeline_model_parallel_size={pp}"))
    assert installed_rank_mode() == "global"
    assert plan.replica_ranks(n, installed_rank_mode()) == _verl_profiled(ranks, all_ranks, tp, dp, pp, n)


def test_ranks_past_the_replicas_are_refused_where_verl_would_profile_fewer():
    # tp=8 on 16 GPUs: 2 replicas; global rank 16 would be a third replica that does not exist.
    cfg = compose(*recipe("/tmp/p"), "actor_rollout_ref.rollout.profiler.all_ranks=False",
                  "actor_rollout_ref.rollout.profiler.ranks=[0,16]",
                  "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
                  "trainer.n_gpus_per_node=8", "trainer.nnodes=2")
    plan = read_verl_config(cfg)
    assert _verl_profiled([0, 16], False, 8, 1, 1, 2) == [0]  # verl silently profiles one
    assert [f.code for f in verl_findings(plan) if f.is_error] == ["verl_ranks_past_replicas"]


def test_the_recipe_composes_with_verls_config_and_loads_by_name():
    from verl.utils.import_utils import load_class_from_fqn

    cfg = compose(*recipe("/tmp/prof"))
    plan = read_verl_config(cfg)
    assert (plan.steps, plan.tool, plan.discrete, plan.enable, plan.all_ranks) == ([1, 3], "torch", True, True, True)
    assert verl_findings(plan) == []
    assert plan.trace_dir == "/tmp/prof" and cfg.trainer.use_v1 is True
    cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    assert f"{cls.__module__}.{cls.__qualname__}" == FQN


def test_validate_prints_the_replicas_verl_profiles(tmp_path):
    from sidecar.cli import app

    cfg = compose(*recipe(tmp_path), "actor_rollout_ref.rollout.profiler.all_ranks=False",
                  "actor_rollout_ref.rollout.profiler.ranks=[0,8]",
                  "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
                  "trainer.n_gpus_per_node=8", "trainer.nnodes=2")
    dump = tmp_path / "ppo.yaml"
    dump.write_text(OmegaConf.to_yaml(cfg))
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    out = CliRunner().invoke(app, ["validate", str(deploy), "--verl-config", str(dump)])
    assert out.exit_code == 0, out.output
    assert "rollout replicas profiled: 0, 1" in out.output
    assert format_replicas(None) == "all"
    data = yaml.safe_load(dump.read_text())
    data["actor_rollout_ref"]["rollout"]["profiler"]["ranks"] = [0, 16]
    dump.write_text(yaml.safe_dump(data))
    out = CliRunner().invoke(app, ["validate", str(deploy), "--verl-config", str(dump)])
    assert out.exit_code != 0 and "verl_ranks_past_replicas" in out.output


@pytest.mark.parametrize("extra", [[], ["trainer.use_v1=False"]])
def test_the_docs_recipe_pasted_composes_with_verls_config(extra):
    from verl.utils.import_utils import load_class_from_fqn

    overrides = docs_recipe()
    assert any(o.startswith("++actor_rollout_ref.rollout.agent.agent_loop_manager_class=") for o in overrides)
    cfg = compose(*overrides, *extra)
    plan = read_verl_config(cfg)
    assert verl_findings(plan) == [] and plan.steps == [1, 3] and plan.use_v1 is (not extra)
    cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    assert f"{cls.__module__}.{cls.__qualname__}" == FQN
