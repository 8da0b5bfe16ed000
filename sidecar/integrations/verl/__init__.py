"""verl / verl-omni without a fork. Name ``sidecar.integrations.verl.SidecarAgentLoopManager`` in
``++actor_rollout_ref.rollout.agent.agent_loop_manager_class``: both verl trainers (v1, the
default, and v0 with ``trainer.use_v1=False``) load that class by name and call its ``create``.
It builds verl's own manager (v1 ``AgentLoopManagerTQ``, v0 ``AgentLoopManager``, or the class
in ``omni_sidecar.agent_loop_manager_class``), then finds the trainer that is building it and
takes over the trainer's rollout profiling calls (:mod:`._hook`): the replicas verl chose are
profiled by the sidecar, checked on their nodes, at the steps verl chose; verl's own engine-level
start/stop no longer runs. Configured by an optional top-level ``omni_sidecar:`` block.

verl is optional: this package imports without it (only ``create`` needs it).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sidecar.config.verl import (
    CONFIG_KEY,
    checked_verl,
    installed_verl,
    read_verl_config,
    verl_findings,
)
from sidecar.errors import ConfigError, HookConfigInvalid, ValidationFailed
from sidecar.fleet import START_TIMEOUT_S
from sidecar.integrations.verl._hook import find_trainer
from sidecar.rollout import DEFAULT_LEASE_S, RolloutProfiler

__all__ = [
    "CONFIG_KEY",
    "ENV_TARGETS",
    "SidecarAgentLoopManager",
    "SidecarDiffusionAgentLoopManager",
    "SidecarHookConfig",
    "attach",
    "hook_config",
    "profiler_from_trainer_config",
]

log = logging.getLogger(__name__)

ENV_TARGETS = "OMNI_SIDECAR_TARGETS"  # comma-separated sidecar targets, when the block names none


class SidecarHookConfig(BaseModel):
    """The ``omni_sidecar:`` block; every key is optional. Without ``targets`` the servers,
    their profiler config and trace folders come from verl at run time; ``targets`` (replica
    order) are for people who run ``omni-sidecar serve`` beside each server themselves."""

    model_config = ConfigDict(extra="forbid")

    targets: list[str] | None = None
    stages: list[int] | None = None  # verl-omni (vLLM-Omni servers): the stages to profile
    strict: bool = False
    wait_artifacts: bool = False  # training goes on once the servers answered stop
    lease_s: float | None = Field(default=DEFAULT_LEASE_S, gt=0)
    flavor: Literal["omni", "vllm"] | None = None  # None: vllm for verl's servers, omni for verl-omni's
    deploy_config: str | None = None  # verl-omni: the deploy YAML the servers run (a path on their nodes)
    token_file: str | None = None  # bearer token of sidecar targets
    role: Literal["rollout", "reward"] = "rollout"
    trainer: str | None = None  # the entry module, for `validate` (at run time it is found)
    agent_loop_manager_class: str | None = None  # the manager to build instead of verl's default
    collect_timeout_s: float = Field(default=120.0, ge=0)
    settle_s: float | None = Field(default=None, ge=0)  # removed: accepted (old configs load) with a warning
    start_timeout_s: float = Field(default=START_TIMEOUT_S, gt=0)
    stop_budget_s: float = Field(default=1800.0, gt=0)
    # explicit steps/ranks: only with `targets`, when verl's own rollout profiling is off
    steps: list[int] | None = None
    ranks: list[int] | None = None
    all_ranks: bool = False

    @field_validator("settle_s")
    @classmethod
    def _settle_s_is_gone(cls, value: float | None) -> float | None:
        if value is not None and not _WARNED_SETTLE:
            _WARNED_SETTLE.append(value)
            log.warning("%s.settle_s is no longer read (completeness comes from the trace files; the wait is "
                        "bounded by collect_timeout_s): remove it from the config", CONFIG_KEY)
        return value


_WARNED_SETTLE: list[float] = []  # warned once per process


def _block(config: Any) -> dict[str, Any] | None:
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        # Only our block is resolved: the rest of a composed config may hold `???` placeholders.
        node = OmegaConf.select(config, CONFIG_KEY, default=None)
        block = OmegaConf.to_container(node, resolve=True) if node is not None else None
    else:
        block = config.get(CONFIG_KEY) if isinstance(config, dict) else None
    if os.environ.get(ENV_TARGETS) and not (block or {}).get("targets"):
        block = {**(block or {}), "targets": [t for t in os.environ[ENV_TARGETS].split(",") if t.strip()]}
    return block


def hook_config(config: Any) -> SidecarHookConfig:
    """The ``omni_sidecar`` block of a trainer config (defaults when there is none)."""
    try:
        return SidecarHookConfig.model_validate(_block(config) or {})
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in (CONFIG_KEY, *first["loc"]))
        raise HookConfigInvalid(f"{key}: {first['msg']}", key=key) from None


def profiler_from_trainer_config(config: Any, *, rank_mode: str | None = None, **options: Any) -> RolloutProfiler | None:
    """A :class:`RolloutProfiler` over the block's ``targets`` (``None`` when it names none);
    ``options`` go to it (over the block's own)."""
    if isinstance(config, (str, os.PathLike)):
        from sidecar.config._yaml import load_yaml

        config = load_yaml(config)
    hook = hook_config(config)
    if not hook.targets:
        return None
    token = None
    if hook.token_file:
        from sidecar.config.settings import SidecarSettings

        token = SidecarSettings(token_file=hook.token_file).read_token()
    common: dict[str, Any] = dict(
        stages=hook.stages, strict=hook.strict, wait_artifacts=hook.wait_artifacts, lease_s=hook.lease_s,
        deploy_config=hook.deploy_config, flavor=hook.flavor or "omni", token=token,
        start_timeout_s=hook.start_timeout_s, stop_budget_s=hook.stop_budget_s,
    )
    common.update(options)
    if hook.steps is None:
        return RolloutProfiler.from_verl_config(config, hook.targets, role=hook.role,
                                                rank_mode=rank_mode or installed_verl().rank_mode, **common)
    return RolloutProfiler(hook.targets, hook.steps, ranks=hook.ranks, all_ranks=hook.all_ranks, **common)


# --- attaching to a trainer -----------------------------------------------------------------


def _refuse(hook: SidecarHookConfig, code: str, message: str, findings: list[Any] | None = None) -> None:
    """Strict: raise (verl stops at trainer start). Best effort: one warning, no captures."""
    if hook.strict:
        raise ValidationFailed.relay(code, f"omni-sidecar: {message}", findings=findings or [])
    log.warning("omni-sidecar: rollout is NOT profiled by the sidecar: %s", message)


def attach(agent_loop_manager: Any, config: Any, trainer: Any, *, entry: str | None = None) -> Any:
    """Check what verl will profile for ``trainer`` and take over its rollout profiling calls.
    Returns the hook (``None`` when refused in best-effort mode). ``entry``: the module of the
    trainer's entry point, for the rules of trainers without step profiling."""
    from sidecar.config.verl import ROLE_PATHS, format_replicas
    from sidecar.fleet import Placement, RayNodes, Target
    from sidecar.fleet._ray import deploy_for_server
    from sidecar.integrations.verl._hook import RolloutHook, discover, replicas_of, rollout_managers

    hook = hook_config(config)
    support = checked_verl(strict=hook.strict, log=log)  # outside the table: refused (strict) or warned once
    managers = rollout_managers(trainer, agent_loop_manager)
    if not managers:
        _refuse(hook, "verl_trainer_not_found",
                f"the verl trainer {type(trainer).__qualname__} has no rollout servers (no llm_server_manager); "
                "build the manager from verl's own init path, or drive the profiler yourself "
                "(sidecar.RolloutProfiler, docs/rl.md)")
        return None
    rank_mode = support.rank_mode
    plan = read_verl_config(config, role=hook.role)
    n = max((int(getattr(r, "replica_rank", i)) + 1 for m in managers for i, r in enumerate(replicas_of(m))), default=0)
    every = verl_findings(plan, n_replicas=n, rank_mode=rank_mode, trainer=entry)
    findings = [f for f in every if f.is_error]
    if findings:
        _refuse(hook, findings[0].code, "; ".join(f.message for f in findings), findings)
        return None
    for f in every:  # e.g. a resume past the profiled steps: said at trainer start, not dropped
        log.warning("omni-sidecar: %s", f.message)
    chosen = plan.requested_replicas(rank_mode)
    base = ROLE_PATHS[hook.role]
    if hook.role == "reward" and not hook.targets:
        _refuse(hook, "verl_reward_not_followed",
                "verl drives no step-scoped profiling of reward-model servers (their profiler block is "
                f"verl-omni's `{base}`); name the reward servers' sidecars in `'+{CONFIG_KEY}.targets=[\"sidecar=URL\",...]'`")
        return None
    reached = _reached_steps(plan.steps, trainer)
    if not reached:
        _refuse(hook, "verl_steps_unreachable", _unreached_message(plan.steps, trainer, none=True))
        return None
    if reached != sorted(set(plan.steps)):
        log.warning("omni-sidecar: %s", _unreached_message(plan.steps, trainer, none=False))
    common: dict[str, Any] = dict(
        strict=hook.strict, wait_artifacts=hook.wait_artifacts, lease_s=hook.lease_s,
        artifact_timeout_s=hook.collect_timeout_s + 60, start_timeout_s=hook.start_timeout_s,
        stop_budget_s=hook.stop_budget_s)
    nodes = None
    if hook.targets:
        prof = profiler_from_trainer_config(config, rank_mode=rank_mode, **common)
        assert prof is not None
    else:
        import ray

        if not ray.is_initialized():
            _refuse(hook, "verl_no_ray", "Ray is not initialized: the sidecar checks each replica's traces on its "
                    "node through the Ray cluster verl runs on; start the trainer through verl (it runs ray.init), "
                    f"or name sidecar targets in `'+{CONFIG_KEY}.targets=[\"sidecar=URL\",...]'`")
            return None
        try:
            replicas = discover(managers, chosen, hook.flavor)
        except Exception as exc:
            _refuse(hook, "verl_replicas_unreadable", f"the rollout replicas could not be read from verl: {exc}")
            return None
        placements: dict[str, Placement] = {}
        targets = []
        for r in replicas:
            if r.profiler_config is None:
                _refuse(hook, "verl_replica_not_profiled",
                        f"replica {r.rank} was launched without a profiler config (verl sets `--profiler-config` only "
                        f"on the replicas its rule selects); check `{base}.enable/tool/ranks`")
                return None
            if r.verl_profiles is False:
                log.warning("omni-sidecar: verl's own rule on replica %d says it is not profiled, the sidecar's "
                            "says it is; the sidecar follows its rule (config/verl.py)", r.rank)
            if r.flavor == "omni" and not (hook.deploy_config or hook.stages):
                _refuse(hook, "verl_omni_stages_unknown",
                        f"replica {r.rank} is a vLLM-Omni server; name its stages (`+{CONFIG_KEY}.stages=[0,1]`) "
                        f"or its deploy YAML (`+{CONFIG_KEY}.deploy_config=PATH`)")
                return None
            target = Target.ray(r.http_url, flavor=r.flavor)  # type: ignore[arg-type]
            deploy: Any = (hook.deploy_config or deploy_for_server(r.profiler_config, hook.stages)
                           if r.flavor == "omni" else deploy_for_server(r.profiler_config, None))
            placements[target.name] = Placement(node_id=r.node_id, deploy=deploy)
            targets.append(target)
        nodes = RayNodes(placements, control={"collect_timeout_s": hook.collect_timeout_s})
        try:  # each replica's node profiler up now, at trainer start, not inside step 1's start budget
            nodes.launch(targets, stop_budget_s=hook.stop_budget_s)
        except Exception as exc:
            _refuse(hook, "verl_node_profilers_not_started", str(exc))
            return None
        stages = hook.stages if any(r.flavor == "omni" for r in replicas) else None
        # The replicas verl's rule chose, every one profiled: the rule was applied above.
        prof = RolloutProfiler(targets, plan.steps, stages, drivers=nodes, **common)
    rollout_hook = RolloutHook(trainer=trainer, managers=managers, profiler=prof, save_path=plan.trace_dir,
                               nodes=nodes, last_step=max(reached),
                               wait_timeout_s=hook.collect_timeout_s + 60 + hook.start_timeout_s)
    prof.on_result = rollout_hook._done
    rollout_hook.install()
    log.info("omni-sidecar: follows verl's rollout profiling at steps %s on replicas %s (%s); verl's own "
             "engine start/stop is replaced", plan.steps, format_replicas(chosen), support.describe())
    return rollout_hook


def _trainer_span(trainer: Any) -> tuple[int, int | None]:
    """The steps this run of ``trainer`` can still reach: after ``global_steps`` (a v1 trainer has
    loaded its checkpoint before it builds the manager; v0 sets it in ``fit``) up to
    ``total_training_steps`` (both set by verl's trainers before this point; unknown: unbounded)."""
    def whole(value: Any) -> int | None:
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    done = whole(getattr(trainer, "global_steps", None)) or 0
    return done, whole(getattr(trainer, "total_training_steps", None))


def _reached_steps(steps: list[int], trainer: Any) -> list[int]:
    done, total = _trainer_span(trainer)
    return sorted({s for s in steps if s > done and (total is None or s <= total)})


def _unreached_message(steps: list[int], trainer: Any, *, none: bool) -> str:
    done, total = _trainer_span(trainer)
    span = f"steps {done + 1}..{total}" if total is not None else f"steps from {done + 1}"
    resumed = f" (resumed from a checkpoint at step {done})" if done else ""
    never = sorted({s for s in steps if s <= done or (total is not None and s > total)})
    head = (f"global_profiler.steps {sorted(set(steps))}: none is reached" if none
            else f"global_profiler.steps {never} are never reached, so not profiled")
    return (f"{head}: this run trains {span}{resumed} (trainer.total_training_steps={total}); name steps in "
            f"that range{', or set `trainer.resume_mode=disable`' if done else ''}")


# --- the classes verl loads by name ---------------------------------------------------------


def _load(fqn: str) -> Any:
    import importlib

    module, _, name = fqn.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _use_v1(config: Any) -> bool:
    """``trainer.use_v1`` as set; absent, the installed verl's default: v1 where verl has the v1
    trainer (0.9.1 defaults to it), else v0, said once in the log."""
    trainer = config.get("trainer", {}) if hasattr(config, "get") else {}
    value = trainer.get("use_v1", None) if hasattr(trainer, "get") else None
    if value is not None:
        return bool(value)
    support = installed_verl()
    if support.version is not None and not support.seams.v1_trainer:
        log.info("omni-sidecar: trainer.use_v1 is not set and verl %s has no v1 trainer (verl.trainer.ppo.v1): "
                 "building the v0 agent-loop manager", support.version)
        return False
    return True


class _SidecarFactory:
    """What verl loads by name: ``create`` (and a call of the class) builds verl's manager and
    attaches the hook. The manager returned is verl's own class, unchanged. Sync or async is
    the base's: whatever ``base.create(...)`` returns (a manager, or an awaitable of one) is
    what the caller gets, the hook attached once the manager exists."""

    @classmethod
    def _base(cls, config: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config", args[0] if args else None)
        fqn = hook_config(config).agent_loop_manager_class
        base = _load(fqn) if fqn else cls._base(config)
        # verl hands its trainer over as the `self` of the init method calling this (one, or fail).
        trainer, entry = find_trainer(sys._getframe(1))
        made = base.create(*args, **kwargs) if hasattr(base, "create") else base(*args, **kwargs)
        if inspect.isawaitable(made):
            async def attached() -> Any:
                manager = await made
                attach(manager, config, trainer, entry=entry)
                return manager

            return attached()
        attach(made, config, trainer, entry=entry)
        return made

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # older verl builds the manager by calling the class
        return cls.create(*args, **kwargs)


class SidecarAgentLoopManager(_SidecarFactory):
    """verl's default agent-loop manager (v1: ``AgentLoopManagerTQ``; v0: ``AgentLoopManager``),
    with rollout profiling driven by the sidecar."""

    @classmethod
    def _base(cls, config: Any) -> Any:
        try:
            if _use_v1(config):
                from verl.trainer.ppo.v1 import AgentLoopManagerTQ

                return AgentLoopManagerTQ
            from verl.experimental.agent_loop import AgentLoopManager

            return AgentLoopManager
        except ImportError as err:
            support = installed_verl()
            if support.version is not None:
                raise ImportError(f"{cls.__qualname__}: verl {support.version} has no {err.name or 'such module'} "
                                  f"for trainer.use_v1={_use_v1(config)} ({err}); set trainer.use_v1 to match this "
                                  "verl, or name the manager in omni_sidecar.agent_loop_manager_class") from err
            raise ImportError(f"{cls.__qualname__} needs verl (`pip install verl`); the rest of omni-sidecar "
                              f"works without it ({err})") from err


class SidecarDiffusionAgentLoopManager(_SidecarFactory):
    """verl-omni's diffusion manager (what its trainers build when no manager class is named):
    v1 ``create_diffusion_agent_loop_manager``, v0 verl's manager with verl-omni's diffusion workers."""

    @classmethod
    def _base(cls, config: Any) -> Any:
        try:
            if _use_v1(config):
                from verl_omni.agent_loop import create_diffusion_agent_loop_manager

                return create_diffusion_agent_loop_manager
            import ray
            from verl.experimental.agent_loop import AgentLoopManager
            from verl_omni.agent_loop import DiffusionAgentLoopWorker
        except ImportError as err:
            raise ImportError(f"{cls.__qualname__} needs verl-omni ({err})") from err

        class DiffusionAgentLoopManager(AgentLoopManager):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.agent_loop_workers_class = ray.remote(DiffusionAgentLoopWorker)
                super().__init__(*args, **kwargs)

        return DiffusionAgentLoopManager
