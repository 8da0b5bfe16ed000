"""The no-fork verl integration, against a trainer config shaped exactly like verl 0.9.1's
``_generated_ppo_trainer.yaml`` (the keys involved, copied from the wheel) and a stand-in ``verl``
package with the same module paths and calling convention as the real one (``AgentLoopManager``
with an ``@auto_await async def generate_sequences``, resolved by FQN). The real wheel pulls ray,
torch and transformers, so it is not installed here.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from sidecar.errors import ConfigError, ValidationFailed

omegaconf = pytest.importorskip("omegaconf")
OmegaConf = omegaconf.OmegaConf

FQN = "sidecar.integrations.verl.SidecarAgentLoopManager"

# verl 0.9.1 verl/trainer/config/_generated_ppo_trainer.yaml, the keys the hook reads (verbatim).
VERL_CONFIG = """
actor_rollout_ref:
  actor:
    profiler:
      _target_: verl.utils.profiler.ProfilerConfig
      tool: ${oc.select:global_profiler.tool,null}
      enable: false
      all_ranks: false
      ranks: []
      save_path: ${oc.select:global_profiler.save_path,null}
      tool_config:
        torch:
          _target_: verl.utils.profiler.config.TorchProfilerToolConfig
          contents: []
          discrete: false
  rollout:
    n: 1
    agent:
      _target_: verl.workers.config.AgentLoopConfig
      num_workers: 8
      default_agent_loop: single_turn_agent
      agent_loop_config_path: null
      custom_async_server:
        _target_: verl.workers.config.CustomAsyncServerConfig
        path: null
        name: null
    profiler:
      _target_: verl.utils.profiler.ProfilerConfig
      tool: ${oc.select:global_profiler.tool,null}
      enable: ${oc.select:actor_rollout_ref.actor.profiler.enable,false}
      all_ranks: ${oc.select:actor_rollout_ref.actor.profiler.all_ranks,false}
      ranks: ${oc.select:actor_rollout_ref.actor.profiler.ranks,[]}
      save_path: ${oc.select:global_profiler.save_path,null}
      tool_config:
        torch:
          _target_: verl.utils.profiler.config.TorchProfilerToolConfig
          contents: ${oc.select:actor_rollout_ref.actor.profiler.tool_config.torch.contents,[]}
          discrete: ${oc.select:actor_rollout_ref.actor.profiler.tool_config.torch.discrete,false}
          profile_token_start: null
          profile_token_end: null
trainer:
  total_training_steps: null
  resume_mode: auto
  save_freq: -1
  test_freq: -1
global_profiler:
  _target_: verl.utils.profiler.ProfilerConfig
  tool: null
  steps: null
  profile_continuous_steps: false
  save_path: outputs/profile
"""

# The stand-in: verl's module paths, AgentLoopManager's constructor/create/generate_sequences
# signatures, and auto_await's three cases (awaited → coroutine; no loop → asyncio.run; a
# running loop but a sync caller → run in a worker thread).
FAKE_VERL = {
    "verl/__init__.py": "",
    "verl/utils/__init__.py": "",
    "verl/utils/ray_utils.py": '''
        import asyncio, concurrent.futures, functools, inspect

        def auto_await(func):
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                coro = func(*args, **kwargs)
                try:
                    asyncio.get_running_loop()
                except RuntimeError:
                    return asyncio.run(coro)
                caller = inspect.currentframe().f_back
                if caller is not None and caller.f_code.co_flags & inspect.CO_COROUTINE:
                    return coro
                with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                    return pool.submit(asyncio.run, coro).result()
            return wrapper
    ''',
    "verl/experimental/__init__.py": "",
    "verl/experimental/agent_loop/__init__.py": "from .agent_loop import AgentLoopManager\n",
    "verl/experimental/agent_loop/agent_loop.py": '''
        import asyncio
        import httpx
        from verl.utils.ray_utils import auto_await

        class AgentLoopManager:
            def __init__(self, config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None):
                self.config = config
                self.rollout_config = config.actor_rollout_ref.rollout
                self.llm_client = llm_client
                self.calls = []

            @classmethod
            @auto_await
            async def create(cls, *args, **kwargs):
                return cls(*args, **kwargs)

            @auto_await
            async def generate_sequences(self, prompts):
                # stands in for the agent-loop workers calling every rollout server
                async with httpx.AsyncClient(timeout=60) as client:
                    for url in self.llm_client:
                        r = await client.post(f"{url}/v1/chat/completions",
                                              json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
                        r.raise_for_status()
                self.calls.append(dict(prompts.meta_info))
                return prompts
    ''',
    # verl's RayPPOTrainer, reduced to what touches rollout profiling: init_workers builds the
    # LLMServerManager, then the manager class named by agent_loop_manager_class; fit() calls
    # llm_server_manager.start_profile()/stop_profile() around generate_sequences at profiled steps.
    "verl/trainer/__init__.py": "",
    "verl/trainer/ppo/__init__.py": "",
    "verl/trainer/ppo/ray_trainer.py": '''
        import importlib
        from verl.utils.ray_utils import auto_await

        class LLMServerManager:
            def __init__(self, urls):
                self.urls, self.profile_calls = urls, []

            @auto_await
            async def start_profile(self, **kwargs):
                self.profile_calls.append("start")

            @auto_await
            async def stop_profile(self):
                self.profile_calls.append("stop")

        class RayPPOTrainer:
            def __init__(self, config, urls):
                self.config, self.urls = config, urls

            def init_workers(self):
                self.llm_server_manager = LLMServerManager(self.urls)
                fqn = self.config.actor_rollout_ref.rollout.agent.get("agent_loop_manager_class")
                module, _, name = fqn.rpartition(".")
                manager_cls = getattr(importlib.import_module(module), name)
                self.async_rollout_manager = manager_cls.create(config=self.config, llm_client=self.urls)

            def fit(self, batches, steps):
                for self.global_steps, batch in enumerate(batches, start=1):
                    batch.meta_info["global_steps"] = self.global_steps
                    profiled = self.global_steps in (self.config.global_profiler.steps or [])
                    if profiled:
                        self.llm_server_manager.start_profile()
                    self.async_rollout_manager.generate_sequences(batch)
                    if profiled:
                        self.llm_server_manager.stop_profile()
    ''',
}


class DataProto:
    """The part of verl.protocol.DataProto the hook reads."""

    def __init__(self, meta_info: dict) -> None:
        self.meta_info = meta_info


@pytest.fixture
def fake_verl(tmp_path, monkeypatch):
    root = tmp_path / "site"
    for rel, text in FAKE_VERL.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(root))
    yield
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        del sys.modules[name]
    module = importlib.import_module("sidecar.integrations.verl")
    for name in module._LAZY:  # the classes built on the stand-in
        module.__dict__.pop(name, None)


def load_class_from_fqn(fqn: str) -> type:
    """What verl's trainer does with agent_loop_manager_class (verl.utils.import_utils)."""
    module, _, name = fqn.rpartition(".")
    return getattr(importlib.import_module(module), name)


def trainer_config(*overrides: str):
    """The composed config plus Hydra-style `key=value` overrides, as a user would pass them."""
    return OmegaConf.merge(OmegaConf.create(VERL_CONFIG), OmegaConf.from_dotlist(list(overrides)))


PROFILE_ROLLOUT = [
    "global_profiler.tool=torch",
    "global_profiler.steps=[1,3]",
    "actor_rollout_ref.actor.profiler.enable=true",
    "actor_rollout_ref.actor.profiler.all_ranks=true",
    "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true",
    "trainer.resume_mode=disable",
    f"actor_rollout_ref.rollout.agent.agent_loop_manager_class={FQN}",
]


@pytest.mark.slow
def test_in_a_verl_trainer_the_hook_drives_the_profiled_steps_instead_of_verl(fake_verl, replica_factory):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    (replica,) = replica_factory(1, stages=(0,))
    cfg = trainer_config(*PROFILE_ROLLOUT)
    cfg.omni_sidecar = {"targets": [f"upstream={replica.url}"], "deploy_config": str(replica.deploy)}
    trainer = RayPPOTrainer(cfg, [replica.url])
    trainer.init_workers()
    trainer.fit([DataProto({}) for _ in range(3)], steps=3)
    prof = trainer.async_rollout_manager._omni_sidecar
    results = prof.wait(timeout=60)
    prof.close()
    assert trainer.llm_server_manager.profile_calls == []  # verl's own start/stop were skipped
    assert sorted(results) == [1, 3] and all(r.ok for r in results.values())
    assert [c["stages"] for c in replica.calls("/start_profile")] == [[0], [0]]


@pytest.mark.slow
def test_manager_profiles_verl_steps_and_skips_validation(fake_verl, replica_factory):
    replicas = replica_factory(2, stages=(0,))
    cfg = trainer_config(*PROFILE_ROLLOUT)
    cfg.omni_sidecar = {"targets": [f"upstream={r.url}" for r in replicas], "deploy_config": str(replicas[0].deploy)}
    manager_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class)
    manager = manager_cls.create(config=cfg, llm_client=[r.url for r in replicas])
    for step in range(1, 5):  # the fit loop: a sync call per step; validation batches too
        manager.generate_sequences(DataProto({"global_steps": step, "validate": True}))
        manager.generate_sequences(DataProto({"global_steps": step}))
    results = manager._omni_sidecar.wait(timeout=60)
    manager._omni_sidecar.close()
    assert sorted(results) == [1, 3] and all(res.ok and len(res.targets) == 2 for res in results.values())
    assert len(manager.calls) == 8  # generation itself is untouched
    for r in replicas:
        assert len(r.calls("/start_profile")) == 2


@pytest.mark.slow
async def test_manager_with_its_own_steps_when_awaited(fake_verl, replica_factory):
    (replica,) = replica_factory(1, stages=(0,))
    cfg = trainer_config()  # verl's own rollout profiling stays off
    cfg.omni_sidecar = {"targets": [f"upstream={replica.url}"], "deploy_config": str(replica.deploy),
                        "steps": [2], "stages": [0], "wait_artifacts": True}
    manager = load_class_from_fqn(FQN)(config=cfg, llm_client=[replica.url])
    for step in (1, 2):
        await manager.generate_sequences(DataProto({"global_steps": step}))
    manager._omni_sidecar.close()
    assert list(manager._omni_sidecar.results()) == [2] and manager._omni_sidecar.results()[2].ok


def test_without_a_block_the_manager_generates_unprofiled(fake_verl):
    manager = load_class_from_fqn(FQN)(config=trainer_config(*PROFILE_ROLLOUT), llm_client=[])
    manager.generate_sequences(DataProto({"global_steps": 1}))
    assert manager._omni_sidecar is None and manager.calls == [{"global_steps": 1}]


def test_verl_config_that_verl_would_skip_is_refused(fake_verl):
    cfg = trainer_config("global_profiler.steps=[1]", "global_profiler.tool=torch",
                         "actor_rollout_ref.actor.profiler.enable=true")  # discrete stays false
    cfg.omni_sidecar = {"targets": ["sidecar=http://127.0.0.1:9"]}
    with pytest.raises(ValidationFailed) as info:
        load_class_from_fqn(FQN)(config=cfg, llm_client=[])
    assert info.value.code == "verl_not_discrete"


def test_a_bad_hook_block_names_the_key():
    from sidecar.integrations.verl import profiler_from_trainer_config

    with pytest.raises(ConfigError) as info:
        profiler_from_trainer_config({"omni_sidecar": {"targets": [], "stagse": [0]}})
    assert info.value.key.startswith("omni_sidecar.")


def test_the_module_imports_without_verl_and_says_what_is_missing():
    module = importlib.import_module("sidecar.integrations.verl")
    with pytest.raises(ImportError, match="needs verl"):
        module.SidecarAgentLoopManager  # noqa: B018
    assert "verl" not in sys.modules
