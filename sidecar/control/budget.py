"""A ``steps`` window planned to a budget: short probe captures (1 and 2 engine steps by default)
measure, per stage, the bytes its files take and the server's stop time; a straight line through
the probes (``fixed + per_step x steps``) predicts any window, and the plan is the most steps that
fit both the size budget and the stop bound. The profiler flags are the server's, fixed at its
start: the plan measures those it runs with and names them.

A server that ends its own windows (``max_iterations`` on every stage, vllm/profiler/wrapper.py
``step()``) bounds the plan too: no window holds more than its iterations, so the plan is never
more than ``max_iterations - IDLE_ITERATIONS`` steps (what ``render --steps N`` writes, inverted),
and no probe is longer. Such a window's trace is written inside the engine when the server ends it,
and the sidecar's stop then answers at once: so a plan at the cap predicts that write (each probe's
``trace_write_s``, from its trace's last event to its file's last write), not the stop's round trip.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, Field

from sidecar.config.rules import IDLE_ITERATIONS, capped_by_server, server_window_ends
from sidecar.control.artifacts import is_trace
from sidecar.control.models import MAX_ENGINE_STEPS, Capture, CaptureState, StopReason
from sidecar.control.notes import ends_text as window_ends_text
from sidecar.errors import BudgetExceeded, PlanInvalid, PlanTimeout, PlanUnmeasurable

if TYPE_CHECKING:
    from sidecar.config.models import DeployConfig
    from sidecar.control.models import StageVerdict


class Prober(Protocol):
    """What a plan drives: the capture controller's start, wait and stop (no import of it here)."""

    deploy: DeployConfig

    def stages_for(self, stages: list[int] | None) -> list[int]:
        """The stages a capture of ``stages`` profiles (None: the default set)."""

    async def start(self, stages: list[int] | None = None, **opts: Any) -> Capture: ...

    async def wait(self, capture_id: str, timeout: float | None = None) -> Capture: ...

    async def stop(self, capture_id: str, **opts: Any) -> Capture: ...

MB = 1_000_000
PROBE_LABEL = "plan-probe-"  # each probe capture's label: this and its steps (the CLI's progress finds them so)
FLAGS = ("torch_profiler_with_stack", "torch_profiler_record_shapes", "torch_profiler_with_memory",
         "torch_profiler_with_flops", "torch_profiler_use_gzip")  # fmt: skip


class Probe(BaseModel):
    capture_id: str
    steps_asked: int
    steps_traced: dict[int, int]  # stage -> engine steps its trace holds
    bytes: dict[int, int]  # stage -> bytes of its files
    stop_s: float  # stop asked -> the server answered
    window_s: float = 0.0  # the server accepted the start -> the stop was asked
    write_s: float | None = None  # the longest of its stages' trace writes (StageVerdict.trace_write_s)


class StagePlan(BaseModel):
    stage_id: int
    flags: dict[str, bool]  # the stage's profiler flags (the server's, fixed at its start)
    bytes_fixed: float
    bytes_per_step: float


class Plan(BaseModel):
    stages: list[int]
    budget_mb: float | None = None
    max_stop_s: float | None = None
    probes: list[Probe] = Field(default_factory=list)
    per_stage: list[StagePlan] = Field(default_factory=list)
    stop_fixed_s: float = 0.0
    stop_per_step_s: float = 0.0
    # the trace write (its last event to its file's last write), the stop of a window the server
    # ends itself; None where no probe's trace says when its last event was
    write_fixed_s: float | None = None
    write_per_step_s: float | None = None
    # where every stage's server ends its windows itself: the steps to ask for its whole window
    # (max_iterations - IDLE_ITERATIONS, as render --steps writes it); such a window holds up to
    # max_iterations steps (no idle iteration), and is predicted at that. None: the sidecar's stop ends them
    server_cap_steps: int | None = None
    steps: int | None = None  # the most steps that fit both bounds (None: no bound given)
    limited_by: Literal["budget_mb", "max_stop_s", "max_iterations"] | None = None
    predicted_mb: float | None = None  # at ``steps``
    predicted_stop_s: float | None = None
    # at the server's whole window, probed more than once: the least and most its probes held and
    # took to write (the prediction is their median); None elsewhere
    predicted_mb_range: tuple[float, float] | None = None
    predicted_stop_range_s: tuple[float, float] | None = None
    notes: list[str] = Field(default_factory=list)  # probes taken again, the whole window probed
    # probes that did not end ``completed`` (not measured): capture id -> its state
    skipped: dict[str, str] = Field(default_factory=dict)
    bound_s: float | None = None  # the most this plan was allowed to take (plan_max_s)

    def predict(self, steps: int) -> tuple[float, float]:
        """(MB on disk, stop seconds) of a ``steps`` window on these stages. At the server's cap, of
        its whole window: the median of the probes of that window where there are any, else the
        lines at the most it holds (``max_iterations`` steps, no iteration idle: on the real vLLM
        CPU server under load 8 of 8, 29-30 of 32); its stop is the trace write inside the engine
        (the server ends the window itself, and the sidecar's stop answers at once)."""
        capped = self.server_cap_steps is not None and steps >= self.server_cap_steps
        whole = self.whole_probes(steps)
        held = self.server_cap_steps + IDLE_ITERATIONS if capped and self.server_cap_steps is not None else steps
        size = sum(p.bytes_fixed + p.bytes_per_step * held for p in self.per_stage) / MB
        if whole:
            size = statistics.median(_mb(p) for p in whole)
            writes = [p.write_s for p in whole if p.write_s is not None]
            if writes:
                return size, statistics.median(writes)
        if capped and self.write_fixed_s is not None:
            return size, self.write_fixed_s + (self.write_per_step_s or 0.0) * held
        return size, self.stop_fixed_s + self.stop_per_step_s * held

    def predict_range(self, steps: int) -> tuple[tuple[float, float], tuple[float, float] | None] | None:
        """((MB low, high), (write s low, high) or None) of the server's whole window, from its probes
        (two or more); None below the cap or with fewer. At equal steps such windows differ: with
        stacks on, 0.37 to 1.84 MB in 16 windows of 8 steps on the real vLLM CPU server, the Python
        calls of its worker's busy-wait between steps (docs/captures.md)."""
        whole = self.whole_probes(steps)
        if len(whole) < 2:
            return None
        sizes = [_mb(p) for p in whole]
        writes = [p.write_s for p in whole if p.write_s is not None]
        return (min(sizes), max(sizes)), ((min(writes), max(writes)) if len(writes) >= 2 else None)

    def whole_probes(self, steps: int | None = None) -> list[Probe]:
        """The probes that asked for the server's whole window (``server_cap_steps`` or more); none
        where ``steps`` (when given) is short of that window, which the sidecar's stop ends."""
        cap = self.server_cap_steps
        if cap is None or (steps is not None and steps < cap):
            return []
        return [p for p in self.probes if p.steps_asked >= cap]


def _mb(probe: Probe) -> float:
    return sum(probe.bytes.values()) / MB


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``(intercept, slope)`` through ``(steps, value)``, both kept >= 0; a single
    step count gives a line through the origin (all of it per step: the safe side), and probes
    that all traced no step give what they measured as fixed (the per-step part is unknown)."""
    xs = {x for x, _ in points}
    if len(xs) < 2:
        x = sum(x for x, _ in points) / len(points)
        y = sum(y for _, y in points) / len(points)
        return (0.0, y / x) if x > 0 else (y, 0.0)
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def trace_bytes(verdicts: list[StageVerdict]) -> int:
    """Bytes of the trace files on disk (tables such as plain vLLM's profiler_out_<r>.txt, rewritten
    at every stop whatever the window, are not what grows with the steps)."""
    return sum(f.size for v in verdicts for s in v.sessions for f in s.files if is_trace(f.name))


def probe_of(cap: Capture) -> Probe:
    traced: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for v in cap.verdicts:
        traced[v.stage_id] = v.steps_traced if v.steps_traced is not None else (cap.steps_counted or cap.steps or 0)
        sizes[v.stage_id] = trace_bytes([v])
    writes = [v.trace_write_s for v in cap.verdicts if getattr(v, "trace_write_s", None) is not None]
    stop_s = window_s = 0.0
    if cap.stop_requested_at is not None and cap.stopped_at is not None:
        stop_s = max((cap.stopped_at - cap.stop_requested_at).total_seconds(), 0.0)
    if cap.started_at is not None and cap.stop_requested_at is not None:
        window_s = max((cap.stop_requested_at - cap.started_at).total_seconds(), 0.0)
    return Probe(capture_id=cap.id, steps_asked=cap.steps or 0, steps_traced=traced, bytes=sizes, stop_s=stop_s,
                 window_s=window_s, write_s=max(writes) if writes else None)


def _local(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The two points of the longest windows (distinct step counts): the line near a refining
    probe, where the size and stop grow faster per step than between tiny probes (stacks)."""
    by_x: dict[float, tuple[float, float]] = {}
    for x, y in sorted(points):
        by_x[x] = (x, y)
    return list(by_x.values())[-2:] if len(by_x) >= 2 else points


def make_plan(stages: list[int], probes: list[Probe], flags: dict[int, dict[str, bool]], *,
              budget_mb: float | None, max_stop_s: float | None, local: bool = False,
              server_cap_steps: int | None = None) -> Plan:
    """The plan from the probes: per stage a size line, one stop line, and the steps that fit.
    ``local``: each line through the two longest probes only (after a refining probe).
    ``server_cap_steps``: the most steps a window holds where the server ends every stage's window
    itself (the plan is never more, and there predicts the trace write as the stop)."""
    pick = _local if local else list
    per_stage = []
    for sid in stages:
        points = [(float(p.steps_traced.get(sid, 0)), float(p.bytes.get(sid, 0))) for p in probes]
        fixed, per_step = fit(pick(points))
        per_stage.append(StagePlan(stage_id=sid, flags=flags.get(sid, {}), bytes_fixed=fixed, bytes_per_step=per_step))
    # the stop line from the windows the sidecar's stop ended: one that held the server's whole
    # window had its trace written inside the engine before the stop came, which answered at once
    # (a 30-step probe of light's max_iterations 32 answered in 0.01 s, beside 0.68 s at 31 steps)
    stopped = [p for p in probes if server_cap_steps is None or _longest([p]) < server_cap_steps] or probes
    stop_fixed, stop_per_step = fit(pick([(float(_longest([p])), p.stop_s) for p in stopped]))
    # the write line from the probes of the server's whole window, where there are any: theirs is the
    # server's own write; where the sidecar's stop ended a window, the time from its last event to
    # the file holds what the engines did not record while the stop travelled (on the real vLLM-Omni
    # server probes so stopped gave 1.3 and 2.7 s, its whole window 0.13 s)
    whole = [p for p in probes if server_cap_steps is not None and p.steps_asked >= server_cap_steps]
    written = [(float(_longest([p])), p.write_s) for p in (whole or probes) if p.write_s is not None]
    write_fixed, write_per_step = fit(pick(written)) if written else (None, None)
    plan = Plan(stages=stages, budget_mb=budget_mb, max_stop_s=max_stop_s, probes=probes, per_stage=per_stage,
                stop_fixed_s=stop_fixed, stop_per_step_s=stop_per_step, write_fixed_s=write_fixed,
                write_per_step_s=write_per_step, server_cap_steps=server_cap_steps)
    bounds: list[tuple[float, Literal["budget_mb", "max_stop_s", "max_iterations"]]] = []
    if budget_mb is not None:
        per_step = sum(p.bytes_per_step for p in per_stage) / MB
        fixed_mb = sum(p.bytes_fixed for p in per_stage) / MB
        if per_step <= 0:  # no growth seen between probes: all of a probe's bytes per step (the safe side)
            per_step = max(_mb(p) / max(_longest([p]), 1) for p in probes) if probes else 0.0
            fixed_mb = 0.0
        bounds.append(((budget_mb - fixed_mb) / per_step if per_step > 0 else math.inf, "budget_mb"))
    if max_stop_s is not None:
        bounds.append(((max_stop_s - stop_fixed) / stop_per_step if stop_per_step > 0 else math.inf, "max_stop_s"))
    if bounds:
        most, why = min(bounds)
        plan.limited_by = why if math.isfinite(most) else None
        plan.steps = max(int(min(most, MAX_ENGINE_STEPS)), 0)
        if server_cap_steps is not None and plan.steps >= server_cap_steps:
            # the server's whole window, if what it may hold fits the bounds; else one step short of
            # it, which the sidecar's stop ends
            size, stop = plan.predict(server_cap_steps)
            if size <= (budget_mb or math.inf) and stop <= (max_stop_s or math.inf):
                plan.steps, plan.limited_by = server_cap_steps, "max_iterations"
            else:
                plan.steps = server_cap_steps - 1
        plan.predicted_mb, plan.predicted_stop_s = plan.predict(plan.steps)
        spread = plan.predict_range(plan.steps)
        if spread is not None:
            plan.predicted_mb_range, plan.predicted_stop_range_s = spread
    return plan


# A plan's bounds no probe could meet: the smallest trace a window writes (an empty one, a few kB)
# and the quickest stop a server answers (a loopback round trip) are above these.
MIN_BUDGET_MB = 0.01
MIN_STOP_S = 0.01


async def run_plan(controller: Prober, stages: list[int] | None, *, budget_mb: float | None,
                   max_stop_s: float | None, probe_steps: tuple[int, ...] = (1, 2), refine: bool = True,
                   max_s: float | None = None) -> Plan:
    """Probe captures of ``probe_steps`` engine steps each on ``stages`` (the server must be
    stepping: each probe is a ``steps`` window, which ends by its stall bound where it does not),
    then the plan; with ``refine``, a plan far beyond the probes is probed again at half its steps
    and planned from the longest probes. Refused before any probe where a bound is out of reach;
    ``PlanUnmeasurable`` where a stage traced no step or too few probes completed; ``PlanTimeout``
    past ``max_s`` (the probe then running is stopped)."""
    for name, bound, low in (("budget_mb", budget_mb, MIN_BUDGET_MB), ("max_stop_s", max_stop_s, MIN_STOP_S)):
        if bound is not None and not (bound > 0 and math.isfinite(bound)):
            raise PlanInvalid(f"{name} must be > 0, got {bound}", key=name)
        if bound is not None and bound < low:
            raise PlanInvalid(f"{name} {bound:g} is below what any window can meet (the smallest trace and the "
                              f"quickest stop are above {low:g}); ask for {low:g} or more", key=name,
                              details={"minimum": low})
    if not probe_steps or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PROBE_STEPS
                              for n in probe_steps):
        raise PlanInvalid(f"probe steps must be whole numbers from 1 to {MAX_PROBE_STEPS}, got {list(probe_steps)}",
                          key="probe_steps")
    chosen = controller.stages_for(stages)
    running: list[str] = []
    work = asyncio.ensure_future(_probe_and_plan(controller, chosen, running, budget_mb=budget_mb,
                                                 max_stop_s=max_stop_s, probe_steps=probe_steps, refine=refine))
    try:
        plan = await asyncio.wait_for(asyncio.shield(work), max_s) if max_s is not None else await work
    except asyncio.TimeoutError:
        work.cancel()
        for cid in running:  # the probe still recording: never left on
            await controller.stop(cid)
        raise PlanTimeout(f"the plan did not finish within its bound of {max_s:g}s (plan_max_s); a probe on a slow "
                          "or idle server takes up to its stall bound: send load while planning, or plan fewer "
                          "stages", details={"bound_s": max_s}) from None
    except BaseException:
        work.cancel()
        for cid in running:
            await controller.stop(cid)
        raise
    plan.bound_s = max_s
    return plan


async def _probe_and_plan(controller: Prober, chosen: list[int], running: list[str], *, budget_mb: float | None,
                          max_stop_s: float | None, probe_steps: tuple[int, ...], refine: bool) -> Plan:
    probes: list[Probe] = []
    skipped: dict[str, str] = {}
    notes: list[str] = []

    async def probe(n: int) -> None:
        bound = "server" if capped_by_server(controller.deploy, chosen, n) else "count"
        cap = await controller.start(chosen, steps=n, steps_bound=bound, label=f"{PROBE_LABEL}{n}", budget_check=False)
        running.append(cap.id)
        done = await controller.wait(cap.id)
        running.remove(cap.id)
        reason = done.stop_reason
        if reason in CANCELLING:
            # someone else stopped the probe (the CLI's Ctrl-C, `omni-sidecar stop`, the sidecar's
            # shutdown): the plan ends here. Before, it went on with its next probes, holding the
            # capture slot for minutes after the caller had gone, and kept what they measured.
            raise PlanUnmeasurable(
                f"probe {done.id} ({n} step(s)) was stopped ({reason.value}) before its steps ended: the "
                f"plan was cancelled after {len(probes)} probe(s), nothing planned; plan again",
                details={"capture_id": done.id, "stop_reason": reason.value, "completed": len(probes),
                         "cancelled": True})
        if done.state is not CaptureState.completed:  # what it wrote is not a measure of a window
            skipped[done.id] = done.state.value
            return
        p = probe_of(done)
        probes.append(p)
        if len(probes) == 1:
            _out_of_reach(p, budget_mb=budget_mb, max_stop_s=max_stop_s)

    for n in probe_steps:
        await probe(n)
    cap_steps = server_cap_steps(controller.deploy, chosen)
    # A line needs two step counts per stage. An engine faster than the start's round trip can trace
    # 0 steps in a 1-step probe, or the same count in both: probe again, longer, up to twice.
    n = max(probe_steps)
    for _ in range(REPROBES):
        flat = _flat(probes)
        if not flat and len(probes) >= 2:
            break
        longer = min(n * 4, MAX_PROBE_STEPS, cap_steps or MAX_PROBE_STEPS)
        if longer <= n:
            notes.append(f"{_describe(flat, probes)}: no longer probe fits the server's own bound on its windows "
                         f"(max_iterations: at most {cap_steps} steps)")
            break
        n = longer
        notes.append(f"{_describe(flat, probes)}: probed again with {n} steps")
        await probe(n)
    _measurable(chosen, probes, skipped)
    flags = {}
    for sid in chosen:
        stage = controller.deploy.stage(sid)
        cfg = stage.profiler_config if stage is not None else None
        flags[sid] = {f.removeprefix("torch_profiler_"): bool(getattr(cfg, f, False)) for f in FLAGS} if cfg else {}
    plan = make_plan(chosen, probes, flags, budget_mb=budget_mb, max_stop_s=max_stop_s, server_cap_steps=cap_steps)
    whole = cap_steps is not None and plan.limited_by == "max_iterations"
    taken = len(plan.whole_probes()) if whole else 0  # a probe again may have asked for the whole window
    if whole and refine and taken < WHOLE_PROBES:
        # the plan is the server's whole window, no longer than the window it plans: probed as it is
        # (on the real vLLM CPU server probes of 3 and 4 steps put light's 30-step write at 0.04s of
        # 0.30s: tiny probes' writes are noise), and more than once: such windows differ at equal
        # steps (stacks: 0.37 to 1.84 MB in 16 windows of 8; ops: a 30-step write of 1.03 s, then 0.60)
        for _ in range(WHOLE_PROBES - taken):
            await probe(plan.steps or cap_steps)
        # lines through every probe, not the two longest: those can be a step apart (stacks: 6 and 7
        # steps held 0.32 and 0.84 MB, and a line through them put 8 steps at 4.2 MB, where it held 0.41)
        plan = make_plan(chosen, probes, flags, budget_mb=budget_mb, max_stop_s=max_stop_s, server_cap_steps=cap_steps)
        notes.append(_whole_note(plan))
    n2 = _refining_steps(plan.steps, probes) if refine and plan.steps is not None and not whole else None
    if n2 is not None and plan.steps is not None:
        longest = _longest(probes)
        notes.append(f"planned {plan.steps} steps, {plan.steps // max(longest, 1)}x the longest probe ({longest}): "
                     f"probed again with {n2} steps; the lines go through the two longest probes")
        await probe(n2)
        plan = make_plan(chosen, probes, flags, budget_mb=budget_mb, max_stop_s=max_stop_s, local=True,
                         server_cap_steps=cap_steps)
    if cap_steps is not None:
        notes.append(_capped_note(plan, cap_steps, server_window_ends(controller.deploy, chosen)))
    if skipped:
        notes.append(f"not measured: {', '.join(f'{cid} ({state})' for cid, state in skipped.items())}: a probe "
                     "that did not end completed is no measure of a window")
    plan.notes, plan.skipped = notes, skipped
    return plan


def _out_of_reach(first: Probe, *, budget_mb: float | None, max_stop_s: float | None) -> None:
    """Refused once the shortest window already breaks a bound: no window of the plan can meet it."""
    size = _mb(first)
    if budget_mb is not None and size > budget_mb:
        raise PlanUnmeasurable(
            f"the shortest probe ({first.steps_asked} step(s)) wrote {size:.3f} MB, above the budget of {budget_mb:g} "
            "MB: no window fits it; raise budget_mb or profile with lighter flags (torch_profiler_with_stack / "
            "record_shapes off)", key="budget_mb", details={"probe_mb": round(size, 6), "budget_mb": budget_mb})
    if max_stop_s is not None and first.stop_s > max_stop_s and first.write_s is None:
        raise PlanUnmeasurable(
            f"the shortest probe's stop took {first.stop_s:.2f}s, above max_stop_s {max_stop_s:g}: no window fits it; "
            "raise max_stop_s", key="max_stop_s", details={"probe_stop_s": round(first.stop_s, 4),
                                                           "max_stop_s": max_stop_s})


def _measurable(stages: list[int], probes: list[Probe], skipped: dict[str, str]) -> None:
    """Refused where the probes measure no window: too few completed, or a stage that traced no step."""
    if len(probes) < 2:
        why = "; ".join(f"{cid} ended {state}" for cid, state in skipped.items()) or "none ran"
        raise PlanUnmeasurable(
            f"{len(probes)} probe(s) completed, a plan needs 2 ({why}); check the captures' reasons, send load while "
            "planning, and plan again", details={"completed": len(probes), "skipped": skipped})
    stepless = [sid for sid in stages if not any(p.steps_traced.get(sid, 0) for p in probes)]
    if stepless:
        asked = ", ".join(str(p.steps_asked) for p in probes)
        raise PlanUnmeasurable(
            f"stage{'s' if len(stepless) > 1 else ''} {', '.join(map(str, stepless))} traced no engine step in "
            f"{len(probes)} probes ({asked} steps asked): no request reached {'them' if len(stepless) > 1 else 'it'} "
            "while they ran, so their size per step is unknown; send load that reaches every planned stage while "
            f"planning, or plan without {'them' if len(stepless) > 1 else 'it'}",
            key="stages", details={"stages": stepless, "probes": len(probes)})


def server_cap_steps(deploy: DeployConfig, stages: list[int]) -> int | None:
    """The most steps a window of ``stages`` holds where the server ends every stage's window itself
    (``max_iterations`` on each, idle iterations counted: the first to end at ``max_iterations -
    IDLE_ITERATIONS``, at least 1; a fed stage given its idle iterations ends later, within that
    window: ``capped_by_server``); None where one stage's window is ended by the sidecar's stop."""
    ends = server_window_ends(deploy, stages)
    if not stages or set(ends) != set(stages):
        return None
    steps = max(min(ends.values()) - IDLE_ITERATIONS, 1)
    return steps if capped_by_server(deploy, stages, steps) else None


def _capped_note(plan: Plan, cap_steps: int, ends: dict[int, int]) -> str:
    iterations = cap_steps + IDLE_ITERATIONS
    probed = len(plan.whole_probes())
    fed = ("" if len(set(ends.values())) == 1 else
           "; a stage that ends later was given the iterations it idles: render --steps N --idle")
    head = (f"the server ends each window of stages {plan.stages} itself after {window_ends_text(ends)} engine iterations "
            f"(max_iterations, fixed at its start; idle ones count{fed}): --steps {cap_steps} or more asks for that "
            f"whole window (render --steps {cap_steps} caps at {iterations}), which holds up to {max(ends.values())} "
            "steps and is " + (f"predicted from its {probed} probes of it" if probed else f"predicted at {iterations}"))
    if plan.write_fixed_s is None:
        return head + ("; no probe's trace says when its last event was (no baseTimeNanoseconds), so the stop "
                       "predicted is the sidecar's, not the server's own")
    at = plan.predict(cap_steps)[1]
    how = ("the median of its probes' writes" if probed else
           f"the probes' writes: {plan.write_fixed_s:.2f}s + {plan.write_per_step_s or 0.0:.3f}s per step")
    return (head + f"; the server writes its trace inside the engine when it ends the window: about {at:.1f}s ({how}), "
            "and the sidecar's stop then answers at once; for longer windows, restart the server with a larger "
            "max_iterations (omni-sidecar render --steps N)")


def _whole_note(plan: Plan) -> str:
    whole, cap = plan.whole_probes(), plan.server_cap_steps or 0
    head = f"planned the server's whole window ({cap} steps asked): probed it {len(whole)} times"
    spread = plan.predict_range(cap)
    if spread is None:
        return head
    (lo, hi), writes = spread
    wrote = "" if writes is None else f" and wrote in {writes[0]:.2f}-{writes[1]:.2f}s"
    note = head + f"; at equal steps they held {lo:.2f}-{hi:.2f} MB{wrote}: predicted at their median, the range beside it"
    if hi <= lo * SPREAD:
        return note
    stacks = any(p.flags.get("with_stack") for p in plan.per_stage)
    return note + f"; their sizes differ by {hi / lo:.1f}x: " + (
        "with stacks on, most of a window can be the Python calls an engine's worker makes while it waits for its "
        "next step (a multiprocess executor's busy-wait: vLLM on CPU, or a stage of more than one GPU), which follow "
        "how the host schedules it, not the steps (docs/captures.md)" if stacks else
        "windows of equal steps differ on this server, and one window may hold more than the most its probes held")


def _longest(probes: list[Probe]) -> int:
    return max((max(p.steps_traced.values(), default=0) for p in probes), default=0)


def _refining_steps(planned: int, probes: list[Probe]) -> int | None:
    """The steps of a refining probe, or None when the plan is within reach of its probes.

    A window many times longer than the probes is an extrapolation: with stacks on, a step's bytes
    and stop time grow with the window (measured: 0.055 MB/step between probes of 2 and 31 steps,
    0.10 between 31 and 98). So half the planned window is probed, at most REFINE_S of the
    server's steps at the fastest rate a probe saw (a plan is a short wait), and worth it only at
    twice the longest probe."""
    longest = max(_longest(probes), 1)
    if planned < REFINE_BEYOND * longest:
        return None
    rates = [max(p.steps_traced.values(), default=0) / p.window_s for p in probes if p.window_s > 0]
    n = min(planned // 2, MAX_REFINE_STEPS, int(max(rates) * REFINE_S) if rates else MAX_REFINE_STEPS)
    return n if n >= 2 * longest else None


# a probe stopped so was stopped by someone else: the plan ends (its own stops are the steps')
CANCELLING = (StopReason.explicit, StopReason.shutdown)
SPREAD = 1.25  # whole-window probes whose sizes differ by more: the note says why they may
WHOLE_PROBES = 3  # probes of the server's whole window, where the plan is that window
REPROBES = 2  # longer probes after the asked ones, when a stage's probes give no line
MAX_PROBE_STEPS = 64
REFINE_BEYOND = 8  # a plan this many times the longest probe gets a refining probe
MAX_REFINE_STEPS = 4096
REFINE_S = 5.0  # the refining probe's length at most, in seconds of the server's steps


def _counts(probes: list[Probe], sid: int) -> str:
    return ", ".join(str(p.steps_traced.get(sid, 0)) for p in probes)


def _flat(probes: list[Probe]) -> list[int]:
    """The stages whose probes traced fewer than two distinct step counts (no size line per step)."""
    stages = sorted({sid for p in probes for sid in p.steps_traced})
    return [sid for sid in stages if len({p.steps_traced.get(sid, 0) for p in probes}) < 2]


def _describe(flat: list[int], probes: list[Probe]) -> str:
    asked = ", ".join(str(p.steps_asked) for p in probes)
    return "; ".join(f"stage {sid}'s probes of {asked} steps traced {_counts(probes, sid)}" for sid in flat)


def check_budget(plan: Plan | None, stages: list[int], steps: int, budget_mb: float,
                 action: Literal["refuse", "warn"]) -> str | None:
    """A ``steps`` capture against the budget: raises ``BudgetExceeded`` (``refuse``) or returns
    the warning (``warn``) when the plan predicts more; None when it fits or nothing predicts it."""
    if plan is None or sorted(plan.stages) != sorted(stages):
        return None
    size_mb, stop_s = plan.predict(steps)
    if size_mb <= budget_mb:
        return None
    fits = plan.per_stage and sum(p.bytes_per_step for p in plan.per_stage) > 0
    most = int((budget_mb * MB - sum(p.bytes_fixed for p in plan.per_stage))
               / sum(p.bytes_per_step for p in plan.per_stage)) if fits else 0
    message = (f"{steps} steps on stages {stages} are predicted at {size_mb:.1f} MB (stop {stop_s:.1f}s), above "
               f"the budget of {budget_mb:g} MB; ask for at most {max(most, 0)} steps, or lighter profiler flags "
               "on the server (torch_profiler_with_stack / record_shapes off), or raise OMNI_SIDECAR_BUDGET_MB")
    if action == "refuse":
        raise BudgetExceeded(message, key="steps", details={"predicted_mb": round(size_mb, 3), "budget_mb": budget_mb,
                                                             "max_steps": max(most, 0)})
    return message


__all__ = ["Plan", "Probe", "StagePlan", "check_budget", "fit", "make_plan", "probe_of", "run_plan", "trace_bytes"]
