"""Drivers: one per target kind, the same small async interface (open, start, stop, get, wait,
heartbeat, live, close). A sidecar target is driven over its HTTP API; an upstream target by the
same ``CaptureController`` a sidecar runs, in this process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

from sidecar.config.models import DeployConfig, Stage, StageKind
from sidecar.config.profiler import ProfilerConfig
from sidecar.control.models import Capture, CaptureState, StopReason
from sidecar.fleet._targets import Target

# "upstream answered stop": the capture left `stopping` (collecting, or already terminal).
STOPPED = (CaptureState.collecting, CaptureState.completed, CaptureState.degraded, CaptureState.failed)


class Driver(Protocol):
    target: Target

    async def open(self) -> DeployConfig | None: ...
    async def start(self, stages: list[int] | None, label: str | None, duration_s: float | None,
                    lease_s: float | None) -> Capture: ...
    async def stop(self, capture_id: str, reason: StopReason) -> Capture: ...
    async def get(self, capture_id: str) -> Capture: ...
    async def wait(self, capture_id: str, timeout: float | None) -> Capture: ...
    async def heartbeat(self, capture_id: str) -> None: ...
    async def live(self) -> Capture | None: ...
    async def close(self, keep_live: bool = False) -> None: ...


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
    def __init__(self, target: Target, *, timeout_s: float, poll_s: float) -> None:
        from sidecar.client import AsyncSidecarClient

        self.target = target
        self.poll_s = poll_s
        self.client = AsyncSidecarClient(target.url, token=target.token, timeout=timeout_s)

    async def open(self) -> DeployConfig | None:
        return deploy_from_stages_reply(await self.client.stages())

    async def start(self, stages, label, duration_s, lease_s) -> Capture:  # type: ignore[no-untyped-def]
        return await self.client.start_capture(stages=stages, label=label, duration_s=duration_s, lease_s=lease_s)

    async def stop(self, capture_id: str, reason: StopReason) -> Capture:
        # The sidecar answers at once; "stopped" means its upstream answered, so poll for that.
        cap = await self.client.stop_capture(capture_id)
        while cap.state not in STOPPED:
            await asyncio.sleep(self.poll_s)
            cap = await self.client.get_capture(capture_id)
        return cap

    async def get(self, capture_id: str) -> Capture:
        return await self.client.get_capture(capture_id)

    async def wait(self, capture_id: str, timeout: float | None) -> Capture:
        from sidecar.client import WaitTimeout

        try:
            return await self.client.wait_capture(capture_id, timeout=timeout, poll_s=self.poll_s)
        except WaitTimeout:
            return await self.client.get_capture(capture_id)

    async def heartbeat(self, capture_id: str) -> None:
        await self.client.heartbeat(capture_id)

    async def live(self) -> Capture | None:
        return next((c for c in await self.client.list_captures() if not c.terminal), None)

    async def close(self, keep_live: bool = False) -> None:
        await self.client.aclose()


class UpstreamDriver:
    """An upstream server driven in-process: the same controller the sidecar runs."""

    def __init__(self, target: Target, deploy: DeployConfig, *, stop_budget_s: float,
                 settings: Any | None, state_dir: Path | None) -> None:
        from sidecar.control.controller import CaptureController
        from sidecar.upstream.server import Flavor as UpstreamFlavor
        from sidecar.upstream.server import UpstreamServer

        self.target = target
        self.upstream = UpstreamServer(target.url, flavor=UpstreamFlavor(target.flavor), stop_budget_s=stop_budget_s)
        self.controller = CaptureController(self.upstream, deploy, state_dir=state_dir, settings=settings)
        self.deploy = deploy

    async def open(self) -> DeployConfig | None:
        await self.controller.open()
        return self.deploy

    async def start(self, stages, label, duration_s, lease_s) -> Capture:  # type: ignore[no-untyped-def]
        return await self.controller.start(stages, label=label, duration_s=duration_s, lease_s=lease_s)

    async def stop(self, capture_id: str, reason: StopReason) -> Capture:
        # controller.stop returns at once; wait (by subscription, no polling) for the upstream reply.
        answered = asyncio.Event()

        def on_change(cap: Capture) -> None:
            if cap.id == capture_id and cap.state in STOPPED:
                answered.set()

        unsubscribe = self.controller.subscribe(on_change)
        try:
            cap = await self.controller.stop(capture_id, reason=reason)
            if cap.state not in STOPPED:
                cap = self.controller.get(capture_id)
            if cap.state not in STOPPED:
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
        # After open(), a capture journaled live by an earlier process is here, already stopping.
        return self.controller.active

    async def close(self, keep_live: bool = False) -> None:
        try:
            if not keep_live:  # controller.close() stops the live capture (reason: shutdown)
                await self.controller.close()
        finally:
            await self.upstream.aclose()
