"""A capture window's measures from the server: its /metrics at the window's edges (the window's
metrics), a ``steps`` window's counter fed to the policy (steps.py, through window.py), and the
engine steps its traces held afterwards, as facts. The capture state machine asks; it decides nothing
here about states.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from sidecar.config.models import DeployConfig
from sidecar.config.rules import IDLE_ITERATIONS, MAX_IDLE_SHARE, max_iterations_for, server_bounded_stages
from sidecar.config.rules import server_window_ends
from sidecar.control import window
from sidecar.control.models import Capture, StageVerdict
from sidecar.control.notes import note
from sidecar.control.settings import ControlSettings
from sidecar.control.steps import Bound, Decision, Read, StepsWindow, idle_fix, steps_traced
from sidecar.control.summaries import SummaryCache
from sidecar.errors import MetricsUnavailable, SidecarError, StepsUnavailable
from sidecar.upstream.metrics import Labels, MetricsSnapshot, WindowMetrics, engine_steps, window_metrics
from sidecar.upstream.server import UpstreamServer

log = logging.getLogger(__name__)


def window_ends(deploy: DeployConfig, cap: Capture) -> dict[int, int] | None:
    """Each stage's own end of a window its server ends: the deploy's caps (``server_cap``), or the
    steps (after the delay) the start's body asked for (``per_capture``); None for a counted one."""
    if cap.steps_bound is Bound.server_cap:
        return server_window_ends(deploy, cap.stages)
    if cap.steps_bound is Bound.per_capture and cap.steps is not None:
        return {s: cap.steps + (cap.delay_steps or 0) for s in cap.stages}
    return None


class WindowMeasures:
    """What the server says about one controller's windows."""

    def __init__(self, upstream: UpstreamServer, deploy: DeployConfig, settings: ControlSettings,
                 summaries: SummaryCache) -> None:
        self.upstream, self.deploy, self.settings, self.summaries = upstream, deploy, settings, summaries

    async def scrape(self) -> MetricsSnapshot | str:
        """The server's /metrics now, or why not (a window never fails for its metrics)."""
        try:
            return await self.upstream.metrics()
        except MetricsUnavailable as exc:
            return exc.message

    def reader(self) -> window.ReadCounts:
        return window.reader(self.upstream.step_counts)

    async def step_counter(self, stages: list[int]) -> dict[Labels, int]:
        """The engines' step counts now, refused when the server has no counter (the check a counted
        window needs): the fast read of the step family only, not a whole scrape (the window's
        metrics take theirs at the send)."""
        try:
            counts = await self.upstream.step_counts()
        except MetricsUnavailable as exc:
            raise StepsUnavailable(
                f"a steps window counts the server's engine steps from its /metrics, and {exc.message}; check that "
                "the server is up, or ask for duration_s instead of steps", details={"stages": stages}) from None
        if not counts:
            raise StepsUnavailable(
                f"a steps window counts the server's engine steps from its /metrics, and {self.upstream.base_url}"
                "/metrics has no vllm:iteration_tokens_total (the server runs with --disable-log-stats?); restart "
                "it without --disable-log-stats, or ask for duration_s instead of steps", details={"stages": stages})
        return counts

    async def at_send(self) -> tuple[Read, MetricsSnapshot | str]:
        """A counted window's edge, read just before its start is sent: the counters (the steps
        window's base) and the metrics (the window's metrics' first edge), from one scrape."""
        t0 = time.monotonic()
        snap = await self.scrape()
        at = (t0 + time.monotonic()) / 2
        return Read(at, engine_steps(snap) if isinstance(snap, MetricsSnapshot) else None), snap

    async def wait_delay(self, first: dict[Labels, int], stages: list[int], n: int) -> None:
        """Until the server has run ``n`` steps since ``first`` (a ``delay_steps`` start)."""
        await window.wait_steps(self.reader(), first, stages, n, wait_s=self.settings.steps_wait_s,
                                poll_s=self.settings.steps_poll_s)

    async def count(self, cap: Capture, base: Read | None, answered_at: float) -> Decision:
        """A ``steps`` window: its counter read and fed to the policy until it says stop; its end is
        kept on the capture (``steps_counted``, ``steps_ended_by`` and a ``steps_ended`` fact)."""
        assert cap.steps is not None and cap.steps_bound is not None
        ends = window_ends(self.deploy, cap)
        policy = StepsWindow(cap.steps, cap.stages, bound=cap.steps_bound, ends=ends, base=base,
                             answered_at=answered_at, stall_s=self.settings.steps_stall_s,
                             max_s=self.settings.steps_wait_s)
        decision = await window.count_window(policy, self.reader(), poll_s=self.settings.steps_poll_s)
        cap.steps_counted, cap.steps_ended_by = decision.counted, decision.ended_by
        cap.facts.append(note("steps_ended", ended_by=decision.ended_by.value if decision.ended_by else None,
                              steps_asked=cap.steps, counted=decision.counted, bound=cap.steps_bound.value,
                              per_stage=dict(decision.per_stage), heads=dict(decision.heads),
                              behind=list(decision.behind), still_s=round(decision.still_s, 3),
                              start_s=round(answered_at - base.at, 3) if base is not None else None,
                              read_gap_s=round(policy.read_gap_s, 3),
                              per_capture=bool((cap.server or {}).get("per_capture_bounds")),
                              ends={str(s): n for s, n in (ends or {}).items()}, margin=policy.margin,
                              max_s=policy.max_s))
        if self.settings.steps_record_dir:
            await asyncio.to_thread(window.record, self.settings.steps_record_dir, cap.id, policy, decision)
        return decision

    async def settle(self, cap: Capture, before: asyncio.Task[Any] | None, after: asyncio.Task[Any] | None) -> None:
        """The window's metrics from the scrapes at its edges."""
        if before is None:
            return
        timeout = self.upstream.timeouts.probe
        try:
            first = await asyncio.wait_for(asyncio.shield(before), timeout)
            last = await asyncio.wait_for(asyncio.shield(after), timeout) if after is not None \
                else "no scrape after the stop"
        except asyncio.TimeoutError:
            cap.window_metrics = WindowMetrics(unavailable=f"a /metrics scrape did not answer within {timeout:g}s")
            return
        if isinstance(first, str) or isinstance(last, str):
            cap.window_metrics = WindowMetrics(unavailable=first if isinstance(first, str) else str(last))
            return
        cap.window_metrics = window_metrics(first, last)

    async def steps_traced(self, cap: Capture, verdicts: list[StageVerdict]) -> list[StageVerdict]:
        """Each stage's engine steps as its trace holds them (the trace summary), with a fact when a
        stage holds other than asked, and the way to the steps where the server's cap idled short."""
        try:
            data = await self.summaries.get(cap, live=True)
        except SidecarError as exc:
            cap.facts.append(note("steps_not_counted", why=exc.message))
            return verdicts
        except Exception as exc:  # a summary never changes the capture's outcome (a bug included)
            log.warning("capture %s: the steps the traces hold are not counted: %s", cap.id, exc, exc_info=True)
            cap.facts.append(note("steps_not_counted", why=f"the summary failed ({type(exc).__name__}: {exc})"))
            return verdicts
        per_stage, idle, writes = window.trace_steps(data.get("files", []), cap.stages)
        steps = cap.steps or 0
        capped = set(cap.stages) if cap.steps_bound is Bound.per_capture else {
            s for s, pc in server_bounded_stages(self.deploy, cap.stages) if pc.max_iterations > 0}
        for f in steps_traced(steps, per_stage, idle, capped=capped):
            sid = f.pop("stage_id")
            cap.facts.append(note("steps_traced", sid if isinstance(sid, int) else None, **f))
        if cap.steps_bound is Bound.server_cap:
            short = {s: idle[s] for s, n in per_stage.items() if n < steps and s in idle}
            for f in idle_fix(steps, short, server_window_ends(self.deploy, cap.stages),
                              idle_iterations=IDLE_ITERATIONS, max_share=MAX_IDLE_SHARE,
                              max_iterations_for=max_iterations_for):
                code, sid = str(f.pop("code")), f.pop("stage_id", None)
                cap.facts.append(note(code, sid if isinstance(sid, int) else None, **f))
        return [v.model_copy(update={"steps_traced": per_stage[v.stage_id], "trace_write_s": writes.get(v.stage_id)})
                if v.stage_id in per_stage else v for v in verdicts]


__all__ = ["WindowMeasures", "window_ends"]
