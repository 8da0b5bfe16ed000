"""The verl integration's own logic, without verl (the real wheel runs in the ``-m verl`` group,
tests/verl/): the hook follows the start/stop calls a trainer makes on its rollout manager
(``sidecar=``/``upstream=`` targets), writes one result per step, and the package imports
without verl. The hook's logic needs no real server: replica 0 is an in-process fake upstream
(``upstream=``, the block's one ``deploy_config``), replica 1 a stub sidecar (``sidecar=``,
tests/fixtures/stubs.py), so no two targets share a trace folder. The fleet over a real sidecar
and emulators is test_fleet.py's; the real verl wheel over emulators is tests/verl/'s.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.errors import ConfigError
from sidecar.integrations.verl import attach, hook_config
from tests.fixtures.stubs import StubFleet

HAVE_VERL = importlib.util.find_spec("verl") is not None


def _trainer_config(save_path: str, targets: list[str], deploy: str) -> dict[str, Any]:
    """The keys of verl's composed ppo_trainer config the integration reads, plus its block."""
    return {
        "global_profiler": {"tool": "torch", "steps": [1, 3], "save_path": save_path},
        "actor_rollout_ref": {"rollout": {"profiler": {
            "tool": "torch", "enable": True, "all_ranks": True, "ranks": [], "save_path": save_path,
            "tool_config": {"torch": {"discrete": True, "contents": []}}}}},
        "trainer": {"resume_mode": "disable"},
        "omni_sidecar": {"targets": targets, "deploy_config": deploy},
    }


def _trainer(save: Path, upstream: Any, sidecar: StubFleet) -> Trainer:
    """Replica 0 driven in-process (``upstream=``, the block's deploy_config), replica 1 through
    its (stub) sidecar."""
    targets = [f"upstream={upstream.url}", f"sidecar={sidecar.urls[0]}"]
    return Trainer(_trainer_config(str(save), targets, str(upstream.deploy)))


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
        return attach(SimpleNamespace(), self.config, self)


def test_the_hook_follows_the_trainers_calls_and_writes_one_result_per_step(fake_replica_factory, tmp_path):
    (upstream,) = fake_replica_factory(1, stages=(0,))
    save = tmp_path / "profile"
    with StubFleet(1, mode="sidecar", root=tmp_path / "stubs") as sidecar:
        trainer = _trainer(save, upstream, sidecar)
        hook = trainer.init_workers()
        manager = trainer.llm_server_manager
        for step in range(1, 5):
            trainer.global_steps = step
            if step in (1, 3):
                manager.start_profile()
                manager.start_profile()  # a second rollout manager of the same step: one window
            if step in (1, 3):
                manager.stop_profile()
                manager.stop_profile()
            if step == 2:
                manager.stop_profile()  # a stop without a start (continuous steps): nothing is live
        results = hook.wait(timeout=120)
        hook.close()
        sidecar_starts = sidecar.received("/v1/captures")[0]
        sidecar_stops = [p for m, p, _ in sidecar.log()[0]["calls"] if m == "POST" and p.endswith("/stop")]
    assert trainer.verl_calls == []  # the trainer's own start/stop were replaced
    assert sorted(results) == [1, 3] and all(r.ok and len(r.targets) == 2 for r in results.values())
    assert len(upstream.calls("/start_profile")) == 2 and len(upstream.calls("/stop_profile")) == 2
    assert len(sidecar_starts) == 2 and len(sidecar_stops) == 2
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


def test_best_effort_a_failed_start_is_in_the_steps_result_and_one_log_line(fake_replica_factory, tmp_path, caplog):
    import logging

    (upstream,) = fake_replica_factory(1, stages=(0,))
    save = tmp_path / "profile"
    with StubFleet(1, mode="sidecar", root=tmp_path / "stubs", faults={0: "refuse_start"}) as sidecar:
        trainer = _trainer(save, upstream, sidecar)
        hook = trainer.init_workers()
        trainer.global_steps = 1
        with caplog.at_level(logging.WARNING, logger="sidecar.integrations.verl"):
            trainer.llm_server_manager.start_profile()  # does not raise: training goes on
            trainer.llm_server_manager.stop_profile()
        results = hook.wait(timeout=120)
        hook.close()
        assert not sidecar.log()[0]["recording"]
    assert results[1].error is not None and not results[1].ok
    ours = [r for r in caplog.records if r.name == "sidecar.integrations.verl"]
    assert len(ours) == 1 and "rollout step 1" in ours[0].getMessage()
    assert json.loads((save / "omni_sidecar" / "step1.json").read_text())["ok"] is False
    # the started replica was rolled back
    assert upstream.profiling() == {0: False} and len(upstream.calls("/stop_profile")) == 1


# --- the seams: what verl passes, what verl returns, which verl is installed -------------------


class _SyncManager:
    """An agent-loop manager whose ``create`` is sync (what auto_await makes of verl's own)."""

    @classmethod
    def create(cls, **kwargs: Any) -> _SyncManager:
        return cls()


class _AsyncManager:
    """An agent-loop manager whose ``create`` is a plain coroutine function (no auto_await)."""

    @classmethod
    async def create(cls, **kwargs: Any) -> _AsyncManager:
        return cls()


def _hooked_trainer(tmp_path: Path, manager_class: str) -> Trainer:
    cfg = _trainer_config(str(tmp_path / "profile"), ["sidecar=http://127.0.0.1:9", "sidecar=http://127.0.0.1:10"],
                          str(tmp_path / "deploy.yaml"))
    cfg["omni_sidecar"]["agent_loop_manager_class"] = manager_class
    return Trainer(cfg)


def _init_workers(self: Trainer) -> Any:
    """Shaped like verl's init_workers: the trainer is the caller's ``self``."""
    from sidecar.integrations.verl import SidecarAgentLoopManager

    return SidecarAgentLoopManager.create(config=self.config, llm_client=None)


def test_a_sync_create_gives_the_manager_with_the_hook_attached(tmp_path):
    trainer = _hooked_trainer(tmp_path, f"{__name__}._SyncManager")
    manager = _init_workers(trainer)
    assert type(manager) is _SyncManager
    trainer.llm_server_manager._omni_sidecar.close()


async def test_an_async_create_gives_an_awaitable_and_attaches_once_awaited(tmp_path):
    trainer = _hooked_trainer(tmp_path, f"{__name__}._AsyncManager")
    made = _init_workers(trainer)
    assert inspect.isawaitable(made) and not hasattr(trainer.llm_server_manager, "_omni_sidecar")
    assert type(await made) is _AsyncManager
    trainer.llm_server_manager._omni_sidecar.close()


def test_start_profile_takes_verls_arguments_and_prefers_the_step_passed(fake_replica_factory, tmp_path):
    with StubFleet(1, mode="sidecar", root=tmp_path / "stubs") as sidecar:
        trainer = _trainer(tmp_path / "profile", fake_replica_factory(1, stages=(0,))[0], sidecar)
        hook = trainer.init_workers()
        trainer.global_steps = 2  # not profiled: the step verl passes wins
        trainer.llm_server_manager.start_profile("positional", global_step=3, other="ignored")
        trainer.llm_server_manager.stop_profile("positional", flag=True)
        results = hook.wait(timeout=120)
        hook.close()
    assert sorted(results) == [3] and results[3].ok
    assert json.loads((tmp_path / "profile" / "omni_sidecar" / "step3.json").read_text())["step"] == 3


def test_keyword_arguments_reach_only_a_signature_that_takes_them():
    from sidecar.integrations.verl._hook import _call_accepting

    def old(profiler_config, tool_config, rank):  # the verl that verl-omni pins
        return (profiler_config, tool_config, rank)

    def new(profiler_config, tool_config, rank, legacy_env=True):  # verl 0.9.1
        return (profiler_config, tool_config, rank, legacy_env)

    assert _call_accepting(old, "p", "t", 1, legacy_env=False) == ("p", "t", 1)
    assert _call_accepting(new, "p", "t", 1, legacy_env=False) == ("p", "t", 1, False)


def test_without_use_v1_a_verl_with_no_v1_trainer_builds_v0_and_says_why(tmp_path, monkeypatch, caplog):
    import logging

    from sidecar.integrations.verl import SidecarAgentLoopManager
    from tests.test_config_verl import _fake_verl

    monkeypatch.syspath_prepend(str(_fake_verl(tmp_path, "0.8.2", global_rule=False)))
    with caplog.at_level(logging.INFO, logger="sidecar.integrations.verl"), \
            pytest.raises(ImportError, match=r"verl 0\.8\.2 has no .* for trainer\.use_v1=False"):
        SidecarAgentLoopManager.create(config={"trainer": {}})  # the fake cannot be imported: v0's import fails
    assert any("trainer.use_v1 is not set and verl 0.8.2 has no v1 trainer" in r.getMessage() for r in caplog.records)


_EXITS_RIGHT_AFTER = """
import json, sys
from types import SimpleNamespace
from sidecar.integrations.verl import attach

class Trainer:  # exits as soon as verl's last stop returns: no wait(), no close()
    def __init__(self, config):
        self.config, self.global_steps = config, 0
        self.llm_server_manager = SimpleNamespace(get_replicas=lambda: [], start_profile=None, stop_profile=None)

trainer = Trainer(json.loads(sys.argv[1]))
attach(SimpleNamespace(), trainer.config, trainer)
for step in (1, 2, 3):
    trainer.global_steps = step
    if step in (1, 3):
        trainer.llm_server_manager.start_profile()
        trainer.llm_server_manager.stop_profile()
"""


def test_no_step_result_is_lost_when_the_trainer_exits_right_after_the_last_step(fake_replica_factory, tmp_path):
    import os
    import subprocess

    (upstream,) = fake_replica_factory(1, stages=(0,))
    upstream.fake.gzip_delay = 1.0  # each check is still running when verl's stop returns
    save = tmp_path / "profile"
    with StubFleet(1, mode="sidecar", root=tmp_path / "stubs") as sidecar:
        cfg = _trainer_config(str(save), [f"upstream={upstream.url}", f"sidecar={sidecar.urls[0]}"], str(upstream.deploy))
        cfg["global_profiler"]["steps"] = [1, 3, 9]  # the run ends before step 9: step 3 is not waited for in its stop
        root = Path(__file__).resolve().parents[1]
        ran = subprocess.run([sys.executable, "-c", _EXITS_RIGHT_AFTER, json.dumps(cfg)], capture_output=True,
                             text=True, timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert ran.returncode == 0, ran.stderr
    for step in (1, 3):
        body = json.loads((save / "omni_sidecar" / f"step{step}.json").read_text())
        assert body["ok"] and body["result"]["targets"], ran.stderr
