"""The trainer side: follow verl's own rollout profiling calls. verl (v1 ``_start_rollout_profiling``
/ ``on_sample_end`` → ``_stop_rollout_profiling``; v0's fit loop; verl-omni's trainers) calls
``start_profile()`` / ``stop_profile()`` on each rollout ``LLMServerManager`` at the steps it chose.
Those two calls become one :class:`~sidecar.rollout.RolloutProfiler` step: the fleet's fan-out over
the profiled replicas, through the Ray driver (each controller on its replica's node,
``sidecar/fleet/_ray.py``) or over HTTP (sidecar targets named in the block). verl's own
engine-level start/stop never also runs. A step's result goes to
``<save_path>/omni_sidecar/step<N>.json`` and one log line.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.errors import VerlReplicaNotLaunched, VerlTrainerNotFound
from sidecar.fleet import RayNodes
from sidecar.rollout import RolloutProfiler, StepResult

__all__ = ["Replica", "RolloutHook", "discover", "find_trainer", "replicas_of", "rollout_managers"]

log = logging.getLogger("sidecar.integrations.verl")


# --- finding verl's objects -----------------------------------------------------------------

# What the hook reads on verl's objects (tests/verl/test_seams.py checks each on verl's own classes).
TRAINER_READS = ("llm_server_manager", "global_steps", "total_training_steps")  # v1 also `_rollout_server_managers()`
MANAGER_READS = ("get_replicas", "start_profile", "stop_profile")  # LLMServerManager
REPLICA_READS = ("replica_rank", "servers", "server_address")  # RolloutReplica
SERVER_READS = ("profiler_controller", "replica_rank")  # vLLMHttpServer, inside its actor
PROFILER_READS = ("check_enable", "check_this_rank", "is_discrete_mode", "config", "tool_config")


def _trainer_of(owner: Any) -> Any | None:
    """``owner`` itself when it is a verl trainer with rollout servers (v0 ``RayPPOTrainer``, v1
    ``PPOTrainer*``), or the trainer it holds (v1 ``TaskRunnerV1.trainer``)."""
    if hasattr(owner, "llm_server_manager") or hasattr(owner, "_rollout_server_managers"):
        return owner
    inner = getattr(owner, "trainer", None)
    if inner is not None and (hasattr(inner, "llm_server_manager") or hasattr(inner, "_rollout_server_managers")):
        return inner
    return None


def find_trainer(frame: Any) -> tuple[Any, str]:
    """The verl trainer that builds the agent-loop manager: the ``self`` of verl's own init
    method that calls ``create`` (v0 ``RayPPOTrainer.init_workers``; v1
    ``TaskRunnerV1.init_agent_loop_manager``, whose ``self.trainer`` it is), found among the
    callers from ``frame`` up. Exactly one trainer must be there: none or several distinct ones
    raise ``VerlTrainerNotFound`` naming them. Also returns the module of the object that held it
    (the entry point)."""
    found: dict[int, tuple[Any, str]] = {}
    while frame is not None:
        owner = frame.f_locals.get("self")
        trainer = _trainer_of(owner) if owner is not None else None
        if trainer is not None and id(trainer) not in found:
            found[id(trainer)] = (trainer, type(owner).__module__)
        frame = frame.f_back
    if len(found) == 1:
        return next(iter(found.values()))
    if not found:
        raise VerlTrainerNotFound(
            "omni-sidecar: no verl trainer with rollout servers calls the agent-loop manager's create(); "
            "build the manager from verl's trainer (its init_workers / TaskRunnerV1), or drive the profiler "
            "yourself (sidecar.RolloutProfiler, docs/rl.md)")
    names = ", ".join(f"{type(t).__qualname__} ({m})" for t, m in found.values())
    raise VerlTrainerNotFound(
        f"omni-sidecar: {len(found)} verl trainers are up the call stack of create() ({names}); the hook cannot "
        "tell whose steps to follow. Build one trainer's manager at a time",
        details={"trainers": names})


def rollout_managers(trainer: Any, agent_loop_manager: Any) -> list[Any]:
    """The objects verl calls ``start_profile``/``stop_profile`` on for rollout: the trainer's
    rollout ``LLMServerManager``s (verl >= 0.8), else the agent-loop manager itself (older verl)."""
    if trainer is not None:
        managers = getattr(trainer, "_rollout_server_managers", None)
        if callable(managers):
            found = list(managers())
            if found:
                return found
        manager = getattr(trainer, "llm_server_manager", None)
        if manager is not None:
            return [manager]
    if hasattr(agent_loop_manager, "start_profile") and hasattr(agent_loop_manager, "rollout_replicas"):
        return [agent_loop_manager]
    return []


def replicas_of(manager: Any) -> list[Any]:
    getter = getattr(manager, "get_replicas", None)
    return list(getter() if callable(getter) else getattr(manager, "rollout_replicas", []) or [])


def _call_accepting(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with only the keyword arguments its signature accepts (verl's
    ``build_vllm_profiler_args`` took no ``legacy_env`` before 0.9)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def _probe_server(server: Any) -> dict[str, Any]:
    """What verl's rollout server itself holds (run inside the server actor via ``__ray_call__``):
    its node, whether its own profiler rule selects it, and the ``--profiler-config`` it was
    launched with (verl's ``build_vllm_profiler_args``: ``<save_path>/agent_loop_rollout_replica_<rank>``)."""
    import json as _json

    import ray as _ray

    out: dict[str, Any] = {"node_id": _ray.get_runtime_context().get_node_id()}
    ctl = getattr(server, "profiler_controller", None)
    if ctl is not None:
        from verl.utils.profiler import build_vllm_profiler_args

        out["should_profile"] = bool(ctl.check_enable() and ctl.check_this_rank() and ctl.is_discrete_mode())
        args = _call_accepting(build_vllm_profiler_args, ctl.config, ctl.tool_config, server.replica_rank,
                               legacy_env=False)
        if args.get("profiler_config"):
            out["profiler_config"] = _json.loads(args["profiler_config"])
    return out


@dataclass
class Replica:
    """One verl rollout replica as the integration drives it."""

    rank: int
    url: str
    node_id: str
    flavor: str
    profiler_config: dict[str, Any] | None
    verl_profiles: bool | None = None  # verl's own rule on the server, when it could be read

    @property
    def http_url(self) -> str:
        return self.url if "://" in self.url else f"http://{self.url}"


def discover(managers: list[Any], chosen: list[int] | None, flavor: str | None) -> list[Replica]:
    """The chosen replicas (``None``: all) of verl's managers, with address, node and profiler
    config read from verl's own objects (the server actor of each replica's first node)."""
    import ray

    out: list[Replica] = []
    for manager in managers:
        for rep in replicas_of(manager):
            rank = int(getattr(rep, "replica_rank", len(out)))
            if chosen is not None and rank not in chosen:
                continue
            servers = list(getattr(rep, "servers", []) or [])
            if not servers:
                raise VerlReplicaNotLaunched(f"verl rollout replica {rank} has no server actor yet; it is not launched")
            probe = ray.get(servers[0].__ray_call__.remote(_probe_server))
            address = getattr(rep, "server_address", None) or getattr(rep, "_server_address", None)
            kind = flavor or ("omni" if type(rep).__module__.startswith("verl_omni") else "vllm")
            out.append(Replica(rank=rank, url=str(address), node_id=probe["node_id"], flavor=kind,
                               profiler_config=probe.get("profiler_config"), verl_profiles=probe.get("should_profile")))
    return out


# --- the hook on verl's start/stop ----------------------------------------------------------


@dataclass
class RolloutHook:
    """Installed on verl's rollout managers: their ``start_profile`` / ``stop_profile`` run one
    :class:`RolloutProfiler` step for the step verl passes (``global_step=``), else
    ``trainer.global_steps``. ``strict``: failures raise into verl; else they are in the step's
    result and one log line, and training goes on. ``nodes``: the Ray driver factory, when the
    replicas are driven on their nodes (its top ops go into the step's file)."""

    trainer: Any
    managers: list[Any]
    profiler: RolloutProfiler
    save_path: str | None
    nodes: RayNodes | None = None
    # The last step this run reaches and profiles: its check is waited for (bounded) before verl's
    # stop returns, so its result is on disk before a run that ends right after it exits; then the
    # profiler is closed (its node actors ended, nothing left for an exit after ray.shutdown()).
    last_step: int | None = None
    wait_timeout_s: float | None = None
    top_ops: dict[int, dict[str, Any]] = field(default_factory=dict)
    _step: Any = None  # the open step's context manager
    _step_no: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> None:
        """Replace each manager's ``start_profile``/``stop_profile``, keeping verl's calling
        convention: ``auto_await`` (a sync call runs it, an awaiting caller gets a coroutine); a
        verl without it calls plain sync methods. Any arguments verl passes are accepted."""
        try:
            from verl.utils.ray_utils import auto_await
        except ImportError:
            def start_profile(*args: Any, **kwargs: Any) -> None:
                self.start(kwargs.get("global_step"))

            def stop_profile(*args: Any, **kwargs: Any) -> None:
                self.stop()
        else:
            @auto_await
            async def start_profile(*args: Any, **kwargs: Any) -> None:
                await asyncio.to_thread(self.start, kwargs.get("global_step"))

            @auto_await
            async def stop_profile(*args: Any, **kwargs: Any) -> None:
                await asyncio.to_thread(self.stop)

        for manager in self.managers:
            manager.start_profile = start_profile
            manager.stop_profile = stop_profile
            manager._omni_sidecar = self

    def _step_of(self, passed: Any) -> int | None:
        step = passed if passed is not None else getattr(self.trainer, "global_steps", None)
        if isinstance(step, bool) or not (isinstance(step, int) or hasattr(step, "__index__")):
            return None
        return int(step)

    def start(self, global_step: Any = None) -> None:
        step = self._step_of(global_step)
        with self._lock:
            if self._step is not None or step is None:
                return  # already open (a second manager of the same step), or no step to name it by
            cm = self.profiler.step(step)
            cm.__enter__()  # strict: a failure raises into verl here
            self._step, self._step_no = cm, step

    def stop(self) -> None:
        with self._lock:
            cm, step, self._step, self._step_no = self._step, self._step_no, None, None
        if cm is None:
            return  # verl's stop without a start of ours (e.g. continuous steps): nothing is live
        try:
            cm.__exit__(None, None, None)  # strict: a failed stop raises into verl here
        finally:
            if self.last_step is not None and step is not None and step >= self.last_step:
                self.profiler.close(self.wait_timeout_s)  # waits for the check first

    def _done(self, result: StepResult) -> None:
        """``on_result``: the step's result on disk (where verl writes its profiles), one log line."""
        top = {name: self.nodes.top_ops(name, r.capture_id) for name, r in result.targets.items()} if self.nodes else {}
        self.top_ops[result.step] = top
        where = None
        if self.save_path:
            try:
                folder = Path(self.save_path) / "omni_sidecar"
                folder.mkdir(parents=True, exist_ok=True)
                where = folder / f"step{result.step}.json"
                body = {"step": result.step, "ok": result.ok, "result": result.model_dump(mode="json"),
                        "folders": result.folders, "top_ops": top}
                tmp = where.with_suffix(".json.tmp")
                tmp.write_text(json.dumps(body, indent=2))
                tmp.replace(where)
            except OSError as exc:
                log.warning("omni-sidecar: cannot write the step result under %s: %s", self.save_path, exc)
                where = None
        at = f"; result in {where}" if where else ""
        if result.ok:
            log.info("omni-sidecar: rollout step %d profiled on %d replica(s), traces ok%s", result.step,
                     len(result.targets), at)
        else:
            log.warning("omni-sidecar: %s%s", self.profiler._describe(result) if result.error is None
                        else f"rollout step {result.step}: {result.error.message}", at)

    def wait(self, timeout: float | None = None) -> dict[int, StepResult]:
        """Every step's result, once the last artifact check is over (or ``timeout``)."""
        return self.profiler.wait(timeout)

    def close(self, timeout: float | None = 120.0) -> None:
        self.profiler.close(timeout)
