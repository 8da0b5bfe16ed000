"""How the CLI shows captures at any terminal width: a capture id, a URL or a session-folder path
is never cut. The default layout puts each long value on its own line, and wraps prose between
words; ``--wide`` prints one table row per session folder at its natural width instead. Every
stage's reason is shown, an ``ok`` one's too (a GPU stage with memory on that wrote no snapshot is
``ok`` with a reason). Tables and lines are laid out by ``sidecar.cli._layout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from sidecar.cli._layout import Column, print_table, print_text
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


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def styled(value: str, styles: dict[str, str]) -> str:
    """``value`` as markup in its colour (for a line of ``print_text``)."""
    style = styles.get(value, "")
    return f"[{style}]{escape(value)}[/]" if style else escape(value)


def styled_cell(value: str, styles: dict[str, str]) -> Text:
    """``value`` as a table cell in its colour."""
    return Text(value, style=styles.get(value, ""))


def _traces(session: SessionFolder) -> list[str]:
    files = [f for f in session.files if is_trace(Path(f.name).name)]  # plain vLLM's *.pt.trace.json.gz too
    return [f"{f.name} ({size_text(f.size)})" for f in files]


def print_verdicts(console: Console, verdicts: Sequence[StageVerdict], *, indent: str = "") -> None:
    """Per stage: ``stage N  verdict``, then its reason where it has one (``ok`` verdicts can: what
    the traces prove but something beside them lacks), then each session folder and each of its
    trace files on a line of its own (a path longer than the terminal whole)."""
    for v in verdicts:
        verdict = v.verdict.value if v.verdict else "-"
        print_text(console, f"{indent}stage {v.stage_id}  {styled(verdict, VERDICT_STYLES)}")
        if v.reason:
            print_text(console, f"reason: {v.reason}", indent=f"{indent}  ", hang=f"{indent}    ", markup=False)
        for session in v.sessions:
            print_text(console, session.local_path or session.path, indent=f"{indent}  ", markup=False)
            for trace in _traces(session):
                print_text(console, trace, indent=f"{indent}    ", hang=f"{indent}      ", markup=False)


def print_verdict_table(console: Console, title: str, verdicts: Sequence[StageVerdict],
                        empty: str = "no verdicts yet") -> None:
    """``--wide``: stage, verdict, session folder, trace files, reason; one row per session folder,
    at the table's natural width whatever the terminal's."""
    columns = [Column("stage"), Column("verdict"), Column("session folder"), Column("trace"),
               Column("reason", prose=True)]
    rows: list[list[str | Text]] = []
    for v in verdicts:
        cell = styled_cell(v.verdict.value if v.verdict else "-", VERDICT_STYLES)
        reason = v.reason or ""
        if not v.sessions:
            rows.append([str(v.stage_id), cell, "-", "-", reason])
        for session in v.sessions:
            rows.append([str(v.stage_id), cell, session.local_path or session.path,
                         ", ".join(_traces(session)) or "-", reason])
    if not verdicts:
        rows.append(["-", "-", "-", "-", empty])
    print_table(console, Text.from_markup(title), columns, rows, wide=True)


def print_steps(console: Console, cap: Capture) -> None:
    """A ``steps`` window: the steps asked, those the server counted, those each trace holds."""
    if cap.steps is None:
        return
    traced = ", ".join(f"stage {v.stage_id}: {v.steps_traced}" for v in cap.verdicts if v.steps_traced is not None)
    counted = "?" if cap.steps_counted is None else str(cap.steps_counted)
    print_text(console, f"steps: {cap.steps} asked, {counted} counted by the server"
               + (f"; in the traces: {traced}" if traced else ""), markup=False)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1000:.1f}"


WINDOW_COLUMNS = [
    Column("engine"),
    *(Column(c, "right", group="counts") for c in ("steps", "requests", "prompt tok", "gen tok")),
    *(Column(f"{c} p50/p95 ms", "right", group="latency") for c in ("ttft", "itl", "e2e", "queue")),
]


def print_window_metrics(console: Console, wm: WindowMetrics | None) -> None:
    """The server's /metrics over the window: one row per engine, latencies as p50/p95 ms."""
    if wm is None:
        return
    if wm.unavailable:
        print_text(console, f"server metrics: none ({wm.unavailable})", markup=False)
        return
    rows = []
    for e in wm.engines:
        name = f"stage {e.stage}" + (f" rep {e.replica}" if e.replica not in (None, "0") else "") \
            if e.stage is not None else f"engine {e.engine}"
        lat = [f"{_ms(h.p50_s)}/{_ms(h.p95_s)}" if (h := e.latency.get(k)) and h.count else ""
               for k in ("ttft", "itl", "e2e", "queue")]
        rows.append([name, *["" if v is None else str(v) for v in (e.engine_steps, e.requests_finished,
                                                                     e.prompt_tokens, e.generation_tokens)], *lat])
    print_table(console, f"server metrics over the window ({wm.seconds or 0:.1f}s)", WINDOW_COLUMNS, rows,
                empty="no engine reported")


def print_plan(console: Console, plan: Plan) -> None:
    """A plan: per stage its size line and flags, the stop line, the steps that fit."""
    rows = []
    for p in plan.per_stage:
        on = ", ".join(k for k, v in p.flags.items() if v) or "none"
        rows.append([str(p.stage_id), f"{p.bytes_fixed / 1e6:.3f}", f"{p.bytes_per_step / 1e6:.3f}", on])
    print_table(console, f"plan for stages {plan.stages} ({len(plan.probes)} probes)",
                [Column("stage"), Column("fixed MB", "right"), Column("MB per step", "right"),
                 Column("flags on", prose=True)], rows)
    print_text(console, f"stop: {plan.stop_fixed_s:.2f}s + {plan.stop_per_step_s:.3f}s per step")
    for note in plan.notes:
        print_text(console, f"note: {note}", hang="  ", markup=False)
    if plan.steps is None:
        print_text(console, "no --budget-mb or --max-stop-s: nothing to fit", markup=False)
        return
    mb, stop = plan.predicted_mb_range, plan.predicted_stop_range_s  # the server's whole window, probed more than once
    print_text(console, f"fits: --steps {plan.steps} (limited by {plan.limited_by or 'nothing'}): predicted "
               f"{plan.predicted_mb:.2f} MB{f' ({mb[0]:.2f}-{mb[1]:.2f} in its probes)' if mb else ''}, stop "
               f"{plan.predicted_stop_s:.2f}s{f' ({stop[0]:.2f}-{stop[1]:.2f}s in its probes)' if stop else ''}",
               hang="  ", markup=False)
