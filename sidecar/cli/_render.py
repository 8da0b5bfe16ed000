"""How the CLI shows verdicts at any terminal width: a capture id, a URL or a session-folder path
is never cut. The default layout puts each long value on its own line (printed unwrapped: the
terminal may fold it visually, a copy still gets it whole); ``--wide`` prints one table row per
session folder at its natural width instead. The reason of every non-``ok`` stage is shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sidecar.control.artifacts import is_trace
from sidecar.control.models import SessionFolder, StageVerdict, Verdict

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
