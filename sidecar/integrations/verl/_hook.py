"""The trainer side: follow verl's own rollout profiling calls. verl (v1 ``_start_rollout_profiling``
/ ``on_sample_end`` → ``_stop_rollout_profiling``; v0's fit loop; verl-omni's trainers) calls
``start_profile()`` / ``stop_profile()`` on each rollout ``LLMServerManager`` at the steps it chose.
Those two calls become the sidecar's: one capture per profiled replica, checked on the replica's
node (:mod:`._node`), so verl's own engine-level start/stop never also runs. A step's result goes
to ``<save_path>/omni_sidecar/step<N>.json`` and one log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.control.models import Capture
from sidecar.errors import FleetError, SidecarError, VerlReplicaNotLaunched
from sidecar.fleet import TargetError, TargetKind, TargetOutcome, TargetResult
from sidecar.rollout import StepResult

__all__ = ["NodeCaptures", "Replica", "RolloutHook", "TargetCaptures", "find_trainer", "rollout_managers"]

log = logging.getLogger("sidecar.integrations.verl")


# --- finding verl's objects -----------------------------------------------------------------


def find_trainer(frame: Any, depth: int = 40) -> tuple[Any, str] | None:
    """The verl trainer that is building the agent-loop manager, up the call stack: v0's
    ``RayPPOTrainer.init_workers`` (``self.llm_server_manager``) or v1's ``TaskRunnerV1`` (the
    trainer is ``self.trainer``). Also returns the module of the object found (the entry point)."""
    while frame is not None and depth > 0:
        owner = frame.f_locals.get("self")
        if owner is not None:
            if hasattr(owner, "llm_server_manager") or hasattr(owner, "_rollout_server_managers"):
                return owner, type(owner).__module__
            inner = getattr(owner, "trainer", None)
            if inner is not None and hasattr(inner, "llm_server_manager"):
                return inner, type(owner).__module__
        frame, depth = frame.f_back, depth - 1
    return None


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
        args = build_vllm_profiler_args(ctl.config, ctl.tool_config, server.replica_rank, legacy_env=False)
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
    def name(self) -> str:
        return f"replica{self.rank}=http://{self.url}" if "://" not in self.url else f"replica{self.rank}={self.url}"

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


# --- windows: one capture per profiled replica, per verl start/stop ------------------------


def _target_error(reply: dict[str, Any]) -> TargetError:
    err = reply.get("error") or {}
    return TargetError(code=str(err.get("code", "internal_error")), message=str(err.get("message", "?")))


class NodeCaptures:
    """Captures on verl-launched replicas, each driven by a :class:`._node.ReplicaProfiler`
    actor placed on the replica's node. Start is all or nothing (a failure stops the started
    ones); stop returns once every server answered; the artifact checks finish on the nodes."""

    def __init__(self, replicas: list[Replica], *, deploys: dict[int, dict[str, Any] | str], stages: list[int] | None,
                 lease_s: float | None, control: dict[str, Any], start_timeout_s: float, stop_budget_s: float,
                 artifact_timeout_s: float | None) -> None:
        self.replicas = replicas
        self.deploys = deploys
        self.stages = stages
        self.lease_s = lease_s
        self.control = control
        self.start_timeout_s = start_timeout_s
        self.stop_budget_s = stop_budget_s
        self.artifact_timeout_s = artifact_timeout_s
        self._actors: dict[str, Any] = {}
        self._live: dict[str, str] = {}  # target name -> capture id
        self._beat: threading.Event | None = None

    def _open(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from sidecar.integrations.verl._node import ReplicaProfiler

        remote = ray.remote(num_cpus=0)(ReplicaProfiler)
        todo = {}
        for r in self.replicas:
            if r.name in self._actors:
                continue
            actor = remote.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=r.node_id, soft=False),
            ).remote(r.http_url, self.deploys[r.rank], flavor=r.flavor, stop_budget_s=self.stop_budget_s,
                     control=self.control)
            todo[r.name] = actor
        replies = ray.get([a.open.remote() for a in todo.values()], timeout=self.start_timeout_s)
        bad = {n: _target_error(rep) for n, rep in zip(todo, replies) if not rep.get("ok")}
        for name, actor in todo.items():
            if name in bad:
                ray.kill(actor)
            else:
                self._actors[name] = actor
        if bad:
            raise FleetError.relay(next(iter(bad.values())).code, "; ".join(f"{n}: {e.message}" for n, e in bad.items()))

    def start(self, step: int) -> StepResult:
        import ray

        label = f"step{step}"
        result = StepResult(step=step, label=label)
        try:
            self._open()
            names = [r.name for r in self.replicas]
            replies = ray.get([self._actors[n].start.remote(self.stages, label, self.lease_s) for n in names],
                              timeout=self.start_timeout_s)
        except Exception as exc:
            return result.model_copy(update={"error": _as_target_error(exc)})
        targets: dict[str, TargetResult] = {}
        for name, reply in zip(names, replies):
            base = TargetResult(target=name, kind=TargetKind.upstream, outcome=TargetOutcome.started)
            if reply.get("ok"):
                targets[name] = base.with_capture(Capture.model_validate(reply["capture"]))
            else:
                targets[name] = base.model_copy(update={"outcome": TargetOutcome.start_failed,
                                                        "error": _target_error(reply)})
        started = {n: t.capture_id for n, t in targets.items() if t.outcome is TargetOutcome.started and t.capture_id}
        if len(started) < len(targets):  # all or nothing: undo the started ones
            undone = ray.get([self._actors[n].stop.remote(c) for n, c in started.items()], timeout=self.stop_budget_s)
            for (name, _), reply in zip(started.items(), undone):
                outcome = TargetOutcome.rolled_back if reply.get("ok") else TargetOutcome.rollback_failed
                targets[name] = targets[name].model_copy(update={"outcome": outcome})
            bad = [t for t in targets.values() if t.outcome is TargetOutcome.start_failed]
            return StepResult(step=step, label=label, targets=targets, error=TargetError(
                code=bad[0].error.code if bad[0].error else "start_failed",
                message=f"start failed on {len(bad)} of {len(targets)} replicas: "
                        + "; ".join(f"{t.target}: {t.error.message if t.error else '?'}" for t in bad)))
        self._live = started
        self._heartbeats()
        return StepResult(step=step, label=label, targets=targets)

    def _heartbeats(self) -> None:
        if self.lease_s is None:
            return
        import ray

        stop = self._beat = threading.Event()
        live = dict(self._live)
        actors = dict(self._actors)

        def beat() -> None:
            while not stop.wait(self.lease_s / 3):  # type: ignore[operator]
                try:
                    ray.get([actors[n].heartbeat.remote(c) for n, c in live.items()], timeout=self.lease_s / 3)
                except Exception as exc:  # the lease is the safety net
                    log.debug("omni-sidecar: heartbeat failed: %s", exc)

        threading.Thread(target=beat, name="omni-sidecar-verl-heartbeat", daemon=True).start()

    def stop(self, result: StepResult) -> tuple[StepResult, Callable[[], tuple[StepResult, dict[str, Any]]]]:
        """Stop every live capture; returns the result as of the servers' answers and a callable
        that waits for the node-side artifact checks (verdicts, top ops)."""
        import ray

        if self._beat is not None:
            self._beat.set()
            self._beat = None
        live, self._live = self._live, {}
        targets = dict(result.targets)
        try:
            replies = ray.get([self._actors[n].stop.remote(c) for n, c in live.items()], timeout=self.stop_budget_s)
        except Exception as exc:
            err = _as_target_error(exc)
            for n in live:
                targets[n] = targets[n].model_copy(update={"outcome": TargetOutcome.stop_failed, "error": err})
            done = result.model_copy(update={"targets": targets})
            return done, lambda: (done, {})
        for (name, _), reply in zip(live.items(), replies):
            if reply.get("ok"):
                targets[name] = targets[name].with_capture(Capture.model_validate(reply["capture"]),
                                                           outcome=TargetOutcome.stopped)
            else:
                targets[name] = targets[name].model_copy(update={"outcome": TargetOutcome.stop_failed,
                                                                 "error": _target_error(reply)})
        stopped = result.model_copy(update={"targets": targets})
        pending = {n: self._actors[n].finish.remote(c, self.artifact_timeout_s)
                   for n, c in live.items() if targets[n].outcome is TargetOutcome.stopped}

        def finish() -> tuple[StepResult, dict[str, Any]]:
            out = dict(stopped.targets)
            top: dict[str, Any] = {}
            timeout = None if self.artifact_timeout_s is None else self.artifact_timeout_s + 30
            for name, ref in pending.items():
                try:
                    reply = ray.get(ref, timeout=timeout)
                except Exception as exc:
                    out[name] = out[name].model_copy(update={"error": _as_target_error(exc)})
                    continue
                if reply.get("ok"):
                    cap = Capture.model_validate(reply["capture"])
                    err = out[name].error
                    if err is None and cap.state.value == "failed" and cap.errors:
                        err = TargetError(code=cap.errors[-1].code, message=cap.errors[-1].message)
                    out[name] = out[name].with_capture(cap, error=err)
                    top[name] = reply.get("top_ops") or {}
                else:
                    out[name] = out[name].model_copy(update={"error": _target_error(reply)})
            return stopped.model_copy(update={"targets": out}), top

        return stopped, finish

    def close(self) -> None:
        import ray

        if self._beat is not None:
            self._beat.set()
        try:
            ray.get([a.close.remote() for a in self._actors.values()], timeout=60)
        except Exception as exc:
            log.warning("omni-sidecar: closing the replica profilers failed: %s", exc)
        for actor in self._actors.values():
            try:
                ray.kill(actor)
            except Exception:  # already gone with its node
                pass
        self._actors.clear()


def _as_target_error(exc: BaseException) -> TargetError:
    if isinstance(exc, SidecarError):
        return TargetError(code=exc.code, message=exc.message)
    name = type(exc).__name__
    if "Timeout" in name:
        return TargetError(code="timeout", message=f"no answer from the replica profiler in time ({exc})")
    return TargetError(code="internal_error", message=f"{name}: {exc}")


class TargetCaptures:
    """``sidecar=URL`` (or ``upstream=URL``) targets given in the ``omni_sidecar`` block: the same
    :class:`~sidecar.rollout.RolloutProfiler` the plain hook uses, opened at verl's start and
    closed at verl's stop (its own rollback, lease and heartbeats)."""

    def __init__(self, prof: Any) -> None:
        self.prof = prof
        self._cm: Any = None

    def start(self, step: int) -> StepResult:
        self._cm = self.prof.step(step)
        entered = self._cm.__enter__()
        if entered is None:  # the profiler does not take this step (not in its list)
            self._cm = None
            return StepResult(step=step, label=f"step{step}", error=TargetError(
                code="step_not_profiled", message=f"step {step} is not in the hook's steps"))
        return entered

    def stop(self, result: StepResult) -> tuple[StepResult, Callable[[], tuple[StepResult, dict[str, Any]]]]:
        cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(None, None, None)
        step = result.step
        stopped = self.prof.results().get(step, result)

        def finish() -> tuple[StepResult, dict[str, Any]]:
            return self.prof.wait().get(step, stopped), {}

        return stopped, finish

    def close(self) -> None:
        self.prof.close()


# --- the hook on verl's start/stop ----------------------------------------------------------


@dataclass
class RolloutHook:
    """Installed on verl's rollout managers: their ``start_profile`` / ``stop_profile`` run the
    sidecar's window for ``trainer.global_steps``. ``strict``: failures raise into verl; else they
    are in the step's result and one log line, and training goes on."""

    trainer: Any
    managers: list[Any]
    captures: NodeCaptures | TargetCaptures
    save_path: str | None
    strict: bool = False
    wait_artifacts: bool = False
    # The last step verl profiles: its check is waited for (bounded), so the result is written
    # before a run that ends right after it exits.
    last_step: int | None = None
    results: dict[int, StepResult] = field(default_factory=dict)
    top_ops: dict[int, dict[str, Any]] = field(default_factory=dict)
    _open: StepResult | None = None
    _finishing: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> None:
        """Replace each manager's ``start_profile``/``stop_profile``. verl's calling convention is kept: ``auto_await`` (a sync call runs it, an awaiting
        caller gets a coroutine); a verl without it calls plain sync methods."""
        try:
            from verl.utils.ray_utils import auto_await
        except ImportError:
            def start_profile(**_: Any) -> None:
                self.start()

            def stop_profile(**_: Any) -> None:
                self.stop()
        else:
            @auto_await
            async def start_profile(**_: Any) -> None:
                await asyncio.to_thread(self.start)

            @auto_await
            async def stop_profile(**_: Any) -> None:
                await asyncio.to_thread(self.stop)

        for manager in self.managers:
            manager.start_profile = start_profile
            manager.stop_profile = stop_profile
            manager._omni_sidecar = self

    def _step(self) -> int | None:
        step = getattr(self.trainer, "global_steps", None)
        return int(step) if isinstance(step, int) or hasattr(step, "__index__") else None

    def start(self) -> None:
        step = self._step()
        if self._open is not None or step is None:
            return  # already open (a second manager of the same step), or no step to name it by
        if step in self.results:
            log.debug("omni-sidecar: step %d was profiled already; not again", step)
            return
        self._join()  # one capture at a time per server: the previous step's check ends first
        result = self.captures.start(step)
        with self._lock:
            self.results[step] = result
        if result.error is not None:
            self._done(result, {})
            if self.strict:
                raise FleetError.relay(result.error.code, f"omni-sidecar: rollout profiling of step {step} did not start: "
                                       f"{result.error.message}")
            return
        self._open = result

    def stop(self) -> None:
        result, self._open = self._open, None
        if result is None:
            return  # verl's stop without a start of ours (e.g. continuous steps): nothing is live
        stopped, finish = self.captures.stop(result)
        with self._lock:
            self.results[result.step] = stopped
        failures = [t for t in stopped.targets.values() if t.error is not None]
        if self.wait_artifacts or (self.last_step is not None and result.step >= self.last_step):
            self._finish(finish)
        else:
            self._finishing = threading.Thread(target=self._finish, args=(finish,), daemon=True,
                                               name=f"omni-sidecar-verl-step{result.step}")
            self._finishing.start()
        if self.strict:
            final = self.results[result.step]
            if failures or (self.wait_artifacts and not final.ok):
                raise final.to_error(f"omni-sidecar: rollout profiling of {final.label}")

    def _finish(self, finish: Callable[[], tuple[StepResult, dict[str, Any]]]) -> None:
        try:
            result, top = finish()
        except Exception as exc:  # the check must never take the trainer down
            log.warning("omni-sidecar: checking the traces failed: %s", exc)
            return
        with self._lock:
            self.results[result.step] = result
            self.top_ops[result.step] = top
        self._done(result, top)

    def _join(self, timeout: float | None = None) -> None:
        t = self._finishing
        if t is not None:
            t.join(timeout)

    def _done(self, result: StepResult, top: dict[str, Any]) -> None:
        """The step's result on disk (where verl writes its profiles) and one log line."""
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
        n = len(result.targets)
        if result.ok:
            log.info("omni-sidecar: rollout step %d profiled on %d replica(s), traces ok%s", result.step, n,
                     f"; result in {where}" if where else "")
        else:
            why = result.error.message if result.error else "; ".join(
                f"{t.target}: " + (t.error.message if t.error else ", ".join(
                    v.reason or f"stage {v.stage_id} {v.verdict.value if v.verdict else '?'}"
                    for v in t.verdicts if v.verdict is None or v.verdict.value != "ok") or
                    (t.state.value if t.state else t.outcome.value))
                for t in result.failures())
            log.warning("omni-sidecar: rollout step %d: %s%s", result.step, why, f"; result in {where}" if where else "")

    def wait(self, timeout: float | None = None) -> dict[int, StepResult]:
        """Every step's result, once the last artifact check is over (or ``timeout``)."""
        self._join(timeout)
        with self._lock:
            return {k: self.results[k] for k in sorted(self.results)}

    def close(self, timeout: float | None = 120.0) -> None:
        self._join(timeout)
        self.captures.close()
