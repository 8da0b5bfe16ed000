"""How the CLI shows verdicts at any terminal width: a capture id, a URL or a session-folder path
is never cut. The default layout puts each long value on its own line (printed unwrapped: the
terminal may fold it visually, a copy still gets it whole); ``--wide`` prints one table row per
session folder at its natural width instead. The reason of every non-``ok`` stage is shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sidecar.control.artifacts import is_trace
from sidecar.control.budget import Plan
from sidecar.control.models import Capture, SessionFolder, StageVerdict, Verdict
from sidecar.upstream.metrics import WindowMetrics

# every Verdict has a colour: red where traces are lost, yellow where they exist but prove less
VERDICT_STYLES: dict[str, str] = {
    Verdict.ok.value: "green",
    Verdict.empty.value: "yellow",
    Verdict.missing.value: "red",
    Verdict.partial.value: "red",
    Verdict.ambiguous.value: "yellow",
    Verdict.unverified.value: "yellow",
}
STATE_STYLES = {"completed": "green", "degraded": "yellow", "failed": "red"}
WIDE = 10_000  # a --wide table is as wide as its longest value


def print_wide(title: str, table: Table) -> None:
    """Print ``title`` and ``table`` at its natural width, whatever the terminal's (``--wide``)."""
    wide = Console(width=WIDE)
    wide.print(title, highlight=False)
    wide.print(table)


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def styled(value: str, styles: dict[str, str]) -> str:
    style = styles.get(value, "")
    return f"[{style}]{escape(value)}[/]" if style else escape(value)


def _traces(session: SessionFolder) -> str:
    files = [f for f in session.files if is_trace(Path(f.name).name)]  # plain vLLM's *.pt.trace.json.gz too
    return ", ".join(f"{f.name} ({size_text(f.size)})" for f in files)


def print_verdicts(console: Console, verdicts: Sequence[StageVerdict], *, indent: str = "") -> None:
    """Per stage: ``stage N  verdict``, then the reason (when not ``ok``), then each session folder
    and its trace files, each on its own unwrapped line."""
    for v in verdicts:
        verdict = v.verdict.value if v.verdict else "-"
        console.print(f"{indent}stage {v.stage_id}  {styled(verdict, VERDICT_STYLES)}", highlight=False)
        if v.reason and v.verdict is not Verdict.ok:
            console.print(f"{indent}  reason: {escape(v.reason)}", highlight=False, soft_wrap=True)
        for session in v.sessions:
            console.print(f"{indent}  {escape(session.local_path or session.path)}", highlight=False, soft_wrap=True)
            traces = _traces(session)
            if traces:
                console.print(f"{indent}    {escape(traces)}", highlight=False, soft_wrap=True)


def verdict_table(verdicts: Sequence[StageVerdict], empty: str = "no verdicts yet") -> Table:
    """``--wide``: stage, verdict, session folder, trace files, reason; one row per session folder,
    no cell wrapped (print it with ``print_wide``)."""
    table = Table()
    for col in ("stage", "verdict", "session folder", "trace", "reason"):
        table.add_column(col, no_wrap=True)
    for v in verdicts:
        cell = styled(v.verdict.value if v.verdict else "-", VERDICT_STYLES)
        reason = escape(v.reason or "")
        if not v.sessions:
            table.add_row(str(v.stage_id), cell, "-", "-", reason)
        for session in v.sessions:
            table.add_row(str(v.stage_id), cell, escape(session.local_path or session.path),
                          escape(_traces(session) or "-"), reason)
    if not verdicts:
        table.add_row("-", "-", "-", "-", escape(empty))
    return table


def print_steps(console: Console, cap: Capture) -> None:
    """A ``steps`` window: the steps asked, those the server counted, those each trace holds."""
    if cap.steps is None:
        return
    traced = ", ".join(f"stage {v.stage_id}: {v.steps_traced}" for v in cap.verdicts if v.steps_traced is not None)
    counted = "?" if cap.steps_counted is None else str(cap.steps_counted)
    console.print(f"steps: {cap.steps} asked, {counted} counted by the server"
                  + (f"; in the traces: {traced}" if traced else ""), highlight=False, soft_wrap=True)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1000:.1f}"


def print_window_metrics(console: Console, wm: WindowMetrics | None) -> None:
    """The server's /metrics over the window: one row per engine, latencies as p50/p95 ms."""
    if wm is None:
        return
    if wm.unavailable:
        console.print(f"server metrics: none ({escape(wm.unavailable)})", highlight=False, soft_wrap=True)
        return
    table = Table(title=f"server metrics over the window ({wm.seconds or 0:.1f}s)", title_justify="left",
                  box=box.SIMPLE)
    for col in ("engine", "steps", "requests", "prompt tok", "gen tok", "ttft p50/p95 ms", "itl p50/p95 ms",
                "e2e p50/p95 ms", "queue p50/p95 ms"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for e in wm.engines:
        name = f"stage {e.stage}" + (f" rep {e.replica}" if e.replica not in (None, "0") else "") \
            if e.stage is not None else f"engine {e.engine}"
        lat = [f"{_ms(h.p50_s)}/{_ms(h.p95_s)}" if (h := e.latency.get(k)) and h.count else ""
               for k in ("ttft", "itl", "e2e", "queue")]
        table.add_row(name, *["" if v is None else str(v) for v in (e.engine_steps, e.requests_finished,
                                                                     e.prompt_tokens, e.generation_tokens)], *lat)
    console.print(table)


def print_plan(console: Console, plan: Plan) -> None:
    """A plan: per stage its size line and flags, the stop line, the steps that fit."""
    table = Table(title=f"plan for stages {plan.stages} ({len(plan.probes)} probes)", title_justify="left",
                  box=box.SIMPLE)
    for col in ("stage", "fixed MB", "MB per step", "flags on"):
        table.add_column(col, justify="left" if col in ("stage", "flags on") else "right")
    for p in plan.per_stage:
        on = ", ".join(k for k, v in p.flags.items() if v) or "none"
        table.add_row(str(p.stage_id), f"{p.bytes_fixed / 1e6:.3f}", f"{p.bytes_per_step / 1e6:.3f}", on)
    console.print(table)
    console.print(f"stop: {plan.stop_fixed_s:.2f}s + {plan.stop_per_step_s:.3f}s per step", highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if plan.steps is None:
        console.print("no --budget-mb or --max-stop-s: nothing to fit", highlight=False)
        return
    mb, stop = plan.predicted_mb_range, plan.predicted_stop_range_s  # the server's whole window, probed more than once
    console.print(f"fits: --steps {plan.steps} (limited by {plan.limited_by or 'nothing'}): predicted "
                  f"{plan.predicted_mb:.2f} MB{f' ({mb[0]:.2f}-{mb[1]:.2f} in its probes)' if mb else ''}, stop "
                  f"{plan.predicted_stop_s:.2f}s{f' ({stop[0]:.2f}-{stop[1]:.2f}s in its probes)' if stop else ''}",
                  highlight=False, soft_wrap=True)
