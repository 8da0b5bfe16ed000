"""Capture controller for one upstream server: the state machine of DESIGN.md §5
(``starting → active → stopping → collecting → completed | degraded | failed``), one capture at a
time, watchdogs for ``duration_s`` and leases, background stop with artifact checks, and a journal
that lets a restarted sidecar stop a capture left active. No HTTP framework here: surfaces call it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from sidecar.config.models import DeployConfig
from sidecar.config.rules import select_stages
from sidecar.control import artifacts
from sidecar.control.artifacts import StageWatch
from sidecar.control.journal import CaptureJournal, atomic_write_text
from sidecar.scrub import scrub_secrets
from sidecar.control.models import Capture, CaptureState, ErrorRecord, StageVerdict, StopReason, Verdict
from sidecar.errors import (
    ArtifactNotFound,
    CaptureActive,
    CaptureNotFound,
    CaptureStateError,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from sidecar.errors import (
    CaptureNotTerminal,
    DurationInvalid,
    LeaseInvalid,
    SidecarClosing,
    StageSetMismatch,
    SummaryUnavailable,
)
from sidecar.upstream.server import Flavor, UpstreamServer

if TYPE_CHECKING:
    from sidecar.config.settings import SidecarSettings

log = logging.getLogger(__name__)

OnChange = Callable[[Capture], Any]
# The summary computed after completion and served by default; other ``top``s are computed on demand.
SUMMARY_TOP = 20
_LIVE = (CaptureState.starting, CaptureState.active, CaptureState.stopping, CaptureState.collecting)


class ControlSettings(BaseModel):
    collect_timeout_s: float = Field(default=120, ge=0)  # bound on waiting for gzip / stable sizes
    settle_s: float = Field(default=1.0, ge=0)  # listing unchanged for this long = done
    poll_s: float = Field(default=0.2, gt=0)
    artifact_roots: dict[str, str] = Field(default_factory=dict)  # SERVER_PATH -> LOCAL_PATH
    default_lease_s: float | None = Field(default=None, gt=0)
    max_duration_s: float | None = Field(default=None, gt=0)
    close_timeout_s: float = Field(default=60, ge=0)  # how long close() waits for a stop
    # A rollback runs inside start(); a dead stage 500s every stop, so it gets its own short budget.
    rollback_budget_s: float = Field(default=30, gt=0)
    summarize: bool = True  # cache a trace summary after completion when sidecar.analysis has one
    keep: int | None = Field(default=None, ge=0)  # finished captures kept in history (None: all)
    keep_days: float | None = Field(default=None, gt=0)  # finished captures older than this are dropped

    @classmethod
    def from_settings(cls, settings: SidecarSettings) -> ControlSettings:
        return cls(
            collect_timeout_s=settings.collect_timeout_s,
            settle_s=settings.settle_s,
            artifact_roots=dict(settings.artifact_roots),
            default_lease_s=settings.default_lease_s,
            max_duration_s=settings.max_duration_s,
            close_timeout_s=settings.close_timeout_s,
            keep=settings.keep,
            keep_days=settings.keep_days,
        )


def _is_server_error(exc: UpstreamError) -> bool:
    """A 5xx answer: the request reached the server (unlike unreachable) and it replied (unlike a hang)."""
    if isinstance(exc, (UpstreamTimeout, UpstreamUnreachable)):
        return False
    return int(exc.details.get("status", 0)) >= 500


def _after_stop_error(v: StageVerdict, stop_error: UpstreamError) -> StageVerdict:
    """A stage without a trace after a failed stop is ``missing`` for that reason (its worker most
    likely died), whatever the folder shows; ``ok`` and ``unverified`` stand as found."""
    if v.verdict in (Verdict.ok, Verdict.unverified):
        return v
    return v.model_copy(
        update={
            "verdict": Verdict.missing,
            "reason": (
                f"stage {v.stage_id} wrote no trace and the stop failed on the server "
                f"({stop_error.message}): its worker most likely died during the window. Check the "
                f"server log for stage {v.stage_id} (a crash, an OOM kill) and whether the server still "
                "serves requests; the other stages' traces are kept"
            ),
        }
    )


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _new_id() -> str:
    # Sortable by time, unique across restarts, safe as a file name and URL segment.
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


class _Runtime:
    """What the controller keeps per live capture beside the record itself."""

    __slots__ = ("watches", "done", "started_mono", "heartbeat_mono", "watchdog", "stopper", "pending_stop")

    def __init__(self) -> None:
        self.watches: list[StageWatch] = []
        self.done = asyncio.Event()
        self.started_mono: float | None = None
        self.heartbeat_mono: float | None = None
        self.watchdog: asyncio.Task[None] | None = None
        self.stopper: asyncio.Task[None] | None = None
        self.pending_stop: StopReason | None = None  # stop asked for while still starting


class CaptureController:
    """One capture at a time on ``upstream``. Call :meth:`open` once before use and
    :meth:`close` at shutdown. Returned captures are copies; they never change under the caller."""

    def __init__(
        self,
        upstream: UpstreamServer,
        deploy: DeployConfig,
        *,
        state_dir: Path | None = None,
        settings: ControlSettings | None = None,
    ) -> None:
        self.upstream = upstream
        self.deploy = deploy
        self.settings = settings or ControlSettings()
        self.journal = (
            CaptureJournal(state_dir, keep=self.settings.keep, keep_days=self.settings.keep_days)
            if state_dir is not None
            else None
        )
        self._captures: dict[str, Capture] = {}
        self._rt: dict[str, _Runtime] = {}
        self._busy: list[str] = []  # live capture ids, oldest first (normally at most one)
        self._start_lock = asyncio.Lock()
        self._listeners: list[OnChange] = []
        self._summary_tasks: set[asyncio.Task[None]] = set()
        self._summaries: dict[tuple[str, int], dict[str, Any]] = {}  # (capture id, top) -> summary
        self._summary_locks: dict[str, asyncio.Lock] = {}
        self._opened = False
        self._closed = False

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
            self._busy.append(cap.id)
            cap.state = CaptureState.stopping
            cap.stop_reason = StopReason.stopped_on_recovery
            cap.stop_requested_at = _now()
            self._changed(cap)
            recovered.append(cap.model_copy(deep=True))
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
                self._rt[cid].pending_stop = StopReason.shutdown
        waits = [self._rt[cid].done.wait() for cid in list(self._busy)]
        if waits:
            try:
                await asyncio.wait_for(asyncio.gather(*waits), self.settings.close_timeout_s)
            except asyncio.TimeoutError:
                log.warning("shutdown: stop still running after %.0fs; it will be recovered at next start",
                            self.settings.close_timeout_s)
        for rt in self._rt.values():
            for task in (rt.watchdog, rt.stopper):
                if task is not None and not task.done():
                    task.cancel()
        for task in list(self._summary_tasks):
            task.cancel()
        if self.journal is not None:
            await self.journal.flush()

    async def __aenter__(self) -> CaptureController:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- queries --------------------------------------------------------------------------

    def get(self, capture_id: str) -> Capture:
        cap = self._captures.get(capture_id)
        if cap is None:
            raise CaptureNotFound(
                f"no capture {capture_id!r}; list captures with GET /v1/captures",
                details={"capture_id": capture_id},
            )
        return cap.model_copy(deep=True)

    def list(self) -> list[Capture]:
        """Every capture this sidecar knows (journal history included), newest first."""
        caps = sorted(self._captures.values(), key=lambda c: (c.created_at, c.id), reverse=True)
        return [c.model_copy(deep=True) for c in caps]

    @property
    def active(self) -> Capture | None:
        """The live capture (any non-terminal state), or None."""
        return self._captures[self._busy[-1]].model_copy(deep=True) if self._busy else None

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
    ) -> Capture:
        """Start a capture of ``stages`` (default: every profiled torch stage, sent explicitly).
        Returns once the upstream accepted (state ``active``, or ``stopping`` when a stop was asked
        for while it was starting). On an upstream failure or an
        ambiguous start the same set is stopped (rollback), the capture ends ``failed`` and the
        upstream error is raised with ``details['capture_id']``."""
        if self._closed:
            raise SidecarClosing("the sidecar is shutting down; start the capture after restart")
        duration_s, lease_s = self._check_window(duration_s, lease_s)
        # Validation comes before anything reaches the server (DESIGN.md §4), and before the
        # overlap check: a bad stage list is wrong whatever else is running.
        selected = select_stages(self.deploy, stages, allow_cuda=False)
        self._refuse_overlap()  # fast path: don't queue behind a start that may take minutes
        async with self._start_lock:
            self._refuse_overlap()
            now = _now()
            cap = Capture(
                id=_new_id(),
                label=scrub_secrets(label) if label else None,
                upstream=scrub_secrets(self.upstream.base_url),  # no URL credentials in the record
                stages=list(selected),
                duration_s=duration_s,
                lease_s=lease_s,
                created_at=now,
            )
            rt = self._rt[cap.id] = _Runtime()
            rt.watches = self._watches(cap.stages)
            self._captures[cap.id] = cap
            self._busy.append(cap.id)
            try:
                await asyncio.to_thread(lambda: [artifacts.snapshot(w) for w in rt.watches])
                self._changed(cap)  # journaled with the baselines before anything can start upstream
                if self.journal is not None:
                    await self.journal.flush()
                await self.upstream.start_profile(cap.stages)
            except UpstreamError as exc:
                await self._rollback(cap, exc.code, exc.message, delivered=not isinstance(exc, UpstreamUnreachable))
                exc.details.setdefault("capture_id", cap.id)
                raise
            except asyncio.CancelledError:
                # The caller went away mid-start: the server may be recording; undo it in the background.
                self._error(cap, "start_cancelled", "start was cancelled before the upstream answered")
                cap.stop_reason = StopReason.rollback
                cap.state = CaptureState.stopping
                self._changed(cap)
                rt.stopper = asyncio.create_task(self._run_stop(cap.id, collect=False))
                raise
            except Exception as exc:  # a bug must not leave a profiler running or the slot taken
                log.exception("capture %s: start failed unexpectedly", cap.id)
                await self._rollback(cap, "internal_error", f"{type(exc).__name__}: {exc}", delivered=True)
                raise
            cap.state = CaptureState.active
            cap.started_at = cap.last_heartbeat_at = _now()
            rt.started_mono = rt.heartbeat_mono = time.monotonic()
            self._changed(cap)
            if rt.pending_stop is not None:
                await self.stop(cap.id, reason=rt.pending_stop)
            elif cap.duration_s is not None or cap.lease_s is not None:
                rt.watchdog = asyncio.create_task(self._watchdog(cap.id), name=f"watchdog-{cap.id}")
            return cap.model_copy(deep=True)

    def _refuse_overlap(self) -> None:
        if self._busy:
            active = self._busy[-1]
            raise CaptureActive(
                f"capture {active} is {self._captures[active].state.value} on {self.upstream.base_url}; "
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

    def _watches(self, stage_ids: list[int]) -> list[StageWatch]:
        out = []
        for sid in stage_ids:
            stage = self.deploy.stage(sid)
            if stage is None:  # a journaled capture from an older deploy config
                out.append(StageWatch(stage_id=sid, kind=artifacts.StageKind.unknown, server_dir=None, local_dir=None))
            else:
                flat = self.upstream.flavor is Flavor.vllm
                out.append(artifacts.watch_stage(stage, self.settings.artifact_roots, flat=flat))
        return out

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
        try:
            await self.upstream.stop_profile(
                cap.stages, budget_s=min(self.settings.rollback_budget_s, self.upstream.stop_budget_s)
            )
            cap.stopped_at = _now()
        except UpstreamError as stop_exc:
            self._error(cap, f"rollback_{stop_exc.code}",
                        f"rollback stop failed: {stop_exc.message}; the profiler may still be running "
                        f"on stages {cap.stages}: POST /stop_profile {{\"stages\": {cap.stages}}} by hand")
        self._finish(cap, CaptureState.failed)

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
        return cap.model_copy(deep=True)

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
            self._rt[capture_id].pending_stop = reason
            return cap.model_copy(deep=True)
        if cap.state is not CaptureState.active:
            return cap.model_copy(deep=True)
        rt = self._rt[capture_id]
        cap.state = CaptureState.stopping
        cap.stop_reason = StopReason(reason)
        cap.stop_requested_at = _now()
        if rt.watchdog is not None and rt.watchdog is not asyncio.current_task():
            rt.watchdog.cancel()
        rt.watchdog = None
        self._changed(cap)
        rt.stopper = asyncio.create_task(self._run_stop(capture_id), name=f"stop-{capture_id}")
        return cap.model_copy(deep=True)

    async def _run_stop(self, capture_id: str, *, collect: bool = True) -> None:
        cap = self._captures[capture_id]
        rt = self._rt[capture_id]
        stop_error: UpstreamError | None = None
        try:
            try:
                await self.upstream.stop_profile(cap.stages)
            except UpstreamError as exc:
                if not (collect and _is_server_error(exc)):
                    self._error(
                        cap,
                        exc.code,
                        f"stop failed within the {self.upstream.stop_budget_s:g}s stop budget: {exc.message}. "
                        f"The profiler may still be running on stages {cap.stages}; the server may still be "
                        "flushing traces. Check the server, then POST /stop_profile with "
                        f"{{\"stages\": {cap.stages}}}",
                    )
                    self._finish(cap, CaptureState.failed)
                    return
                # Delivered, and the server still said 5xx after the retries: a definitive answer (a
                # stage died mid-window), not a hang. The server visits every listed stage even when
                # one fails, so the others wrote their traces: collect them rather than fail.
                stop_error = exc
                self._error(cap, "stop_server_error", f"stop was delivered but failed on the server: {exc.message}")
            cap.stopped_at = _now()
            if not collect:
                self._finish(cap, CaptureState.failed)
                return
            cap.state = CaptureState.collecting
            self._changed(cap)
            verdicts = await artifacts.collect(
                rt.watches,
                collect_timeout_s=self.settings.collect_timeout_s,
                settle_s=self.settings.settle_s,
                poll_s=self.settings.poll_s,
            )
            if stop_error is not None:
                verdicts = [_after_stop_error(v, stop_error) for v in verdicts]
            cap.verdicts = verdicts
            ok = stop_error is None and all(v.verdict is Verdict.ok for v in verdicts)
            self._finish(cap, CaptureState.completed if ok else CaptureState.degraded)
            if self.settings.summarize and any(v.verdict is Verdict.ok for v in verdicts):
                self._schedule_summary(cap)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not leave the capture live forever
            log.exception("capture %s: stop failed unexpectedly", capture_id)
            self._error(cap, "internal_error", f"{type(exc).__name__}: {exc}")
            self._finish(cap, CaptureState.failed)

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
        symlink leaving the folder, another capture's file) is ``ArtifactNotFound``."""
        cap = self.get(capture_id)
        path = artifacts.resolve_artifact(cap.verdicts, relpath)
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
        return self._cached_summary(capture_id, top)

    async def summarize(self, capture_id: str, *, top: int = SUMMARY_TOP) -> dict[str, Any]:
        """The trace summary (``top`` ops per stage) of a terminal capture: the cached one, else
        computed in a thread and cached in the state dir. One summarizer per capture at a time,
        however many callers. ``CaptureError``: ``capture_not_terminal``, ``summary_unavailable``."""
        cap = self.get(capture_id)
        if not cap.terminal:
            raise CaptureNotTerminal(
                f"capture {capture_id} is {cap.state.value}; the summary exists once it is terminal "
                f"(wait with POST /v1/captures/{capture_id}/stop?wait=true)",
                details={"state": cap.state.value},
            )
        async with self._summary_locks.setdefault(capture_id, asyncio.Lock()):
            data = await asyncio.to_thread(self._cached_summary, capture_id, top)  # file read off the loop
            if data is None:
                data = await self._compute_summary(cap, top)
        return data

    def _summary_file(self, capture_id: str, top: int) -> Path | None:
        if self.journal is None:
            return None
        path = self.journal.summary_path(capture_id)
        return path if top == SUMMARY_TOP else path.with_name(f"{capture_id}.top{top}.json")

    def _cached_summary(self, capture_id: str, top: int) -> dict[str, Any] | None:
        data = self._summaries.get((capture_id, top))
        path = self._summary_file(capture_id, top)
        if data is None and path is not None:
            try:
                data = self._summaries[(capture_id, top)] = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
        return data

    async def _compute_summary(self, cap: Capture, top: int) -> dict[str, Any]:
        paths = artifacts.trace_paths(cap.verdicts)
        if not paths:
            raise SummaryUnavailable(
                f"capture {cap.id} has no readable trace (state {cap.state.value}); see its verdicts",
            )
        try:
            from sidecar.analysis import summarize_paths
        except ImportError:
            raise SummaryUnavailable(
                "this sidecar has no trace summarizer installed; download the traces instead",
            ) from None
        result = await asyncio.to_thread(summarize_paths, paths, top=top)
        data: dict[str, Any] = result.model_dump(mode="json")
        path = self._summary_file(cap.id, top)
        if path is not None:
            try:
                await asyncio.to_thread(atomic_write_text, path, json.dumps(data))
            except OSError as exc:  # the summary is served anyway; only its cache is lost
                log.warning("capture %s: cannot cache the summary in %s: %s", cap.id, path, exc)
        self._summaries[(cap.id, top)] = data
        return data

    def _schedule_summary(self, cap: Capture) -> None:
        async def run() -> None:
            try:
                await self.summarize(cap.id)
            except asyncio.CancelledError:
                raise
            except SummaryUnavailable:  # no summarizer or no trace: nothing to cache
                pass
            except Exception as exc:  # a summary never changes the verdict
                log.warning("capture %s: summary failed: %s", cap.id, exc)

        task = asyncio.create_task(run(), name=f"summary-{cap.id}")
        self._summary_tasks.add(task)
        task.add_done_callback(self._summary_tasks.discard)

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
            self._summary_locks.pop(cid, None)
            for key in [k for k in self._summaries if k[0] == cid]:
                del self._summaries[key]

    def state_counts(self) -> dict[str, int]:
        """Captures per state (for metrics), without copying them."""
        counts: dict[str, int] = {}
        for cap in self._captures.values():
            counts[cap.state.value] = counts.get(cap.state.value, 0) + 1
        return counts

    def _changed(self, cap: Capture) -> None:
        if self.journal is not None:
            rt = self._rt.get(cap.id)
            extra = {"watches": [w.to_json() for w in rt.watches]} if rt and not cap.terminal else None
            try:
                self.journal.write(cap, extra)
            except OSError as exc:
                # The capture goes on; losing history is better than leaving a profiler running.
                log.error("journal: cannot write capture %s: %s", cap.id, exc)
        snap = cap.model_copy(deep=True)
        for cb in list(self._listeners):
            try:
                cb(snap)
            except Exception:
                log.exception("capture listener failed")


__all__ = ["CaptureController", "ControlSettings"]
