"""The fan-out: one capture over many targets. Start is concurrent and all-or-nothing (a failure
stops the started ones, then ``FleetError`` lists every target's outcome); stop is sent to every
started target and only the wait for the answers is bounded. Every capture carries the fleet's key
(its label ends ``[fleet:KEY]``) and, where a target takes one, a lease the fleet renews while it
holds the window; the end of every fleet call sweeps each target for live captures carrying the key
and stops them (a start that landed after its deadline, a window whose stop was lost), whatever the
calls sent said. Bad input is refused (``FleetInvalid``) before anything is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import numbers
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from sidecar.config.models import DeployConfig
from sidecar.config.rules import check_stage_list, select_stages
from sidecar.config.sharing import RENDER_FIX, shared_dir_groups, shared_profiler_dirs
from sidecar.control.models import Capture, CaptureState, StopReason, label_problem
from sidecar.errors import (
    BudgetInvalid,
    ConcurrencyInvalid,
    FlavorsMixed,
    FleetClosed,
    FleetDurationInvalid,
    FleetError,
    FleetInvalid,
    FleetKeyInvalid,
    LabelInvalid,
    FleetStagesInvalid,
    KindInvalid,
    ProfilerDirShared,
    SidecarError,
    StageSelectionError,
    StagesNotShared,
    StartWithheld,
    TargetInvalid,
    TargetNoAnswer,
)
from sidecar.fleet._clocks import (
    CLOCK_CONCURRENCY,
    FLEET_MORE,
    GOOD_NS,
    MORE,
    SAMPLES,
    ClockOffset,
)
from sidecar.fleet._drivers import (
    Driver,
    DriverFactory,
    FleetTransports,
    Kind,
    SidecarDriver,
    UpstreamDriver,
    stop_answered,
)
from sidecar.fleet._leases import Leases, key_of, key_problem, keyed_label, swept_text, with_sweep, within
from sidecar.fleet._release import START_AT_MAX_S, Release, check_start_at
from sidecar.fleet._results import (
    FleetCapture,
    Sweep,
    TargetError,
    TargetOutcome,
    TargetResult,
    error_of,
    mark_ambiguous,
)
from sidecar.fleet._targets import Flavor, Target, TargetKind, parse_targets, server_key

log = logging.getLogger("sidecar.fleet")

T = TypeVar("T")
R = TypeVar("R")

# The bound on every call that the server answers at once (open, start, live, a read): a target
# that accepts and never answers costs a fan-out this much, never the HTTP client's default.
START_TIMEOUT_S = 30.0
# Each capture's lease by default: a fleet process that dies leaves a target recording at most
# this long after its last renewal (it renews every third of it while it holds the window).
FLEET_LEASE_S = 60.0
_DEFAULT: Any = object()  # Fleet.start(lease_s=...) not given: the fleet's lease


def _not_sent(exc: BaseException) -> bool:
    """The call never reached its target (no connection was made)."""
    return isinstance(exc, SidecarError) and exc.details.get("sent") is False


class Fleet:
    """Concurrent captures over ``targets``. Use ``async with Fleet(...) as fleet:`` (or call
    :meth:`open` / :meth:`close`). All methods must run on one event loop.

    ``stop_budget_s`` bounds each target's stop (until its upstream answered); the artifact check
    after that is bounded by the target's own collect timeout. ``start_timeout_s`` (default
    :data:`START_TIMEOUT_S`) bounds every other call on a target (open, start, live, a read),
    one deadline per fan-out: a target that accepts and never answers costs that, and its outcome
    says so. ``client_timeout_s`` is the HTTP timeout towards sidecars (default: the start timeout).

    Scale: one TLS context for all targets and a small connection pool per target (see
    ``FleetTransports``), warmed by ``open()``; no thread or process per target: one event loop
    drives them all (where one process is not enough, the Ray driver spreads the controllers over
    node actors). At most ``max_concurrency`` starts and stop sends are in flight at once (default:
    all). A start is two-phase: every target prepares (baselines, journal), then all starts are
    sent together, at ``start_at`` when given (``sidecar/fleet/_release.py``: a sidecar or Ray node
    is told the time and starts itself then), so the skew is the send alone. Every stop is sent;
    one deadline per fan-out bounds the wait for their answers.

    Ends decided from the targets (docs/fleet.md, "When the fleet process dies"): each capture's
    label carries the fleet's ``key`` (default: a new one per fleet), and each a lease of
    ``lease_s`` (default :data:`FLEET_LEASE_S`) that the fleet renews every third of it while it
    holds the window (from a start to its stop). At the end of every call (a failed or cancelled
    start, a stop, :meth:`close`) the fleet lists each target's captures and stops every one still
    starting or active that carries its key and that it does not hold (:meth:`sweep`); a target it
    cannot list is named in the result with what ends it (its lease).

    ``drivers`` places ``ray`` targets (:class:`~sidecar.fleet._ray.RayNodes`: each target's
    controller in a Ray actor on its server's node); the protocol above is the same for every driver.

    Clocks: just after each target's start and its stop, the fleet exchanges timestamps with it
    in the background (``sidecar/fleet/_clocks.py``; ``exchange_clocks=False`` skips it) and
    records its offset in ``TargetResult.clock_start`` / ``clock_stop`` (filled in by ``stop`` and
    ``refresh``): what maps its traces onto the fleet's clock (``sidecar/fleet/_view.py``,
    docs/fleet-clocks.md).

    Shared dirs: before anything starts, the targets' effective profiler dirs are compared
    (``sidecar.config.sharing``); two targets writing into one dir are refused with
    ``ProfilerDirShared`` unless ``allow_shared_dirs``, and then every affected stage verdict is
    ``ambiguous``. The same path on different hosts counts as one dir (a shared filesystem)
    unless ``dirs_host_local``.
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
        start_timeout_s: float = START_TIMEOUT_S,
        client_timeout_s: float | None = None,
        poll_s: float = 0.2,
        control_settings: Any | None = None,
        state_dir: str | Path | None = None,
        allow_shared_dirs: bool = False,
        dirs_host_local: bool = False,
        max_concurrency: int | None = None,
        start_at_max_s: float = START_AT_MAX_S,
        drivers: DriverFactory | None = None,
        exchange_clocks: bool = True,
        key: str | None = None,
        lease_s: float | None = FLEET_LEASE_S,
    ) -> None:
        self.targets = parse_targets(targets, deploy_config=deploy_config, flavor=flavor, token=token)
        if stages is not None and (
            isinstance(stages, (str, bytes)) or not isinstance(stages, (list, tuple))
        ):
            raise FleetStagesInvalid(f"stages must be a list of stage ids, got {stages!r}")
        if stages is not None:
            # The shared rule's part that needs no deploy is applied here, before any profiled step;
            # the rest (each stage known and profiled) is select_stages' once each target's deploy is read.
            try:
                check_stage_list(stages)
            except StageSelectionError as err:
                raise FleetStagesInvalid(err.message, key="stages", details={"stages": list(stages)}) from None
        if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                            or max_concurrency < 1):
            raise ConcurrencyInvalid(f"max_concurrency must be a positive integer, got {max_concurrency!r}")
        self.stages = None if stages is None else list(stages)
        for name, value in (("start_timeout_s", start_timeout_s), ("stop_budget_s", stop_budget_s),
                            ("lease_s", 1.0 if lease_s is None else lease_s)):
            check_seconds(value, name)
        if key is not None and key_problem(key) is not None:
            raise FleetKeyInvalid(str(key_problem(key)), details={"key": repr(key)})
        self.key = key or secrets.token_hex(6)
        self.lease_s = lease_s
        self.stop_budget_s = stop_budget_s
        self.start_timeout_s = start_timeout_s
        self.client_timeout_s = start_timeout_s if client_timeout_s is None else client_timeout_s
        self.poll_s = poll_s
        self.control_settings = control_settings
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.allow_shared_dirs = allow_shared_dirs
        self.dirs_host_local = dirs_host_local
        self.max_concurrency = max_concurrency or len(self.targets)
        self.start_at_max_s = start_at_max_s
        self._make_driver = drivers
        self.exchange_clocks = exchange_clocks
        placed = [t.name for t in self.targets if t.kind is TargetKind.ray]
        if placed and drivers is None:
            raise TargetInvalid(
                f"ray targets ({', '.join(placed[:3])}) are placed by a driver factory; pass "
                "drivers=RayNodes(...) (sidecar.fleet._ray), as the verl integration does",
                details={"targets": placed})
        vllm = [t.name for t in self.targets if t.kind is TargetKind.upstream and t.flavor == "vllm"]
        if vllm and self.stages is not None:
            raise FlavorsMixed(
                f"plain vLLM targets ({', '.join(vllm)}) profile their one engine and take no stage list; "
                "drop the stage list, or put omni and plain vLLM servers in separate fleets",
                details={"vllm_targets": vllm, "stages": self.stages},
            )
        # Upstream deploy files are read (and the stage list and dirs checked) now: nothing is sent yet.
        self._deploys: dict[str, DeployConfig] = {}
        for t in self.targets:
            if t.kind is TargetKind.upstream:
                from sidecar.config.deploy import load_deploy_config

                self._deploys[t.name] = load_deploy_config(t.deploy_config, platform=t.platform)  # type: ignore[arg-type]
        self._check_stages(self._deploys, allow_cuda=True)
        self._ambiguous: dict[str, dict[int, str]] = self._check_dirs(self._deploys)
        self._seen_deploys: dict[str, DeployConfig] = dict(self._deploys)
        self._drivers: dict[str, Driver] = {}
        self._transports = FleetTransports()
        self._opened = False
        self._clock_tasks: list[asyncio.Future[None]] = []
        self._clocks: dict[tuple[str, str], ClockOffset] = {}  # (start|stop, capture id) -> offset
        # the windows this fleet holds, their leases renewed until their stop, and the sweep
        self._leases = Leases(self.key, lease_s=lease_s, state_dir=self.state_dir, timeout_s=start_timeout_s,
                              drivers=lambda: self._drivers, driver=self._driver, each=self._each)
        # starts past their deadline, left to land: an in-process controller's start is waited for at
        # close (cut short, the controller would stop a server whose start is still in flight)
        self._late: dict[asyncio.Future[Any], bool] = {}  # -> in process
        self._unopened: set[str] = set()  # targets whose open failed (this open)

    # --- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Create one client/controller per target (one shared connection pool) and check the
        stage list and the profiler dirs against every sidecar's deploy (``GET /v1/stages``).
        Nothing that changes a server is sent."""
        if self._opened:
            return
        self._opened = True
        try:
            await self._open()
        except BaseException:
            await self.close()  # a later open() starts over (e.g. the next profiled step)
            raise

    async def _open(self) -> None:
        self._unopened = {t.name for t in self.targets}  # until each one's open answered
        for t in self.targets:
            if t.kind is TargetKind.ray:
                self._drivers[t.name] = self._make_driver(t, stop_budget_s=self.stop_budget_s)  # type: ignore[misc]
            elif t.kind is TargetKind.sidecar:
                self._drivers[t.name] = SidecarDriver(t, timeout_s=self.client_timeout_s, poll_s=self.poll_s,
                                                      transport=self._transports.for_target())
            else:
                state_dir = None
                if self.state_dir is not None:
                    state_dir = self.state_dir / server_key(t.url).replace(":", "_").replace("/", "_")
                self._drivers[t.name] = UpstreamDriver(
                    t, self._deploys[t.name], stop_budget_s=self.stop_budget_s, settings=self.control_settings,
                    state_dir=state_dir, transport=self._transports.for_target())
        deadline = asyncio.get_running_loop().time() + self.start_timeout_s
        opened = await self._each(list(self._drivers.values()), lambda d: within(deadline, d.open(), "open", self.start_timeout_s))
        problems: dict[str, TargetError] = {}
        deploys: dict[str, DeployConfig] = {}
        for (name, _), res in zip(self._drivers.items(), opened):
            if isinstance(res, BaseException):
                problems[name] = error_of(res)
            elif res is not None:
                deploys[name] = res
        self._unopened = set(problems)  # nothing was sent to them: nothing to sweep there at close
        if problems:
            raise FleetError(
                f"{len(problems)} of {len(self.targets)} targets cannot be used: "
                + ", ".join(f"{n} ({e.code}: {e.message})" for n, e in problems.items()),
                details={"targets": [{"target": n, "outcome": TargetOutcome.not_started.value,
                                      "error": e.model_dump()} for n, e in problems.items()]},
            )
        self._check_stages({n: d for n, d in deploys.items() if n not in self._deploys}, allow_cuda=True)
        self._ambiguous = self._check_dirs(deploys)
        self._seen_deploys = deploys

    async def close(self, *, keep_live: bool = False) -> None:
        """Sweep every target (every capture carrying this fleet's key still starting or active is
        stopped, a window it still holds included), then close clients and controllers.
        ``keep_live=True`` sweeps nothing and leaves what it holds running: a sidecar's until its
        duration or lease, an upstream target's journaled in ``state_dir`` for a later
        ``Fleet(..., state_dir=same).open()`` to stop (that is how ``fleet start``/``stop`` work)."""
        for task in self._clock_tasks:  # an exchange in flight is not worth holding a close for
            task.cancel()
        self._clock_tasks = []
        self._leases.release_all()
        landing = [t for t, here in self._late.items() if here]
        if landing:  # landed first (within the stop budget), so the sweep stops what they started
            await asyncio.wait(landing, timeout=self.stop_budget_s)
        if self._opened and self._drivers and not keep_live:
            try:
                opened = [n for n in self._drivers if n not in self._unopened]
                swept = await _uncancellable(self._leases.sweep((), opened))
            except Exception as exc:  # closing must go on: the leases are the safety net
                log.warning("fleet %s: the closing sweep failed: %s", self.key, exc)
            else:
                for name, sw in swept.items():
                    log.warning("fleet %s: closing: %s: %s", self.key, name, swept_text(sw))
        for task in list(self._late):  # another process's start goes on there: its sweep was sent
            task.cancel()
        drivers, self._drivers = list(self._drivers.values()), {}
        await asyncio.gather(*(d.close(keep_live) for d in drivers), return_exceptions=True)
        self._opened = False

    async def __aenter__(self) -> Fleet:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_stages(self, deploys: dict[str, DeployConfig], *, allow_cuda: bool = False) -> None:
        """``select_stages`` for each target's deploy; any refusal → ``FleetInvalid`` naming them."""
        refused: dict[str, StageSelectionError] = {}
        for name, deploy in deploys.items():
            try:
                select_stages(deploy, self.stages, allow_cuda=allow_cuda)
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

    def _check_dirs(self, deploys: dict[str, DeployConfig]) -> dict[str, dict[int, str]]:
        """The shared-dir rule over ``deploys`` (the stages each target will capture). Refuses
        with ``ProfilerDirShared``; with ``allow_shared_dirs`` returns, per target and stage, the
        reason its verdict will be ``ambiguous``."""
        stages = {n: select_stages(d, self.stages, allow_cuda=True) for n, d in deploys.items()}
        hosts = {t.name: server_key(t.url).split(":", 1)[0] for t in self.targets}
        groups = shared_dir_groups(deploys, stages, hosts=hosts, host_local=self.dirs_host_local)
        if not groups:
            return {}
        findings = shared_profiler_dirs(deploys, stages, hosts=hosts, host_local=self.dirs_host_local)
        shared = [{"dir": g.dir, "host": g.host, "targets": g.targets,
                   "stages": [{"target": t, "stage_id": s} for t, s in g.members]} for g in groups]
        if not self.allow_shared_dirs:
            shown = "; ".join(f.message for f in findings[:3])
            more = f" (and {len(findings) - 3} more shared dirs)" if len(findings) > 3 else ""
            raise ProfilerDirShared(shown + more, details={"shared": shared}, findings=findings)
        log.warning("allow_shared_dirs: %d shared profiler dir(s); their verdicts will be ambiguous: %s",
                    len(groups), "; ".join(f"{g.dir} ({', '.join(g.targets[:3])}...)" for g in groups))
        out: dict[str, dict[int, str]] = {}
        for g in groups:
            for name, sid in g.members:
                others = [t for t in g.targets if t != name]
                out.setdefault(name, {})[sid] = (
                    f"torch_profiler_dir {g.dir!r} is shared with {', '.join(others[:3])}"
                    + (f" and {len(others) - 3} more" if len(others) > 3 else "")
                    + "; folder names carry no server identity, so this trace cannot be told apart from "
                    "theirs (run with --allow-shared-dirs); " + RENDER_FIX)
        return out

    def _judged(self, r: TargetResult) -> TargetResult:
        return mark_ambiguous(r, self._ambiguous.get(r.target, {}))

    def _driver(self, name: str) -> Driver:
        if not self._opened:
            raise FleetClosed("the fleet is not open; use `async with Fleet(...)` or await fleet.open()")
        return self._drivers[name]

    async def _each(self, items: Sequence[T], call: Callable[[T], Awaitable[R]], *,
                    gate: bool = True) -> list[R | BaseException]:
        """``call`` on every item at once (at most ``max_concurrency`` in flight unless ``gate`` is
        off: the call bounds its own part); exceptions are returned, not raised (cancellation is raised)."""
        if not gate or self.max_concurrency >= len(items):
            return await asyncio.gather(*(call(i) for i in items), return_exceptions=True)
        gate = asyncio.Semaphore(self.max_concurrency)

        async def gated(item: T) -> R:
            async with gate:
                return await call(item)

        return await asyncio.gather(*(gated(i) for i in items), return_exceptions=True)

    # --- start / stop ---------------------------------------------------------------------

    async def start(
        self, *, label: str | None = None, duration_s: float | None = None, lease_s: float | None = _DEFAULT,
        kind: Kind = "torch", start_at: float | datetime | None = None, steps: int | None = None,
    ) -> FleetCapture:
        """Start on every target at once. Returns when every upstream accepted. If any target
        fails, the started ones are stopped (concurrently), the targets swept (a start that timed
        out may still land: it is stopped) and ``FleetError`` lists every outcome. Cancelled
        midway, the starts in flight are let finish and every started target is stopped before the
        cancellation goes on (the cleanup is shielded).

        Each capture's label is ``label`` and the fleet's key; ``duration_s``: each target ends its
        own window that long after its server answered the start (on its host: the ends are
        aligned there, not by this fan-out); ``lease_s`` (default: the fleet's ``lease_s``; None: no
        lease, for a window handed over to another process, as ``fleet start`` does): renewed by
        this fleet until :meth:`stop`.

        Two-phase: each target's capture is prepared first (stage selection, baselines, journal),
        then every start is sent together; a target failing its preparation withholds the others'
        (outcome ``not_started``, nothing sent). ``start_at`` (epoch seconds or an aware datetime,
        like dynolog's ``--profile-start-time``) releases the sends at that wall-clock time;
        refused with ``StartAtInvalid`` when in the past or more than ``start_at_max_s`` ahead.
        Sidecar targets are told ``start_at`` on their own clock (the fleet's plus the offset a
        clock exchange measures first) and each sends its start then: the skew is theirs, not
        the fan-out's (a sidecar that does not know ``start_at`` is released by the fleet then).
        ``steps``: each target's capture stops itself after that many engine steps of its server."""
        if kind not in ("torch", "nsys"):
            raise KindInvalid(f"kind must be 'torch' or 'nsys', got {kind!r}")
        _check_window(label, duration_s)
        lease_s = self.lease_s if lease_s is _DEFAULT else lease_s
        at = check_start_at(start_at, max_ahead_s=self.start_at_max_s)
        tagged = keyed_label(label, self.key)
        # open() checked the stage list against torch and cuda stages; now the kind is known.
        self._check_stages(self._seen_deploys, allow_cuda=kind == "nsys")
        names = [t.name for t in self.targets]
        drivers = [self._driver(n) for n in names]
        loop = asyncio.get_running_loop()
        t0 = loop.time()  # one clock read for the fan-out; each target's own end is read as it lands
        # A fleet that starts at most max_concurrency at once cannot hold every target prepared.
        release = Release(len(drivers), start_at=at, barrier=self.max_concurrency >= len(drivers))
        # One deadline for every start: the time until start_at is not the targets' to answer in.
        def start_by(now: float) -> float:
            return now + self.start_timeout_s + (0.0 if at is None else max(at - time.time(), 0.0))

        deadline = start_by(t0)
        waves = self.max_concurrency < len(drivers)  # started in waves: each target's own budget from its turn
        clocks = asyncio.Semaphore(CLOCK_CONCURRENCY) if at is not None and self.exchange_clocks else None

        async def one(d: Driver) -> tuple[Capture, float, ClockOffset | None]:
            # a Ray node or a sidecar is told start_at on its own clock (measured first: at most
            # CLOCK_CONCURRENCY exchanges at once keep each round trip short); see _release.py
            gate = release.gate(clocks)
            try:
                by = start_by(loop.time()) if waves else deadline
                opts = {} if steps is None else {"steps": steps}  # a driver of an older build takes none
                cap = await self._landing(d.start(self.stages, tagged, duration_s, lease_s, kind, gate, **opts), by,
                                          in_process=isinstance(d, UpstreamDriver))
            except BaseException as exc:
                gate.failed(f"{d.target.name} failed before the starts were sent ({error_of(exc).code})")
                raise
            return cap, loop.time() - t0, gate.clock

        fan_out = asyncio.ensure_future(self._each(drivers, one))
        try:
            results = await asyncio.shield(fan_out)
        except asyncio.CancelledError:
            release.abort("the fleet start was cancelled")
            await _uncancellable(self._undo_start(fan_out, label))
            raise
        if at is not None and release.released_at is not None and release.released_at - at > 0.05:
            log.warning("start_at %.3f: the targets were prepared %.3fs after it; released then", at,
                        release.released_at - at)
        out: dict[str, TargetResult] = {}
        measured: dict[str, ClockOffset] = {}  # the exchanges that mapped start_at: the start's clocks
        for t, res in zip(self.targets, results):
            base = TargetResult(target=t.name, kind=t.kind, outcome=TargetOutcome.started)
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res  # KeyboardInterrupt is not a target failure
                cid = res.details.get("capture_id") if isinstance(res, SidecarError) else None
                outcome = TargetOutcome.not_started if isinstance(res, StartWithheld) else TargetOutcome.start_failed
                err = error_of(res)
                if isinstance(res, TargetNoAnswer):  # it may have started: the sweep below stops what it starts
                    err = TargetError(code="start_timeout", message=f"{res}; the server may have started "
                                      "profiling all the same: the fleet swept it for the capture (see sweep)")
                out[t.name] = base.model_copy(update={"outcome": outcome, "error": err, "capture_id": cid})
            else:
                cap, took, clock = res
                out[t.name] = base.with_capture(cap, start_s=took)
                if clock is not None:
                    measured[t.name] = clock
        fc = FleetCapture(label=label, stages=self.stages, targets=out, start_at=at, released_at=release.released_at,
                          key=self.key, lease_s=lease_s)
        if all(r.outcome is TargetOutcome.started for r in out.values()):
            self._leases.hold(fc, lease_s)
            self._exchange_later("start", fc, list(out), measured)
            return fc
        # a start still landing (past its deadline) and not yet sent sends nothing now
        release.abort("another target failed to start")
        started = [n for n, r in out.items() if r.outcome is TargetOutcome.started]
        out = await _uncancellable(self._roll_back(fc, started))
        fc = fc.model_copy(update={"targets": out})
        err = fc.to_error("start")
        log.warning("%s; stopped the %d that had started", err.message, len(started))
        raise err

    async def _roll_back(self, fc: FleetCapture, started: list[str]) -> dict[str, TargetResult]:
        """Stop the started targets, then sweep every target (a start past its deadline that landed)."""
        out = dict(fc.targets)
        stopped = await self._stop_all(fc, started, reason=StopReason.rollback)
        for name in started:
            r = stopped[name]
            out[name] = r.model_copy(update={
                "outcome": TargetOutcome.rolled_back if r.outcome is TargetOutcome.stopped
                else TargetOutcome.rollback_failed})
        return with_sweep(out, await self._leases.sweep(self._leases.kept()))

    async def _undo_start(self, fan_out: asyncio.Future[list[Any]], label: str | None) -> None:
        results = await fan_out
        started = {t.name: TargetResult(target=t.name, kind=t.kind, outcome=TargetOutcome.started).with_capture(res[0])
                   for t, res in zip(self.targets, results) if not isinstance(res, BaseException)}
        if started:
            log.warning("fleet start cancelled: stopping the %d targets that had started", len(started))
        fc = FleetCapture(label=label, stages=self.stages, targets=started, key=self.key)
        out = await self._roll_back(fc, list(started))
        for name, r in out.items():
            if r.sweep is not None:
                log.warning("fleet %s: start cancelled: %s: %s", self.key, name, swept_text(r.sweep))

    async def _landing(self, aw: Awaitable[R], by: float, *, in_process: bool) -> R:
        """``aw`` (a start) once it answers, within ``by`` (loop time); past it ``TargetNoAnswer``,
        while the start itself goes on: cut, an in-process controller's start would be rolled back
        while the server may still be starting, and a sidecar carries on with it anyway. A start
        that lands late is stopped by the sweep (or :meth:`close`, which lets it land first)."""
        task = asyncio.ensure_future(aw)
        try:
            done, _ = await asyncio.wait({task}, timeout=max(by - asyncio.get_running_loop().time(), 0.0))
        except asyncio.CancelledError:
            self._leave_landing(task, in_process)
            raise
        if task in done:
            return task.result()
        self._leave_landing(task, in_process)
        raise TargetNoAnswer(f"no answer to start within {self.start_timeout_s:g}s")

    def _leave_landing(self, task: asyncio.Future[Any], in_process: bool) -> None:
        self._late[task] = in_process
        task.add_done_callback(lambda t: self._late.pop(t, None))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its outcome is the sweep's

    # --- the sweep (the windows held and their leases: sidecar/fleet/_leases.py) -------------

    async def sweep(self) -> dict[str, Sweep]:
        """Stop every capture carrying this fleet's key that is still starting or active on any
        target and that the fleet does not hold (a start that landed after its deadline, a window
        whose stop was lost); each target's findings, where there are any. Every call that ends a
        window runs it; call it for a fleet made with the ``key`` of one that is gone."""
        return await _uncancellable(self._leases.sweep(self._leases.kept()))

    async def stop(
        self, fc: FleetCapture, *, wait_artifacts: bool = True, artifact_timeout_s: float | None = None
    ) -> FleetCapture:
        """Stop every started target concurrently (each within ``stop_budget_s``). With
        ``wait_artifacts`` also wait for each artifact check (bounded by ``artifact_timeout_s``);
        without, return once every upstream answered and let the checks finish in the background
        (``refresh`` later). Never raises for a target's failure: see ``ok`` / ``to_error``.
        Every stop is sent, at most ``max_concurrency`` at once, however long that takes; only the
        wait for the servers' answers is bounded (``stop_budget_s``). Then every target is swept
        (:meth:`sweep`). Cancelled, it still sends every stop and sweeps before the cancellation
        goes on."""
        return await _uncancellable(self._stop(fc, wait_artifacts, artifact_timeout_s))

    async def _stop(self, fc: FleetCapture, wait_artifacts: bool, artifact_timeout_s: float | None, *,
                    ended: bool = False) -> FleetCapture:
        names = [n for n, r in fc.targets.items() if r.outcome is TargetOutcome.started and r.capture_id]
        for name in names:
            self._leases.drop(name, fc.targets[name].capture_id)  # type: ignore[arg-type]  # no longer renewed
        keep = self._leases.kept() | {fc.targets[n].capture_id for n in names}  # type: ignore[misc]
        # each stopped target is swept with its stop (one read); the others beside
        stopped, swept = await asyncio.gather(
            self._stop_all(fc, names, reason=StopReason.explicit, sweep=keep, ended=ended),
            self._leases.sweep(keep, [n for n in self._drivers if n not in names]))
        out = dict(fc.targets)
        out.update(stopped)
        fc = fc.model_copy(update={"targets": with_sweep(out, swept)})
        self._exchange_later("stop", fc, [n for n in names if out[n].outcome is TargetOutcome.stopped])
        if wait_artifacts:
            return await self.refresh(fc, wait=True, timeout=artifact_timeout_s)
        return await self._with_clocks(fc, wait=False)

    def _exchange_later(self, phase: str, fc: FleetCapture, names: Sequence[str],
                        measured: dict[str, ClockOffset] | None = None) -> None:
        """Each target's clock exchange (``sidecar/fleet/_clocks.py``) just after its start or stop,
        in the background and at most ``CLOCK_CONCURRENCY`` at once: a thousand exchanges at once
        would queue on this loop and each round trip (the error bound) would grow with the fleet.
        ``measured``: exchanges taken already (the one that mapped a target's ``start_at``), only
        recorded. At the stop, a target whose start exchange was good takes one sample: it checks
        the drift, the start's bound stays the tighter. The results land in ``clock_start`` /
        ``clock_stop`` at the next ``stop`` / ``refresh``."""
        pairs = [(n, fc.targets[n].capture_id) for n in names if fc.targets[n].capture_id]
        if not (self.exchange_clocks and pairs):
            return
        loop = asyncio.get_running_loop()
        more = FLEET_MORE // len(pairs)  # a small fleet affords more samples on a busy host
        known = measured or {}

        async def run() -> None:
            gate = asyncio.Semaphore(CLOCK_CONCURRENCY)

            async def one(name: str, cid: str) -> None:
                clock = known.get(name)
                if clock is None:
                    start = self._clocks.get(("start", cid)) if phase == "stop" else None
                    good = start is not None and start.error_ns <= GOOD_NS
                    async with gate:
                        clock = await _clock_of(self._drivers[name], by=loop.time() + self.start_timeout_s,
                                                more=0 if good else more, samples=1 if good else SAMPLES)
                if clock is None:
                    return
                self._clocks[(phase, cid)] = clock
                if clock.method == "in_process":  # offset 0 by construction: this result states it, nothing
                    return                        # crosses (a thousand records beside the stop, from workers)
                record = getattr(self._drivers.get(name), "record_clock", None)
                if record is not None:  # the capture keeps it too (journaled on its host); best effort
                    try:
                        await within(loop.time() + self.start_timeout_s, record(cid, phase, clock), "a clock record", 0.0)
                    except Exception as exc:  # a sidecar older than POST /v1/captures/{id}/clock
                        log.debug("clock offset not recorded on %s: %s", name, exc)

            await asyncio.gather(*(one(n, c) for n, c in pairs if n in self._drivers), return_exceptions=True)

        self._clock_tasks.append(asyncio.ensure_future(run()))

    async def clocks(self, fc: FleetCapture) -> FleetCapture:
        """``fc`` with every target's clock offsets, once the exchanges in flight have ended."""
        return await self._with_clocks(fc, wait=True)

    async def _with_clocks(self, fc: FleetCapture, *, wait: bool) -> FleetCapture:
        """``fc`` with the clock offsets measured so far (with ``wait``: once the exchanges in
        flight end, each bounded by ``start_timeout_s``)."""
        if wait and self._clock_tasks:
            await asyncio.wait(list(self._clock_tasks))
        self._clock_tasks = [t for t in self._clock_tasks if not t.done()]
        out = {}
        for name, r in fc.targets.items():
            start, stop = self._clocks.get(("start", r.capture_id or "")), self._clocks.get(("stop", r.capture_id or ""))
            if (start and not r.clock_start) or (stop and not r.clock_stop):
                r = r.model_copy(update={"clock_start": r.clock_start or start, "clock_stop": r.clock_stop or stop})
            out[name] = r
        return fc.model_copy(update={"targets": out})

    async def _stop_all(self, fc: FleetCapture, names: Sequence[str], *, reason: StopReason,
                        sweep: Collection[str] | None = None, ended: bool = False) -> dict[str, TargetResult]:
        """Send every target its stop (at most ``max_concurrency`` sends at once, each bounded by
        ``start_timeout_s``: a target answers a stop at once), then wait for the servers' answers
        until one deadline, ``stop_budget_s`` after the call. The deadline never holds a stop back:
        one sent after it is read once for its answer. ``sweep``: each target is also swept (its
        captures read once, keeping these ids). ``ended``: the targets were told to end the window
        themselves, so each is read first, and sent a stop only where its window still runs."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sends = asyncio.Semaphore(self.max_concurrency)
        # One deadline for all (a hung target delays no other), kept by one timer that cancels the
        # waits still running when it fires (asyncio.timeout_at needs Python 3.11).
        waiting: set[asyncio.Future[Capture]] = set()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            for w in waiting:
                w.cancel()

        async def answer_of(d: Driver, cid: str) -> Capture:
            """The stopped capture, or (past the deadline) one read of it."""
            if not expired:
                w = asyncio.ensure_future(d.stopped(cid))
                waiting.add(w)
                try:
                    return await w
                except asyncio.CancelledError:
                    if not expired or not w.cancelled():
                        raise
                finally:
                    waiting.discard(w)
            return await within(loop.time() + self.start_timeout_s, d.get(cid), "a read of the capture", self.start_timeout_s)

        async def one(name: str) -> TargetResult:
            r = fc.targets[name]
            assert r.capture_id is not None
            d = self._driver(name)
            sent, listed, cap = False, None, None
            try:
                if ended:  # what the target says first: its window ended by itself, or not
                    with contextlib.suppress(Exception):  # unread: its stop is sent, as to any other
                        listed = await self._leases.listed(d)
                        cap = next((c for c in listed if c.id == r.capture_id), None)
                if cap is None or not stop_answered(cap):
                    async with sends:
                        cap = await within(loop.time() + self.start_timeout_s, d.stop(r.capture_id, reason), "stop",
                                        self.start_timeout_s)
                sent = True
                swept = None if sweep is None else await self._leases.sweep_one(name, sweep, listed)
                if not stop_answered(cap):
                    cap = await answer_of(d, r.capture_id)
            except Exception as exc:
                return r.model_copy(update={**self._stop_fault(d.target, exc, sent), "stop_s": loop.time() - t0})
            if swept is not None:
                r = r.model_copy(update={"sweep": swept})
            took = loop.time() - t0
            # unanswered: by this fan-out's deadline, or by the target's own stop budget first (it then
            # holds the stop, `stopping` with upstream_timeout): the same outcome whichever came first
            if not stop_answered(cap) or cap.state is CaptureState.stopping:
                return r.with_capture(cap, outcome=TargetOutcome.stop_timeout, stop_s=took, error=TargetError(
                    code="stop_timeout",
                    message=f"the stop was sent and its server did not answer it within {self.stop_budget_s:g}s; "
                            f"the target holds the stop (it stays {cap.state.value} until its server answers or is "
                            "gone) and may still be writing traces"))
            err = None
            if cap.state is CaptureState.failed and cap.errors:
                err = TargetError(code=cap.errors[-1].code, message=cap.errors[-1].message)
            return self._judged(r.with_capture(cap, outcome=TargetOutcome.stopped, error=err, stop_s=took))

        timer = loop.call_at(t0 + self.stop_budget_s, expire)
        try:
            results = await self._each(list(names), one, gate=False)
        finally:
            timer.cancel()
        for res in results:
            if isinstance(res, BaseException):
                raise res  # `one` catches every Exception: this is cancellation or an interrupt
        return dict(zip(names, results))  # type: ignore[arg-type]

    def _stop_fault(self, t: Target, exc: BaseException, sent: bool) -> dict[str, Any]:
        """A stop that failed: not sent (no connection: the lease ends it), unanswered, or refused."""
        err = error_of(exc)
        if not sent and _not_sent(exc):
            return {"outcome": TargetOutcome.stop_not_sent, "error": TargetError(
                code="stop_not_sent", message=f"the stop never reached the target ({err.code}: {err.message}); "
                                              f"what ends its capture: {self._leases.ends_by(t)}")}
        if isinstance(exc, TargetNoAnswer):
            return {"outcome": TargetOutcome.stop_timeout, "error": TargetError(
                code="stop_timeout", message=f"{err.message}: the stop was sent and not acknowledged; what ends its "
                                             f"capture if it never arrived: {self._leases.ends_by(t)}")}
        return {"outcome": TargetOutcome.stop_failed, "error": err}

    async def refresh(self, fc: FleetCapture, *, wait: bool = False, timeout: float | None = None) -> FleetCapture:
        """Re-read every target's capture (with ``wait``: until terminal or ``timeout``)."""

        loop = asyncio.get_running_loop()
        # One deadline for the whole fan-out: every target's check ends by it, hung ones included.
        deadline = None if timeout is None else loop.time() + timeout
        read_by = loop.time() + self.start_timeout_s

        async def one(r: TargetResult) -> TargetResult:
            if r.capture_id is None or r.done or r.outcome in (TargetOutcome.start_failed,):
                return r
            # A target past its stop budget (or unreachable) is read once, not waited for: its
            # stop is held on the target and must not hold the fleet past that budget.
            patient = wait and r.outcome not in (TargetOutcome.stop_timeout, TargetOutcome.stop_failed,
                                                 TargetOutcome.stop_not_sent)
            try:
                d = self._driver(r.target)
                if patient:
                    left = None if deadline is None else max(deadline - loop.time(), 0.0)
                    # the driver's own wait honours `left`; the bound beyond it is for one that cannot
                    cap = await within(None if deadline is None else deadline + self.start_timeout_s,
                                    d.wait(r.capture_id, left), "the artifact check", timeout or 0.0)
                else:
                    cap = await within(read_by, d.get(r.capture_id), "a read of the capture", self.start_timeout_s)
            except Exception as exc:
                return r.model_copy(update={"error": r.error or error_of(exc)})
            err = r.error
            if err is None and cap.state is CaptureState.failed and cap.errors:
                err = TargetError(code=cap.errors[-1].code, message=cap.errors[-1].message)
            return self._judged(r.with_capture(cap, error=err))

        results = await self._each(list(fc.targets.values()), one)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        fc = fc.model_copy(update={"targets": {r.target: r for r in results}})  # type: ignore[union-attr]
        return await self._with_clocks(fc, wait=wait)

    async def heartbeat(self, fc: FleetCapture) -> None:
        """Extend every started capture's lease now (best effort; errors are logged). The fleet
        renews the windows it holds by itself: this is for a caller that wants one more."""
        deadline = asyncio.get_running_loop().time() + self.start_timeout_s

        async def one(r: TargetResult) -> None:
            try:
                await within(deadline, self._driver(r.target).heartbeat(r.capture_id),  # type: ignore[arg-type]
                          "a heartbeat", self.start_timeout_s)
            except Exception as exc:  # a missed heartbeat is not fatal; the lease is the safety net
                log.debug("heartbeat to %s failed: %s", r.target, exc)

        await self._each([r for r in fc.targets.values() if r.outcome is TargetOutcome.started and r.capture_id], one)

    async def live(self, *, label: str | None = None, key: str | None = None) -> FleetCapture:
        """The live capture of every target (for a stop from another process: a sidecar's
        non-terminal capture, or one an upstream's journal in ``state_dir`` shows live). Targets
        without one are ``not_started`` with error ``capture_not_found``; with ``key``, a live
        capture whose label does not carry that fleet key (another client's, another fleet's) is
        ``not_started`` with ``capture_not_this_fleets``, so a stop leaves it recording."""

        deadline = asyncio.get_running_loop().time() + self.start_timeout_s

        async def one(t: Target) -> TargetResult:
            base = TargetResult(target=t.name, kind=t.kind, outcome=TargetOutcome.started)
            try:
                cap = await within(deadline, self._driver(t.name).live(), "a read of its live capture", self.start_timeout_s)
            except Exception as exc:
                return base.model_copy(update={"outcome": TargetOutcome.not_started, "error": error_of(exc)})
            if cap is None:
                return base.model_copy(update={"outcome": TargetOutcome.not_started, "error": TargetError(
                    code="capture_not_found", message="no live capture on this target")})
            if key is not None and key_of(cap.label) != key:
                return base.model_copy(update={"outcome": TargetOutcome.not_started, "error": TargetError(
                    code="capture_not_this_fleets", message=f"capture {cap.id} is live here, but it is not fleet "
                    f"{key}'s (its label: {cap.label!r}): left recording")})
            return base.with_capture(cap)

        results = await self._each(self.targets, one)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return FleetCapture(label=label, stages=self.stages, targets={r.target: r for r in results})  # type: ignore[union-attr]

    async def capture(
        self, duration_s: float, *, label: str | None = None, wait_artifacts: bool = True,
        artifact_timeout_s: float | None = None, kind: Kind = "torch", start_at: float | datetime | None = None,
    ) -> FleetCapture:
        """Start (at ``start_at`` when given, see :meth:`start`), keep the window open
        ``duration_s`` seconds, stop. Each target is told ``duration_s`` and ends its own window
        (scheduled where it runs: the ends are as aligned as the starts, whatever this fan-out's
        speed); the fleet's stop, ``duration_s`` after the last start answered, finds them ended and
        reads their outcome (it stops any that is not). Cancelled at any point, every started
        target is stopped before the cancellation goes on (the artifact wait is skipped)."""
        fc = await self.start(label=label, kind=kind, start_at=start_at, duration_s=duration_s)
        try:
            await asyncio.sleep(duration_s)
        except asyncio.CancelledError:
            await _uncancellable(self.stop(fc, wait_artifacts=False))
            raise
        return await _uncancellable(self._stop(fc, wait_artifacts, artifact_timeout_s, ended=True))


def _check_window(label: str | None, duration_s: float | None) -> None:
    """What every target would refuse (the sidecar API's bounds, the controller's), refused once
    here before anything is sent, in the caller's words: sent, each target would answer a bare
    ``request_invalid`` after the others had started."""
    if duration_s is not None and (isinstance(duration_s, bool) or not isinstance(duration_s, (int, float))
                                   or not math.isfinite(duration_s) or not duration_s > 0):
        raise FleetDurationInvalid(f"duration_s must be a finite number of seconds above 0, got {duration_s!r} "
                                   "(--duration S on the CLI); leave it out to stop the window yourself")
    if label is None:
        return
    check_label(label, "label")


def check_seconds(value: object, name: str, *, none: str = "") -> None:
    """``BudgetInvalid`` unless ``value`` is a positive number of seconds (``none``: what None, which
    the caller takes, means there)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise BudgetInvalid(f"{name} must be a positive number of seconds{none}, got {value!r}", key=name)


def check_label(label: object, name: str) -> None:
    """``LabelInvalid`` where ``label`` is one every target would refuse (the API's rule)."""
    if not isinstance(label, str):
        raise LabelInvalid(f"{name} must be text, got {type(label).__name__}", key=name)
    why = label_problem(label)
    if why is not None:
        raise LabelInvalid(f"{name} {why} shown in lists and tables: drop the newline, tab or escape", key=name)


async def _clock_of(d: Driver, *, by: float | None = None, more: int = MORE,
                    samples: int = SAMPLES) -> ClockOffset | None:
    """``d``'s clock exchange (``sidecar/fleet/_clocks.py``), or None where it cannot be measured
    (a sidecar older than ``GET /v1/clock``, a driver without ``clock``): best effort, never a
    target's failure; its traces are then mapped at offset 0 and the archive says so."""
    clock = getattr(d, "clock", None)
    if clock is None:
        return None
    try:
        return await (clock(more, samples) if by is None else within(by, clock(more, samples), "a clock exchange", 0.0))
    except Exception as exc:
        log.debug("no clock offset for %s: %s", d.target.name, exc)
        return None


async def _uncancellable(aw: Awaitable[R]) -> R:
    """Run cleanup to its end even if the caller is cancelled meanwhile (then re-raise). The work
    is bounded by its own budgets; only a cancellation of the cleanup task itself ends it early."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result

