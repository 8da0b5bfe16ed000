"""Drivers: one per target kind, the same small async interface (open, start, stop, get, wait,
heartbeat, live, close). A sidecar target is driven over its HTTP API; an upstream target by the
same ``CaptureController`` a sidecar runs, in this process; a ray target by that controller in a
Ray actor on the server's node (``_ray.py``, made by a ``DriverFactory``)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

import httpx

from sidecar.config.models import DeployConfig, Stage, StageKind
from sidecar.config.profiler import ProfilerConfig
from sidecar.control.models import Capture, CaptureState, StopReason
from sidecar.errors import KindUnsupported, RequestInvalid, SidecarError
from sidecar.fleet._clocks import MORE, ClockOffset, clock_record, exchange
from sidecar.fleet._targets import Target
from sidecar.upstream.transport import AiohttpTransport

# "upstream answered stop": the capture left `stopping` (collecting, or already terminal).
STOPPED = (CaptureState.collecting, CaptureState.completed, CaptureState.degraded, CaptureState.failed)


def stop_answered(cap: Capture) -> bool:
    """The upstream answered the stop, or the controller gave up waiting for its answer within the
    stop budget (it stays ``stopping`` with ``upstream_timeout`` and its partial verdicts, keeping
    the slot taken until the server answers or is gone): either way this fan-out's stop is over."""
    if cap.state in STOPPED:
        return True
    return cap.state is CaptureState.stopping and bool(cap.errors) and cap.errors[-1].code == "upstream_timeout"
TERMINAL = tuple(s for s in CaptureState if s.terminal)


Kind = Literal["torch", "nsys"]
# Awaited once a target's start is prepared, just before it is sent (sidecar/fleet/_release.py).
ReleaseHook = Callable[[], Awaitable[None]]


class Driver(Protocol):
    target: Target

    async def open(self) -> DeployConfig | None: ...
    async def start(self, stages: list[int] | None, label: str | None, duration_s: float | None,
                    lease_s: float | None, kind: Kind = "torch", release: ReleaseHook | None = None,
                    steps: int | None = None) -> Capture: ...
    async def stop(self, capture_id: str, reason: StopReason) -> Capture: ...
    async def get(self, capture_id: str) -> Capture: ...
    async def wait(self, capture_id: str, timeout: float | None) -> Capture: ...
    async def heartbeat(self, capture_id: str) -> None: ...
    async def live(self) -> Capture | None: ...
    async def clock(self, more: int = MORE) -> ClockOffset: ...
    async def close(self, keep_live: bool = False) -> None: ...


class DriverFactory(Protocol):
    """Makes the driver of a target the fleet does not reach itself (``ray`` targets)."""

    def __call__(self, target: Target, *, stop_budget_s: float) -> Driver: ...


class FleetTransports:
    """Connections for a fleet: a small pool per target, over aiohttp (``sidecar/upstream/transport.py``).

    Measured at scale (bench/fanout.py): a default ``httpx.AsyncClient`` builds its own TLS context
    (tens of ms of CPU each, on the event loop, before any request), and one pool shared by every
    target costs O(requests x connections) per request in httpcore's pool. A pool per target costs
    neither, and aiohttp's sessions share its one TLS context; its requests take half httpcore's CPU
    (bench/transport.py)."""

    # a target holds at most a blocking start or stop plus a heartbeat or poll beside it; idle
    # connections are kept as long as the transport's default (below the server's own keep-alive)
    LIMIT = 4

    def for_target(self) -> AiohttpTransport:
        return AiohttpTransport(limit=self.LIMIT)


def deploy_from_stages_reply(reply: dict[str, Any]) -> DeployConfig:
    """The sidecar's ``GET /v1/stages`` as a DeployConfig, so ``select_stages`` (the one rule)
    can check a stage list for a remote sidecar before anything is started."""
    stages = []
    for s in reply.get("stages", []):
        pc = s.get("profiler_config")
        stages.append(
            Stage(
                stage_id=int(s["stage_id"]),
                kind=StageKind(s.get("kind") or "unknown"),
                profiler_config=ProfilerConfig.model_validate(pc) if pc else None,
                num_replicas=int(s.get("num_replicas") or 1),
            )
        )
    return DeployConfig(stages=stages, platform=reply.get("platform") or "cuda")


class SidecarDriver:
    def __init__(self, target: Target, *, timeout_s: float, poll_s: float,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        from sidecar.client import AsyncSidecarClient

        self.target = target
        self.poll_s = poll_s
        self.client = AsyncSidecarClient(target.url, token=target.token, timeout=timeout_s, transport=transport)

    async def open(self) -> DeployConfig | None:
        return deploy_from_stages_reply(await self.client.stages())

    async def start(self, stages, label, duration_s, lease_s, kind: Kind = "torch",  # type: ignore[no-untyped-def]
                    release: ReleaseHook | None = None, steps: int | None = None) -> Capture:
        at = getattr(release, "start_at", None)
        if at is not None and kind == "torch":
            cap = await self._scheduled(release, at, stages, label, duration_s, lease_s, steps)
            if cap is not None:
                return cap
        # The sidecar prepares its capture itself once asked, so the fleet's release gates the
        # request: the skew adds the fan-out's spread and the sidecar's own preparation (~ms).
        if release is not None:
            await release()
        if steps is not None:  # sent only when asked: an older sidecar refuses the field
            return await self.client.start_capture(stages=stages, label=label, duration_s=duration_s,
                                                   lease_s=lease_s, steps=steps)
        if kind == "torch":  # sent only when asked: a sidecar without nsys captures refuses the field
            return await self.client.start_capture(stages=stages, label=label, duration_s=duration_s, lease_s=lease_s)
        if "kind" in inspect.signature(self.client.start_capture).parameters:
            return await self.client.start_capture(stages=stages, label=label, duration_s=duration_s,  # type: ignore[call-arg]
                                                   lease_s=lease_s, kind=kind)
        from sidecar.client import _Calls

        call = _Calls.start_capture(stages, label, duration_s, lease_s)
        return await self.client._send(call._replace(json={**(call.json or {}), "kind": kind}))

    async def _scheduled(self, release: ReleaseHook, at: float, stages: list[int] | None, label: str | None,
                         duration_s: float | None, lease_s: float | None, steps: int | None) -> Capture | None:
        """The start scheduled on the sidecar at ``at`` (the fleet's clock) mapped to its own clock
        by an exchange taken now, in the lead before ``at`` (unless the fleet's exchange is off);
        the capture once its server answered.
        None when the sidecar does not know ``start_at`` (an older build: it refuses the field, or has
        no clock route either): the fleet releases it."""
        clocks = getattr(release, "clocks", None)  # None: the fleet's exchange is off; the clocks are taken as one
        offset = 0.0
        if clocks is not None:
            try:
                async with clocks:
                    clock = await self.clock()
            except SidecarError as err:
                if err.code != "not_found":
                    raise
                return None  # a build before GET /v1/clock, so before start_at too
            # within its own error bound the offset is not measured, only noise: the clocks agree as
            # far as the exchange can tell (same host, NTP), and a start never leaves early for it
            offset = clock.offset_s if abs(clock.offset_ns) > clock.error_ns else 0.0
        try:
            cap = await self.client.start_capture(stages=stages, label=label, duration_s=duration_s, lease_s=lease_s,
                                                  steps=steps, start_at=at + offset)
        except RequestInvalid as err:
            if "start_at" not in err.message:
                raise
            return None
        # held open by the sidecar from now: its answer is the start's, with no poll after start_at
        started = asyncio.ensure_future(self.client.wait_started(cap.id, poll_s=self.poll_s / 4))
        try:  # at start_at, or StartWithheld when another target failed first: then cancel it here
            await release()
        except BaseException:
            started.cancel()
            with contextlib.suppress(Exception):
                await asyncio.shield(self.client.stop_capture(cap.id))
            raise
        cap = await started
        if cap.state is CaptureState.active or (cap.state is CaptureState.stopping
                                                and cap.stop_reason is not StopReason.rollback):
            return cap
        # its start failed (rolled back) or was cancelled: the sidecar's record says why
        err = cap.errors[-1] if cap.errors else None
        raise SidecarError.relay(err.code if err else "start_failed",
                                 err.message if err else f"capture {cap.id} ended {cap.state.value} before it started",
                                 details={"capture_id": cap.id})

    async def _poll(self, capture_id: str, until: tuple[CaptureState, ...], deadline: float | None) -> Capture:
        # Backs off from poll_s to 2 s: a thousand targets polling every 0.2 s would be the load.
        delay = self.poll_s
        loop = asyncio.get_running_loop()
        while True:
            cap = await self.client.get_capture(capture_id)
            done = stop_answered(cap) if until is STOPPED else cap.state in until
            if done or (deadline is not None and loop.time() >= deadline):
                return cap
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, max(self.poll_s, 2.0))

    async def stop(self, capture_id: str, reason: StopReason) -> Capture:
        # The sidecar answers at once; "stopped" means its upstream answered, so poll for that.
        cap = await self.client.stop_capture(capture_id)
        if stop_answered(cap):
            return cap
        return await self._poll(capture_id, STOPPED, None)

    async def get(self, capture_id: str) -> Capture:
        return await self.client.get_capture(capture_id)

    async def wait(self, capture_id: str, timeout: float | None) -> Capture:
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        return await self._poll(capture_id, TERMINAL, deadline)

    async def heartbeat(self, capture_id: str) -> None:
        await self.client.heartbeat(capture_id)

    async def live(self) -> Capture | None:
        return next((c for c in await self.client.list_captures() if not c.terminal), None)

    async def record_clock(self, capture_id: str, phase: str, clock: ClockOffset) -> None:
        await self.client.record_clock(capture_id, clock_record(phase, clock))

    async def clock(self, more: int = MORE) -> ClockOffset:
        async def read() -> tuple[int, int]:
            reply = await self.client.clock()
            return int(reply["realtime_ns"]), int(reply["monotonic_ns"])

        return await exchange(read, more=more)

    async def close(self, keep_live: bool = False) -> None:
        await self.client.aclose()


class UpstreamDriver:
    """An upstream server driven in-process: the same controller the sidecar runs."""

    def __init__(self, target: Target, deploy: DeployConfig, *, stop_budget_s: float,
                 settings: Any | None, state_dir: Path | None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        from sidecar.control.controller import CaptureController
        from sidecar.fleet._pacing import FLEET_PACING
        from sidecar.upstream.server import Flavor as UpstreamFlavor
        from sidecar.upstream.server import UpstreamServer

        self.target = target
        self.upstream = UpstreamServer(target.url, flavor=UpstreamFlavor(target.flavor), stop_budget_s=stop_budget_s,
                                       transport=transport)
        # many controllers on one loop: the fleet's pacing (one thread hop per tick, follow-ups after the stops)
        self.controller = CaptureController(self.upstream, deploy, state_dir=state_dir, settings=settings,
                                            pacing=FLEET_PACING)
        self.deploy = deploy
        self._recovered: list[str] = []  # captures journaled live by an earlier process, stopped at open

    async def open(self) -> DeployConfig | None:
        self._recovered = [c.id for c in await self.controller.open()]
        # A connection made now is one the start does not pay for (TCP connect, pool setup):
        # best effort, an unreachable server is reported by the start itself.
        await self.upstream.warm()
        return self.deploy

    async def start(self, stages, label, duration_s, lease_s, kind: Kind = "torch",  # type: ignore[no-untyped-def]
                    release: ReleaseHook | None = None, steps: int | None = None) -> Capture:
        extra: dict[str, Any] = {} if release is None else {"release": release}
        if steps is not None:
            extra["steps"] = steps
        if kind == "torch":
            return await self.controller.start(stages, label=label, duration_s=duration_s, lease_s=lease_s, **extra)
        if "kind" not in inspect.signature(self.controller.start).parameters:
            raise KindUnsupported(f"{self.target.name}: this build's capture controller has no {kind} captures; "
                               "upgrade omni-sidecar, or capture with kind='torch'")
        return await self.controller.start(stages, label=label, duration_s=duration_s, lease_s=lease_s,  # type: ignore[call-arg]
                                           kind=kind, **extra)

    async def stop(self, capture_id: str, reason: StopReason) -> Capture:
        # controller.stop returns at once; wait (by subscription, no polling) for the upstream reply.
        answered = asyncio.Event()

        def on_change(cap: Capture) -> None:
            if cap.id == capture_id and stop_answered(cap):
                answered.set()

        unsubscribe = self.controller.subscribe(on_change)
        try:
            cap = await self.controller.stop(capture_id, reason=reason)
            if not stop_answered(cap):
                cap = self.controller.get(capture_id)
            if not stop_answered(cap):
                await answered.wait()
            return self.controller.get(capture_id)
        finally:
            unsubscribe()

    async def get(self, capture_id: str) -> Capture:
        return self.controller.get(capture_id)

    async def wait(self, capture_id: str, timeout: float | None) -> Capture:
        return await self.controller.wait(capture_id, timeout=timeout)

    async def heartbeat(self, capture_id: str) -> None:
        await self.controller.heartbeat(capture_id)

    async def live(self) -> Capture | None:
        # After open(), a capture journaled live by an earlier process (``fleet start``) is being
        # stopped by recovery; that stop can finish before this read: it is still the one asked for.
        active = self.controller.active
        if active is None and self._recovered:
            return self.controller.get(self._recovered[-1])
        return active

    async def record_clock(self, capture_id: str, phase: str, clock: ClockOffset) -> None:
        from sidecar.control.models import ClockRecord

        await self.controller.record_clock(capture_id, ClockRecord(**clock_record(phase, clock)))

    async def clock(self, more: int = MORE) -> ClockOffset:
        return ClockOffset.in_process()  # the controller runs here: the traces' host clock is ours

    async def close(self, keep_live: bool = False) -> None:
        try:
            if not keep_live:  # controller.close() stops the live capture (reason: shutdown)
                await self.controller.close()
        finally:
            await self.upstream.aclose()
