"""Fan-out of one capture over many targets: sidecar URLs, or upstream servers driven in-process by
the same ``CaptureController``. Start is concurrent and all-or-nothing (a failure stops the started
ones, then ``FleetError`` lists every target's outcome); stop reaches every started target
concurrently, each within its own budget. Bad input is refused (``FleetInvalid``) before anything
is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from sidecar.config.models import DeployConfig, Stage, StageKind
from sidecar.config.profiler import ProfilerConfig
from sidecar.control.models import Capture, CaptureState, StageVerdict, StopReason
from sidecar.errors import FleetError, FleetInvalid, SidecarError, StageSelectionError
from sidecar.errors import (
    FlavorsMixed,
    FleetClosed,
    FleetStagesInvalid,
    StagesNotShared,
    TargetDuplicate,
    TargetInvalid,
    TargetsEmpty,
)

__all__ = [
    "FanOutResult",
    "Fleet",
    "FleetCapture",
    "Target",
    "TargetKind",
    "TargetOutcome",
    "TargetResult",
    "parse_targets",
]

log = logging.getLogger(__name__)

Flavor = Literal["omni", "vllm"]

# "upstream answered stop": the capture left `stopping` (collecting, or already terminal).
_STOPPED = (CaptureState.collecting, CaptureState.completed, CaptureState.degraded, CaptureState.failed)


# --- targets ------------------------------------------------------------------------------


class TargetKind(str, Enum):
    sidecar = "sidecar"  # an `omni-sidecar serve` in front of the server (HTTP API)
    upstream = "upstream"  # the vLLM-Omni server itself, driven in-process by a CaptureController


def _normalize_url(url: str) -> str:
    text = str(url).strip()
    try:
        parsed = httpx.URL(text)
    except Exception:  # httpx raises several types for garbage
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise TargetInvalid(
            f"target {text!r} is not an http(s) URL; write e.g. sidecar=http://10.0.0.5:8092 "
            "or upstream=http://10.0.0.5:8091",
            details={"target": text},
        )
    return text.rstrip("/")


class Target(BaseModel):
    """One replica to profile. Build with :meth:`sidecar`, :meth:`upstream` or :meth:`parse`.

    String form (CLI, config files): ``sidecar=URL`` or ``upstream=URL``; a bare URL is a sidecar.
    Upstream targets need the server's deploy YAML (what the controller validates stages against
    and where it looks for traces).
    """

    model_config = ConfigDict(frozen=True)

    kind: TargetKind
    url: str
    token: str | None = Field(default=None, repr=False, exclude=True)
    deploy_config: Path | None = None
    flavor: Flavor = "omni"
    platform: str = "cuda"

    @classmethod
    def sidecar(cls, url: str, token: str | None = None) -> Target:
        return cls(kind=TargetKind.sidecar, url=_normalize_url(url), token=token)

    @classmethod
    def upstream(
        cls, url: str, deploy_config: str | Path, *, flavor: Flavor = "omni", platform: str = "cuda"
    ) -> Target:
        if flavor not in ("omni", "vllm"):
            raise TargetInvalid(f"flavor must be 'omni' or 'vllm', got {flavor!r}")
        if deploy_config is None:
            raise TargetInvalid(
                f"upstream target {url} needs the server's deploy YAML (deploy_config=..., or "
                "--deploy-config on the CLI)",
                details={"target": url},
            )
        return cls(
            kind=TargetKind.upstream,
            url=_normalize_url(url),
            deploy_config=Path(deploy_config),
            flavor=flavor,
            platform=platform,
        )

    @classmethod
    def parse(
        cls,
        text: str | Target,
        *,
        deploy_config: str | Path | None = None,
        flavor: Flavor = "omni",
        platform: str = "cuda",
        token: str | None = None,
    ) -> Target:
        """``sidecar=URL`` | ``upstream=URL`` | ``URL`` (a sidecar). ``deploy_config``/``flavor``
        apply to upstream targets, ``token`` to sidecar targets."""
        if isinstance(text, Target):
            return text
        if not isinstance(text, str):
            raise TargetInvalid(
                f"a target is a Target or a string like sidecar=http://h:8092, got {type(text).__name__}",
            )
        raw = text.strip()
        kind, sep, url = raw.partition("=")
        if not sep or "://" in kind:  # a bare URL (a query string may hold '=' too)
            kind, url = "sidecar", raw
        kind = kind.strip().lower()
        if kind == "sidecar":
            return cls.sidecar(url, token=token)
        if kind == "upstream":
            return cls.upstream(url, deploy_config, flavor=flavor, platform=platform)  # type: ignore[arg-type]
        raise TargetInvalid(
            f"unknown target kind {kind!r} in {raw!r}; write sidecar=URL or upstream=URL",
            details={"target": raw},
        )

    @property
    def name(self) -> str:
        return f"{self.kind.value}={self.url}"

    def __str__(self) -> str:
        return self.name


def _server_key(url: str) -> str:
    u = httpx.URL(url)
    host = (u.host or "").lower()
    if host in ("localhost", "::1"):
        host = "127.0.0.1"
    port = u.port or (443 if u.scheme == "https" else 80)
    return f"{host}:{port}{u.path.rstrip('/')}"


def parse_targets(
    targets: Iterable[str | Target] | str,
    *,
    deploy_config: str | Path | None = None,
    flavor: Flavor = "omni",
    platform: str = "cuda",
    token: str | None = None,
) -> list[Target]:
    """Targets from objects or strings (a comma-separated string too). Refuses an empty list and
    duplicates (the same server twice would be started twice: the second start of vLLM-Omni opens
    an empty session folder)."""
    if isinstance(targets, str):
        targets = [t for t in targets.split(",") if t.strip()]
    parsed = [
        Target.parse(t, deploy_config=deploy_config, flavor=flavor, platform=platform, token=token) for t in targets
    ]
    if not parsed:
        raise TargetsEmpty(
            "the target list is empty; name at least one replica, e.g. sidecar=http://10.0.0.5:8092",
        )
    seen: dict[str, Target] = {}
    dupes: list[str] = []
    for t in parsed:
        key = _server_key(t.url)
        if key in seen:
            dupes.append(f"{seen[key].name} and {t.name}")
        else:
            seen[key] = t
    if dupes:
        raise TargetDuplicate(
            f"the same server is listed more than once: {'; '.join(dupes)}; list each replica once",
            details={"duplicates": dupes},
        )
    return parsed


# --- results ------------------------------------------------------------------------------


class TargetOutcome(str, Enum):
    started = "started"  # the upstream accepted start
    start_failed = "start_failed"
    not_started = "not_started"  # nothing sent: another target failed its pre-flight
    rolled_back = "rolled_back"  # started, then stopped because another target failed to start
    rollback_failed = "rollback_failed"
    stopped = "stopped"  # the upstream answered stop (artifacts may still be being checked)
    stop_failed = "stop_failed"
    stop_timeout = "stop_timeout"  # no answer within the stop budget; the stop goes on in the background


class TargetError(BaseModel):
    code: str
    message: str


class TargetResult(BaseModel):
    """One target's part of a fleet capture: its capture id, state, verdicts and folders."""

    target: str
    kind: TargetKind
    outcome: TargetOutcome
    capture_id: str | None = None
    state: CaptureState | None = None
    stages: list[int] = Field(default_factory=list)
    verdicts: list[StageVerdict] = Field(default_factory=list)
    error: TargetError | None = None

    @property
    def folders(self) -> list[str]:
        """Session folders found for this target (local paths where the sidecar maps them)."""
        return [s.local_path or s.path for v in self.verdicts for s in v.sessions]

    @property
    def ok(self) -> bool:
        """Started and stopped cleanly, and — once checked — every stage has its trace."""
        if self.error is not None or self.outcome not in (TargetOutcome.started, TargetOutcome.stopped):
            return False
        return self.state not in (CaptureState.degraded, CaptureState.failed)

    @property
    def done(self) -> bool:
        """The artifact check is over (or nothing is left to check)."""
        return self.state is None or self.state.terminal

    def with_capture(self, cap: Capture, **changes: Any) -> TargetResult:
        return self.model_copy(
            update={"capture_id": cap.id, "state": cap.state, "stages": list(cap.stages),
                    "verdicts": list(cap.verdicts), **changes}
        )


def _error_of(exc: BaseException) -> TargetError:
    if isinstance(exc, SidecarError):
        return TargetError(code=exc.code, message=exc.message)
    if isinstance(exc, asyncio.TimeoutError):
        return TargetError(code="timeout", message="no answer within the budget")
    return TargetError(code="internal_error", message=f"{type(exc).__name__}: {exc}")


class FanOutResult:
    """The per-target roll-up of a fan-out (``FleetCapture``, the rollout hook's ``StepResult``):
    a mixin over the model's own ``targets`` field, so each model keeps its field order."""

    if TYPE_CHECKING:
        targets: dict[str, TargetResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.targets.values())

    @property
    def done(self) -> bool:
        """Every artifact check is over (or nothing is left to check)."""
        return all(r.done for r in self.targets.values())

    @property
    def folders(self) -> dict[str, list[str]]:
        """Session folders per target."""
        return {name: r.folders for name, r in self.targets.items()}

    def failures(self) -> list[TargetResult]:
        return [r for r in self.targets.values() if not r.ok]

    def to_error(self, what: str) -> FleetError:
        bad = self.failures()
        names = ", ".join(f"{r.target} ({r.error.code if r.error else r.state.value if r.state else r.outcome.value})"
                          for r in bad)
        return FleetError(
            f"{what} failed on {len(bad)} of {len(self.targets)} targets: {names}",
            details={"targets": [r.model_dump(mode="json") for r in self.targets.values()]},
        )


class FleetCapture(BaseModel, FanOutResult):
    """A started fan-out: one capture per target, keyed by target name (in target order)."""

    label: str | None = None
    stages: list[int] | None = None  # as asked; each target's own list is in its result
    targets: dict[str, TargetResult]


# --- drivers: one per target kind -------------------------------------------------------


class _Driver(Protocol):
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


def _deploy_from_stages_reply(reply: dict[str, Any]) -> DeployConfig:
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


class _SidecarDriver:
    def __init__(self, target: Target, *, timeout_s: float, poll_s: float) -> None:
        from sidecar.client import AsyncSidecarClient

        self.target = target
        self.poll_s = poll_s
        self.client = AsyncSidecarClient(target.url, token=target.token, timeout=timeout_s)

    async def open(self) -> DeployConfig | None:
        return _deploy_from_stages_reply(await self.client.stages())

    async def start(self, stages, label, duration_s, lease_s) -> Capture:  # type: ignore[no-untyped-def]
        return await self.client.start_capture(stages=stages, label=label, duration_s=duration_s, lease_s=lease_s)

    async def stop(self, capture_id: str, reason: StopReason) -> Capture:
        # The sidecar answers at once; "stopped" means its upstream answered, so poll for that.
        cap = await self.client.stop_capture(capture_id)
        while cap.state not in _STOPPED:
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


class _UpstreamDriver:
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
            if cap.id == capture_id and cap.state in _STOPPED:
                answered.set()

        unsubscribe = self.controller.subscribe(on_change)
        try:
            cap = await self.controller.stop(capture_id, reason=reason)
            if cap.state not in _STOPPED:
                cap = self.controller.get(capture_id)
            if cap.state not in _STOPPED:
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


# --- the fleet ----------------------------------------------------------------------------


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
            raise FleetStagesInvalid(f"stages must be a list of stage ids, got {stages!r}")
        self.stages = None if stages is None else list(stages)
        self.stop_budget_s = stop_budget_s
        self.client_timeout_s = client_timeout_s
        self.poll_s = poll_s
        self.control_settings = control_settings
        self.state_dir = Path(state_dir) if state_dir is not None else None
        vllm = [t.name for t in self.targets if t.kind is TargetKind.upstream and t.flavor == "vllm"]
        if vllm and self.stages is not None:
            raise FlavorsMixed(
                f"plain vLLM targets ({', '.join(vllm)}) profile their one engine and take no stage list; "
                "drop the stage list, or put omni and plain vLLM servers in separate fleets",
                details={"vllm_targets": vllm, "stages": self.stages},
            )
        # Upstream deploy files are read (and the stage list checked) now: nothing is sent yet.
        self._deploys: dict[str, DeployConfig] = {}
        for t in self.targets:
            if t.kind is TargetKind.upstream:
                from sidecar.config.deploy import load_deploy_config

                self._deploys[t.name] = load_deploy_config(t.deploy_config, platform=t.platform)  # type: ignore[arg-type]
        self._check_stages(self._deploys)
        self._drivers: dict[str, _Driver] = {}
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
                self._drivers[t.name] = _SidecarDriver(t, timeout_s=self.client_timeout_s, poll_s=self.poll_s)
            else:
                state_dir = None
                if self.state_dir is not None:
                    state_dir = self.state_dir / _server_key(t.url).replace(":", "_").replace("/", "_")
                self._drivers[t.name] = _UpstreamDriver(
                    t, self._deploys[t.name], stop_budget_s=self.stop_budget_s,
                    settings=self.control_settings, state_dir=state_dir,
                )
        opened = await asyncio.gather(*(d.open() for d in self._drivers.values()), return_exceptions=True)
        problems: dict[str, TargetError] = {}
        deploys: dict[str, DeployConfig] = {}
        for (name, _), res in zip(self._drivers.items(), opened):
            if isinstance(res, BaseException):
                problems[name] = _error_of(res)
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
            message = f"the stage list {self.stages} does not fit {len(refused)} target(s): " + "; ".join(
                f"{n}: {e.message}" for n, e in refused.items()
            )
            details = {"targets": {n: e.to_dict() for n, e in refused.items()}}
            if len(refused) < len(deploys):
                raise StagesNotShared(message, details=details)
            raise FleetInvalid.relay(first.code, message, details=details)  # every target refuses alike

    def _driver(self, name: str) -> _Driver:
        if not self._opened:
            raise FleetClosed("the fleet is not open; use `async with Fleet(...)` or await fleet.open()")
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
                                                      "error": _error_of(res), "capture_id": cid})
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
                return r.model_copy(update={"outcome": TargetOutcome.stop_failed, "error": _error_of(exc)})
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
                return r.model_copy(update={"error": r.error or _error_of(exc)})
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
                return base.model_copy(update={"outcome": TargetOutcome.not_started, "error": _error_of(exc)})
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
