"""The fan-out: one capture over many targets. Start is concurrent and all-or-nothing (a failure
stops the started ones, then ``FleetError`` lists every target's outcome); stop reaches every
started target concurrently, each within its own budget. Bad input is refused (``FleetInvalid``)
before anything is sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from sidecar.config.models import DeployConfig
from sidecar.config.rules import select_stages
from sidecar.config.sharing import RENDER_FIX, shared_dir_groups, shared_profiler_dirs
from sidecar.control.models import Capture, CaptureState, StopReason
from sidecar.errors import BudgetInvalid, TargetInvalid, TargetNoAnswer, StagesNotShared, ConcurrencyInvalid, FlavorsMixed, FleetClosed, FleetStagesInvalid, KindInvalid, FleetError, FleetInvalid, ProfilerDirShared, SidecarError, StageSelectionError, StartWithheld
from sidecar.fleet._clocks import FLEET_MORE, MORE, ClockOffset
from sidecar.fleet._drivers import Driver, DriverFactory, Kind, FleetTransports, SidecarDriver, UpstreamDriver
from sidecar.fleet._release import START_AT_MAX_S, Release, check_start_at
from sidecar.fleet._shards import CLOCK_CONCURRENCY, ShardPool, processes_for
from sidecar.fleet._results import FleetCapture, TargetError, TargetOutcome, TargetResult, error_of, mark_ambiguous
from sidecar.fleet._targets import Flavor, Target, TargetKind, parse_targets, server_key

log = logging.getLogger("sidecar.fleet")

T = TypeVar("T")
R = TypeVar("R")

# The bound on every call that the server answers at once (open, start, live, a read): a target
# that accepts and never answers costs a fan-out this much, never the HTTP client's default.
START_TIMEOUT_S = 30.0




async def _by(deadline: float | None, aw: Awaitable[R], what: str, budget_s: float) -> R:
    """``aw`` bounded by ``deadline`` (loop time; ``None``: unbounded), else ``TargetNoAnswer``."""
    if deadline is None:
        return await aw
    try:
        # wait_for, not asyncio.timeout_at: the package supports Python 3.10
        return await asyncio.wait_for(aw, max(deadline - asyncio.get_running_loop().time(), 0.0))
    except asyncio.TimeoutError:  # on 3.10 not the builtin TimeoutError
        raise TargetNoAnswer(f"no answer to {what} within {budget_s:g}s") from None


class Fleet:
    """Concurrent captures over ``targets``. Use ``async with Fleet(...) as fleet:`` (or call
    :meth:`open` / :meth:`close`). All methods must run on one event loop.

    ``stop_budget_s`` bounds each target's stop (until its upstream answered); the artifact check
    after that is bounded by the target's own collect timeout. ``start_timeout_s`` (default
    :data:`START_TIMEOUT_S`) bounds every other call on a target (open, start, live, a read),
    one deadline per fan-out: a target that accepts and never answers costs that, and its outcome
    says so. ``client_timeout_s`` is the HTTP timeout towards sidecars (default: the start timeout).

    Scale: one TLS context for all targets and a small connection pool per target (see
    ``FleetTransports``), warmed by ``open()``; no thread or process per target. Sidecar and
    upstream targets are driven from ``processes`` worker processes (``sidecar/fleet/_shards.py``;
    default: one per 128 from 512 such targets on, leaving this process a core), each a share of
    the HTTP requests and controllers, which at a thousand targets are most of a fan-out's CPU; at most
    ``max_concurrency`` targets are started at once (default: all). A start is two-phase: every
    target prepares (baselines, journal), then all starts are sent together, at ``start_at``
    when given (``sidecar/fleet/_release.py``), so the skew is the send alone. Stops are bounded
    by one deadline per fan-out.

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
        processes: int | None = None,
    ) -> None:
        self.targets = parse_targets(targets, deploy_config=deploy_config, flavor=flavor, token=token)
        if stages is not None and (
            isinstance(stages, (str, bytes)) or not isinstance(stages, (list, tuple))
        ):
            raise FleetStagesInvalid(f"stages must be a list of stage ids, got {stages!r}")
        for name, count in (("max_concurrency", max_concurrency), ("processes", processes)):
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
                raise ConcurrencyInvalid(f"{name} must be a positive integer, got {count!r}")
        self.stages = None if stages is None else list(stages)
        for name, value in (("start_timeout_s", start_timeout_s), ("stop_budget_s", stop_budget_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise BudgetInvalid(f"{name} must be a positive number of seconds, got {value!r}")
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
        self.processes = processes
        self._pool: ShardPool | None = None
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
        workers = processes_for(sum(t.kind is not TargetKind.ray for t in self.targets), self.processes)
        if workers > 1:
            self._pool = ShardPool(workers, timeout_s=self.client_timeout_s, poll_s=self.poll_s)
            await self._pool.open()
        for t in self.targets:
            if t.kind is TargetKind.ray:
                self._drivers[t.name] = self._make_driver(t, stop_budget_s=self.stop_budget_s)  # type: ignore[misc]
            elif t.kind is TargetKind.sidecar and self._pool is not None:
                self._drivers[t.name] = self._pool.driver(t)
            elif t.kind is TargetKind.sidecar:
                self._drivers[t.name] = SidecarDriver(t, timeout_s=self.client_timeout_s, poll_s=self.poll_s,
                                                      transport=self._transports.for_target())
            else:
                state_dir = None
                if self.state_dir is not None:
                    state_dir = self.state_dir / server_key(t.url).replace(":", "_").replace("/", "_")
                upstream = {"deploy": self._deploys[t.name], "stop_budget_s": self.stop_budget_s,
                            "settings": self.control_settings, "state_dir": state_dir}
                if self._pool is not None:
                    self._drivers[t.name] = self._pool.driver(t, upstream)
                else:
                    self._drivers[t.name] = UpstreamDriver(t, transport=self._transports.for_target(), **upstream)
        deadline = asyncio.get_running_loop().time() + self.start_timeout_s
        opened = await self._each(list(self._drivers.values()), lambda d: _by(deadline, d.open(), "open", self.start_timeout_s))
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
        self._check_stages({n: d for n, d in deploys.items() if n not in self._deploys}, allow_cuda=True)
        self._ambiguous = self._check_dirs(deploys)
        self._seen_deploys = deploys

    async def close(self, *, keep_live: bool = False) -> None:
        """Close clients and controllers. An in-process controller stops its live capture on
        close; ``keep_live=True`` leaves it running, journaled in ``state_dir``, for a later
        ``Fleet(..., state_dir=same).open()`` to stop (that is how ``fleet start``/``stop`` work)."""
        for task in self._clock_tasks:  # an exchange in flight is not worth holding a close for
            task.cancel()
        self._clock_tasks = []
        drivers, self._drivers = list(self._drivers.values()), {}
        await asyncio.gather(*(d.close(keep_live) for d in drivers), return_exceptions=True)
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()
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

    async def _each(self, items: Sequence[T], call: Callable[[T], Awaitable[R]]) -> list[R | BaseException]:
        """``call`` on every item at once (at most ``max_concurrency`` in flight); exceptions are
        returned, not raised (cancellation is raised)."""
        if self.max_concurrency >= len(items):
            return await asyncio.gather(*(call(i) for i in items), return_exceptions=True)
        gate = asyncio.Semaphore(self.max_concurrency)

        async def gated(item: T) -> R:
            async with gate:
                return await call(item)

        return await asyncio.gather(*(gated(i) for i in items), return_exceptions=True)

    # --- start / stop ---------------------------------------------------------------------

    async def start(
        self, *, label: str | None = None, duration_s: float | None = None, lease_s: float | None = None,
        kind: Kind = "torch", start_at: float | datetime | None = None, steps: int | None = None,
    ) -> FleetCapture:
        """Start on every target at once. Returns when every upstream accepted. If any target
        fails, the started ones are stopped (concurrently) and ``FleetError`` lists every outcome.
        Cancelled midway, the starts in flight are let finish and every started target is stopped
        before the cancellation goes on (the cleanup is shielded).

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
        at = check_start_at(start_at, max_ahead_s=self.start_at_max_s)
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

        async def one(d: Driver) -> tuple[Capture, float]:
            arrived = False

            async def gate() -> None:
                nonlocal arrived
                arrived = True
                release.arrive()
                await release.wait()

            # a Ray node waits for start_at where the server is; a sidecar is told it (its clock,
            # measured first: at most CLOCK_CONCURRENCY exchanges at once keep each round trip short)
            gate.start_at = at  # type: ignore[attr-defined]
            gate.clocks = clocks  # type: ignore[attr-defined]
            try:
                by = start_by(loop.time()) if waves else deadline
                opts = {} if steps is None else {"steps": steps}  # a driver of an older build takes none
                cap = await _by(by, d.start(self.stages, label, duration_s, lease_s, kind, gate, **opts), "start",
                                self.start_timeout_s)
            except BaseException as exc:
                if not arrived:  # failed in its preparation: nobody sends (all or nothing)
                    release.arrive()
                    release.abort(f"{d.target.name} failed before the starts were sent "
                                  f"({error_of(exc).code})")
                raise
            return cap, loop.time() - t0

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
        for t, res in zip(self.targets, results):
            base = TargetResult(target=t.name, kind=t.kind, outcome=TargetOutcome.started)
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res  # KeyboardInterrupt is not a target failure
                cid = res.details.get("capture_id") if isinstance(res, SidecarError) else None
                outcome = TargetOutcome.not_started if isinstance(res, StartWithheld) else TargetOutcome.start_failed
                err = error_of(res)
                if isinstance(res, TargetNoAnswer):  # it may have started: say so (a lease is its safety net)
                    err = TargetError(code="start_timeout", message=f"{res}; the server may have started "
                                      "profiling all the same (the capture's lease stops it on a sidecar)")
                out[t.name] = base.model_copy(update={"outcome": outcome, "error": err, "capture_id": cid})
            else:
                cap, took = res
                out[t.name] = base.with_capture(cap, start_s=took)
        fc = FleetCapture(label=label, stages=self.stages, targets=out, start_at=at, released_at=release.released_at)
        if all(r.outcome is TargetOutcome.started for r in out.values()):
            self._exchange_later("start", fc, list(out))
            return fc
        started = [n for n, r in out.items() if r.outcome is TargetOutcome.started]
        stopped = await _uncancellable(self._stop_all(fc, started, reason=StopReason.rollback))
        for name in started:
            r = stopped[name]
            out[name] = r.model_copy(update={
                "outcome": TargetOutcome.rolled_back if r.outcome is TargetOutcome.stopped
                else TargetOutcome.rollback_failed})
        fc = FleetCapture(label=label, stages=self.stages, targets=out, start_at=at, released_at=release.released_at)
        err = fc.to_error("start")
        log.warning("%s; stopped the %d that had started", err.message, len(started))
        raise err

    async def _undo_start(self, fan_out: asyncio.Future[list[Any]], label: str | None) -> None:
        results = await fan_out
        started = {t.name: TargetResult(target=t.name, kind=t.kind, outcome=TargetOutcome.started).with_capture(res[0])
                   for t, res in zip(self.targets, results) if not isinstance(res, BaseException)}
        if started:
            log.warning("fleet start cancelled: stopping the %d targets that had started", len(started))
            fc = FleetCapture(label=label, stages=self.stages, targets=started)
            await self._stop_all(fc, list(started), reason=StopReason.rollback)

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
        self._exchange_later("stop", fc, [n for n in names if out[n].outcome is TargetOutcome.stopped])
        if wait_artifacts:
            return await self.refresh(fc, wait=True, timeout=artifact_timeout_s)
        return await self._with_clocks(fc, wait=False)

    def _exchange_later(self, phase: str, fc: FleetCapture, names: Sequence[str]) -> None:
        """Each target's clock exchange (``sidecar/fleet/_clocks.py``) just after its start or stop,
        in the background and at most ``CLOCK_CONCURRENCY`` at once: a thousand exchanges at once
        would queue on this loop and each round trip (the error bound) would grow with the fleet.
        The results land in ``clock_start`` / ``clock_stop`` at the next ``stop`` / ``refresh``."""
        pairs = [(n, fc.targets[n].capture_id) for n in names if fc.targets[n].capture_id]
        if not (self.exchange_clocks and pairs):
            return
        loop = asyncio.get_running_loop()
        more = FLEET_MORE // len(pairs)  # a small fleet affords more samples on a busy host

        async def run() -> None:
            gate = asyncio.Semaphore(CLOCK_CONCURRENCY)

            async def one(name: str, cid: str) -> None:
                async with gate:
                    clock = await _clock_of(self._drivers[name], by=loop.time() + self.start_timeout_s, more=more)
                if clock is None:
                    return
                self._clocks[(phase, cid)] = clock
                if clock.method == "in_process":  # offset 0 by construction: this result states it, nothing
                    return                        # crosses (a thousand records beside the stop, from workers)
                record = getattr(self._drivers.get(name), "record_clock", None)
                if record is not None:  # the capture keeps it too (journaled on its host); best effort
                    try:
                        await _by(loop.time() + self.start_timeout_s, record(cid, phase, clock), "a clock record", 0.0)
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

    async def _stop_all(self, fc: FleetCapture, names: Sequence[str], *, reason: StopReason) -> dict[str, TargetResult]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        # One deadline for all (a hung target delays no other), kept by one timer that cancels the
        # stops still waiting when it fires: not a wait_for per target (a task and a timer each,
        # a thousand of them in the fleet's process; asyncio.timeout_at needs Python 3.11).
        waiting: set[asyncio.Task[Any]] = set()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            for task in waiting:
                task.cancel()

        async def one(name: str) -> TargetResult:
            r = fc.targets[name]
            assert r.capture_id is not None
            me = asyncio.current_task()
            assert me is not None
            waiting.add(me)
            try:
                if expired:  # still queued behind max_concurrency when the budget ran out
                    raise asyncio.CancelledError
                cap = await self._driver(name).stop(r.capture_id, reason)
            except asyncio.CancelledError:
                if not expired:
                    raise
                return r.model_copy(update={"outcome": TargetOutcome.stop_timeout, "stop_s": loop.time() - t0,
                                            "error": TargetError(
                    code="stop_timeout",
                    message=f"the upstream did not answer stop within {self.stop_budget_s:g}s; "
                            "it may still be flushing traces (the stop goes on in the background)")})
            except Exception as exc:
                return r.model_copy(update={"outcome": TargetOutcome.stop_failed, "error": error_of(exc),
                                            "stop_s": loop.time() - t0})
            finally:
                waiting.discard(me)
            took = loop.time() - t0
            err = None
            if cap.state is CaptureState.failed and cap.errors:
                err = TargetError(code=cap.errors[-1].code, message=cap.errors[-1].message)
            return self._judged(r.with_capture(cap, outcome=TargetOutcome.stopped, error=err, stop_s=took))

        timer = loop.call_at(t0 + self.stop_budget_s, expire)
        try:
            results = await self._each(list(names), one)
        finally:
            timer.cancel()
        for res in results:
            if isinstance(res, BaseException):
                raise res  # `one` catches every Exception: this is cancellation or an interrupt
        return dict(zip(names, results))  # type: ignore[arg-type]

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
            # stop goes on in the background and must not hold the fleet past that budget.
            patient = wait and r.outcome not in (TargetOutcome.stop_timeout, TargetOutcome.stop_failed)
            try:
                d = self._driver(r.target)
                if patient:
                    left = None if deadline is None else max(deadline - loop.time(), 0.0)
                    # the driver's own wait honours `left`; the bound beyond it is for one that cannot
                    cap = await _by(None if deadline is None else deadline + self.start_timeout_s,
                                    d.wait(r.capture_id, left), "the artifact check", timeout or 0.0)
                else:
                    cap = await _by(read_by, d.get(r.capture_id), "a read of the capture", self.start_timeout_s)
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
        """Extend every started capture's lease (best effort; errors are logged)."""
        deadline = asyncio.get_running_loop().time() + self.start_timeout_s

        async def one(r: TargetResult) -> None:
            try:
                await _by(deadline, self._driver(r.target).heartbeat(r.capture_id),  # type: ignore[arg-type]
                          "a heartbeat", self.start_timeout_s)
            except Exception as exc:  # a missed heartbeat is not fatal; the lease is the safety net
                log.debug("heartbeat to %s failed: %s", r.target, exc)

        await self._each([r for r in fc.targets.values() if r.outcome is TargetOutcome.started and r.capture_id], one)

    async def live(self, *, label: str | None = None) -> FleetCapture:
        """The live capture of every target (for a stop from another process: a sidecar's
        non-terminal capture, or one an upstream's journal in ``state_dir`` shows live). Targets
        without one are ``not_started`` with error ``capture_not_found``."""

        deadline = asyncio.get_running_loop().time() + self.start_timeout_s

        async def one(t: Target) -> TargetResult:
            base = TargetResult(target=t.name, kind=t.kind, outcome=TargetOutcome.started)
            try:
                cap = await _by(deadline, self._driver(t.name).live(), "a read of its live capture", self.start_timeout_s)
            except Exception as exc:
                return base.model_copy(update={"outcome": TargetOutcome.not_started, "error": error_of(exc)})
            if cap is None:
                return base.model_copy(update={"outcome": TargetOutcome.not_started, "error": TargetError(
                    code="capture_not_found", message="no live capture on this target")})
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
        ``duration_s`` seconds, stop. Cancelled at any point, every started target is stopped
        before the cancellation goes on (the artifact wait is skipped)."""
        fc = await self.start(label=label, kind=kind, start_at=start_at)
        try:
            await asyncio.sleep(duration_s)
        except asyncio.CancelledError:
            await _uncancellable(self.stop(fc, wait_artifacts=False))
            raise
        return await _uncancellable(self.stop(fc, wait_artifacts=wait_artifacts, artifact_timeout_s=artifact_timeout_s))


async def _clock_of(d: Driver, *, by: float | None = None, more: int = MORE) -> ClockOffset | None:
    """``d``'s clock exchange (``sidecar/fleet/_clocks.py``), or None where it cannot be measured
    (a sidecar older than ``GET /v1/clock``, a driver without ``clock``): best effort, never a
    target's failure; its traces are then mapped at offset 0 and the archive says so."""
    clock = getattr(d, "clock", None)
    if clock is None:
        return None
    try:
        return await (clock(more) if by is None else _by(by, clock(more), "a clock exchange", 0.0))
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
