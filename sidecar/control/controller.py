"""Capture controller for one upstream server: the state machine of docs/design.md §5
(``starting → active → stopping → collecting → completed | degraded | failed``), one capture at a
time, watchdogs for ``duration_s`` and leases, background stop with artifact checks, and a journal
that lets a restarted sidecar stop a capture left active. No HTTP framework here: surfaces call it.

The slot stays taken while a stop is unanswered: a stop that outlives its budget is collected as
"found so far" and held in ``stopping`` until the server answers or is shown gone (unreachable for
``gone_after_s`` by its readiness probe), so a next capture never races the previous one's files.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from sidecar.config.models import DeployConfig, StageKind
from sidecar.config.rules import capped_by_server, select_stages, server_bounded_stages, steps_bounded_by_server
from sidecar.config.rules import IDLE_ITERATIONS, MAX_IDLE_SHARE, max_iterations_for, server_window_ends
from sidecar.config.rules import window_ends_text
from sidecar.control import artifacts
from sidecar.control.artifacts import StageWatch, Window
from sidecar.control.claims import CLAIMS, ClaimRegistry
from sidecar.control.budget import Plan, check_budget, run_plan
from sidecar.control.collect import after_stop_error, collect, found_so_far
from sidecar.control.journal import CaptureJournal
from sidecar.control.lead import MAX_SHARE, Lead, StopLead
from sidecar.control.schedule import check_start_at
from sidecar.control.models import (
    CLOCKS_MAX,
    MAX_ENGINE_STEPS,
    Capture,
    CaptureKind,
    CaptureState,
    ClockRecord,
    ErrorRecord,
    StageVerdict,
    StopReason,
    Verdict,
)
from sidecar.control.nsys import nsys_command, nsys_hint
from sidecar.control.summaries import SUMMARY_TOP, SummaryCache
from sidecar.errors import (
    ArtifactNotFound,
    CaptureActive,
    CaptureNotFound,
    CaptureStateError,
    CaptureStopPending,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from sidecar.errors import (
    DurationInvalid,
    LeaseInvalid,
    MetricsUnavailable,
    EngineStepsInvalid,
    StartCancelled,
    StepsNotReached,
    StepsUnavailable,
    SidecarClosing,
    SidecarError,
    StageSetMismatch,
)
from sidecar.scrub import env_secret_values, scrub_secrets
from sidecar.upstream.metrics import Labels, MetricsSnapshot, WindowMetrics, engine_steps, steps_by_stage, steps_since
from sidecar.upstream.metrics import window_metrics
from sidecar.upstream.server import Flavor, UpstreamServer

if TYPE_CHECKING:
    from sidecar.config.settings import SidecarSettings

log = logging.getLogger(__name__)

OnChange = Callable[[Capture], Any]
_LIVE = (CaptureState.starting, CaptureState.active, CaptureState.stopping, CaptureState.collecting)


class ControlSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt knob is an error, not silently ignored

    collect_timeout_s: float = Field(default=120, ge=0)  # bound on waiting for gzip after the stop
    # An unclosed plain .json is still being written until unchanged this long (within the bound).
    trace_quiet_s: float = Field(default=2.0, gt=0)
    poll_s: float = Field(default=0.05, gt=0)  # how often a pending gzip is looked at
    artifact_roots: dict[str, str] = Field(default_factory=dict)  # SERVER_PATH -> LOCAL_PATH
    default_lease_s: float | None = Field(default=None, gt=0)
    max_duration_s: float | None = Field(default=None, gt=0)
    close_timeout_s: float = Field(default=60, ge=0)  # how long close() waits for a stop
    # A rollback runs inside start(); a dead stage 500s every stop, so it gets its own short budget.
    rollback_budget_s: float = Field(default=30, gt=0)
    summarize: bool = True  # cache a trace summary after completion when sidecar.analysis has one
    keep: int | None = Field(default=None, ge=0)  # finished captures kept in history (None: all)
    keep_days: float | None = Field(default=None, gt=0)  # finished captures older than this are dropped
    # Clock skew allowed between the server's stamps (folder epoch, file ns) and this process.
    clock_skew_s: float = Field(default=2.0, ge=0)
    # A stop ends ``failed`` once the server has been unreachable this long (probed every
    # ``gone_poll_s``) instead of waiting out the stop budget.
    gone_after_s: float = Field(default=10.0, gt=0)
    gone_poll_s: float = Field(default=1.0, gt=0)
    # Server-side torch_profiler_dirs another server also writes into (-> who), e.g. set by the
    # fleet when the user overrides the ``profiler_dir_shared`` refusal: those stages are
    # ``ambiguous``, never ``ok``.
    shared_profiler_dirs: dict[str, str] = Field(default_factory=dict)
    # ``steps`` windows: how often the server's /metrics step counter is read while one runs, and
    # how long a ``delay_steps`` start waits for the server to run them.
    steps_poll_s: float = Field(default=0.02, gt=0)
    steps_wait_s: float = Field(default=600, gt=0)
    # A ``steps`` window every stage's server caps: its stop waits this long at most for a stage
    # whose count stands still short of its window (on the real vLLM-Omni server the downstream
    # stage's stood 2.5 s in the first window after the server's start).
    steps_stall_s: float = Field(default=10.0, gt=0)
    # A start scheduled (``start_at``) further ahead than this is refused (None: any time ahead;
    # the capture holds the slot until then, and a stop cancels it).
    start_at_max_s: float | None = Field(default=None, gt=0)
    window_metrics: bool = True  # scrape /metrics at start and stop and keep the difference
    # A ``steps`` capture planned (``plan``) above this many MB is refused (or only noted: warn).
    budget_mb: float | None = Field(default=None, gt=0)
    budget_action: Literal["refuse", "warn"] = "refuse"

    @classmethod
    def from_settings(cls, settings: SidecarSettings) -> ControlSettings:
        return cls(
            collect_timeout_s=settings.collect_timeout_s,
            trace_quiet_s=settings.trace_quiet_s,
            artifact_roots=dict(settings.artifact_roots),
            default_lease_s=settings.default_lease_s,
            max_duration_s=settings.max_duration_s,
            close_timeout_s=settings.close_timeout_s,
            keep=settings.keep,
            keep_days=settings.keep_days,
            budget_mb=settings.budget_mb,
            budget_action=settings.budget_action,
            gone_after_s=settings.gone_after_s,
            steps_wait_s=settings.steps_wait_s,
            steps_stall_s=settings.steps_stall_s,
            start_at_max_s=settings.start_at_max_s,
        )


def _is_server_error(exc: UpstreamError) -> bool:
    """A 5xx answer: the request reached the server (unlike unreachable) and it replied (unlike a hang)."""
    if isinstance(exc, (UpstreamTimeout, UpstreamUnreachable)):
        return False
    return int(exc.details.get("status", 0)) >= 500


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _copy(cap: Capture) -> Capture:
    """A copy that never changes under its holder, without a deep copy's cost (measured: a third
    of a fan-out's CPU per target): scalars, datetimes and enums are immutable, error records are
    never changed once appended, so only the lists and the verdicts are copied."""
    return cap.model_copy(update={"stages": list(cap.stages), "errors": list(cap.errors), "notes": list(cap.notes),
                                  "verdicts": [v.model_copy(deep=True) for v in cap.verdicts]})


class _ThreadBatch:
    """Blocking calls made in one event-loop tick run in one thread hop: a fan-out starting a
    thousand controllers at once takes one worker thread for their baselines, not a thousand
    hops queued on the default pool."""

    def __init__(self) -> None:
        self._pending: list[tuple[Callable[[], Any], asyncio.Future[Any]]] | None = None

    async def run(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self._pending is None:
            self._pending = []
            loop.call_soon(self._flush, loop)
        self._pending.append((fn, fut))
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending or [], None

        def work() -> list[tuple[bool, Any]]:
            out: list[tuple[bool, Any]] = []
            for fn, _ in batch:
                try:
                    out.append((True, fn()))
                except BaseException as exc:  # handed to its caller, like to_thread does
                    out.append((False, exc))
            return out

        def done(results: asyncio.Future[list[tuple[bool, Any]]]) -> None:
            if results.cancelled() or results.exception() is not None:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(results.exception() or asyncio.CancelledError())
                return
            for (_, fut), (ok, value) in zip(batch, results.result()):
                if fut.done():  # its caller was cancelled meanwhile
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

        loop.run_in_executor(None, work).add_done_callback(done)


# A stop's follow-up work waits at most this long for the other stops sent on its event loop.
FOLLOW_UP_WAIT_S = 1.0


class _StopsInFlight:
    """The upstream stops sent and not yet answered by the controllers of one event loop. A
    stop's follow-up work (the after-window scrape, the artifact looks) waits, at most
    ``FOLLOW_UP_WAIT_S``, until none is: in a process that drives many controllers (a fleet's
    worker, 128 upstream targets stopped in one turn) each answered stop's scrape and looks ran
    between the other stops' answers and delayed them (measured: 128 targets in one process
    stopped in 3.7x one target's time with them beside, 2.4x without). A stop counts as in
    flight until its answer is published (the capture's change that its waiters see), and the
    follow-ups start two loop turns after the last one is: the answer's waiter (a fleet worker
    sending it on) runs first. Released at once, the look threads and 128 follow-ups held the
    last answer of a fleet worker back 40 to 145 ms (device, 1,024 targets: each worker's last
    stop answered in time, its answer to the fleet late). A lone controller's own stop is
    answered when its follow-up starts, so it never waits."""

    def __init__(self) -> None:
        self.count = 0
        self.quiet = asyncio.Event()
        self.quiet.set()

    def sending(self) -> Callable[[], None]:
        """One stop sent; returns its ``answered`` callback (once is counted; call it again freely)."""
        self.count += 1
        self.quiet.clear()
        ended = False

        def answered() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.count -= 1
                if not self.count:
                    self.quiet.set()

        return answered

    async def answered(self) -> None:
        if not self.quiet.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.quiet.wait(), FOLLOW_UP_WAIT_S)
        for _ in range(2):  # the answers' waiters first (the change woke them a turn ago)
            await asyncio.sleep(0)


_T = TypeVar("_T")
_SNAPSHOTS: dict[asyncio.AbstractEventLoop, _ThreadBatch] = {}
_STOPS: dict[asyncio.AbstractEventLoop, _StopsInFlight] = {}


def _of_loop(table: dict[asyncio.AbstractEventLoop, _T], make: Callable[[], _T]) -> _T:
    """This event loop's entry of ``table`` (made on first use; closed loops' entries dropped)."""
    loop = asyncio.get_running_loop()
    entry = table.get(loop)
    if entry is None:
        for old in [lp for lp in table if lp.is_closed()]:
            del table[old]
        entry = table[loop] = make()
    return entry


async def _snapshot(watches: list[StageWatch]) -> None:
    """The baselines before a start, in a thread shared by every controller starting this tick."""
    await _of_loop(_SNAPSHOTS, _ThreadBatch).run(lambda: [artifacts.snapshot(w) for w in watches])


# A scheduled start this late when ready is noted (the fan-out of a fleet lands within ms of it).
START_AT_LATE_S = 0.002


def _ago(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if abs(seconds) < 10 else f"{seconds:.1f} s"


def _write_s(summary: dict[str, Any]) -> float | None:
    """Seconds from the last event of a trace file's summary to the file's last write (its mtime):
    how long the server took to write what it recorded. None where the trace has no wall-clock
    base (baseTimeNanoseconds) or the file is gone."""
    end_us = summary.get("window", {}).get("end_epoch_us")
    if end_us is None or not summary.get("file"):
        return None
    try:
        written_ns = os.stat(summary["file"]).st_mtime_ns
    except OSError:
        return None
    return max(written_ns / 1e9 - end_us / 1e6, 0.0)


def _idle_note(idle: int, ran: int, *, capped: bool) -> str:
    """What a steps window's note adds about its stage's idle iterations (nothing scheduled), which
    its steps do not count and a server's cap does."""
    if not idle:
        return ""
    return (f"; {idle} of the {ran} iterations it recorded were idle (nothing scheduled: between requests, or a "
            "stage waiting for another's output)" + (", and the server's max_iterations counts them" if capped else ""))


def _idle_fix(steps: int, short: dict[int, tuple[int, int]], ends: dict[int, int]) -> list[str]:
    """The way to ``steps`` on the stages of a window the server ended itself that held fewer
    because they idled (``short``: stage -> (idle iterations, iterations recorded); ``ends``: every
    stage's own end, in iterations): give each the share of its iterations it idles (``render
    --steps N --idle``), or, past ``MAX_IDLE_SHARE``, say that it is fed too little for a window
    counted in steps. The render keeps a window the server ends (``capped_by_server``: the first
    stage to end does within N + 2): a stage ending the window first that idled short is told
    what feeds it instead (more requests at once; a one-stage server's, or stage 0 at 50 steps on
    the real vLLM-Omni server: 4-5 of 52 idle)."""
    shares = {s: i / n for s, (i, n) in short.items() if i}
    notes = [f"stage {s} idled {short[s][0]} of its {short[s][1]} iterations, more than {MAX_IDLE_SHARE:.0%}: it is fed "
             "too little for a window counted in steps (more requests at once feed it; docs/captures.md)"
             for s, share in sorted(shares.items()) if share > MAX_IDLE_SHARE]
    fixable = {s: share for s, share in shares.items() if share <= MAX_IDLE_SHARE}
    while fixable and min(max_iterations_for(steps, fixable[s]) if s in fixable else n for s, n in ends.items()) > \
            max_iterations_for(steps):
        first = min(fixable, key=lambda s: (ends.get(s, 0), fixable[s], s))
        del fixable[first]
        notes.append(f"stage {first} idled {short[first][0]} of its {short[first][1]} iterations (nothing scheduled: "
                     f"between requests), and it ends the window first: its cap stays at the steps + {IDLE_ITERATIONS} "
                     f"(render --idle gives a stage that ends later the iterations it idles), so for {steps} steps on it "
                     "send more requests at once")
    if fixable:
        flags = " ".join(f"--idle {s}={short[s][0]}/{short[s][1]}" for s in sorted(fixable))
        caps = ", ".join(f"{max_iterations_for(steps, fixable[s])} on stage {s}" for s in sorted(fixable))
        notes.append(f"for {steps} steps on {'those stages' if len(fixable) > 1 else f'stage {next(iter(fixable))}'} "
                     f"too, give {'each' if len(fixable) > 1 else 'it'} the iterations it idles: restart the server "
                     f"with the profiler config `omni-sidecar render --steps {steps} {flags}` writes (max_iterations "
                     f"{caps})")
    return notes


def _reach(reach: dict[int, int], label: str, steps: int) -> int:
    """The iterations a capped window's stage runs (``reach``, by stage id) for its step counter's
    label (vLLM-Omni's stage; plain vLLM's one engine: "")."""
    return reach[int(label)] if label and int(label) in reach else max(reach.values(), default=steps)


def _quiet(task: asyncio.Task[Any]) -> None:
    """A background start's exception is in its capture's record: retrieve it, log it at debug."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("scheduled start ended: %s", task.exception())


def _done(value: Any) -> asyncio.Task[Any]:
    """A finished task holding ``value`` (a scrape already taken, where a task is expected)."""

    async def have() -> Any:
        return value

    return asyncio.ensure_future(have())


RATE_WINDOW_S = 1.0  # a ``steps`` window's step rate is taken over this much of its latest reads
STEP_READS_OUT = 4  # a ``steps`` window's counter reads out at once (a late one is hedged by fresh ones)
# A window every stage's server ends itself: its stop waits this many steps past the count at which
# the profilers have surely run ``steps`` iterations (the first, empty one counts too)
CAPPED_MARGIN = 2


def _check_steps(steps: int | None, delay_steps: int | None) -> None:
    for key, value, low in (("steps", steps, 1), ("delay_steps", delay_steps, 0)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_ENGINE_STEPS:
            raise EngineStepsInvalid(f"{key} must be a whole number of engine steps from {low} to {MAX_ENGINE_STEPS}, "
                                     f"got {value!r}",
                               key=key)


def _new_id() -> str:
    # Sortable by time, unique across restarts, safe as a file name and URL segment.
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


class _Runtime:
    """What the controller keeps per live capture beside the record itself."""

    __slots__ = ("watches", "done", "started_mono", "heartbeat_mono", "watchdog", "stopper", "pending_stop",
                 "stop_timed_out", "metrics_before", "metrics_after", "steps_counter", "steps_base",
                 "steps_at_stop", "steps_learn", "wake")

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
        # the counters read just before the start is sent (``_count``'s answer)
        self.steps_base: tuple[dict[Labels, int] | None, float, float] | None = None
        self.steps_at_stop: int | None = None  # steps counted past the base when the stop was sent
        self.steps_learn = False  # sent on time by the count: its lateness teaches the next stop (lead.py)
        self.wake: asyncio.Event | None = None  # set by a stop while a scheduled start waits for its time


class CaptureController:
    """One capture at a time on ``upstream``. Call :meth:`open` once before use and
    :meth:`close` at shutdown. Returned captures are copies; they never change under the caller.
    ``claims`` is the process's shared claim registry unless a test passes its own."""

    def __init__(
        self,
        upstream: UpstreamServer,
        deploy: DeployConfig,
        *,
        state_dir: Path | None = None,
        settings: ControlSettings | None = None,
        claims: ClaimRegistry | None = None,
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
        self._captures: dict[str, Capture] = {}
        self._rt: dict[str, _Runtime] = {}
        self._busy: list[str] = []  # live capture ids, oldest first (normally at most one)
        self._start_lock = asyncio.Lock()
        self._listeners: list[OnChange] = []
        self._summaries = SummaryCache(self.journal)
        self._copies: Path | None = Path(state_dir).expanduser() / "artifacts" if state_dir is not None else None
        self._background: set[asyncio.Task[None]] = set()
        # Journal writes (two fsyncs each) run in a thread, latest state per capture, off the
        # event loop and off the caller's path; only the baseline before a start is awaited.
        self._opened = False
        self._closed = False
        self.last_plan: Plan | None = None  # the latest ``plan``: what a ``steps`` start is predicted by
        self._lead = StopLead()  # how early a ``steps`` window's stop is sent (lead.py)

    # --- lifecycle ------------------------------------------------------------------------

    async def open(self) -> list[Capture]:
        """Load the journal. A capture left live by a crashed sidecar is stopped upstream (its
        own stage set) in the background with ``stop_reason=stopped_on_recovery``; the recovered
        captures are returned in state ``stopping`` (``wait`` on them to see the outcome)."""
        if self._opened:
            return []
        self._opened = True
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
            if not rt.watches:
                rt.watches = self._watches(cap.stages)  # no baseline: every session folder counts
            self._open_window(cap, rt)
            self._busy.append(cap.id)
            cap.state = CaptureState.stopping
            cap.stop_reason = StopReason.stopped_on_recovery
            cap.stop_requested_at = _now()
            self._changed(cap)
            recovered.append(_copy(cap))
        if recovered:
            ids = [c.id for c in recovered]
            log.warning("recovering captures left live by a previous run: %s", ", ".join(ids))
            task = asyncio.create_task(self._recover(ids), name="capture-recovery")
            for cid in ids:
                self._rt[cid].stopper = task
        return recovered

    async def _recover(self, ids: list[str]) -> None:
        for cid in ids:
            await self._run_stop(cid)

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
                out.notes.append(
                    f"files changed since the verdict: {', '.join(changed)} (another size, time or inode, or gone): "
                    "the verdict describes them as they were when checked; what is on disk now may be another "
                    "window's (a later start that reused the session folder name) or rewritten")
        return out

    def list(self) -> list[Capture]:
        """Every capture this sidecar knows (journal history included), newest first."""
        caps = sorted(self._captures.values(), key=lambda c: (c.created_at, c.id), reverse=True)
        return [_copy(c) for c in caps]

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
        budget_check: bool = True,
        start_at: float | None = None,
        prepared: asyncio.Future[Capture] | None = None,
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
        for while it was starting). On an upstream failure or an
        ambiguous start the same set is stopped (rollback), the capture ends ``failed`` and the
        upstream error is raised with ``details['capture_id']``.
        ``steps``: the capture stops itself once the server's engine-step counter (its /metrics)
        has advanced that much since the start's reply; ``delay_steps``: the start is sent once it
        has advanced that much (the capture is ``starting`` meanwhile, bounded by ``steps_wait_s``).
        ``start_at`` (epoch seconds, this host's clock): the start is sent then (at once if past,
        with a note saying how late); ``prepared``, when given, gets the capture once it is
        prepared and waiting (see :meth:`schedule`). A stop meanwhile cancels it: nothing is sent."""
        if self._closed:
            raise SidecarClosing("the sidecar is shutting down; start the capture after restart")
        kind = CaptureKind(kind)
        duration_s, lease_s = self._check_window(duration_s, lease_s)
        _check_steps(steps, delay_steps)
        start_at = check_start_at(start_at, max_ahead_s=self.settings.start_at_max_s or math.inf, past_ok=True)
        # Validation comes before anything reaches the server (docs/design.md §4), and before the
        # overlap check: a bad stage list is wrong whatever else is running.
        selected = select_stages(self.deploy, stages, kind=kind.value)
        warning = None
        if steps is not None and budget_check and self.settings.budget_mb is not None:
            warning = check_budget(self.last_plan, list(selected), steps, self.settings.budget_mb,
                                   self.settings.budget_action)
        self._refuse_overlap()  # fast path: don't queue behind a start that may take minutes
        counted = steps is not None or delay_steps is not None
        first = await self._step_counter(selected) if counted else None
        async with self._start_lock:
            self._refuse_overlap()
            now = _now()
            secrets = env_secret_values()  # read once: the environment scan is most of a start's CPU
            cap = Capture(
                id=_new_id(),
                label=scrub_secrets(label, secrets) if label else None,
                upstream=scrub_secrets(self.upstream.base_url, secrets),  # no URL credentials in the record
                stages=list(selected),
                kind=kind,
                duration_s=duration_s,
                lease_s=lease_s,
                steps=steps,
                delay_steps=delay_steps,
                start_at=None if start_at is None else datetime.fromtimestamp(start_at, timezone.utc),
                created_at=now,
            )
            if warning is not None:
                cap.notes.append(warning)
            if steps is not None:
                cap.notes.extend(steps_bounded_by_server(self.deploy, cap.stages, steps))
            rt = self._rt[cap.id] = _Runtime()
            if first is not None:
                rt.metrics_before = _done(first)
            rt.watches = self._watches(cap.stages, shared_stages)
            self._captures[cap.id] = cap
            self._busy.append(cap.id)
            sent = False

            async def count_from_here() -> None:
                """A ``steps`` window's base: the counters read just before the start is sent. Not
                beside it: vLLM 0.30's API server answers nothing while its front-end profiler
                starts (seconds on CPU), while the engines already step and record."""
                if cap.steps is not None:
                    rt.steps_base = await self._count(cap.stages)

            async def send_now() -> None:  # from here on the start may be delivered
                nonlocal sent
                await release()  # type: ignore[misc]
                await count_from_here()
                sent = True

            try:
                await _snapshot(rt.watches)
                await self._next_folder_second(cap, rt)
                self._open_window(cap, rt)
                self._changed(cap)
                await self.flush()  # journaled with the baselines before anything can start upstream
                if delay_steps and first is not None:
                    await self._wait_steps(cap, first, delay_steps)
                if prepared is not None and not prepared.done():
                    prepared.set_result(_copy(cap))
                if start_at is not None:
                    await self._until(cap, rt, start_at)
                if release is None:
                    await count_from_here()
                    sent = True
                    await self.upstream.start_profile(cap.stages)
                else:  # the request waits, all but sent, for the fan-out's release
                    await self.upstream.start_profile(cap.stages, before_send=send_now)
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
                await self._rollback(cap, code, message, delivered=False)
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
                rt.metrics_before = asyncio.create_task(self._scrape(), name=f"metrics-before-{cap.id}")
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
        await _snapshot(rt.watches)  # the baseline as the start will find it
        cap.notes.append(
            f"start waited {wait:.2f}s for the next second: a session folder of this capture's stages is named "
            f"with second {newest} (the previous window's), and a start in that second would reuse its name")

    async def _start_failed(self, cap: Capture, rt: _Runtime, exc: BaseException) -> None:
        """The start was sent and did not succeed: roll back what the server may have started."""
        if isinstance(exc, UpstreamError):
            await self._rollback(cap, exc.code, exc.message, delivered=not isinstance(exc, UpstreamUnreachable))
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

    def _check_window(self, duration_s: float | None, lease_s: float | None) -> tuple[float | None, float | None]:
        if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
            raise DurationInvalid(f"duration_s must be > 0 seconds, got {duration_s}", 
                               key="duration_s")
        limit = self.settings.max_duration_s
        if limit is not None:
            if duration_s is None:
                duration_s = limit  # a bounded sidecar never leaves a window open-ended
            elif duration_s > limit:
                raise DurationInvalid(
                    f"duration_s {duration_s:g} is above this sidecar's limit of {limit:g}s; ask for less "
                    "or raise the sidecar's OMNI_SIDECAR_MAX_DURATION_S",
                    key="duration_s",
                    details={"max_duration_s": limit},
                )
        if lease_s is None:
            lease_s = self.settings.default_lease_s
        elif not (lease_s > 0 and math.isfinite(lease_s)):
            raise LeaseInvalid(f"lease_s must be > 0 seconds, got {lease_s}", key="lease_s")
        return duration_s, lease_s

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

    async def _rollback(self, cap: Capture, code: str, message: str, *, delivered: bool) -> None:
        self._error(cap, code, message)
        cap.stop_reason = StopReason.rollback
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
        finally:
            if not held:
                self.claims.close_window(cap.id, time.time())
                self._finish(cap, CaptureState.failed)

    async def _hold_rollback(self, cap: Capture, rt: _Runtime) -> None:
        """A rollback stop that timed out, sent again until the server answers it or is gone.
        Cancelled (the sidecar closing): left ``stopping`` in the journal, for recovery."""
        try:
            outcome, detail = await self._stop_upstream(cap, rt, hold=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not hold the slot forever
            log.exception("capture %s: held rollback failed unexpectedly", cap.id)
            outcome, detail = "internal_error", exc
        if outcome == "answered":
            cap.stopped_at = _now()
        elif outcome == "gone":
            self._error(cap, "upstream_gone", f"the server went away during the rollback stop: {detail}")
        elif isinstance(detail, SidecarError):
            self._error(cap, f"rollback_{detail.code}", f"rollback stop failed: {detail.message}; POST "
                        f"/stop_profile {{\"stages\": {cap.stages}}} by hand")
        else:
            self._error(cap, "internal_error", f"{type(detail).__name__}: {detail}")
        self.claims.close_window(cap.id, time.time())
        self._finish(cap, CaptureState.failed)

    # --- steps and window metrics ---------------------------------------------------------

    async def plan(self, stages: list[int] | None = None, *, budget_mb: float | None = None,
                   max_stop_s: float | None = None, probe_steps: tuple[int, ...] = (1, 2),
                   refine: bool = True) -> Plan:
        """Probe captures of ``probe_steps`` engine steps, then the steps that fit ``budget_mb``
        and ``max_stop_s`` (sidecar/control/budget.py). Kept as ``last_plan``: later ``steps``
        starts on the same stages are checked against the sidecar's ``budget_mb`` with it."""
        plan = await run_plan(self, stages, budget_mb=budget_mb, max_stop_s=max_stop_s, probe_steps=probe_steps,
                              refine=refine)
        self.last_plan = plan
        return plan

    async def _scrape(self) -> MetricsSnapshot | str:
        """The server's /metrics now, or why not (a window never fails for its metrics)."""
        try:
            return await self.upstream.metrics()
        except MetricsUnavailable as exc:
            return exc.message

    async def _step_counter(self, stages: list[int]) -> MetricsSnapshot:
        """The first read of a ``steps`` window's counter; refused when the server has none."""
        snap = await self._scrape()
        if isinstance(snap, str):
            raise StepsUnavailable(
                f"a steps window counts the server's engine steps from its /metrics, and {snap}; check that the "
                "server is up, or ask for duration_s instead of steps", details={"stages": stages})
        if not engine_steps(snap):
            raise StepsUnavailable(
                f"a steps window counts the server's engine steps from its /metrics, and {self.upstream.base_url}"
                "/metrics has no vllm:iteration_tokens_total (the server runs with --disable-log-stats?); restart "
                "it without --disable-log-stats, or ask for duration_s instead of steps", details={"stages": stages})
        return snap

    async def _count(self, stages: list[int]) -> tuple[dict[Labels, int] | None, float, float]:
        """The engines' step counters now (None: the read failed), the middle of the read (when
        the server counted, as near as the sidecar can tell) and how long the read took."""
        t0 = time.monotonic()
        try:
            counts: dict[Labels, int] | None = await self.upstream.step_counts()
        except MetricsUnavailable as exc:
            counts = None
            log.debug("a step counter read failed after %.0f ms: %s", (time.monotonic() - t0) * 1000, exc.message)
        t1 = time.monotonic()
        return counts, (t0 + t1) / 2, t1 - t0

    async def _wait_steps(self, cap: Capture, first: MetricsSnapshot, n: int) -> None:
        """Until the server has run ``n`` steps since ``first`` (a ``delay_steps`` start)."""
        base = engine_steps(first)
        deadline = time.monotonic() + self.settings.steps_wait_s
        ran = 0
        while True:
            counts, _, _ = await self._count(cap.stages)
            if counts is not None:
                ran = steps_since(base, counts, cap.stages)
                if ran >= n:
                    return
            if time.monotonic() >= deadline:
                raise StepsNotReached(
                    f"the server ran {ran} of the {n} delay_steps within {self.settings.steps_wait_s:g}s; "
                    "send load to it, or ask for fewer delay_steps", details={"delay_steps": n, "counted": ran})
            await asyncio.sleep(self.settings.steps_poll_s)

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
            cap.notes.append(f"start_at was {_ago(late)} past when the capture was ready: its start was sent at once")
            return
        rt.wake = asyncio.Event()
        try:
            # the loop's timers run on the monotonic clock: the wall clock is read again after each
            while (ahead := start_at - time.time()) > 0 and rt.pending_stop is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(rt.wake.wait(), ahead)
        finally:
            rt.wake = None
        if rt.pending_stop is not None:
            early = _ago(start_at - time.time())
            raise StartCancelled(f"stopped ({rt.pending_stop.value}) {early} before its start_at: nothing was sent to "
                                 "the server", details={"capture_id": cap.id})

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

    async def _read_steps(self, stages: list[int], *, due: float, hedge_s: float
                          ) -> tuple[dict[Labels, int] | None, float, float] | None:
        """One count (as :meth:`_count`), hedged: a read not back within ``hedge_s`` gets a fresh
        one beside it (at most ``STEP_READS_OUT`` out at once) and the freshest that comes back with
        counts wins, so one slow reply does not blind a window. None when ``due`` (monotonic) comes
        first; a failed read when every read out failed."""
        out: set[asyncio.Future[tuple[dict[Labels, int] | None, float, float]]] = set()
        try:
            while True:
                if len(out) < STEP_READS_OUT:
                    out.add(asyncio.ensure_future(self._count(stages)))
                left = due - time.monotonic()
                if left <= 0:
                    return None
                done, out = await asyncio.wait(out, timeout=min(left, hedge_s), return_when=asyncio.FIRST_COMPLETED)
                results = [t.result() for t in done if t.exception() is None]
                counted = [r for r in results if r[0] is not None]
                if counted:
                    return max(counted, key=lambda r: r[1])
                if done and not out:  # every read out failed
                    return results[0] if results else (None, time.monotonic(), 0.0)
        finally:
            for t in out:
                t.cancel()

    async def _count_steps(self, capture_id: str) -> None:
        """A ``steps`` window: read the server's counter every ``steps_poll_s``; from the reads, the
        step rate, and from their round trip, the time a request takes to land. The base is the
        read just before the start was sent: both servers start the engines' profilers as the start
        arrives (vLLM 0.30 answers only once its front-end profiler has started too, which takes
        seconds on CPU while the engines step and record). The stop is sent so that it lands when
        the count reaches ``steps`` past the base: at once when due, else after the wait the rate
        predicts, when that is shorter than the next read. No read is waited for past that moment:
        a read that comes back late (a busy server or host: one took over a second in CI) or fails
        would otherwise let the window run on uncounted, so the rate decides then, and says so."""
        cap, rt = self._captures[capture_id], self._rt[capture_id]
        assert cap.steps is not None
        steps, poll = cap.steps, self.settings.steps_poll_s
        # Every stage's server ends its own window after ``steps`` iterations (render --steps): a stop
        # landing sooner would cut that window short (the profilers started somewhere between the
        # base read and the start's answer), one landing later changes nothing. So the stop waits
        # until every stage has run ``steps`` past its count at the start's answer, each stage by its
        # own counter (a stage fed by another steps later than it); no lead, nothing runs past.
        capped = capped_by_server(self.deploy, cap.stages, steps)
        # how far each stage's count must go past its count at the start's answer: the iterations of
        # its window (render --steps N caps at N + 2, more on a stage given its idle iterations),
        # which its steps never outnumber
        ends = server_window_ends(self.deploy, cap.stages)
        reach = {sid: max(steps, end) for sid, end in ends.items()}
        heads: dict[str, int] = {}  # a capped window's steps per stage by the start's answer
        moved: dict[str, tuple[int, float]] = {}  # per stage: its count, and when it last moved
        ahead = Lead(0.0, 0, 0.0) if capped else self._lead.lead(cap.stages, steps)
        lead = ahead.ahead
        aim = steps - lead  # the count the stop is sent at
        base: dict[Labels, int] | None = None
        reads: collections.deque[tuple[float, int]] = collections.deque()  # (when the server counted, steps run)
        rate = took = 0.0

        def due() -> float:
            """When the stop is to be sent, by the rate, to land (half a round trip later) at ``steps``."""
            if not reads or rate <= 0:
                return math.inf
            at, now = reads[-1]
            return at + (aim - now) / rate - took / 2

        def predicted(sent: float) -> int:
            at, now = reads[-1]
            return int(round(now + rate * max(sent + took / 2 - at, 0.0)))

        def late(sent: float, count: int) -> str | None:
            """Why a stop sent by the rate is past ``steps``: it was sent late (the sidecar's process
            did not run: a host whose CPUs the server keeps busy left it unscheduled for seconds)."""
            if count - steps <= 2 or capped:
                return None
            return (f"the stop was sent {(sent - due()) * 1000:.0f} ms after the rate ({rate:.1f} steps/s) put the "
                    f"window at {steps} steps, at about {count}: the sidecar was not running meanwhile (a host "
                    "whose CPUs are all busy, e.g. with the server itself, can leave it unscheduled for seconds)")

        async def stop(count: int, why: str | None = None) -> None:
            rt.steps_at_stop, rt.steps_learn = count, why is None
            if why is not None and not capped:
                cap.notes.append(why)
            elif capped:
                counted = ", ".join(f"{f'stage {s}: ' if s else ''}{heads.get(s, 0)} then {n}"  # "": plain vLLM's one engine
                                    for s, (n, _) in sorted(moved.items()))
                waits = set(reach.values())
                cap.notes.append(
                    f"the stop was sent at {count} steps counted, past the {steps} asked: every stage's server ends its "
                    f"own window after {window_ends_text(ends)} engine iterations "
                    f"(max_iterations), so the stop waited until each stage had counted "
                    f"{waits.pop() if len(waits) == 1 else 'its own'} + {CAPPED_MARGIN} steps past its count at the "
                    "start's answer, when its "
                    f"profiler had started ({counted}): a stop sent sooner could cut a window short, one sent later "
                    "changes nothing" + (f"; {why}" if why else ""))
            elif lead:
                cap.notes.append(
                    f"the stop was sent at {count} of the {steps} steps counted, {lead:.0f} ahead: in this "
                    f"server's last {ahead.windows} steps windows of these stages the engines recorded "
                    f"{ahead.late:.0f} steps past the count the stop was sent at (its travel to them; the median, "
                    "docs/captures.md)" + ("" if lead == ahead.late else f"; {lead:.0f}, not {ahead.late:.0f}: a stop "
                                           f"is never sent more than {MAX_SHARE:.0%} of the window ahead"))
            rt.steps_counter = None  # stop() cancels the counter; this one must not cancel itself
            await self.stop(capture_id, reason=StopReason.steps)

        if rt.steps_base is not None:
            counts, at, _ = rt.steps_base
            if counts is not None:
                base = counts
                reads.append((at, 0))
        first = True
        while cap.state is CaptureState.active:
            sent, hedge_s, by = time.monotonic(), max(3 * took, 4 * poll), math.inf if capped else due()
            got = await self._read_steps(cap.stages, due=by, hedge_s=hedge_s)
            if got is None:  # the rate says the window is full while no read has come back
                now = time.monotonic()
                if now - by > max(5 * poll, 0.1) or now - sent < hedge_s:  # woken late: the sidecar did not run
                    why = late(now, predicted(now))
                else:
                    why = (f"the step counter's reads had not come back after {(now - sent) * 1000:.0f} ms (the one "
                           f"before took {took * 1000:.0f} ms): the stop was sent when the rate ({rate:.1f} steps/s "
                           f"from {reads[-1][1]} counted) put the window at {steps} steps")
                await stop(predicted(now), why)
                return
            counts, at, took_now = got
            if counts is None:  # a failed read: the next one, unless the rate says the window is full
                await asyncio.sleep(poll if capped else min(poll, max(due() - time.monotonic(), 0.0)))
                continue
            took = took_now
            if base is None:
                base = counts
            prev = reads[-1] if reads else None
            now = steps_since(base, counts, cap.stages)
            reads.append((at, now))
            # The rate over the last second of reads: the servers' counters move in bursts (vLLM-Omni's
            # is recorded behind its busy API server), so read-to-read rates swing between 0 and several times it.
            # The base goes once two reads follow the start's answer: a start can pause the engines
            # (vLLM's first one on CPU held the engine 2.6 s), and a rate across it is too low.
            answered = rt.started_mono if rt.started_mono is not None else -math.inf
            while len(reads) > 2 and (at - reads[1][0] >= RATE_WINDOW_S or reads[0][0] < answered):
                reads.popleft()
            rate = (now - reads[0][1]) / (at - reads[0][0]) if at > reads[0][0] else 0.0
            log.debug("capture %s: %d of %d steps (read %.0f ms, %.1f steps/s)", cap.id, now, steps,
                      took * 1000, rate)
            if capped:
                per = steps_by_stage(base, counts, cap.stages)
                if first:  # the first read after the start's answer: the profilers have started
                    heads = dict(per)
                    first = False
                for s, n in per.items():
                    if s not in moved or moved[s][0] != n:
                        moved[s] = (n, at)
                behind = [s for s, n in sorted(per.items()) if n < heads.get(s, 0) + _reach(reach, s, steps) + CAPPED_MARGIN]
                if not behind:
                    await stop(now)
                    return
                # A stage that runs only on what another hands it (vLLM-Omni's downstream stages) may
                # stand still while the others have run their window: once it has for steps_stall_s,
                # the stop goes, and says which stage it did not wait for.
                stall = self.settings.steps_stall_s
                if len(behind) < len(per) and all(at - moved[s][1] >= stall for s in behind):
                    await stop(now, "; ".join(
                        f"stage {s} had counted {per[s] - heads.get(s, 0)} of its {_reach(reach, s, steps)} past the start's answer and "
                        f"none more for {at - moved[s][1]:.1f}s (a stage runs only on what reaches it): its trace "
                        "may hold fewer" for s in behind))
                    return
                await asyncio.sleep(poll)
                continue
            if now - steps > 2 and not capped:
                if first and rt.started_mono is not None:
                    why = (f"the server had run {now} engine steps by the first count after the start was answered "
                           f"({rt.started_mono - reads[0][0]:.2f}s after it was sent), more than the {steps} asked: a "
                           "window on this server is at least that long (a server's first profiler start initialises "
                           "the profiler, seconds on CPU); ask for more steps")
                else:
                    why = (f"the count went from {prev[1] if prev else 0} to {now} between two reads "
                           f"{(at - prev[0]) * 1000 if prev else 0:.0f} ms apart (this read took {took * 1000:.0f} ms): "
                           f"the server ran past the {steps} steps asked before the sidecar could see it")
                await stop(now, why)
                return
            first = False
            if aim - now <= 0.5:
                await stop(now)
                return
            # stop after the predicted wait when the next read would come back later than it
            wait = due() - time.monotonic()
            if wait <= poll + took:
                if wait > 0:
                    await asyncio.sleep(wait)
                t = time.monotonic()
                await stop(predicted(t), late(t, predicted(t)))
                return
            await asyncio.sleep(poll)

    async def _settle_metrics(self, cap: Capture, rt: _Runtime) -> None:
        """The window's metrics from the scrapes at its edges (and a ``steps`` window's count)."""
        cap.steps_counted = rt.steps_at_stop
        if rt.metrics_before is None:
            return
        try:
            before = await asyncio.wait_for(asyncio.shield(rt.metrics_before), self.upstream.timeouts.probe)
            after = await asyncio.wait_for(asyncio.shield(rt.metrics_after), self.upstream.timeouts.probe) \
                if rt.metrics_after is not None else "no scrape after the stop"
        except asyncio.TimeoutError:
            cap.window_metrics = WindowMetrics(unavailable="a /metrics scrape did not answer within "
                                               f"{self.upstream.timeouts.probe:g}s")
            return
        if isinstance(before, str) or isinstance(after, str):
            cap.window_metrics = WindowMetrics(unavailable=before if isinstance(before, str) else str(after))
            return
        cap.window_metrics = window_metrics(before, after)

    async def _steps_traced(self, cap: Capture, rt: _Runtime, verdicts: list[StageVerdict]) -> list[StageVerdict]:
        """Each stage's engine steps as its trace holds them (the trace summary), with a note
        when a stage holds more or fewer than asked; a window stopped on time by the count teaches
        the next one how early to send its stop (lead.py)."""
        try:
            data = await self._summaries.get(cap, live=True)
        except SidecarError as exc:
            cap.notes.append(f"the steps the traces hold are not counted: {exc.message}")
            return verdicts
        except Exception as exc:  # a summary never changes the capture's outcome (a bug included)
            log.warning("capture %s: the steps the traces hold are not counted: %s", cap.id, exc, exc_info=True)
            cap.notes.append(f"the steps the traces hold are not counted: the summary failed ({type(exc).__name__}: {exc})")
            return verdicts
        per_stage: dict[int, int] = {}
        idle: dict[int, tuple[int, int]] = {}  # per stage: its trace's idle iterations, of how many
        writes: dict[int, float] = {}  # per stage: its trace's last event to its file's last write, s
        for f in data.get("files", []):
            sid = f.get("stage_id")
            if sid is None and len(cap.stages) == 1:
                sid = cap.stages[0]  # plain vLLM's traces carry no stage in their names: its one engine
            if sid is None:
                continue
            kinds = {k["kind"]: k["count"] for k in f.get("engine_step_kinds", [])}
            if (took := _write_s(f)) is not None:
                writes[sid] = max(writes.get(sid, took), took)
            ran = f.get("window", {}).get("engine_steps", 0)
            worked = ran - kinds.get("idle", 0)
            if worked >= per_stage.get(sid, 0):
                per_stage[sid], idle[sid] = worked, (kinds.get("idle", 0), ran)
        server_bounded = server_bounded_stages(self.deploy, cap.stages)
        capped = {s for s, pc in server_bounded if pc.max_iterations > 0}
        if rt.steps_learn and rt.steps_at_stop is not None and not server_bounded:
            self._lead.learn(cap.stages, per_stage, rt.steps_at_stop)
        out = []
        for v in verdicts:
            if v.stage_id in per_stage:
                v = v.model_copy(update={"steps_traced": per_stage[v.stage_id],
                                         "trace_write_s": writes.get(v.stage_id)})
                if v.steps_traced != cap.steps:
                    cap.notes.append(f"stage {v.stage_id}: the trace holds {v.steps_traced} engine steps, "
                                     f"{cap.steps} {'was' if cap.steps == 1 else 'were'} asked ({v.steps_traced - (cap.steps or 0):+d})"
                                     + _idle_note(*idle[v.stage_id], capped=v.stage_id in capped))
            out.append(v)
        steps = cap.steps or 0
        if capped_by_server(self.deploy, cap.stages, steps):
            short = {s: idle[s] for s, n in per_stage.items() if n < steps and s in idle}
            cap.notes.extend(_idle_fix(steps, short, server_window_ends(self.deploy, cap.stages)))
        if any(abs(n - steps) > 2 for n in per_stage.values()) and not server_bounded:
            # the way to the steps asked where the stop's travel moves it (docs/captures.md)
            cap.notes.append(
                f"the sidecar's stop ended this window, so the steps the engines ran while the start and the stop "
                f"travelled to them moved it: for {steps} steps give or take 2, let the server end each window itself "
                f"(restart it with the profiler config `omni-sidecar render --steps {steps}` writes: max_iterations "
                f"{max_iterations_for(steps)})")
        return out

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

    async def _gone(self, *, waited: bool = False) -> str:
        """Returns (with the probe's reason) once the server has been unreachable for
        ``gone_after_s``; a server that answers at all, however slowly, is not gone. ``waited``:
        the first poll interval has passed already (the first probe is sent at once)."""
        since: float | None = None
        while True:
            if not waited:
                await asyncio.sleep(self.settings.gone_poll_s)
            waited = False
            try:
                probe = await self.upstream.probe()
            except Exception:  # a closed client at shutdown: nothing is known, so not gone
                since = None
                continue
            if probe.reachable:
                since = None
                continue
            now = time.monotonic()
            since = now if since is None else since
            if now - since >= self.settings.gone_after_s:
                return probe.reason or f"{self.upstream.base_url} is not reachable"

    async def _stop_upstream(self, cap: Capture, rt: _Runtime, *, hold: bool) -> tuple[str, Any]:
        """Send the stop until it is answered: ``("answered", None)``, ``("server_error", exc)``
        (5xx after the retries), ``("failed", exc)`` (never answered within the budget and not
        held, or refused), or ``("gone", reason)``. With ``hold``, a stop that outlives its budget
        is collected as found so far, and sent again (the server answers once its first stop
        is done) until answered or gone."""
        # The watcher for a server gone is started only once a stop has gone unanswered for a poll
        # interval: a stop answered sooner (nearly every one) costs no task beside it, nor the loop
        # turn its cancellation takes (a fleet's worker answers 128 stops at once).
        gone: asyncio.Task[str] | None = None
        stop: asyncio.Task[None] | None = None
        try:
            while True:
                # Once the budget is spent, each repeat waits a whole read timeout: the server handles
                # stops one after another, so the repeat answers once the first one is done.
                budget = max(self.upstream.stop_budget_s, self.upstream.timeouts.stop) if rt.stop_timed_out else None
                stop = asyncio.create_task(self.upstream.stop_profile(cap.stages, budget_s=budget),
                                           name=f"stop-call-{cap.id}")
                if gone is None:
                    await asyncio.wait({stop}, timeout=self.settings.gone_poll_s)
                    if not stop.done():
                        gone = asyncio.create_task(self._gone(waited=True), name=f"gone-{cap.id}")
                if not stop.done():
                    assert gone is not None
                    await asyncio.wait({stop, gone}, return_when=asyncio.FIRST_COMPLETED)
                if stop.done():
                    try:
                        stop.result()
                        return "answered", None
                    except UpstreamError as exc:
                        if _is_server_error(exc):
                            return "server_error", exc
                        if hold and isinstance(exc, UpstreamTimeout):
                            if not rt.stop_timed_out:
                                rt.stop_timed_out = True
                                await self._found_so_far(cap, rt, exc)
                            continue
                        return "failed", exc
                assert gone is not None
                return "gone", gone.result()
        finally:
            for task in (stop, gone):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task

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
        stops = _of_loop(_STOPS, _StopsInFlight)
        published = stops.sending()
        try:
            outcome, detail = await self._stop_upstream(cap, rt, hold=collect)
            self.claims.close_window(cap.id, time.time())
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
            await stops.answered()
            if rt.metrics_before is not None:  # beside the collect, not before it
                rt.metrics_after = asyncio.create_task(self._scrape(), name=f"metrics-after-{cap.id}")
            verdicts = await self._collect(cap, rt)
            if stop_error is not None:
                verdicts = [after_stop_error(v, stop_error) for v in verdicts]
            await self._settle_metrics(cap, rt)
            cap.verdicts = verdicts
            if cap.steps is not None:
                verdicts = cap.verdicts = await self._steps_traced(cap, rt, verdicts)
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

    async def wait(self, capture_id: str, timeout: float | None = None) -> Capture:
        """Until the capture is terminal, or ``timeout`` seconds (then its current snapshot)."""
        cap = self.get(capture_id)
        if cap.terminal:
            return cap
        rt = self._rt[capture_id]
        try:
            await asyncio.wait_for(rt.done.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        if self.journal is not None:
            await self.journal.flush()  # a terminal capture is on disk when wait returns
        return self.get(capture_id)

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
