"""The Ray driver of the fan-out: each ``ray`` target's capture controller runs in a Ray actor
(:class:`NodeProfiler`, one process per node for all its servers) placed on the server's node,
so the trace folder is checked where it is written and only captures (verdicts, folders) and a
short summary travel back. The protocol
(all-or-nothing start, rollback, heartbeats, stop, finish, ``start_at``) stays the ``Fleet``'s:
the actor is the in-process :class:`~sidecar.fleet._drivers.UpstreamDriver` on the node, and
:class:`RayNodeDriver` is its trainer-side proxy. Ray is imported only when a driver is made.

    nodes = RayNodes({target.name: Placement(node_id, deploy)})
    Fleet([target], drivers=nodes)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sidecar import errors as _errors
from sidecar.config.models import DeployConfig
from sidecar.control.models import Capture, StopReason
from sidecar.fleet._clocks import MORE, SAMPLES, ClockOffset, exchange
from sidecar.fleet._release import gated_start
from sidecar.fleet._targets import Target
from sidecar.fleet._wire import answer, failure, raise_reply

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


class NodeProfiler:
    """The servers of one node, each driven by the fleet's
    :class:`~sidecar.fleet._drivers.UpstreamDriver` on that node: one Ray async actor (one
    process) per node, however many replicas it holds. Every method names its server (the
    target's name) and answers ``("ok", value)`` or ``("error", (class, code, message, details))``:
    a failure is data, never an exception crossing Ray."""

    def __init__(self, servers: dict[str, tuple[str, dict[str, Any] | str, str]], *, stop_budget_s: float = 1800.0,
                 control: dict[str, Any] | None = None, journal: str | None = None) -> None:
        # name -> (url, deploy, flavor); ``deploy`` a mapping (written here) or a deploy YAML's path on
        # this node. Given at construction, which Ray runs before any method: an async actor runs its
        # methods in no guaranteed order, so a separate ``add`` could come after the ``open`` it was
        # meant for (seen in CI under load: open failed with KeyError, its add not yet run).
        self._servers = dict(servers)
        # ``journal``: the run's id. Each server's controller journals under a folder of this node
        # named by it and the server, so an actor started to replace a dead one (RayNodes.replace)
        # finds the captures the dead one left live and stops them when it opens them.
        self.journal = journal
        self.stop_budget_s = stop_budget_s
        self.control = control or {}
        self._drivers: dict[str, Any] = {}
        self._dirs: dict[str, tempfile.TemporaryDirectory[str]] = {}

    def ready(self) -> bool:
        return True

    def _state_dir(self, name: str) -> Path | None:
        if self.journal is None:
            return None
        digest = hashlib.sha1(name.encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"omni-sidecar-node-{self.journal}" / digest

    async def _call(self, work: Callable[[], Awaitable[Any]]) -> tuple[str, Any]:
        try:
            return answer(await work())
        except Exception as exc:
            return failure(exc)

    async def open(self, name: str) -> tuple[str, Any]:
        async def work() -> DeployConfig:
            from sidecar.config.deploy import load_deploy_config
            from sidecar.control.controller import ControlSettings
            from sidecar.fleet._drivers import UpstreamDriver

            url, deploy, flavor = self._servers[name]
            if isinstance(deploy, str):
                path = Path(deploy)
            else:
                self._dirs[name] = tempfile.TemporaryDirectory(prefix="omni-sidecar-node-")
                path = Path(self._dirs[name].name) / "deploy.yaml"
                path.write_text(yaml.safe_dump(deploy, sort_keys=False))
            config = load_deploy_config(path)
            target = Target.upstream(url, path, flavor=flavor)  # type: ignore[arg-type]
            state_dir = self._state_dir(name)
            if state_dir is not None:
                state_dir.mkdir(parents=True, exist_ok=True)
            driver = UpstreamDriver(target, config, stop_budget_s=self.stop_budget_s,
                                    settings=ControlSettings(**self.control), state_dir=state_dir)
            await driver.open()
            self._drivers[name] = driver
            # what a dead actor left recording on this server is stopped before this one is used
            for cid in driver.recovered:
                await driver.wait(cid, self.stop_budget_s)
            return config

        return await self._call(work)

    async def start(self, name: str, stages: list[int] | None, label: str | None, duration_s: float | None,
                    lease_s: float | None, kind: str, start_at: float | None = None,
                    steps: int | None = None) -> tuple[str, Any]:
        """The start now (answered once the server started), or with ``start_at`` (this node's
        clock) scheduled here, where the server is: answered once prepared (``starting``), sent
        then by the node's controller itself; :meth:`wait_started` answers once it went."""
        return await self._call(lambda: self._drivers[name].start(stages, label, duration_s, lease_s, kind,
                                                                  steps=steps, start_at=start_at))

    async def wait_started(self, name: str, capture_id: str) -> tuple[str, Any]:
        return await self._call(lambda: self._drivers[name].wait_started(capture_id))

    async def stop(self, name: str, capture_id: str, reason: str) -> tuple[str, Any]:
        """Sends the stop: answered at once (:meth:`stopped` waits for the server's answer)."""
        return await self._call(lambda: self._drivers[name].stop(capture_id, StopReason(reason)))

    async def stopped(self, name: str, capture_id: str) -> tuple[str, Any]:
        """Once the server answered the stop (the artifact check goes on: :meth:`wait`)."""
        return await self._call(lambda: self._drivers[name].stopped(capture_id))

    async def get(self, name: str, capture_id: str) -> tuple[str, Any]:
        return await self._call(lambda: self._drivers[name].get(capture_id))

    async def wait(self, name: str, capture_id: str, timeout: float | None, top: int = TOP_OPS) -> tuple[str, Any]:
        """The capture once terminal (or at ``timeout``) and, when a stage is ok, its top ops."""
        async def work() -> tuple[Capture, dict[str, Any]]:
            driver = self._drivers[name]
            cap = await driver.wait(capture_id, timeout)
            ops: dict[str, Any] = {}
            if top and cap.terminal and any(v.verdict is not None and v.verdict.value == "ok" for v in cap.verdicts):
                try:
                    ops = _top_ops(await driver.controller.summarize(capture_id, top=top), top)
                except Exception as exc:  # a summary never changes the verdict
                    ops = {"error": f"{type(exc).__name__}: {exc}"}
            return cap, ops

        return await self._call(work)

    async def heartbeat(self, name: str, capture_id: str) -> tuple[str, Any]:
        return await self._call(lambda: self._drivers[name].heartbeat(capture_id))

    async def live(self, name: str) -> tuple[str, Any]:
        return await self._call(lambda: self._drivers[name].live())

    async def captures(self, name: str) -> tuple[str, Any]:
        """The server's captures that are not terminal (what the fleet's sweep looks through)."""
        return await self._call(lambda: self._drivers[name].captures())

    def clock(self) -> tuple[str, Any]:
        """This node's realtime and monotonic clocks (ns): one sample of the fleet's exchange."""
        from sidecar.fleet._clocks import read_clocks

        return answer(read_clocks())

    async def close(self, name: str, keep_live: bool = False) -> tuple[str, Any]:
        async def work() -> int:
            try:
                driver = self._drivers.pop(name, None)
                if driver is not None:
                    await driver.close(keep_live)
            finally:
                self._servers.pop(name, None)
                folder = self._dirs.pop(name, None)
                if folder is not None:
                    folder.cleanup()
                state_dir = self._state_dir(name)
                if state_dir is not None and not keep_live:
                    shutil.rmtree(state_dir, ignore_errors=True)
                    with contextlib.suppress(OSError):
                        state_dir.parent.rmdir()  # the run's folder, once its last server is closed
            return len(self._servers)  # servers this actor still holds

        return await self._call(work)


# --- trainer side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where a ``ray`` target's controller runs (the server's node) and the deploy it checks the
    server against: a mapping, or the path of a deploy YAML on that node."""

    node_id: str
    deploy: dict[str, Any] | str


class RayNodeDriver:
    """The fleet's driver for one ``ray`` target: each call goes to its node's :class:`NodeProfiler`,
    naming the target. Closing the last target an actor holds ends the actor. A call that finds
    the actor dead has :class:`RayNodes` start another on the node (it stops what the dead one
    left recording) and fails, saying so; a call after ``ray.shutdown()`` fails without starting
    a new local cluster (what Ray does for a call with none running)."""

    def __init__(self, target: Target, actor: Any, top: int = TOP_OPS, nodes: RayNodes | None = None) -> None:
        self.target = target
        self.actor = actor
        self.top = top
        self.nodes = nodes
        self.top_ops: dict[str, dict[str, Any]] = {}  # capture id -> top ops per stage

    async def _remote(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray
        from ray.exceptions import ActorDiedError

        if not ray.is_initialized():
            raise _errors.FleetError.relay(
                "ray_not_running",
                "Ray is not running (ray.shutdown() ran before this profiler was closed): its "
                "node actors ended with the cluster; close the profiler before shutting Ray down")
        actor = self.actor
        try:
            return raise_reply(await getattr(actor, method).remote(*args, **kwargs))
        except ActorDiedError as exc:
            why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            node = self.nodes.placements[self.target.name].node_id if self.nodes else "?"
            if self.nodes is None:
                raise _errors.FleetError.relay(
                    "node_profiler_died", f"its node profiler actor died ({why})") from None
            try:
                await self.nodes.replace(actor)
            except _errors.SidecarError as err:
                raise _errors.FleetError.relay(
                    "node_profiler_died", f"its node profiler actor on node {node} died ({why}) "
                    f"and none could replace it: {err.message}") from None
            raise _errors.FleetError.relay(
                "node_profiler_died",
                f"its node profiler actor on node {node} died during {method} ({why}); a new one "
                "was started there and stopped what the dead one had left recording; this call was not retried "
                "(the window's traces are not checked)") from None

    async def open(self) -> DeployConfig | None:
        return await self._remote("open", self.target.name)  # type: ignore[no-any-return]

    async def start(self, stages, label, duration_s, lease_s, kind="torch", release=None,  # type: ignore[no-untyped-def]
                    steps=None) -> Capture:
        """Through the fleet's gate (sidecar/fleet/_release.py, as a sidecar's): with the fleet's
        ``start_at`` the node is told the time on its own clock and sends the start then itself."""
        name = self.target.name

        async def send(start_at: float | None = None) -> Capture:
            return await self._remote("start", name, stages, label, duration_s, lease_s, kind,  # type: ignore[no-any-return]
                                      start_at=start_at, steps=steps)

        async def started(cid: str) -> Capture:
            return await self._remote("wait_started", name, cid)  # type: ignore[no-any-return]

        async def cancel(cid: str) -> Capture:
            return await self.stop(cid, StopReason.rollback)

        return await gated_start(release, send=send, schedule=send, started=started, cancel=cancel,
                                 clock=self.clock)

    async def stop(self, capture_id: str, reason: StopReason) -> Capture:
        return await self._remote("stop", self.target.name, capture_id, reason.value)  # type: ignore[no-any-return]

    async def stopped(self, capture_id: str) -> Capture:
        return await self._remote("stopped", self.target.name, capture_id)  # type: ignore[no-any-return]

    async def get(self, capture_id: str) -> Capture:
        return await self._remote("get", self.target.name, capture_id)  # type: ignore[no-any-return]

    async def wait(self, capture_id: str, timeout: float | None) -> Capture:
        cap, ops = await self._remote("wait", self.target.name, capture_id, timeout, self.top)
        self.top_ops[capture_id] = ops
        return cap  # type: ignore[no-any-return]

    async def heartbeat(self, capture_id: str) -> None:
        await self._remote("heartbeat", self.target.name, capture_id)

    async def live(self) -> Capture | None:
        return await self._remote("live", self.target.name)  # type: ignore[no-any-return]

    async def captures(self) -> list[Capture]:
        return await self._remote("captures", self.target.name)  # type: ignore[no-any-return]

    async def clock(self, more: int = MORE, samples: int = SAMPLES) -> ClockOffset:
        # The node's controller reads the node's clock, not the trainer's: exchanged like a sidecar's.
        async def read() -> tuple[int, int]:
            real, mono = await self._remote("clock")
            return int(real), int(mono)

        return await exchange(read, more=more, samples=samples)

    async def close(self, keep_live: bool = False) -> None:
        import ray

        if not ray.is_initialized():
            return  # the cluster is gone and its actors with it; a call would start a new local one
        left = 0
        try:
            for _ in range(2):  # once more on the actor that replaced a dead one (it holds this server now)
                actor = self.actor
                try:
                    left = await self._remote("close", self.target.name, keep_live)
                    break
                except _errors.FleetError:
                    if self.actor is actor:
                        break
        finally:
            if not left:
                ray.kill(self.actor)


class RayNodes:
    """The driver factory a ``Fleet`` takes (``drivers=``) for ``ray`` targets: one
    :class:`NodeProfiler` actor per node holding that node's targets, pinned to it (hard
    affinity, no CPU reserved). ``per_actor``: at most that many targets per actor (several
    actors on a node; default: one actor per node). ``control``: the node controllers'
    ``ControlSettings`` fields. ``top``: ops per stage summarised on the node with each finished
    check (0: none; a summary reads the whole trace)."""

    def __init__(self, placements: dict[str, Placement], *, control: dict[str, Any] | None = None,
                 per_actor: int | None = None, top: int = TOP_OPS) -> None:
        self.placements = dict(placements)
        self.top = top
        self.control = dict(control or {})
        self.per_actor = per_actor
        self.drivers: dict[str, RayNodeDriver] = {}
        self._launched: dict[str, Any] = {}
        self.run_id = uuid.uuid4().hex[:12]  # names the node controllers' journals (NodeProfiler.journal)
        self._stop_budget_s = 1800.0
        # id(dead actor) -> (it, its replacement): once per dead actor; the handle is kept so that
        # its id is not reused by another object (a later replacement's) while it is a key here
        self._replacing: dict[int, tuple[Any, asyncio.Future[Any]]] = {}

    def _actors(self, targets: list[Target], stop_budget_s: float) -> dict[str, Any]:
        """One actor per node (or per ``per_actor`` targets of a node), each told its targets."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._stop_budget_s = stop_budget_s
        by_node: dict[str, list[Target]] = {}
        for t in targets:
            by_node.setdefault(self.placements[t.name].node_id, []).append(t)
        out: dict[str, Any] = {}
        for node_id, held in by_node.items():
            size = self.per_actor or len(held)
            for i in range(0, len(held), size):
                mine = held[i:i + size]
                actor = ray.remote(num_cpus=0)(NodeProfiler).options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                ).remote({t.name: (t.url, self.placements[t.name].deploy, t.flavor) for t in mine},
                         stop_budget_s=stop_budget_s, control=self.control, journal=self.run_id)
                out.update(dict.fromkeys((t.name for t in mine), actor))
        return out

    async def replace(self, dead: Any, timeout_s: float = 120.0) -> Any:
        """A new actor on the node of ``dead`` for the targets it held, each server opened there
        (its journal: what the dead one left recording is stopped). Once per dead actor, whichever
        of its drivers asks first; the others wait for the same one. Raises ``TargetNoAnswer`` when
        none comes up within ``timeout_s`` (the node itself is gone)."""
        key = id(dead)
        if key not in self._replacing:
            self._replacing[key] = (dead, asyncio.ensure_future(self._replace(dead, timeout_s)))
        return await asyncio.shield(self._replacing[key][1])

    async def _replace(self, dead: Any, timeout_s: float) -> Any:
        import ray

        drivers = [d for d in self.drivers.values() if d.actor is dead]
        targets = [d.target for d in drivers]
        if not targets:
            return None
        actor = self._actors(targets, self._stop_budget_s)[targets[0].name]
        try:
            await asyncio.wait_for(actor.ready.remote(), timeout_s)
        except Exception as exc:  # not up: the node is gone, or has no room for a process
            ray.kill(actor)
            raise _errors.TargetNoAnswer(
                f"no node profiler came up on node {self.placements[targets[0].name].node_id} within {timeout_s:g}s "
                f"({type(exc).__name__}); is the node alive?", details={"targets": [t.name for t in targets]},
            ) from None
        for d in drivers:
            d.actor = actor
        for t in targets:  # each server opened: its journal's live captures stopped before it is used
            with contextlib.suppress(_errors.SidecarError):  # a server gone too: its own calls say so
                raise_reply(await actor.open.remote(t.name))
        return actor

    def launch(self, targets: list[Target], *, stop_budget_s: float, timeout_s: float = 300.0) -> None:
        """Start the actors of every target now and wait (at most ``timeout_s``) until each is up:
        an actor is a new process on its node (seconds each on a busy node), paid here, at trainer
        start, not inside a step's start budget. Raises ``TargetNoAnswer`` naming those not up."""
        import ray

        actors = self._actors([t for t in targets if t.name not in self._launched], stop_budget_s)
        distinct = {id(a): a for a in actors.values()}
        refs = {key: a.ready.remote() for key, a in distinct.items()}
        done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        late_actors = {key for key, ref in refs.items() if ref not in done}
        late = [name for name, a in actors.items() if id(a) in late_actors]
        self._launched.update({n: a for n, a in actors.items() if id(a) not in late_actors})
        for key in late_actors:
            ray.kill(distinct[key])
        if late:
            raise _errors.TargetNoAnswer(
                f"the node profiler actors of {', '.join(late[:3])}{' and more' if len(late) > 3 else ''} did not "
                f"start within {timeout_s:g}s (is each replica's node alive, with room for one more process?)",
                details={"targets": late})

    def __call__(self, target: Target, *, stop_budget_s: float) -> RayNodeDriver:
        actor = self._launched.pop(target.name, None) or self._actors([target], stop_budget_s)[target.name]
        driver = self.drivers[target.name] = RayNodeDriver(target, actor, self.top, nodes=self)
        return driver

    def top_ops(self, target: str, capture_id: str | None) -> dict[str, Any]:
        """The top ops per stage the node reported with ``capture_id``'s finished check."""
        driver = self.drivers.get(target)
        return {} if driver is None or capture_id is None else driver.top_ops.get(capture_id, {})
