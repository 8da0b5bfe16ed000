"""Drivers: one per target kind, the same small async interface (open, start, stop, stopped, get,
wait, heartbeat, live, captures, close). A sidecar target is driven over its HTTP API; an upstream
target by the same ``CaptureController`` a sidecar runs, in this process; a ray target by that
controller in a Ray actor on the server's node (``_ray.py``, made by a ``DriverFactory``). A stop is
two calls: ``stop`` sends it (the target answers at once), ``stopped`` waits for the server's answer,
so a fan-out bounds only the wait and never leaves a stop unsent."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

from sidecar.config.models import DeployConfig, Stage, StageKind
from sidecar.config.profiler import ProfilerConfig
from sidecar.control.models import Capture, CaptureState, StopReason
from sidecar.errors import CaptureNotFound, KindUnsupported, NotASidecar, RequestInvalid, SidecarError
from sidecar.fleet._clocks import MORE, SAMPLES, ClockOffset, clock_record, exchange
from sidecar.fleet._release import Gate, Release, gated_start
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


class Driver(Protocol):
    target: Target

    async def open(self) -> DeployConfig | None: ...
    async def start(self, stages: list[int] | None, label: str | None, duration_s: float | None,
                    lease_s: float | None, kind: Kind = "torch", release: Gate | None = None,
                    steps: int | None = None) -> Capture: ...
    async def stop(self, capture_id: str, reason: StopReason) -> Capture:
        """Send the stop; returns once the target has it (at once: the server's answer is ``stopped``'s)."""
    async def stopped(self, capture_id: str) -> Capture:
        """Once the server answered the stop (``stop_answered``)."""
    async def get(self, capture_id: str) -> Capture: ...
    async def wait(self, capture_id: str, timeout: float | None) -> Capture: ...
    async def heartbeat(self, capture_id: str) -> None: ...
    async def live(self) -> Capture | None: ...
    async def captures(self) -> list[Capture]:
        """The target's newest captures, newest first, every live one among them (what a fleet's
        sweep looks through, and what it reads a window's end from)."""
    async def clock(self, more: int = MORE, samples: int = SAMPLES) -> ClockOffset: ...
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
        try:
            reply = await self.client.stages()
        except SidecarError as exc:
            status = exc.details.get("status")
            # a sidecar answers every error with its own code; a bare 404/405 is a server without the route
            if exc.code == f"http_{status}" and status in (404, 405):
                raise self._not_a_sidecar(f"{status} on /v1/stages") from None
            raise
        try:
            return deploy_from_stages_reply(reply)
        except (AttributeError, KeyError, TypeError, ValueError):  # pydantic's ValidationError is a ValueError
            raise self._not_a_sidecar("its /v1/stages is not a sidecar's stage list") from None

    def _not_a_sidecar(self, seen: str) -> NotASidecar:
        return NotASidecar(
            f"{self.target.url} is not an omni-sidecar ({seen}); a vLLM or vLLM-Omni server is "
            f"`upstream={self.target.url}` (with --deploy-config), a sidecar is the URL of `omni-sidecar serve`",
            details={"target": self.target.name, "url": self.target.url},
        )

    # a live capture is always among a sidecar's newest (one at a time; a late start is the newest)
    NEWEST = 8

    async def start(self, stages, label, duration_s, lease_s, kind: Kind = "torch",  # type: ignore[no-untyped-def]
                    release: Gate | None = None, steps: int | None = None) -> Capture:
        # Fields are sent only when asked: an older sidecar refuses one it does not know.
        fields: dict[str, Any] = {"stages": stages, "label": label, "duration_s": duration_s, "lease_s": lease_s}
        if steps is not None:
            fields["steps"] = steps

        async def send(start_at: float | None = None) -> Capture:
            if kind == "torch":
                return await self.client.start_capture(**fields, start_at=start_at)
            from sidecar.client import _Calls

            call = _Calls.start_capture(stages, label, duration_s, lease_s, steps, None, start_at)
            return await self.client._send(call._replace(json={**(call.json or {}), "kind": kind}))

        async def schedule(at: float) -> Capture | None:
            if kind != "torch":  # the sidecar's scheduled start takes torch captures: the gate times this one
                return None
            try:
                return await send(at)
            except RequestInvalid as err:  # a build before start_at refuses the field: released by the gate
                if "start_at" not in err.message:
                    raise
                return None

        # held open by the sidecar until it answered: no poll after start_at
        return await gated_start(release, send=send, schedule=schedule,
                                 started=lambda cid: self.client.wait_started(cid, poll_s=self.poll_s / 4),
                                 cancel=self.client.stop_capture, clock=self.clock)

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
        return await self.client.stop_capture(capture_id)  # answered at once, before its server's answer

    async def stopped(self, capture_id: str) -> Capture:
        return await self._poll(capture_id, STOPPED, None)

    async def get(self, capture_id: str) -> Capture:
        return await self.client.get_capture(capture_id)

    async def wait(self, capture_id: str, timeout: float | None) -> Capture:
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        return await self._poll(capture_id, TERMINAL, deadline)

    async def heartbeat(self, capture_id: str) -> None:
        await self.client.heartbeat(capture_id)

    async def live(self) -> Capture | None:
        return next((c for c in await self.captures() if not c.terminal), None)

    async def captures(self) -> list[Capture]:
        return await self.client.list_captures(limit=self.NEWEST)

    async def record_clock(self, capture_id: str, phase: str, clock: ClockOffset) -> None:
        await self.client.record_clock(capture_id, clock_record(phase, clock))

    async def clock(self, more: int = MORE, samples: int = SAMPLES) -> ClockOffset:
        async def read() -> tuple[int, int]:
            reply = await self.client.clock()
            return int(reply["realtime_ns"]), int(reply["monotonic_ns"])

        return await exchange(read, more=more, samples=samples)

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
        self.recovered: list[str] = []  # captures journaled live by an earlier process, stopped at open
        self._started: list[str] = []  # the captures this driver started, oldest first
        self._timed: dict[str, Release] = {}  # a scheduled start's own gate, until it was sent

    async def open(self) -> DeployConfig | None:
        self.recovered = [c.id for c in await self.controller.open()]
        # The pool opened now is one the start's preparation does not pay for: best effort, an
        # unreachable server is reported by the start itself.
        await self.upstream.warm()
        return self.deploy

    async def start(self, stages, label, duration_s, lease_s, kind: Kind = "torch",  # type: ignore[no-untyped-def]
                    release: Gate | None = None, steps: int | None = None, start_at: float | None = None) -> Capture:
        """``release``: the gate the prepared start waits at (in this process). ``start_at`` (this
        host's clock; a Ray node's schedule): answered once prepared (state ``starting``), the start
        then held at its last byte until ``start_at`` by a gate of its own (the one gate, timed
        here); a stop before then withholds it, and nothing reaches the server."""
        if start_at is not None:
            return await self._schedule(stages, label, duration_s, lease_s, kind, steps, start_at)
        return await self._start(stages, label, duration_s, lease_s, kind, release, steps)

    async def _schedule(self, stages, label, duration_s, lease_s, kind, steps, start_at) -> Capture:  # type: ignore[no-untyped-def]
        timed = Release(1, start_at=start_at)
        prepared: asyncio.Future[Capture] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._start(stages, label, duration_s, lease_s, kind, timed.gate(), steps,
                                                 prepared=prepared))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its outcome is the capture's record
        await asyncio.wait({prepared, task}, return_when=asyncio.FIRST_COMPLETED)
        if not prepared.done():
            prepared.cancel()
            return task.result()  # refused before it was prepared: raises
        cap = prepared.result()
        self._timed[cap.id] = timed
        task.add_done_callback(lambda _: self._timed.pop(cap.id, None))
        self._started.append(cap.id)
        return cap

    async def _start(self, stages, label, duration_s, lease_s, kind, release, steps,  # type: ignore[no-untyped-def]
                     prepared: asyncio.Future[Capture] | None = None) -> Capture:
        extra: dict[str, Any] = {} if release is None else {"release": release}
        if steps is not None:
            extra["steps"] = steps
        if prepared is not None:
            extra["prepared"] = prepared
        if kind == "torch":
            cap = await self.controller.start(stages, label=label, duration_s=duration_s, lease_s=lease_s, **extra)
        elif "kind" not in inspect.signature(self.controller.start).parameters:
            raise KindUnsupported(f"{self.target.name}: this build's capture controller has no {kind} captures; "
                                  "upgrade omni-sidecar, or capture with kind='torch'")
        else:
            cap = await self.controller.start(stages, label=label, duration_s=duration_s, lease_s=lease_s,  # type: ignore[call-arg]
                                              kind=kind, **extra)
        if prepared is None:
            self._started.append(cap.id)
        return cap

    async def stop(self, capture_id: str, reason: StopReason) -> Capture:
        timed = self._timed.get(capture_id)
        if timed is not None:  # a start waiting for its start_at sends nothing now (once released, no-op)
            timed.abort(f"stopped ({reason.value}) before its start_at")
        return await self.controller.stop(capture_id, reason=reason)  # at once: the stop runs in the background

    async def stopped(self, capture_id: str) -> Capture:
        # by subscription, no polling: the controller publishes the server's answer
        answered = asyncio.Event()

        def on_change(cap: Capture) -> None:
            if cap.id == capture_id and stop_answered(cap):
                answered.set()

        unsubscribe = self.controller.subscribe(on_change)
        try:
            if not stop_answered(self.controller.get(capture_id)):
                await answered.wait()
            return self.controller.get(capture_id)
        finally:
            unsubscribe()

    async def wait_started(self, capture_id: str) -> Capture:
        return await self.controller.wait_started(capture_id)

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
        if active is None and self.recovered:
            return self.controller.get(self.recovered[-1])
        return active

    async def captures(self) -> list[Capture]:
        # the live one (a start still in flight too) and the newest this driver started: not the
        # controller's whole journal, copied for each of a thousand targets at every stop
        active = self.controller.active
        ids = [*self._started[-SidecarDriver.NEWEST:], *self.recovered, *([active.id] if active else [])]
        found = {}
        for cid in ids:
            with contextlib.suppress(CaptureNotFound):  # past the journal's retention
                found[cid] = self.controller.get(cid)
        return sorted(found.values(), key=lambda c: (c.created_at, c.id), reverse=True)

    async def record_clock(self, capture_id: str, phase: str, clock: ClockOffset) -> None:
        from sidecar.control.models import ClockRecord

        await self.controller.record_clock(capture_id, ClockRecord(**clock_record(phase, clock)))

    async def clock(self, more: int = MORE, samples: int = SAMPLES) -> ClockOffset:
        return ClockOffset.in_process()  # the controller runs here: the traces' host clock is ours

    async def close(self, keep_live: bool = False) -> None:
        try:
            if not keep_live:  # controller.close() stops the live capture (reason: shutdown)
                await self.controller.close()
        finally:
            await self.upstream.aclose()
