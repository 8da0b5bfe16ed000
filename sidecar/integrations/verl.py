"""verl / verl-omni without a fork: an ``AgentLoopManager`` subclass that wraps
``generate_sequences`` in :class:`~sidecar.rollout.RolloutProfiler`, selected with
``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` and configured by a top-level
``omni_sidecar:`` block of the trainer config. verl is optional: this module imports without it,
and only the manager classes need it (they are built on first access).

verl puts the training step in ``prompts.meta_info["global_steps"]`` before calling
``generate_sequences`` and marks validation batches with ``meta_info["validate"]``; validation is
never profiled, and a step is profiled once even if verl generates several times in it.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sidecar.errors import HookConfigInvalid
from sidecar.rollout import RolloutProfiler

__all__ = [
    "CONFIG_KEY",
    "ENV_TARGETS",
    "SidecarHookConfig",
    "profiler_from_trainer_config",
    "profiled_step",
    "SidecarAgentLoopManager",
    "SidecarDiffusionAgentLoopManager",
]

log = logging.getLogger(__name__)

CONFIG_KEY = "omni_sidecar"
ENV_TARGETS = "OMNI_SIDECAR_TARGETS"  # comma-separated targets, when the config has no block


class SidecarHookConfig(BaseModel):
    """The ``omni_sidecar:`` block. ``targets`` are in replica order (rank i = targets[i]).
    ``steps: null`` takes ``global_profiler.steps`` and the replica ranks from verl's rollout
    profiler block, refusing what verl would skip; explicit ``steps`` (with ``ranks`` /
    ``all_ranks``) are for when verl's own rollout profiling is off (see docs/rl.md)."""

    model_config = ConfigDict(extra="forbid")

    targets: list[str] = Field(min_length=1)
    steps: list[int] | None = None
    stages: list[int] | None = None
    ranks: list[int] | None = None
    all_ranks: bool = False
    role: Literal["rollout", "reward"] = "rollout"
    strict: bool = False
    # A trainer should not wait for the artifact check: the next step starts once upstream answered.
    wait_artifacts: bool = False
    deploy_config: str | None = None  # for upstream=URL targets
    flavor: Literal["omni", "vllm"] = "omni"
    token_file: str | None = None  # bearer token of the sidecar targets
    lease_s: float | None = Field(default=None, gt=0)
    # verl's trainer calls llm_server_manager.start_profile()/stop_profile() itself at its profiled
    # steps; on the same servers that is a second start (an empty session folder). By default the
    # hook takes over: those two calls become no-ops on the trainer that builds this manager.
    take_over: bool = True


def _block(config: Any) -> dict[str, Any] | None:
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        # Only our block is resolved: the rest of a composed config may hold `???` placeholders.
        node = OmegaConf.select(config, CONFIG_KEY, default=None)
        block = OmegaConf.to_container(node, resolve=True) if node is not None else None
    else:
        block = config.get(CONFIG_KEY) if isinstance(config, dict) else None
    if block is None and os.environ.get(ENV_TARGETS):
        block = {"targets": [t for t in os.environ[ENV_TARGETS].split(",") if t.strip()]}
    return block


def profiler_from_trainer_config(config: Any) -> RolloutProfiler | None:
    """The hook for a verl trainer config (dict, OmegaConf or YAML path), or ``None`` when it has
    no ``omni_sidecar`` block (and ``OMNI_SIDECAR_TARGETS`` is unset): then the hook does nothing."""
    if isinstance(config, (str, os.PathLike)):
        from sidecar.config._yaml import load_yaml

        raw = load_yaml(config)
    else:
        raw = config
    block = _block(raw)
    if block is None:
        log.info("omni-sidecar: no `%s` block in the trainer config; rollout is not profiled by the sidecar",
                 CONFIG_KEY)
        return None
    try:
        hook = SidecarHookConfig.model_validate(block)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in (CONFIG_KEY, *first["loc"]))
        raise HookConfigInvalid(f"{key}: {first['msg']}", key=key) from None
    token = None
    if hook.token_file:
        from sidecar.config.settings import SidecarSettings

        token = SidecarSettings(token_file=hook.token_file).read_token()
    common: dict[str, Any] = dict(
        stages=hook.stages, strict=hook.strict, wait_artifacts=hook.wait_artifacts, lease_s=hook.lease_s,
        deploy_config=hook.deploy_config, flavor=hook.flavor, token=token,
    )
    if hook.steps is None:
        return RolloutProfiler.from_verl_config(config, hook.targets, role=hook.role, **common)
    return RolloutProfiler(hook.targets, hook.steps, ranks=hook.ranks, all_ranks=hook.all_ranks, **common)


def profiled_step(prompts: Any) -> Any | None:
    """The training step of a ``generate_sequences`` batch, or ``None`` (validation, no step)."""
    meta = getattr(prompts, "meta_info", None) or {}
    if meta.get("validate"):
        return None
    return meta.get("global_steps")


def _take_over(frame: Any, depth: int = 40) -> bool:
    """Make verl's own rollout start/stop no-ops on the trainer building this manager (found up
    the call stack as the object with ``llm_server_manager``), keeping their calling convention."""
    try:
        from verl.utils.ray_utils import auto_await
    except ImportError:  # older verl: plain sync methods

        def skipped(*_: Any, **__: Any) -> None:
            return None
    else:

        @auto_await
        async def skipped(*_: Any, **__: Any) -> None:
            return None

    while frame is not None and depth > 0:
        owner = frame.f_locals.get("self")
        manager = getattr(owner, "llm_server_manager", None)
        if manager is not None and hasattr(manager, "start_profile") and hasattr(manager, "stop_profile"):
            manager.start_profile = skipped
            manager.stop_profile = skipped
            log.info("omni-sidecar: drives rollout profiling; verl's llm_server_manager start/stop are skipped")
            return True
        frame, depth = frame.f_back, depth - 1
    return False


class _SidecarHooked:
    """What both manager classes add: a profiler built from the trainer config in ``__init__``."""

    _omni_sidecar: RolloutProfiler | None = None

    def _omni_sidecar_init(self, config: Any) -> None:
        self._omni_sidecar = profiler_from_trainer_config(config)
        block = _block(config) or {}
        if self._omni_sidecar is not None and block.get("take_over", True):
            if not _take_over(inspect.currentframe()):
                log.warning(
                    "omni-sidecar: no verl trainer found up the stack; if verl's own rollout profiler "
                    "also drives these servers, each profiled step is started twice (empty session folder)"
                )


def _manager_class(base: type, name: str, *, workers: Any = None) -> type:
    """``base`` with ``generate_sequences`` wrapped, keeping verl's calling convention: verl's is
    ``@auto_await async def`` (callable sync or awaited); older verl has a plain sync method."""
    parent = base.generate_sequences  # the wrapped one: verl's decorators (auto_await, skip) stay on
    is_async = inspect.iscoroutinefunction(inspect.unwrap(parent))

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if workers is not None and not hasattr(self, "agent_loop_workers_class"):
            # verl-omni sets its diffusion workers on the stock manager only when no custom
            # manager is configured; a custom manager must do the same itself.
            self.agent_loop_workers_class = workers()
        base.__init__(self, config, *args, **kwargs)
        self._omni_sidecar_init(config)

    if is_async:
        from verl.utils.ray_utils import auto_await

        async def _generate(self: Any, prompts: Any) -> Any:
            step = profiled_step(prompts) if self._omni_sidecar is not None else None
            if step is None:
                return await parent(self, prompts)
            async with self._omni_sidecar.astep(step):
                return await parent(self, prompts)

        generate_sequences = auto_await(_generate)
    else:

        def generate_sequences(self: Any, prompts: Any) -> Any:  # type: ignore[misc]
            step = profiled_step(prompts) if self._omni_sidecar is not None else None
            if step is None:
                return parent(self, prompts)
            with self._omni_sidecar.step(step):
                return parent(self, prompts)

    generate_sequences.__doc__ = "verl's generate_sequences, profiled by omni-sidecar at the configured steps."
    return type(name, (_SidecarHooked, base), {
        "__init__": __init__,
        "generate_sequences": generate_sequences,
        "__module__": __name__,
        "__qualname__": name,
    })


def _diffusion_workers() -> Any:
    import ray
    from verl_omni.agent_loop import DiffusionAgentLoopWorker

    return ray.remote(DiffusionAgentLoopWorker)


def _build(name: str) -> type:
    try:
        from verl.experimental.agent_loop import AgentLoopManager
    except ImportError as err:
        raise ImportError(
            f"sidecar.integrations.verl.{name} needs verl (`pip install verl`); "
            f"the rest of omni-sidecar works without it ({err})"
        ) from err
    if name == "SidecarDiffusionAgentLoopManager":
        return _manager_class(AgentLoopManager, name, workers=_diffusion_workers)
    return _manager_class(AgentLoopManager, name)


_LAZY = ("SidecarAgentLoopManager", "SidecarDiffusionAgentLoopManager")


def __getattr__(name: str) -> Any:
    # verl resolves the manager by FQN (importlib + getattr), which lands here.
    if name in _LAZY:
        cls = _build(name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
