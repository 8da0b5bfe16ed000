"""The verl integration's own logic, without verl (the real wheel runs in the ``-m verl`` group,
tests/verl/): the hook follows the start/stop calls a trainer makes on its rollout manager
(``sidecar=``/``upstream=`` targets, real emulators), writes one result per step, and the package
imports without verl.

Each replica has its own trace folders (a shared ``torch_profiler_dir`` is refused up front): the
block's one ``deploy_config`` is replica 0's, so replica 0 is an ``upstream=`` target and the
others are ``sidecar=`` targets, each sidecar started with its own replica's deploy YAML.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.errors import ConfigError
from sidecar.integrations.verl import attach, hook_config

HAVE_VERL = importlib.util.find_spec("verl") is not None


def _trainer_config(save_path: str, targets: list[str], deploy: str) -> dict[str, Any]:
    """The keys of verl's composed ppo_trainer config the integration reads, plus its block."""
    return {
        "global_profiler": {"tool": "torch", "steps": [1, 3], "save_path": save_path},
        "actor_rollout_ref": {"rollout": {"profiler": {
            "tool": "torch", "enable": True, "all_ranks": True, "ranks": [], "save_path": save_path,
            "tool_config": {"torch": {"discrete": True, "contents": []}}}}},
        "trainer": {"resume_mode": "disable"},
        "omni_sidecar": {"targets": targets, "deploy_config": deploy, "settle_s": 0.3},
    }


def _targets(replicas: list[Any], sidecar_factory: Any) -> list[str]:
    """Replica 0 driven in-process (``upstream=``, the block's deploy_config), every other replica
    through its own sidecar: no two targets share a trace folder."""
    return [f"upstream={replicas[0].url}"] + [
        f"sidecar={sidecar_factory(r.url, r.deploy).url}" for r in replicas[1:]
    ]


class Trainer:
    """What a verl trainer holds for rollout profiling: ``global_steps`` and an
    ``llm_server_manager`` whose ``start_profile``/``stop_profile`` it calls at profiled steps."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.global_steps = 0
        self.verl_calls: list[str] = []
        self.llm_server_manager = SimpleNamespace(
            get_replicas=lambda: [SimpleNamespace(replica_rank=0), SimpleNamespace(replica_rank=1)],
            start_profile=lambda **_: self.verl_calls.append("start"),
            stop_profile=lambda: self.verl_calls.append("stop"))

    def init_workers(self) -> Any:
        return attach(SimpleNamespace(), self.config, sys._getframe())


@pytest.mark.slow
def test_the_hook_follows_the_trainers_calls_and_writes_one_result_per_step(replica_factory, sidecar_factory, tmp_path):
    replicas = replica_factory(2, stages=(0,))
    save = tmp_path / "profile"
    trainer = Trainer(_trainer_config(str(save), _targets(replicas, sidecar_factory), str(replicas[0].deploy)))
    hook = trainer.init_workers()
    manager = trainer.llm_server_manager
    for step in range(1, 5):
        trainer.global_steps = step
        if step in (1, 3):
            manager.start_profile()
            manager.start_profile()  # a second rollout manager of the same step: one window
        for r in replicas:
            r.generate()
        if step in (1, 3):
            manager.stop_profile()
            manager.stop_profile()
        if step == 2:
            manager.stop_profile()  # a stop without a start (continuous steps): nothing is live
    results = hook.wait(timeout=120)
    hook.close()
    assert trainer.verl_calls == []  # the trainer's own start/stop were replaced
    assert sorted(results) == [1, 3] and all(r.ok and len(r.targets) == 2 for r in results.values())
    for r in replicas:
        assert len(r.calls("/start_profile")) == 2 and len(r.sessions(0)) == 2
    written = sorted(p.name for p in (save / "omni_sidecar").iterdir())
    assert written == ["step1.json", "step3.json"]
    assert json.loads((save / "omni_sidecar" / "step3.json").read_text())["ok"] is True


def test_a_bad_hook_block_names_the_key():
    with pytest.raises(ConfigError) as info:
        hook_config({"omni_sidecar": {"stagse": [0]}})
    assert info.value.key == "omni_sidecar.stagse"


@pytest.mark.skipif(HAVE_VERL, reason="verl is installed: the -m verl group covers the real classes")
def test_the_package_imports_without_verl_and_says_what_is_missing():
    module = importlib.import_module("sidecar.integrations.verl")
    with pytest.raises(ImportError, match="needs verl"):
        module.SidecarAgentLoopManager.create(config={"trainer": {}})
    assert "verl" not in sys.modules


@pytest.mark.slow
def test_best_effort_a_failed_start_is_in_the_steps_result_and_one_log_line(
    replica_factory, sidecar_factory, tmp_path, caplog
):
    import logging

    replicas = replica_factory(2, stages=(0,), faults={1: ["--fault-start-500"]})
    save = tmp_path / "profile"
    trainer = Trainer(_trainer_config(str(save), _targets(replicas, sidecar_factory), str(replicas[0].deploy)))
    hook = trainer.init_workers()
    trainer.global_steps = 1
    with caplog.at_level(logging.WARNING, logger="sidecar.integrations.verl"):
        trainer.llm_server_manager.start_profile()  # does not raise: training goes on
        trainer.llm_server_manager.stop_profile()
    results = hook.wait(timeout=120)
    hook.close()
    assert results[1].error is not None and not results[1].ok
    ours = [r for r in caplog.records if r.name == "sidecar.integrations.verl"]
    assert len(ours) == 1 and "rollout step 1" in ours[0].getMessage()
    assert json.loads((save / "omni_sidecar" / "step1.json").read_text())["ok"] is False
    assert not any(r.profiling()[0] for r in replicas)  # the started replica was rolled back
