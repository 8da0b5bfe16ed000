"""The fan-out: one capture over many targets. Start is concurrent and all-or-nothing (a failure
stops the started ones, then ``FleetError`` lists every target's outcome); stop reaches every
started target concurrently, each within its own budget. Bad input is refused (``FleetInvalid``)
before anything is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sidecar.config.models import DeployConfig
from sidecar.control.models import CaptureState, StopReason
from sidecar.errors import FleetError, FleetInvalid, SidecarError, StageSelectionError
from sidecar.fleet._drivers import Driver, SidecarDriver, UpstreamDriver
from sidecar.fleet._results import FleetCapture, TargetError, TargetOutcome, TargetResult, error_of
from sidecar.fleet._targets import Flavor, Target, TargetKind, parse_targets, server_key

log = logging.getLogger("sidecar.fleet")


class Fleet:
    """Concurrent captures over ``targets``. Use ``async with Fleet(...) as fleet:`` (or call
    :meth:`open` / :meth:`close`). All methods must run on one event loop.

    ``stop_budget_s`` bounds each target's stop (until its upstream answered); the artifact check
    after that is bounded by the target's own collect timeout. ``client_timeout_s`` is the HTTP
    timeout towards sidecars (their start returns once the upstream accepted).
    """

    def __init__(
        self,
        targets: Iterable[str | Target] | str,
        *,
        stages: list[int] | None = None,
        deploy_config: str | Path | None = None,
        flavor: Flavor = "omni",
        token: str | None = None,
        stop_budget_s: float = 1800.0,
        client_timeout_s: float = 330.0,
        poll_s: float = 0.2,
        control_settings: Any | None = None,
        state_dir: str | Path | None = None,
    ) -> None:
        self.targets = parse_targets(targets, deploy_config=deploy_config, flavor=flavor, token=token)
        if stages is not None and (
            isinstance(stages, (str, bytes)) or not isinstance(stages, (list, tuple))
        ):
            raise FleetInvalid(f"stages must be a list of stage ids, got {stages!r}", code="stages_invalid")
        self.stages = None if stages is None else list(stages)
        self.stop_budget_s = stop_budget_s
        self.client_timeout_s = client_timeout_s
        self.poll_s = poll_s
        self.control_settings = control_settings
        self.state_dir = Path(state_dir) if state_dir is not None else None
        vllm = [t.name for t in self.targets if t.kind is TargetKind.upstream and t.flavor == "vllm"]
        if vllm and self.stages is not None:
            raise FleetInvalid(
                f"plain vLLM targets ({', '.join(vllm)}) profile their one engine and take no stage list; "
                "drop the stage list, or put omni and plain vLLM servers in separate fleets",
                code="flavors_mixed",
                details={"vllm_targets": vllm, "stages": self.stages},
            )
        # Upstream deploy files are read (and the stage list checked) now: nothing is sent yet.
        self._deploys: dict[str, DeployConfig] = {}
        for t in self.targets:
            if t.kind is TargetKind.upstream:
                from sidecar.config.deploy import load_deploy_config

                self._deploys[t.name] = load_deploy_config(t.deploy_config, platform=t.platform)  # type: ignore[arg-type]
        self._check_stages(self._deploys)
        self._drivers: dict[str, Driver] = {}
        self._opened = False

    # --- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Create one client/controller per target and check the stage list against every
        sidecar's deploy (``GET /v1/stages``). Nothing that changes a server is sent."""
        if self._opened:
            return
        self._opened = True
        try:
            await self._open()
        except BaseException:
            await self.close()  # a later open() starts over (e.g. the next profiled step)
            raise

    async def _open(self) -> None:
        for t in self.targets:
            if t.kind is TargetKind.sidecar:
                self._drivers[t.name] = SidecarDriver(t, timeout_s=self.client_timeout_s, poll_s=self.poll_s)
            else:
                state_dir = None
                if self.state_dir is not None:
                    state_dir = self.state_dir / server_key(t.url).replace(":", "_").replace("/", "_")
                self._drivers[t.name] = UpstreamDriver(
                    t, self._deploys[t.name], stop_budget_s=self.stop_budget_s,
                    settings=self.control_settings, state_dir=state_dir,
                )
        opened = await asyncio.gather(*(d.open() for d in self._drivers.values()), return_exceptions=True)
        problems: dict[str, TargetError] = {}
        deploys: dict[str, DeployConfig] = {}
        for (name, _), res in zip(self._drivers.items(), opened):
            if isinstance(res, BaseException):
                problems[name] = error_of(res)
            elif res is not None:
                deploys[name] = res
        if problems:
            raise FleetError(
                f"{len(problems)} of {len(self.targets)} targets cannot be reached: "
                + ", ".join(f"{n} ({e.code}: {e.message})" for n, e in problems.items()),
                details={"targets": [{"target": n, "outcome": TargetOutcome.not_started.value,
                                      "error": e.model_dump()} for n, e in problems.items()]},
            )
        self._check_stages({n: d for n, d in deploys.items() if n not in self._deploys})

    async def close(self, *, keep_live: bool = False) -> None:
        """Close clients and controllers. An in-process controller stops its live capture on
        close; ``keep_live=True`` leaves it running, journaled in ``state_dir``, for a later
        ``Fleet(..., state_dir=same).open()`` to stop (that is how ``fleet start``/``stop`` work)."""
        drivers, self._drivers = list(self._drivers.values()), {}
        await asyncio.gather(*(d.close(keep_live) for d in drivers), return_exceptions=True)
        self._opened = False

    async def __aenter__(self) -> Fleet:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_stages(self, deploys: dict[str, DeployConfig]) -> None:
        """``select_stages`` for each target's deploy; any refusal → ``FleetInvalid`` naming them."""
        from sidecar.config.rules import select_stages

        refused: dict[str, StageSelectionError] = {}
        for name, deploy in deploys.items():
            try:
                select_stages(deploy, self.stages)
            except StageSelectionError as err:
                refused[name] = err
        if refused:
            first = next(iter(refused.values()))
            raise FleetInvalid(
                f"the stage list {self.stages} does not fit {len(refused)} target(s): "
                + "; ".join(f"{n}: {e.message}" for n, e in refused.items()),
                code=first.code if len(refused) == len(deploys) else "stages_not_shared",
                details={"targets": {n: e.to_dict() for n, e in refused.items()}},
            )

    def _driver(self, name: str) -> Driver:
        if not self._opened:
            raise FleetInvalid("the fleet is not open; use `async with Fleet(...)` or await fleet.open()",
                               code="fleet_closed")
        return self._drivers[name]

    # --- start / stop ---------------------------------------------------------------------

    async def start(
        self, *, label: str | None = None, duration_s: float | None = None, lease_s: float | None = None
    ) -> FleetCapture:
        """Start on every target at once. Returns when every upstream accepted. If any target
        fails, the started ones are stopped (concurrently) and ``FleetError`` lists every outcome."""
        names = [t.name for t in self.targets]
        drivers = [self._driver(n) for n in names]
        results = await asyncio.gather(
            *(d.start(self.stages, label, duration_s, lease_s) for d in drivers), return_exceptions=True
        )
        out: dict[str, TargetResult] = {}
        for t, res in zip(self.targets, results):
            base = TargetResult(target=t.name, kind=t.kind, outcome=TargetOutcome.started)
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res  # cancellation / KeyboardInterrupt is not a target failure
                cid = res.details.get("capture_id") if isinstance(res, SidecarError) else None
                out[t.name] = base.model_copy(update={"outcome": TargetOutcome.start_failed,
                                                      "error": error_of(res), "capture_id": cid})
            else:
                out[t.name] = base.with_capture(res)
        fc = FleetCapture(label=label, stages=self.stages, targets=out)
        if all(r.outcome is TargetOutcome.started for r in out.values()):
            return fc
        started = [n for n, r in out.items() if r.outcome is TargetOutcome.started]
        stopped = await self._stop_all(fc, started, reason=StopReason.rollback)
        for name in started:
            r = stopped[name]
            out[name] = r.model_copy(update={
                "outcome": TargetOutcome.rolled_back if r.outcome is TargetOutcome.stopped
                else TargetOutcome.rollback_failed})
        fc = FleetCapture(label=label, stages=self.stages, targets=out)
        err = fc.to_error("start")
        log.warning("%s; stopped the %d that had started", err.message, len(started))
        raise err

    async def stop(
        self, fc: FleetCapture, *, wait_artifacts: bool = True, artifact_timeout_s: float | None = None
    ) -> FleetCapture:
        """Stop every started target concurrently (each within ``stop_budget_s``). With
        ``wait_artifacts`` also wait for each artifact check (bounded by ``artifact_timeout_s``);
        without, return once every upstream answered and let the checks finish in the background
        (``refresh`` later). Never raises for a target's failure: see ``ok`` / ``to_error``."""
        names = [n for n, r in fc.targets.items() if r.outcome is TargetOutcome.started and r.capture_id]
        stopped = await self._stop_all(fc, names, reason=StopReason.explicit)
        out = dict(fc.targets)
        out.update(stopped)
        fc = fc.model_copy(update={"targets": out})
        if wait_artifacts:
            fc = await self.refresh(fc, wait=True, timeout=artifact_timeout_s)
        return fc

    async def _stop_all(self, fc: FleetCapture, names: Sequence[str], *, reason: StopReason) -> dict[str, TargetResult]:
        async def one(name: str) -> TargetResult:
            r = fc.targets[name]
            assert r.capture_id is not None
            try:
                cap = await asyncio.wait_for(self._driver(name).stop(r.capture_id, reason), self.stop_budget_s)
            except asyncio.TimeoutError:
                return r.model_copy(update={"outcome": TargetOutcome.stop_timeout, "error": TargetError(
                    code="stop_timeout",
                    message=f"the upstream did not answer stop within {self.stop_budget_s:g}s; "
                            "it may still be flushing traces (the stop goes on in the background)")})
            except Exception as exc:
                return r.model_copy(update={"outcome": TargetOutcome.stop_failed, "error": error_of(exc)})
            err = None
            if cap.state is CaptureState.failed and cap.errors:
                err = TargetError(code=cap.errors[-1].code, message=cap.errors[-1].message)
            return r.with_capture(cap, outcome=TargetOutcome.stopped, error=err)

        results = await asyncio.gather(*(one(n) for n in names))
        return dict(zip(names, results))

    async def refresh(self, fc: FleetCapture, *, wait: bool = False, timeout: float | None = None) -> FleetCapture:
        """Re-read every target's capture (with ``wait``: until terminal or ``timeout``)."""

        async def one(r: TargetResult) -> TargetResult:
            if r.capture_id is None or r.done or r.outcome in (TargetOutcome.start_failed,):
                return r
            try:
                d = self._driver(r.target)
                cap = await (d.wait(r.capture_id, timeout) if wait else d.get(r.capture_id))
            except Exception as exc:
                return r.model_copy(update={"error": r.error or error_of(exc)})
            err = r.error
            if err is None and cap.state is CaptureState.failed and cap.errors:
                err = TargetError(code=cap.errors[-1].code, message=cap.errors[-1].message)
            return r.with_capture(cap, error=err)

        results = await asyncio.gather(*(one(r) for r in fc.targets.values()))
        return fc.model_copy(update={"targets": {r.target: r for r in results}})

    async def heartbeat(self, fc: FleetCapture) -> None:
        """Extend every started capture's lease (best effort; errors are logged)."""
        async def one(r: TargetResult) -> None:
            try:
                await self._driver(r.target).heartbeat(r.capture_id)  # type: ignore[arg-type]
            except Exception as exc:  # a missed heartbeat is not fatal; the lease is the safety net
                log.debug("heartbeat to %s failed: %s", r.target, exc)

        await asyncio.gather(*(one(r) for r in fc.targets.values()
                               if r.outcome is TargetOutcome.started and r.capture_id))

    async def live(self, *, label: str | None = None) -> FleetCapture:
        """The live capture of every target (for a stop from another process: a sidecar's
        non-terminal capture, or one an upstream's journal in ``state_dir`` shows live). Targets
        without one are ``not_started`` with error ``capture_not_found``."""

        async def one(t: Target) -> TargetResult:
            base = TargetResult(target=t.name, kind=t.kind, outcome=TargetOutcome.started)
            try:
                cap = await self._driver(t.name).live()
            except Exception as exc:
                return base.model_copy(update={"outcome": TargetOutcome.not_started, "error": error_of(exc)})
            if cap is None:
                return base.model_copy(update={"outcome": TargetOutcome.not_started, "error": TargetError(
                    code="capture_not_found", message="no live capture on this target")})
            return base.with_capture(cap)

        results = await asyncio.gather(*(one(t) for t in self.targets))
        return FleetCapture(label=label, stages=self.stages, targets={r.target: r for r in results})

    async def capture(
        self, duration_s: float, *, label: str | None = None, wait_artifacts: bool = True,
        artifact_timeout_s: float | None = None,
    ) -> FleetCapture:
        """Start, keep the window open ``duration_s`` seconds, stop (the stop is sent also when
        this task is cancelled)."""
        fc = await self.start(label=label)
        try:
            await asyncio.sleep(duration_s)
        finally:
            fc = await asyncio.shield(self.stop(fc, wait_artifacts=wait_artifacts,
                                                artifact_timeout_s=artifact_timeout_s))
        return fc
