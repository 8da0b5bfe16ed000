"""Capture controller for one upstream server: the state machine of docs/design.md §5
(``starting → active → stopping → collecting → completed | degraded | failed``), one capture at a
time, watchdogs for ``duration_s`` and leases, background stop with artifact checks, and a journal
that lets a restarted sidecar stop a capture left active. No HTTP framework here: surfaces call it.

The slot stays taken while a stop is unanswered: a stop that outlives its budget is collected as
"found so far" and held in ``stopping`` until the server answers or is shown gone (unreachable for
``gone_after_s`` by its readiness probe), so a next capture never races the previous one's files.
What a start may ask is checked in limits.py, when a ``steps`` window ends is steps.py's policy
(fed by window.py), the stop's sending is stopping.py's, a plan is budget.py's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sidecar.config.models import DeployConfig, StageKind
from sidecar.config.rules import select_stages, server_bounded_stages, steps_bounded_by_server
from sidecar.control import artifacts, budget, limits
from sidecar.control.artifacts import StageWatch, Window
from sidecar.control.claims import CLAIMS, ClaimRegistry
from sidecar.control.collect import after_stop_error, collect, found_so_far
from sidecar.control.journal import CaptureJournal, unusable
from sidecar.control.limits import StepsAsk, check_steps, check_window
from sidecar.control.models import CLOCKS_MAX, Capture, CaptureKind, CaptureState, ClockRecord, ErrorRecord
from sidecar.control.models import StageVerdict, StopReason, Verdict
from sidecar.control.measures import WindowMeasures
from sidecar.control.notes import note
from sidecar.control.nsys import nsys_command, nsys_hint
from sidecar.control.pacing import Direct, Pacing
from sidecar.control.schedule import check_start_at, wait_until
from sidecar.control.settings import ControlSettings
from sidecar.control.steps import Bound, Read
from sidecar.control.stopping import Unconfirmed, send_stop
from sidecar.control.summaries import SUMMARY_TOP, SummaryCache
from sidecar.errors import ArtifactNotFound, CaptureActive, CaptureNotFound, CaptureStateError, CaptureStopPending
from sidecar.errors import JournalUnwritable, SidecarClosing, SidecarError, StageSetMismatch, StartCancelled
from sidecar.errors import UpstreamError, UpstreamNotHttp, UpstreamSessionActive, UpstreamTimeout, UpstreamUnreachable
from sidecar.scrub import env_secret_values, scrub_secrets
from sidecar.upstream.metrics import MetricsSnapshot
from sidecar.upstream.server import Flavor, UpstreamServer
from sidecar.versions import ServerVersion

log = logging.getLogger(__name__)

OnChange = Callable[[Capture], Any]
_LIVE = (CaptureState.starting, CaptureState.active, CaptureState.stopping, CaptureState.collecting)
# A scheduled start this late when ready is noted (the fan-out of a fleet lands within ms of it).
START_AT_LATE_S = 0.002


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _copy(cap: Capture) -> Capture:
    """A copy that never changes under its holder, without a deep copy's cost (measured: a third
    of a fan-out's CPU per target): scalars, datetimes and enums are immutable, error records and
    notes are never changed once appended, so only the lists and the verdicts are copied."""
    return cap.model_copy(update={"stages": list(cap.stages), "errors": list(cap.errors), "facts": list(cap.facts),
                                  "verdicts": [v.model_copy(deep=True) for v in cap.verdicts]})


def _quiet(task: asyncio.Task[Any]) -> None:
    """A background start's exception is in its capture's record: retrieve it, log it at debug."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("scheduled start ended: %s", task.exception())


def _done(value: Any) -> asyncio.Task[Any]:
    """A finished task holding ``value`` (a scrape already taken, where a task is expected)."""

    async def have() -> Any:
        return value

    return asyncio.ensure_future(have())


def _new_id() -> str:
    # Sortable by time, unique across restarts, safe as a file name and URL segment.
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


class _Runtime:
    """What the controller keeps per live capture beside the record itself."""

    __slots__ = ("watches", "done", "started_mono", "heartbeat_mono", "watchdog", "stopper", "pending_stop",
                 "stop_timed_out", "metrics_before", "metrics_after", "steps_counter", "steps_base", "wake")

    def __init__(self) -> None:
        self.watches: list[StageWatch] = []
        self.done = asyncio.Event()
        self.started_mono: float | None = None
        self.heartbeat_mono: float | None = None
        self.watchdog: asyncio.Task[None] | None = None
        self.stopper: asyncio.Task[None] | None = None
        self.pending_stop: StopReason | None = None  # stop asked for while still starting
        self.stop_timed_out = False  # the stop outlived its budget; waiting for the server
        # /metrics scrapes at the window's edges (tasks: never on the start's or stop's path)
        self.metrics_before: asyncio.Task[MetricsSnapshot | str] | None = None
        self.metrics_after: asyncio.Task[MetricsSnapshot | str] | None = None
        self.steps_counter: asyncio.Task[None] | None = None  # a ``steps`` window's counter
        self.steps_base: Read | None = None  # the counters read just before the start was sent
        self.wake: asyncio.Event | None = None  # set by a stop while a scheduled start waits for its time


class CaptureController:
    """One capture at a time on ``upstream``. Call :meth:`open` once before use and
    :meth:`close` at shutdown. Returned captures are copies; they never change under the caller.
    ``claims`` is the process's shared claim registry unless a test passes its own; ``pacing`` is
    how its blocking work is paced beside other controllers (a fleet's; a sidecar's runs at once)."""

    def __init__(
        self,
        upstream: UpstreamServer,
        deploy: DeployConfig,
        *,
        state_dir: Path | None = None,
        settings: ControlSettings | None = None,
        claims: ClaimRegistry | None = None,
        pacing: Pacing | None = None,
    ) -> None:
        self.upstream = upstream
        self.deploy = deploy
        self.settings = settings or ControlSettings()
        self.journal = (
            CaptureJournal(state_dir, keep=self.settings.keep, keep_days=self.settings.keep_days)
            if state_dir is not None
            else None
        )
        self.claims = claims if claims is not None else CLAIMS
        self.pacing: Pacing = pacing or Direct()
        self._captures: dict[str, Capture] = {}
        self._rt: dict[str, _Runtime] = {}
        self._busy: list[str] = []  # live capture ids, oldest first (normally at most one)
        self._start_lock = asyncio.Lock()
        self._listeners: list[OnChange] = []
        self._summaries = SummaryCache(self.journal)
        self._measures = WindowMeasures(upstream, deploy, self.settings, self._summaries)
        self._copies: Path | None = Path(state_dir).expanduser() / "artifacts" if state_dir is not None else None
        self._background: set[asyncio.Task[None]] = set()
        self._opened = False
        self._closed = False
        self.last_plan: budget.Plan | None = None  # the latest ``plan``: what a ``steps`` start is predicted by
        self._unconfirmed = Unconfirmed()  # stages whose stop the server did not confirm

    # --- lifecycle ------------------------------------------------------------------------

    async def open(self) -> list[Capture]:
        """Load the journal. A capture left live by a crashed sidecar is stopped upstream (its
        own stage set) in the background with ``stop_reason=stopped_on_recovery``; the recovered
        captures are returned in state ``stopping`` (``wait`` on them to see the outcome). One whose
        ``start_at`` is still ahead was never sent: it ends ``failed`` (``start_cancelled``) here,
        nothing stopped; a rollback's stop is sent again and it stays ``failed`` (``rollback``)."""
        if self._opened:
            return []
        self._opened = True
        self._identify_soon()
        entries = await asyncio.to_thread(self.journal.load) if self.journal else []
        recovered: list[Capture] = []
        for entry in entries:
            cap = entry.capture
            self._captures[cap.id] = cap
            if cap.state not in _LIVE:
                # A finished capture's folders stay its own: no later capture may claim them.
                self.claims.claim(cap.id, [s.local_path for v in cap.verdicts for s in v.sessions if s.local_path])
                continue
            rt = self._rt[cap.id] = _Runtime()
            rt.watches = [StageWatch.from_json(w) for w in entry.extra.get("watches", [])]
            if scrub_secrets(cap.upstream) != scrub_secrets(self.upstream.base_url):  # journaled scrubbed
                # Stopping it here would hit the wrong server; say so instead of guessing.
                self._error(
                    cap,
                    "recovery_other_upstream",
                    f"capture was left {cap.state.value} on {cap.upstream}, which this sidecar "
                    f"({self.upstream.base_url}) does not control; stop it there by hand",
                )
                cap.stop_reason = StopReason.stopped_on_recovery
                self._finish(cap, CaptureState.failed)
                continue
            if cap.state is CaptureState.starting and cap.start_at is not None and cap.start_at > _now():
                # A scheduled start is sent at its start_at, never before: nothing reached the server.
                self._error(cap, "start_cancelled",
                            f"the sidecar ended (killed or crashed) {(cap.start_at - _now()).total_seconds():.0f}s "
                            f"before this capture's start_at {cap.start_at.isoformat()}: nothing was sent to the "
                            "server. Start the capture again")
                cap.stop_reason = StopReason.stopped_on_recovery
                self._finish(cap, CaptureState.failed)
                log.warning("capture %s was scheduled for %s when the previous run ended: nothing was sent; failed",
                            cap.id, cap.start_at.isoformat())
                continue
            if not rt.watches:
                rt.watches = self._watches(cap.stages)  # no baseline: every session folder counts
            self._open_window(cap, rt)
            self._busy.append(cap.id)
            cap.state = CaptureState.stopping
            if cap.stop_reason is not StopReason.rollback:  # a failed start's undoing stays one
                cap.stop_reason = StopReason.stopped_on_recovery
            cap.stop_requested_at = _now()
            self._changed(cap)
            recovered.append(_copy(cap))
        for cap in sorted(self._captures.values(), key=lambda c: (c.created_at, c.id)):
            self._unconfirmed.track(cap)
        if recovered:
            ids = [c.id for c in recovered]
            log.warning("recovering captures left live by a previous run: %s", ", ".join(ids))
            task = asyncio.create_task(self._recover(ids), name="capture-recovery")
            for cid in ids:
                self._rt[cid].stopper = task
        return recovered

    async def _recover(self, ids: list[str]) -> None:
        for cid in ids:
            # A rollback's stop is sent again and the capture stays failed, as its start did: its
            # files are not a capture's window (the rollback's own path never collects them).
            await self._run_stop(cid, collect=self._captures[cid].stop_reason is not StopReason.rollback)

    async def close(self) -> None:
        """Stop the active capture (reason ``shutdown``) and wait for its stop within
        ``close_timeout_s``. A stop still running then is left to recovery at next start-up (the
        journal says ``stopping``). Does not close the upstream client (the caller owns it)."""
        if self._closed:
            return
        self._closed = True
        for cid in list(self._busy):
            cap = self._captures[cid]
            if cap.state is CaptureState.active:
                await self.stop(cid, reason=StopReason.shutdown)
            elif cap.state is CaptureState.starting:
                self._stop_while_starting(cid, StopReason.shutdown)
        waits = [self._rt[cid].done.wait() for cid in list(self._busy)]
        if waits:
            # A server flushing traces takes minutes to answer a stop: say what the exit waits for.
            log.warning("shutdown: waiting up to %.0fs for the stop of capture %s (the server may be writing its "
                        "traces); a stop still running then is recovered at the next start",
                        self.settings.close_timeout_s, ", ".join(self._busy))
            try:
                await asyncio.wait_for(asyncio.gather(*waits), self.settings.close_timeout_s)
            except asyncio.TimeoutError:
                log.warning("shutdown: stop still running after %.0fs; it will be recovered at next start",
                            self.settings.close_timeout_s)
        for rt in self._rt.values():
            for task in (rt.watchdog, rt.stopper, rt.steps_counter, rt.metrics_before, rt.metrics_after):
                if task is not None and not task.done():
                    task.cancel()
        for task in list(self._background):
            task.cancel()
        self._summaries.cancel()
        await self.flush()

    async def flush(self) -> None:
        """Until every state change so far is in the journal (its writer thread)."""
        if self.journal is not None:
            await self.journal.flush()

    async def __aenter__(self) -> CaptureController:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- queries --------------------------------------------------------------------------

    def get(self, capture_id: str) -> Capture:
        """The capture now; a finished one whose listed files were replaced since its verdict (a
        later start reused the folder name, someone rewrote a trace) says so in its notes."""
        cap = self._captures.get(capture_id)
        if cap is None:
            raise CaptureNotFound(
                f"no capture {capture_id!r}; list captures with GET /v1/captures",
                details={"capture_id": capture_id},
            )
        out = _copy(cap)
        if cap.terminal:
            changed = artifacts.changed_since_listed(cap.verdicts)
            if changed:
                out.facts.append(note("files_changed", files=changed))
        return out

    def list(self) -> list[Capture]:
        """Every capture this sidecar knows (journal history included), newest first."""
        return self.page()[0]

    def page(self, limit: int | None = None, before: str | None = None) -> tuple[list[Capture], str | None]:
        """The captures this sidecar knows (journal history included), newest first: the newest
        ``limit`` (None: all) older than capture ``before`` (an id past retention: by id, which sorts
        by creation time), and the id the next page starts before (None: this is the oldest). Only
        the page is copied: the web page asks every few seconds, the history holds a thousand.
        With ``keep_days`` the history is pruned first: age drops captures without any ending."""
        if self.journal is not None and self.journal.keep_days is not None:
            self._retain()
        caps = sorted(self._captures.values(), key=lambda c: (c.created_at, c.id), reverse=True)
        if before is not None:
            ref = self._captures.get(before)
            caps = ([c for c in caps if (c.created_at, c.id) < (ref.created_at, ref.id)] if ref is not None
                    else [c for c in caps if c.id < before])
        page = caps if limit is None else caps[:limit]
        return [_copy(c) for c in page], page[-1].id if page and len(caps) > len(page) else None

    @property
    def active(self) -> Capture | None:
        """The live capture (any non-terminal state), or None."""
        return _copy(self._captures[self._busy[-1]]) if self._busy else None

    def subscribe(self, callback: OnChange) -> Callable[[], None]:
        """Call ``callback(capture)`` after every state change (e.g. to update metrics).
        Returns a function that unsubscribes. Exceptions in callbacks are logged, not raised."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    # --- start ----------------------------------------------------------------------------

    async def start(
        self,
        stages: list[int] | None = None,
        *,
        label: str | None = None,
        duration_s: float | None = None,
        lease_s: float | None = None,
        kind: str | CaptureKind = CaptureKind.torch,
        shared_stages: Mapping[int, str] | None = None,
        release: Callable[[], Awaitable[None]] | None = None,
        steps: int | None = None,
        delay_steps: int | None = None,
        steps_bound: StepsAsk | None = None,
        budget_check: bool = True,
        start_at: float | None = None,
        prepared: asyncio.Future[Capture] | None = None,
        profile: str | None = None,
    ) -> Capture:
        """Start a capture of ``stages`` (default: every stage of that ``kind``, sent explicitly).
        ``kind="nsys"`` targets ``profiler: cuda`` stages (verdict ``unverified`` with the nsys
        wrapper to run under). ``shared_stages`` maps a stage id to who else writes into its
        folder: those stages end ``ambiguous``, never ``ok``. ``release``, when given, is awaited
        once the capture is prepared (baselines taken, journaled) and just before the start is
        sent: a fan-out prepares every target, then releases all their starts together. If it
        raises (or the caller is cancelled while waiting at it), nothing was sent: the capture
        ends ``failed`` without a stop upstream and the exception is raised.
        Returns once the upstream accepted (state ``active``, or ``stopping`` when a stop was asked
        for while it was starting). On an upstream failure or an ambiguous start the same set is
        stopped (rollback), the capture ends ``failed`` and the upstream error is raised with
        ``details['capture_id']``.
        ``steps``: a window of that many engine steps, ended by the server's own cap on every stage
        (``render --steps N``; refused where there is none) or, with ``steps_bound="count"``, by the
        sidecar's best-effort count of the server's /metrics; either way it ends by a time bound when
        the counter stops moving (steps.py). ``delay_steps``: the start is sent once the server has
        run that many (the capture is ``starting`` meanwhile, bounded by ``steps_wait_s``).
        ``start_at`` (epoch seconds, this host's clock): the start is sent then (at once if past,
        with a note saying how late); ``prepared``, when given, gets the capture once it is
        prepared and waiting (see :meth:`schedule`). A stop meanwhile cancels it: nothing is sent.
        ``profile``: a stage preset's torch options for this capture only (vLLM >= 0.33's
        ``profiler_kwargs``; refused on other servers, naming the restart: limits.check_profile)."""
        self._refuse_closing()
        kind = CaptureKind(kind)
        duration_s, lease_s = check_window(duration_s, lease_s, max_duration_s=self.settings.max_duration_s,
                                           default_lease_s=self.settings.default_lease_s)
        check_steps(steps, delay_steps)
        start_at = check_start_at(start_at, max_ahead_s=self.settings.start_at_max_s or math.inf, past_ok=True)
        # Validation comes before anything reaches the server (docs/design.md §4), and before the
        # overlap check: a bad stage list is wrong whatever else is running.
        selected = select_stages(self.deploy, stages, kind=kind.value)
        version = await self._version()
        kwargs = limits.check_profile(version, profile)
        bound = limits.steps_bound(self.deploy, list(selected), steps, steps_bound,
                                   per_capture=version is not None and version.per_capture_bounds)
        warning = None
        if steps is not None and budget_check and self.settings.budget_mb is not None:
            warning = budget.check_budget(self.last_plan, list(selected), steps, self.settings.budget_mb,
                                          self.settings.budget_action)
        self._refuse_overlap()  # fast path: don't queue behind a start that may take minutes
        counted = steps is not None or delay_steps is not None
        first = await self._measures.step_counter(selected) if counted else None  # only: has it a counter?
        async with self._start_lock:
            self._refuse_closing()  # again: close() may have run while this start waited (the version, a counter)
            self._refuse_overlap()
            swept = await self._unconfirmed.sweep(
                self.upstream, min(self.settings.rollback_budget_s, self.upstream.stop_budget_s))
            secret_values = env_secret_values()  # read once: the environment scan is most of a start's CPU
            cap = Capture(
                id=_new_id(),
                label=scrub_secrets(label, secret_values) if label else None,
                upstream=scrub_secrets(self.upstream.base_url, secret_values),  # no URL credentials in the record
                stages=list(selected),
                kind=kind,
                duration_s=duration_s,
                lease_s=lease_s,
                steps=steps,
                delay_steps=delay_steps,
                steps_bound=bound,
                start_at=None if start_at is None else datetime.fromtimestamp(start_at, timezone.utc),
                created_at=_now(),
            )
            if swept is not None:
                cap.facts.append(note("stopped_first", stages=swept[0], after=swept[1]))
            if warning is not None:
                cap.facts.append(note("budget_over", **warning))
            options = limits.start_options(version, cap.id, bound, steps, delay_steps, kwargs)
            self._version_facts(cap, version, options)
            if steps is not None and bound is not Bound.per_capture:
                cap.facts.extend(note("server_bound", sid, **f)
                                 for sid, f in steps_bounded_by_server(self.deploy, cap.stages, steps))
            elif steps is None:  # a window in time: the server's own iteration bounds still end its trace
                cap.facts.extend(note("window_capped", sid, max_iterations=pc.max_iterations,
                                      delay_iterations=pc.delay_iterations)
                                 for sid, pc in server_bounded_stages(self.deploy, cap.stages))
            rt = self._rt[cap.id] = _Runtime()
            rt.watches = self._watches(cap.stages, shared_stages)
            artifacts.name_files(rt.watches, options.get("profile_prefix"))  # type: ignore[arg-type]
            self._captures[cap.id] = cap
            self._busy.append(cap.id)
            sent = False

            async def at_the_send() -> None:
                """A counted window's edge: the counters and metrics read just before the start is
                sent, after any delay or schedule (a window's metrics cover the window only). Not
                beside it: vLLM 0.30's API server answers nothing while its front-end profiler
                starts (seconds on CPU), while the engines already step and record."""
                nonlocal sent
                if counted:
                    rt.steps_base, snap = await self._measures.at_send()
                    if self.settings.window_metrics:
                        rt.metrics_before = _done(snap)
                sent = True

            async def send_now() -> None:  # from here on the start may be delivered
                await release()  # type: ignore[misc]
                await at_the_send()

            try:
                await self.pacing.run_blocking(lambda: [artifacts.snapshot(w) for w in rt.watches])
                await self._next_folder_second(cap, rt)
                self._open_window(cap, rt)
                self._changed(cap)
                await self.flush()  # journaled with the baselines before anything can start upstream
                if self.journal is not None and not self.journal.path(cap.id).exists():
                    raise self._unjournaled(cap)
                if delay_steps and first is not None and "delay_iterations" not in options:
                    await self._delay(cap, rt, first, delay_steps)
                if prepared is not None and not prepared.done():
                    prepared.set_result(_copy(cap))
                if start_at is not None:
                    await self._until(cap, rt, start_at)
                if release is None:
                    await at_the_send()
                    await self._send_start(cap, options)
                else:  # the request waits, all but sent, for the fan-out's release
                    await self._send_start(cap, options, before_send=send_now)
            except BaseException as exc:
                if sent:
                    await self._start_failed(cap, rt, exc)
                    raise
                # Nothing reached the server: no stop to send, and the slot is free again at once.
                if isinstance(exc, asyncio.CancelledError):
                    code, message = "start_cancelled", "start was cancelled before it was sent upstream"
                elif isinstance(exc, SidecarError):
                    code, message = exc.code, exc.message
                else:
                    log.exception("capture %s: start failed unexpectedly before it was sent", cap.id)
                    code, message = "internal_error", f"{type(exc).__name__}: {exc}"
                # a stop asked for meanwhile (its caller's, the lease's, the shutdown's) is why it ended
                await self._rollback(cap, code, message, delivered=False, reason=rt.pending_stop)
                if isinstance(exc, SidecarError):
                    exc.details.setdefault("capture_id", cap.id)
                raise
            cap.state = CaptureState.active
            cap.started_at = cap.last_heartbeat_at = _now()
            self.claims.mark_started(cap.id, cap.started_at.timestamp())
            rt.started_mono = rt.heartbeat_mono = time.monotonic()
            if rt.metrics_before is None and self.settings.window_metrics:
                # once the start is answered: a scrape beside it makes the server render ~100 kB of
                # text in the process that handles the start (vLLM-Omni: +40 ms on the start, p50)
                rt.metrics_before = asyncio.create_task(self._measures.scrape(), name=f"metrics-before-{cap.id}")
            self._changed(cap)
            if rt.pending_stop is not None:
                await self.stop(cap.id, reason=rt.pending_stop)
                return _copy(cap)
            if cap.duration_s is not None or cap.lease_s is not None:
                rt.watchdog = asyncio.create_task(self._watchdog(cap.id), name=f"watchdog-{cap.id}")
            if cap.steps is not None:
                rt.steps_counter = asyncio.create_task(self._count_steps(cap.id), name=f"steps-{cap.id}")
            return _copy(cap)

    async def _next_folder_second(self, cap: Capture, rt: _Runtime) -> None:
        """Session folders are named to the second: a start in the second of an existing folder of
        these stages (the previous window's, back to back) would write into that folder and replace
        its trace. Such a start waits for the next second (bounded by the clock skew), and says so."""
        newest = artifacts.newest_session_second(rt.watches)
        if newest is None:
            return
        wait = min(newest + 1 - time.time(), 1 + self.settings.clock_skew_s)
        if wait <= 0:
            return
        await asyncio.sleep(wait)
        await self.pacing.run_blocking(lambda: [artifacts.snapshot(w) for w in rt.watches])  # the baseline as the start finds it
        cap.facts.append(note("folder_second_wait", wait_s=round(wait, 3), second=newest))

    async def _start_failed(self, cap: Capture, rt: _Runtime, exc: BaseException) -> None:
        """The start was sent and did not succeed: roll back what the server may have started."""
        if isinstance(exc, UpstreamError):
            # a 409 started nothing of this capture's: no stop for it (that would end another's session);
            # a reply that is not HTTP came from another service, where no profiler runs
            delivered = not isinstance(exc, (UpstreamUnreachable, UpstreamSessionActive, UpstreamNotHttp))
            await self._rollback(cap, exc.code, exc.message, delivered=delivered)
            exc.details.setdefault("capture_id", cap.id)
        elif isinstance(exc, asyncio.CancelledError):
            # The caller went away mid-start: the server may be recording; undo it in the background.
            self._error(cap, "start_cancelled", "start was cancelled before the upstream answered")
            cap.stop_reason = StopReason.rollback
            cap.state = CaptureState.stopping
            self._changed(cap)
            rt.stopper = asyncio.create_task(self._run_stop(cap.id, collect=False))
        elif isinstance(exc, Exception):  # a bug must not leave a profiler running or the slot taken
            log.exception("capture %s: start failed unexpectedly", cap.id)
            await self._rollback(cap, "internal_error", f"{type(exc).__name__}: {exc}", delivered=True)

    async def _version(self) -> ServerVersion | None:
        """What the server is (sidecar/versions.py), asked once per connection: plain vLLM's start
        depends on it (its body, its 409). vLLM-Omni's HTTP surface is the same in every known
        release, so its start does not wait for it: the version known so far, and one asked for in
        the background for the captures after."""
        if self.upstream.flavor is Flavor.vllm:
            return await self.upstream.identify()
        self._identify_soon()
        return self.upstream.version

    def _identify_soon(self) -> None:
        """Ask what the server is in the background (at open: the sidecar's connect), once at a time."""
        if self.upstream.version is None and not any(t.get_name() == "identify" for t in self._background):
            task = asyncio.create_task(self.upstream.identify(), name="identify")
            self._background.add(task)  # type: ignore[arg-type]
            task.add_done_callback(self._background.discard)  # type: ignore[arg-type]

    def _version_facts(self, cap: Capture, version: ServerVersion | None, options: dict[str, object]) -> None:
        """The server's version and the start's options on the capture; a note where a reader must
        act (a version the table does not know, a mismatched pair) or the start bounds the window."""
        if version is None:
            return
        cap.server = {**version.figures(), "start_options": dict(options)}
        cap.facts.extend(note(str(w.pop("code")), **w) for w in version.warnings() if w.get("version") or
                         w["code"] == "version_mismatch")
        if "max_iterations" in options or "profiler_kwargs" in options:
            cap.facts.append(note("start_options", **options))

    async def _send_start(self, cap: Capture, options: dict[str, object],
                          before_send: Callable[[], Awaitable[None]] | None = None) -> None:
        """The start, with its per-capture options. A 409 (vLLM >= 0.32: a session still open) is
        not this sidecar's: the windows whose stop it did not see confirmed were stopped again just
        before (``Unconfirmed.sweep``). It is refused, named, and never stopped here."""
        try:
            await self.upstream.start_profile(cap.stages, before_send=before_send, options=options)
        except UpstreamSessionActive as exc:
            exc.message = (
                f"{exc.message.rstrip('.')}. The session open on {self.upstream.base_url} is not this sidecar's (every window it "
                "journaled there was stopped, or stopped again just now): another client started it (a POST "
                "/start_profile by hand, another sidecar or trainer on this server). Stop it there (POST "
                "/stop_profile) and start again")
            exc.details["open_session"] = "not this sidecar's"
            raise

    def _unjournaled(self, cap: Capture) -> JournalUnwritable:
        """The start's first record is not on disk: recovery after a crash would not know of it."""
        assert self.journal is not None
        why = unusable(self.journal.state_dir, self.journal.dir, OSError(self.journal.last_write_error or "not written"))
        return JournalUnwritable(
            f"capture {cap.id} was not started: its journal record could not be written, and without it a crash "
            f"would leave the server recording with nothing to recover it from. {why.message}",
            details={**why.details, "capture_id": cap.id})

    def _refuse_closing(self) -> None:
        if self._closed:
            raise SidecarClosing("the sidecar is shutting down; start the capture after restart")

    def _refuse_overlap(self) -> None:
        if not self._busy:
            return
        active = self._busy[-1]
        cap = self._captures[active]
        if cap.state is CaptureState.stopping and cap.stop_requested_at is not None:
            waited = (_now() - cap.stop_requested_at).total_seconds()
            timed_out = self._rt[active].stop_timed_out if active in self._rt else False
            why = ("its stop outlived the stop budget and the server has not answered it yet"
                   if timed_out else "the server has not answered its stop yet")
            raise CaptureStopPending(
                f"capture {active} is stopping on {self.upstream.base_url}: {why} ({waited:.0f}s so far; the "
                "server may still be writing its traces). The slot stays taken until the server answers the "
                f"stop or is shown gone (unreachable for {self.settings.gone_after_s:g}s); wait for it "
                f"(POST /v1/captures/{active}/stop?wait=true) or check the server",
                details={"active_id": active, "upstream": self.upstream.base_url,
                         "stop_requested_at": cap.stop_requested_at.isoformat(), "stop_timed_out": timed_out},
            )
        raise CaptureActive(
            f"capture {active} is {cap.state.value} on {self.upstream.base_url}; "
            f"stop it first (POST /v1/captures/{active}/stop) or wait for it to finish",
            details={"active_id": active},
        )

    def _watches(self, stage_ids: list[int], shared_stages: Mapping[int, str] | None = None) -> list[StageWatch]:
        out = []
        shared_dirs = self.settings.shared_profiler_dirs
        for sid in stage_ids:
            stage = self.deploy.stage(sid)
            if stage is None:  # a journaled capture from an older deploy config
                out.append(StageWatch(stage_id=sid, kind=StageKind.unknown, server_dir=None, local_dir=None))
                continue
            shared = (shared_stages or {}).get(sid)
            if shared is None and stage.profiler_dir is not None:
                shared = shared_dirs.get(stage.profiler_dir) or shared_dirs.get(stage.profiler_dir.rstrip("/"))
            flat = self.upstream.flavor is Flavor.vllm
            out.append(artifacts.watch_stage(stage, self.settings.artifact_roots, flat=flat, shared_with=shared))
        return out

    def _window(self, cap: Capture) -> Window:
        return Window(
            opened=cap.created_at.timestamp(),
            started=cap.started_at.timestamp() if cap.started_at else None,
            closed=cap.stopped_at.timestamp() if cap.stopped_at else None,
            skew_s=self.settings.clock_skew_s,
        )

    def _open_window(self, cap: Capture, rt: _Runtime) -> None:
        dirs = [str(w.local_dir) for w in rt.watches if w.local_dir is not None]
        self.claims.open_window(cap.id, cap.upstream, dirs, cap.created_at.timestamp())
        if cap.started_at is not None:
            self.claims.mark_started(cap.id, cap.started_at.timestamp())

    async def _rollback(self, cap: Capture, code: str, message: str, *, delivered: bool,
                        reason: StopReason | None = None) -> None:
        self._error(cap, code, message)
        cap.stop_reason = reason or StopReason.rollback
        if not delivered:
            # Never delivered: nothing started upstream, and a stop would only wait out the budget.
            self._finish(cap, CaptureState.failed)
            return
        cap.state = CaptureState.stopping
        cap.stop_requested_at = _now()
        self._changed(cap)
        stop = asyncio.create_task(self._rollback_stop(cap), name=f"rollback-{cap.id}")
        try:
            # Shielded: a caller cancelled mid-rollback must not leave the capture `stopping`
            # forever; the rollback finishes (and frees the slot) in the background.
            await asyncio.shield(stop)
        except asyncio.CancelledError:
            self._background.add(stop)
            stop.add_done_callback(self._background.discard)
            raise

    async def _rollback_stop(self, cap: Capture) -> None:
        held = False
        try:
            await self.upstream.stop_profile(
                cap.stages, budget_s=min(self.settings.rollback_budget_s, self.upstream.stop_budget_s)
            )
            cap.stopped_at = _now()
            self._unconfirmed.confirmed(cap.stages)
        except UpstreamTimeout as stop_exc:
            # Unanswered, like a normal stop past its budget: the server may still be recording or
            # writing, so the slot stays taken until it answers or is shown gone.
            held = True
            rt = self._rt[cap.id]
            rt.stop_timed_out = True
            self._error(cap, f"rollback_{stop_exc.code}",
                        f"rollback stop timed out: {stop_exc.message}; the profiler may still be running on stages "
                        f"{cap.stages}. The capture stays stopping (new starts are refused) until the server answers "
                        f"the stop or is shown gone (unreachable for {self.settings.gone_after_s:g}s)")
            self._changed(cap)
            rt.stopper = asyncio.create_task(self._hold_rollback(cap, rt), name=f"rollback-held-{cap.id}")
        except UpstreamError as stop_exc:
            self._error(cap, f"rollback_{stop_exc.code}",
                        f"rollback stop failed: {stop_exc.message}; the profiler may still be running "
                        f"on stages {cap.stages}: POST /stop_profile {{\"stages\": {cap.stages}}} by hand")
            self._unconfirmed.unconfirm(cap, f"{stop_exc.code}: {stop_exc.message}")
        finally:
            if not held:
                self.claims.close_window(cap.id, time.time())
                self._finish(cap, CaptureState.failed)

    async def _hold_rollback(self, cap: Capture, rt: _Runtime) -> None:
        """A rollback stop that timed out, sent again until the server answers it or is gone.
        Cancelled (the sidecar closing): left ``stopping`` in the journal, for recovery."""
        try:
            outcome, detail = await self._send_stop(cap, rt, hold=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not hold the slot forever
            log.exception("capture %s: held rollback failed unexpectedly", cap.id)
            outcome, detail = "internal_error", exc
        if outcome == "answered":
            cap.stopped_at = _now()
            self._unconfirmed.confirmed(cap.stages)
        elif outcome == "gone":
            self._error(cap, "upstream_gone", f"the server went away during the rollback stop: {detail}")
            self._unconfirmed.clear()
        elif isinstance(detail, SidecarError):
            self._error(cap, f"rollback_{detail.code}", f"rollback stop failed: {detail.message}; POST "
                        f"/stop_profile {{\"stages\": {cap.stages}}} by hand")
            self._unconfirmed.unconfirm(cap, f"{detail.code}: {detail.message}")
        else:
            self._error(cap, "internal_error", f"{type(detail).__name__}: {detail}")
            self._unconfirmed.unconfirm(cap, f"internal_error: {detail}")
        self.claims.close_window(cap.id, time.time())
        self._finish(cap, CaptureState.failed)

    # --- plans, steps and window metrics --------------------------------------------------

    async def plan(self, stages: list[int] | None = None, *, budget_mb: float | None = None,
                   max_stop_s: float | None = None, probe_steps: tuple[int, ...] = (1, 2),
                   refine: bool = True) -> budget.Plan:
        """Probe captures of ``probe_steps`` engine steps, then the steps that fit ``budget_mb``
        and ``max_stop_s`` (sidecar/control/budget.py), within ``plan_max_s``. Kept as
        ``last_plan``: later ``steps`` starts on the same stages are checked against the
        sidecar's ``budget_mb`` with it."""
        plan = await budget.run_plan(self, stages, budget_mb=budget_mb, max_stop_s=max_stop_s,
                                     probe_steps=probe_steps, refine=refine, max_s=self.settings.plan_max_s)
        self.last_plan = plan
        return plan

    def stages_for(self, stages: list[int] | None) -> list[int]:
        """The stages a torch capture of ``stages`` profiles (None: every profiled stage); refused as a start would."""
        return list(select_stages(self.deploy, stages, kind="torch"))

    async def _count_steps(self, capture_id: str) -> None:
        """A ``steps`` window: counted until the policy ends it (measures.py), then stopped."""
        cap, rt = self._captures[capture_id], self._rt[capture_id]
        assert rt.started_mono is not None
        await self._measures.count(cap, rt.steps_base, rt.started_mono)
        rt.steps_counter = None  # stop() cancels the counter; this one must not cancel itself
        await self.stop(capture_id, reason=StopReason.steps)

    # --- scheduling -------------------------------------------------------------------------

    def _stop_while_starting(self, capture_id: str, reason: StopReason) -> None:
        """A stop asked for before the start was answered: sent once it is; a scheduled start
        still waiting for its time is cancelled instead (nothing reaches the server)."""
        rt = self._rt[capture_id]
        rt.pending_stop = reason
        if rt.wake is not None:
            rt.wake.set()

    async def _until(self, cap: Capture, rt: _Runtime, start_at: float) -> None:
        """Until ``start_at`` (this host's wall clock) for a scheduled start; at once, with a note,
        when it is already past. A stop meanwhile raises ``StartCancelled``."""
        late = time.time() - start_at
        if late > START_AT_LATE_S:
            cap.facts.append(note("start_at_late", late_s=round(late, 4)))
            return
        rt.wake = asyncio.Event()
        try:
            await wait_until(start_at, rt.wake, lambda: rt.pending_stop is not None)
        finally:
            rt.wake = None
        if rt.pending_stop is not None:
            early = start_at - time.time()
            raise StartCancelled(f"stopped ({rt.pending_stop.value}) {early * 1000:.0f} ms before its start_at: "
                                 "nothing was sent to the server", details={"capture_id": cap.id})

    async def _delay(self, cap: Capture, rt: _Runtime, first: Any, n: int) -> None:
        """Until the server has run ``n`` steps (a ``delay_steps`` start). A stop meanwhile raises
        ``StartCancelled`` at once: before, it was taken and ignored, the slot held for up to
        ``steps_wait_s``, and the start sent when load came, only to be stopped."""
        rt.wake = asyncio.Event()
        waiting = asyncio.create_task(self._measures.wait_delay(first, cap.stages, n), name=f"delay-{cap.id}")
        woken = asyncio.create_task(rt.wake.wait(), name=f"delay-stop-{cap.id}")
        try:
            if rt.pending_stop is None:
                await asyncio.wait({waiting, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            rt.wake = None
            for task in (waiting, woken):
                task.cancel()
            await asyncio.gather(waiting, woken, return_exceptions=True)
        if rt.pending_stop is not None:
            raise StartCancelled(f"stopped ({rt.pending_stop.value}) while waiting for the server to run {n} engine "
                                 "steps before the start: nothing was sent to the server", details={"capture_id": cap.id})
        waiting.result()  # its refusal (the steps never came within steps_wait_s), if any

    async def schedule(self, stages: list[int] | None = None, *, start_at: float, **opts: Any) -> Capture:
        """:meth:`start` at ``start_at``, answered as soon as the capture is prepared (state
        ``starting``, its slot held) instead of once the server accepted: the start itself runs in
        the background, and the capture says how it went (``active``, or ``failed`` with why). A
        refusal (a bad stage set, the slot taken, ...) is raised here, as by :meth:`start`."""
        prepared: asyncio.Future[Capture] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self.start(stages, start_at=start_at, prepared=prepared, **opts),
                                   name="scheduled-start")
        await asyncio.wait({prepared, task}, return_when=asyncio.FIRST_COMPLETED)
        if not prepared.done():
            prepared.cancel()
            return task.result()  # refused before it was prepared: raises
        self._background.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._background.discard)  # type: ignore[arg-type]
        task.add_done_callback(_quiet)  # its outcome is the capture's record
        return prepared.result()

    # --- heartbeat / watchdog -------------------------------------------------------------

    async def heartbeat(self, capture_id: str) -> Capture:
        """Extend the lease of an active capture."""
        cap = self._live(capture_id)
        if cap.state is not CaptureState.active:
            raise CaptureStateError(
                f"capture {capture_id} is {cap.state.value}; heartbeats only extend an active capture",
                details={"capture_id": capture_id, "state": cap.state.value},
            )
        cap.last_heartbeat_at = _now()
        self._rt[capture_id].heartbeat_mono = time.monotonic()
        # Not journaled on purpose: a heartbeat is frequent and only matters while we run.
        return _copy(cap)

    async def record_clock(self, capture_id: str, record: ClockRecord) -> Capture:
        """Keep a fleet's measurement of this host's clock with the capture (journaled: it maps
        the capture's traces onto the fleet's clock later). At most ``CLOCKS_MAX``, newest kept."""
        cap = self._live(capture_id)
        cap.clocks = [*cap.clocks, record][-CLOCKS_MAX:]
        self._changed(cap)
        return _copy(cap)

    async def _watchdog(self, capture_id: str) -> None:
        cap = self._captures[capture_id]
        rt = self._rt[capture_id]
        while cap.state is CaptureState.active:
            now = time.monotonic()
            due: list[tuple[float, StopReason]] = []
            if cap.duration_s is not None and rt.started_mono is not None:
                due.append((rt.started_mono + cap.duration_s, StopReason.duration))
            if cap.lease_s is not None and rt.heartbeat_mono is not None:
                due.append((rt.heartbeat_mono + cap.lease_s, StopReason.lease_expired))
            if not due:
                return
            when, reason = min(due, key=lambda d: d[0])
            if when <= now:
                rt.watchdog = None  # stop() cancels the watchdog; this one must not cancel itself
                await self.stop(capture_id, reason=reason)
                return
            await asyncio.sleep(when - now)

    # --- stop -----------------------------------------------------------------------------

    async def stop(self, capture_id: str, *, reason: StopReason = StopReason.explicit) -> Capture:
        """Ask for the capture to stop; returns at once (state ``stopping``). The upstream stop,
        its retries and the artifact check run in the background; ``wait`` for the outcome.
        Stopping a capture that is already stopping or finished returns it unchanged."""
        cap = self._captures.get(capture_id)
        if cap is None:
            self.get(capture_id)  # raises CaptureNotFound
        assert cap is not None
        if cap.state is CaptureState.starting:
            self._stop_while_starting(capture_id, reason)
            return _copy(cap)
        if cap.state is not CaptureState.active:
            return _copy(cap)
        rt = self._rt[capture_id]
        cap.state = CaptureState.stopping
        cap.stop_reason = StopReason(reason)
        cap.stop_requested_at = _now()
        for task in (rt.watchdog, rt.steps_counter):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        rt.watchdog = rt.steps_counter = None
        self._changed(cap)
        rt.stopper = asyncio.create_task(self._run_stop(capture_id), name=f"stop-{capture_id}")
        return _copy(cap)

    async def _send_stop(self, cap: Capture, rt: _Runtime, *, hold: bool) -> tuple[str, Any]:
        """stopping.send_stop for this capture: its first timeout collects what was found so far."""

        async def timed_out(exc: UpstreamTimeout) -> None:
            rt.stop_timed_out = True
            await self._found_so_far(cap, rt, exc)

        return await send_stop(self.upstream, cap.stages, hold=hold, timed_out=lambda: rt.stop_timed_out,
                               on_timeout=timed_out, name=cap.id, gone_poll_s=self.settings.gone_poll_s,
                               gone_after_s=self.settings.gone_after_s)

    async def _found_so_far(self, cap: Capture, rt: _Runtime, exc: UpstreamError) -> None:
        budget = self.upstream.stop_budget_s
        # Looked at first, then published with the error in one change: a reader never sees the
        # timeout without the verdicts it comes with.
        verdicts = await self._collect(cap, rt, wait=False)
        self._error(
            cap,
            exc.code,
            f"stop timed out after {budget:g}s: the server has not answered ({exc.message}); it may still be "
            "writing traces. The capture stays stopping (new starts are refused) until the server answers the "
            f"stop or is shown gone (unreachable for {self.settings.gone_after_s:g}s); the verdicts show what "
            "was written so far",
        )
        cap.verdicts = found_so_far(verdicts, f"stop timed out after {budget:g}s")
        self._changed(cap)

    async def _collect(self, cap: Capture, rt: _Runtime, *, wait: bool = True) -> list[StageVerdict]:
        copies = None
        if self._copies is not None or any(w.flat for w in rt.watches):
            if self._copies is None:
                self._copies = Path(tempfile.mkdtemp(prefix="omni-sidecar-artifacts-"))
            copies = self._copies / cap.id
        hints = {w.stage_id: nsys_hint(w.stage_id, self.deploy) for w in rt.watches if w.profiler != "torch"}
        return await collect(
            rt.watches,
            window=self._window(cap),
            claims=self.claims,
            capture_id=cap.id,
            collect_timeout_s=self.settings.collect_timeout_s if wait else 0,
            trace_quiet_s=self.settings.trace_quiet_s,
            poll_s=self.settings.poll_s,
            copy_dir=copies,
            wait=wait,
            nsys_hints=hints,
        )

    async def _run_stop(self, capture_id: str, *, collect: bool = True) -> None:
        cap = self._captures[capture_id]
        rt = self._rt[capture_id]
        stop_error: UpstreamError | None = None
        published = self.pacing.stop_sent()
        try:
            outcome, detail = await self._send_stop(cap, rt, hold=collect)
            self.claims.close_window(cap.id, time.time())
            if outcome == "answered":
                self._unconfirmed.confirmed(cap.stages)
            elif outcome == "gone":  # a server that went away records nothing any more
                self._unconfirmed.clear()
            else:
                self._unconfirmed.unconfirm(cap, f"{detail.code}: {detail.message}")
            if outcome == "gone":
                self._error(
                    cap,
                    "upstream_gone",
                    f"the server went away during the stop: {self.upstream.base_url} was unreachable for more "
                    f"than {self.settings.gone_after_s:g}s and its readiness probe says: {detail}. Nothing is "
                    "recording there any more; the traces written before it went are checked below. Restart the "
                    "server (and look at its log: a crash, an OOM kill); a new capture can start",
                )
                if collect:
                    cap.state = CaptureState.collecting
                    self._changed(cap)
                    published()
                    cap.verdicts = found_so_far(await self._collect(cap, rt), "the server went away during the stop")
                self._finish(cap, CaptureState.failed)
                return
            if outcome == "failed":
                exc = detail
                self._error(
                    cap,
                    exc.code,
                    f"stop failed within the {self.upstream.stop_budget_s:g}s stop budget: {exc.message}. "
                    f"The profiler may still be running on stages {cap.stages}; the server may still be "
                    "flushing traces. Check the server, then POST /stop_profile with "
                    f"{{\"stages\": {cap.stages}}}",
                )
                if collect:
                    cap.verdicts = found_so_far(await self._collect(cap, rt, wait=False),
                                                 f"stop failed ({exc.code})")
                self._finish(cap, CaptureState.failed)
                return
            if outcome == "server_error":
                # Delivered, and the server still said 5xx after the retries: a definitive answer (a
                # stage died mid-window), not a hang. The server visits every listed stage even when
                # one fails, so the others wrote their traces: collect them rather than fail.
                stop_error = detail
                self._error(cap, "stop_server_error",
                            f"stop was delivered but failed on the server: {detail.message}")
            cap.stopped_at = _now()
            if not collect:
                self._finish(cap, CaptureState.failed)
                return
            cap.state = CaptureState.collecting
            self._changed(cap)
            published()
            await self.pacing.before_follow_up()
            if rt.metrics_before is not None:  # beside the collect, not before it
                rt.metrics_after = asyncio.create_task(self._measures.scrape(), name=f"metrics-after-{cap.id}")
            verdicts = await self._collect(cap, rt)
            if cap.started_at is None and not any(v.sessions for v in verdicts):
                # Recovered from `starting`: the start was never answered, and no stage wrote a thing
                # (no session folder; a trace folder the server never made reads as not visible).
                self._error(cap, "start_interrupted", self._interrupted_start(cap))
                cap.verdicts = verdicts
                self._finish(cap, CaptureState.failed)
                return
            if stop_error is not None:
                verdicts = [after_stop_error(v, stop_error) for v in verdicts]
            await self._measures.settle(cap, rt.metrics_before, rt.metrics_after)
            cap.verdicts = verdicts
            if cap.steps is not None:
                verdicts = cap.verdicts = await self._measures.steps_traced(cap, verdicts)
            ok = stop_error is None and all(v.verdict is Verdict.ok for v in verdicts)
            self._finish(cap, CaptureState.completed if ok else CaptureState.degraded)
            if self.settings.summarize and any(v.verdict in (Verdict.ok, Verdict.partial) for v in verdicts):
                self._summaries.schedule(cap)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not leave the capture live forever
            log.exception("capture %s: stop failed unexpectedly", capture_id)
            self._error(cap, "internal_error", f"{type(exc).__name__}: {exc}")
            self._finish(cap, CaptureState.failed)
        finally:
            published()  # every way out (a failed or abandoned stop's outcome is published by now)

    @staticmethod
    def _interrupted_start(cap: Capture) -> str:
        if cap.delay_steps:
            waiting = f"waiting for the server to run {cap.delay_steps} engine steps before its start"
        elif cap.start_at is not None:
            waiting = f"waiting for its start_at {cap.start_at.isoformat()}"
        else:
            waiting = "its start not yet answered by the server"
        return (f"the sidecar ended (killed or crashed) while this capture was starting ({waiting}) and no stage "
                "wrote a trace for it: its start most likely never reached the server. The stop was sent anyway, "
                "so nothing records there; start the capture again")

    async def wait(self, capture_id: str, timeout: float | None = None) -> Capture:
        """Until the capture is terminal, or ``timeout`` seconds (then its current snapshot)."""
        cap = self.get(capture_id)
        if cap.terminal:
            return cap
        record, rt = self._captures[capture_id], self._rt[capture_id]
        try:
            await asyncio.wait_for(rt.done.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        if self.journal is not None:
            await self.journal.flush()  # a terminal capture is on disk when wait returns
        return _copy(record)  # the capture waited for, also where retention dropped it as it ended (--keep 0)

    async def wait_started(self, capture_id: str, timeout: float | None = None) -> Capture:
        """Until the capture has left ``starting`` (a scheduled start answered, or failed), or
        ``timeout`` seconds (then its current snapshot)."""
        cap = self.get(capture_id)
        if cap.state is not CaptureState.starting:
            return cap
        left: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_change(snap: Capture) -> None:
            if snap.id == capture_id and snap.state is not CaptureState.starting and not left.done():
                left.set_result(None)

        unsubscribe = self.subscribe(on_change)
        try:
            await asyncio.wait_for(left, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            unsubscribe()
        return self.get(capture_id)

    async def stop_active(self, stages: list[int] | None = None) -> Capture | None:
        """The upstream's own stop semantics: stop the live capture and return once it is terminal
        (the upstream's stop blocks too). ``stages``, when given, must be the capture's own set: a
        different set would leave stages recording (``CaptureError`` ``stage_set_mismatch``).
        None when nothing is live: the upstream answers a stop without a start with success too."""
        active = self.active
        if active is None:
            return None
        if stages is not None and sorted(stages) != sorted(active.stages):
            raise StageSetMismatch(
                f"stop_profile names stages {stages} but capture {active.id} profiles {active.stages}; "
                "send the same stages or no body (a different set would leave stages recording)",
                details={"active_id": active.id, "active_stages": active.stages, "requested": stages},
            )
        await self.stop(active.id)  # already stopping: a no-op
        return await self.wait(active.id)

    # --- artifacts ------------------------------------------------------------------------

    def artifact_path(self, capture_id: str, relpath: str) -> Path:
        """``<session folder>/<file>`` of this capture → local path. Anything else (``..``, a
        symlink leaving the folder, another capture's file) is ``ArtifactNotFound``. A file that
        later stops rewrite in place resolves to this capture's copy, taken at collect time."""
        cap = self.get(capture_id)
        copies = self._copies / capture_id if self._copies is not None else None
        path = artifacts.resolve_artifact(cap.verdicts, relpath, copies)
        if path is None:
            raise ArtifactNotFound(
                f"{relpath!r} is not a file of capture {capture_id}; paths are "
                "<session folder>/<file> as listed in the capture's verdicts",
                details={"capture_id": capture_id, "path": relpath},
            )
        return path

    def summary(self, capture_id: str, *, top: int = SUMMARY_TOP) -> dict[str, Any] | None:
        """The cached trace summary of a finished capture, or None (not computed, or failed)."""
        self.get(capture_id)
        return self._summaries.cached(capture_id, top)

    async def summarize(self, capture_id: str, *, top: int = SUMMARY_TOP) -> dict[str, Any]:
        """The trace summary (``top`` ops per stage) of a terminal capture: the cached one, else
        computed in a thread and cached in the state dir. One summarizer per capture at a time,
        however many callers. ``CaptureError``: ``capture_not_terminal``, ``summary_unavailable``."""
        return await self._summaries.get(self.get(capture_id), top)

    # --- internals ------------------------------------------------------------------------

    def _live(self, capture_id: str) -> Capture:
        self.get(capture_id)
        return self._captures[capture_id]

    def _error(self, cap: Capture, code: str, message: str) -> None:
        cap.errors.append(ErrorRecord(code=code, message=scrub_secrets(message), at=_now()))

    def _finish(self, cap: Capture, state: CaptureState) -> None:
        cap.state = state
        cap.finished_at = _now()
        if cap.id in self._busy:
            self._busy.remove(cap.id)
        rt = self._rt.get(cap.id)
        self._changed(cap)
        if rt is not None:
            rt.done.set()
            # the folder listings its start took: a capture kept in history held them (the server's
            # profiler dirs hold weeks of session folders: ~5 MB a capture at 20,000 of them)
            rt.watches = []
        self._retain()

    def _retain(self) -> None:
        """Drop finished captures past the journal's retention, with their runtime state and caches."""
        if self.journal is None:
            return
        for cid in self.journal.expired(list(self._captures.values())):
            self._captures.pop(cid, None)
            self._rt.pop(cid, None)
            self._summaries.forget(cid)

    def state_counts(self) -> dict[str, int]:
        """Captures per state (for metrics), without copying them."""
        counts: dict[str, int] = {}
        for cap in self._captures.values():
            counts[cap.state.value] = counts.get(cap.state.value, 0) + 1
        return counts

    def _changed(self, cap: Capture) -> None:
        snap = _copy(cap)
        if self.journal is not None:
            rt = self._rt.get(cap.id)
            extra = {"watches": [w.to_json() for w in rt.watches]} if rt and not cap.terminal else None
            self.journal.write(snap, extra)  # queued to the journal's writer thread: off the loop
        for cb in list(self._listeners):
            try:
                cb(snap)
            except Exception:
                log.exception("capture listener failed")


__all__ = ["CaptureController", "ControlSettings", "nsys_command"]
