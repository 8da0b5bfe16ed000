"""What the integration cannot serve is refused at trainer start (when verl builds the agent-loop
manager): strict raises with the key and the fix; best effort logs one warning and takes nothing
over (verl's own calls stay as they were). The trainer here holds stand-in replicas (launched ones
need GPUs): every refusal happens before any server is contacted."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.errors import ValidationFailed, VerlTrainerNotFound
from sidecar.integrations.verl import attach
from tests.verl.conftest import compose, recipe

pytestmark = pytest.mark.verl


def _verl_start(*_: Any) -> None:
    return None


class Trainer:
    """Holds what verl's trainer holds for rollout: an LLMServerManager with two replicas."""

    def __init__(self, cfg: Any) -> None:
        self.config = cfg
        self.global_steps = 1
        self.llm_server_manager = SimpleNamespace(
            get_replicas=lambda: [SimpleNamespace(replica_rank=0), SimpleNamespace(replica_rank=1)],
            start_profile=_verl_start, stop_profile=_verl_start)

    def init_workers(self, strict: bool) -> Any:
        return attach(SimpleNamespace(), self.config, self)


def _cfg(tmp_path, *extra: str) -> Any:
    return compose(*recipe(tmp_path), "actor_rollout_ref.rollout.tensor_model_parallel_size=1", *extra)


CASES = [
    (["global_profiler.tool=nsys", "actor_rollout_ref.rollout.profiler.tool=nsys"], "verl_tool_not_torch",
     "actor_rollout_ref.rollout.profiler.tool"),
    (["actor_rollout_ref.rollout.profiler.tool_config.torch.discrete=False"], "verl_not_discrete",
     "actor_rollout_ref.rollout.profiler.tool_config.torch.discrete"),
    (["global_profiler.steps=null"], "verl_steps_empty", "global_profiler.steps"),
    (["actor_rollout_ref.rollout.profiler.all_ranks=False", "actor_rollout_ref.rollout.profiler.ranks=[0,2]"],
     "verl_ranks_past_replicas", "actor_rollout_ref.rollout.profiler.ranks"),
]


@pytest.mark.parametrize(("overrides", "code", "key"), CASES)
def test_strict_refuses_at_trainer_start_with_the_key(tmp_path, overrides, code, key):
    trainer = Trainer(_cfg(tmp_path, "+omni_sidecar.strict=True", *overrides))
    with pytest.raises(ValidationFailed) as info:
        trainer.init_workers(strict=True)
    assert info.value.code == code and key in info.value.message
    assert trainer.llm_server_manager.start_profile is _verl_start  # nothing taken over


@pytest.mark.parametrize(("overrides", "code", "key"), CASES)
def test_best_effort_warns_once_and_takes_nothing_over(tmp_path, caplog, overrides, code, key):
    trainer = Trainer(_cfg(tmp_path, *overrides))
    with caplog.at_level(logging.WARNING, logger="sidecar.integrations.verl"):
        assert trainer.init_workers(strict=False) is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and key in warnings[0].getMessage()
    assert trainer.llm_server_manager.start_profile is _verl_start


def test_without_ray_it_is_refused(tmp_path):
    import ray

    assert not ray.is_initialized()
    trainer = Trainer(_cfg(tmp_path, "+omni_sidecar.strict=True"))
    with pytest.raises(ValidationFailed) as info:
        trainer.init_workers(strict=True)
    assert info.value.code == "verl_no_ray"


def test_a_trainer_without_step_profiling_is_refused(tmp_path):
    class DiffusionTaskRunnerV1:  # verl-omni's runner module: no step-scoped profiling
        __module__ = "verl_omni.trainer.main_diffusion_v1"

        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer

        def init_agent_loop_manager(self) -> Any:
            return attach(SimpleNamespace(), self.trainer.config, self.trainer, entry=type(self).__module__)

    runner = DiffusionTaskRunnerV1(Trainer(_cfg(tmp_path, "+omni_sidecar.strict=True")))
    with pytest.raises(ValidationFailed) as info:
        runner.init_agent_loop_manager()
    assert info.value.code == "verl_no_step_profiling" and "main_diffusion" in info.value.message


def test_no_trainer_calling_create_is_refused_loudly(tmp_path):
    from sidecar.integrations.verl import SidecarAgentLoopManager

    with pytest.raises(VerlTrainerNotFound) as info:
        SidecarAgentLoopManager.create(config=_cfg(tmp_path))  # not from a trainer: whose steps?
    assert "no verl trainer with rollout servers calls the agent-loop manager's create()" in info.value.message


def test_two_trainers_up_the_stack_are_refused_naming_both(tmp_path):
    from sidecar.integrations.verl import SidecarAgentLoopManager

    outer, inner = Trainer(_cfg(tmp_path)), Trainer(_cfg(tmp_path))

    def build(self: Trainer, other: Trainer) -> Any:
        return other.build()

    inner.build = lambda: _create_as(inner, SidecarAgentLoopManager)  # type: ignore[attr-defined]
    with pytest.raises(VerlTrainerNotFound) as info:
        build(outer, inner)
    assert info.value.message.count("Trainer (tests.verl.test_bad_input)") == 2


def _create_as(self: Trainer, cls: Any) -> Any:
    return cls.create(config=self.config)


def test_reward_servers_are_not_followed_in_verl(tmp_path):
    # verl 0.9.1 never profiles reward-model servers: nothing to follow without sidecar targets.
    cfg = _cfg(tmp_path, "+omni_sidecar.strict=True", "+omni_sidecar.role=reward",
               "++reward.reward_model.rollout.profiler.enable=True",
               "++reward.reward_model.rollout.profiler.tool=torch",
               "++reward.reward_model.rollout.profiler.tool_config.torch.discrete=True")
    with pytest.raises(ValidationFailed) as info:
        Trainer(cfg).init_workers(strict=True)
    assert info.value.code == "verl_reward_not_followed"
