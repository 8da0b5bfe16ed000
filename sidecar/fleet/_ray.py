"""The Ray driver of the fan-out: each ``ray`` target's capture controller runs in a Ray actor
(:class:`NodeProfiler`) placed on the server's node, so the trace folder is checked where it is
written and only captures (verdicts, folders) and a short summary travel back. The protocol
(all-or-nothing start, rollback, heartbeats, stop, finish, ``start_at``) stays the ``Fleet``'s:
the actor is the in-process :class:`~sidecar.fleet._drivers.UpstreamDriver` on the node, and
:class:`RayNodeDriver` is its trainer-side proxy. Ray is imported only when a driver is made.

    nodes = RayNodes({target.name: Placement(node_id, deploy)})
    Fleet([target], drivers=nodes)
"""

from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sidecar import errors as _errors
from sidecar.config.models import DeployConfig
from sidecar.control.models import Capture, StopReason
from sidecar.errors import FleetError, SidecarError
from sidecar.fleet._targets import Target

__all__ = ["NodeProfiler", "Placement", "RayNodeDriver", "RayNodes", "TOP_OPS", "deploy_for_server"]

# Ops reported per stage with a finished capture.
TOP_OPS = 5


def deploy_for_server(profiler_config: dict[str, Any], stages: list[int] | None) -> dict[str, Any]:
    """The deploy a server launched with one server-wide ``--profiler-config`` is checked against:
    a plain vLLM server is one implicit stage 0; a vLLM-Omni server applies it to every stage
    (``stages``), all writing to the same folder."""
    ids = stages if stages else [0]
    return {"stages": [{"stage_id": sid, "profiler_config": dict(profiler_config)} for sid in ids]}


def _top_ops(summary: dict[str, Any], top: int) -> dict[str, list[dict[str, Any]]]:
    """Per stage: the ``top`` device kernels by time, else the CPU ops (a CPU-only trace)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for stage in summary.get("stages") or []:
        rows = stage.get("kernels") or stage.get("cpu_ops") or []
        out[str(stage.get("stage_id"))] = [
            {"name": r.get("name"), "count": r.get("count"), "total_us": r.get("total_us")} for r in rows[:top]
        ]
    return out


# --- node side ----------------------------------------------------------------------------------


def _answer(value: Any) -> tuple[str, Any]:
    return ("ok", value)


def _failure(exc: BaseException) -> tuple[str, Any]:
    """A failure as data: the error's class name, code, message and details cross Ray intact."""
    if isinstance(exc, SidecarError):
        return ("error", (type(exc).__name__, exc.code, exc.message, exc.details))
    return ("error", ("FleetError", "internal_error", f"{type(exc).__name__}: {exc}", {}))


class NodeProfiler:
    """One server, driven by the fleet's :class:`~sidecar.fleet._drivers.UpstreamDriver` on the
    server's node. Used as a Ray async actor; every method answers ``("ok", value)`` or
    ``("error", (class, code, message, details))``: a failure is data, never an exception
    crossing Ray."""

    def __init__(self, url: str, deploy: dict[str, Any] | str, *, flavor: str = "vllm",
                 stop_budget_s: float = 1800.0, control: dict[str, Any] | None = None) -> None:
        self.url = url
        self.deploy = deploy  # a mapping (written here), or the path of a deploy YAML on this node
        self.flavor = flavor
        self.stop_budget_s = stop_budget_s
        self.control = control or {}
        self._driver: Any = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def ready(self) -> bool:
        return True

    async def _call(self, work: Callable[[], Awaitable[Any]]) -> tuple[str, Any]:
        try:
            return _answer(await work())
        except Exception as exc:
            return _failure(exc)

    async def open(self) -> tuple[str, Any]:
        async def work() -> DeployConfig:
            from sidecar.config.deploy import load_deploy_config
            from sidecar.control.controller import ControlSettings
            from sidecar.fleet._drivers import UpstreamDriver

            if isinstance(self.deploy, str):
                path = Path(self.deploy)
            else:
                self._dir = tempfile.TemporaryDirectory(prefix="omni-sidecar-node-")
                path = Path(self._dir.name) / "deploy.yaml"
                path.write_text(yaml.safe_dump(self.deploy, sort_keys=False))
            deploy = load_deploy_config(path)
            target = Target.upstream(self.url, path, flavor=self.flavor)  # type: ignore[arg-type]
            self._driver = UpstreamDriver(target, deploy, stop_budget_s=self.stop_budget_s,
                                          settings=ControlSettings(**self.control), state_dir=None)
            await self._driver.open()
            return deploy

        return await self._call(work)

    async def start(self, stages: list[int] | None, label: str | None, duration_s: float | None,
                    lease_s: float | None, kind: str) -> tuple[str, Any]:
        return await self._call(lambda: self._driver.start(stages, label, duration_s, lease_s, kind))

    async def stop(self, capture_id: str, reason: str) -> tuple[str, Any]:
        """Returns once the server answered stop (the artifact check goes on: :meth:`wait`)."""
        return await self._call(lambda: self._driver.stop(capture_id, StopReason(reason)))

    async def get(self, capture_id: str) -> tuple[str, Any]:
        return await self._call(lambda: self._driver.get(capture_id))

    async def wait(self, capture_id: str, timeout: float | None, top: int = TOP_OPS) -> tuple[str, Any]:
        """The capture once terminal (or at ``timeout``) and, when a stage is ok, its top ops."""
        async def work() -> tuple[Capture, dict[str, Any]]:
            cap = await self._driver.wait(capture_id, timeout)
            ops: dict[str, Any] = {}
            if cap.terminal and any(v.verdict is not None and v.verdict.value == "ok" for v in cap.verdicts):
                try:
                    ops = _top_ops(await self._driver.controller.summarize(capture_id, top=top), top)
                except Exception as exc:  # a summary never changes the verdict
                    ops = {"error": f"{type(exc).__name__}: {exc}"}
            return cap, ops

        return await self._call(work)

    async def heartbeat(self, capture_id: str) -> tuple[str, Any]:
        return await self._call(lambda: self._driver.heartbeat(capture_id))

    async def live(self) -> tuple[str, Any]:
        return await self._call(lambda: self._driver.live())

    async def close(self, keep_live: bool = False) -> tuple[str, Any]:
        async def work() -> None:
            try:
                if self._driver is not None:
                    await self._driver.close(keep_live)
            finally:
                if self._dir is not None:
                    self._dir.cleanup()

        return await self._call(work)


# --- trainer side -------------------------------------------------------------------------------


def _raise(reply: tuple[str, Any]) -> Any:
    status, value = reply
    if status == "ok":
        return value
    name, code, message, details = value
    cls = getattr(_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, SidecarError)):
        cls = FleetError
    try:
        err = cls.relay(code, message, details=details)
    except TypeError:  # a class built with other arguments: the code and message still cross
        err = FleetError.relay(code, message, details=details)
    raise err


@dataclass(frozen=True)
class Placement:
    """Where a ``ray`` target's controller runs (the server's node) and the deploy it checks the
    server against: a mapping, or the path of a deploy YAML on that node."""

    node_id: str
    deploy: dict[str, Any] | str


class RayNodeDriver:
    """The fleet's driver for one ``ray`` target: each call goes to its :class:`NodeProfiler`."""

    def __init__(self, target: Target, actor: Any) -> None:
        self.target = target
        self.actor = actor
        self.top_ops: dict[str, dict[str, Any]] = {}  # capture id -> top ops per stage

    async def open(self) -> DeployConfig | None:
        return _raise(await self.actor.open.remote())  # type: ignore[no-any-return]

    async def start(self, stages, label, duration_s, lease_s, kind="torch", release=None) -> Capture:  # type: ignore[no-untyped-def]
        # The node prepares its capture once asked: the release gates the call, like a sidecar's.
        if release is not None:
            await release()
        return _raise(await self.actor.start.remote(stages, label, duration_s, lease_s, kind))  # type: ignore[no-any-return]

    async def stop(self, capture_id: str, reason: StopReason) -> Capture:
        return _raise(await self.actor.stop.remote(capture_id, reason.value))  # type: ignore[no-any-return]

    async def get(self, capture_id: str) -> Capture:
        return _raise(await self.actor.get.remote(capture_id))  # type: ignore[no-any-return]

    async def wait(self, capture_id: str, timeout: float | None) -> Capture:
        cap, ops = _raise(await self.actor.wait.remote(capture_id, timeout))
        self.top_ops[capture_id] = ops
        return cap  # type: ignore[no-any-return]

    async def heartbeat(self, capture_id: str) -> None:
        _raise(await self.actor.heartbeat.remote(capture_id))

    async def live(self) -> Capture | None:
        return _raise(await self.actor.live.remote())  # type: ignore[no-any-return]

    async def close(self, keep_live: bool = False) -> None:
        import ray

        if not ray.is_initialized():
            return  # the cluster is gone and its actors with it; a call would start a new local one
        try:
            _raise(await self.actor.close.remote(keep_live))
        finally:
            ray.kill(self.actor)


class RayNodes:
    """The driver factory a ``Fleet`` takes (``drivers=``) for ``ray`` targets: one
    :class:`NodeProfiler` actor per target, pinned to its :class:`Placement`'s node (hard
    affinity, no CPU reserved). ``control``: the node controllers' ``ControlSettings`` fields."""

    def __init__(self, placements: dict[str, Placement], *, control: dict[str, Any] | None = None) -> None:
        self.placements = dict(placements)
        self.control = dict(control or {})
        self.drivers: dict[str, RayNodeDriver] = {}
        self._launched: dict[str, Any] = {}

    def _actor(self, target: Target, stop_budget_s: float) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        where = self.placements[target.name]
        return ray.remote(num_cpus=0)(NodeProfiler).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=where.node_id, soft=False),
        ).remote(target.url, where.deploy, flavor=target.flavor, stop_budget_s=stop_budget_s, control=self.control)

    def launch(self, targets: list[Target], *, stop_budget_s: float, timeout_s: float = 300.0) -> None:
        """Start every target's actor now and wait (at most ``timeout_s``) until each is up: an
        actor is a new process on its node (seconds each on a busy node), paid here, at trainer
        start, not inside a step's start budget. Raises ``TargetNoAnswer`` naming those not up."""
        import ray

        actors = {t.name: self._actor(t, stop_budget_s) for t in targets if t.name not in self._launched}
        refs = {name: a.ready.remote() for name, a in actors.items()}
        done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        late = [name for name, ref in refs.items() if ref not in done]
        self._launched.update({n: a for n, a in actors.items() if n not in late})
        for name in late:
            ray.kill(actors[name])
        if late:
            raise _errors.TargetNoAnswer(
                f"the node profiler actors of {', '.join(late[:3])}{' and more' if len(late) > 3 else ''} did not "
                f"start within {timeout_s:g}s (is each replica's node alive, with room for one more process?)",
                details={"targets": late})

    def __call__(self, target: Target, *, stop_budget_s: float) -> RayNodeDriver:
        actor = self._launched.pop(target.name, None) or self._actor(target, stop_budget_s)
        driver = self.drivers[target.name] = RayNodeDriver(target, actor)
        return driver

    def top_ops(self, target: str, capture_id: str | None) -> dict[str, Any]:
        """The top ops per stage the node reported with ``capture_id``'s finished check."""
        driver = self.drivers.get(target)
        return {} if driver is None or capture_id is None else driver.top_ops.get(capture_id, {})
