"""CLI: ``omni-sidecar summarize PATH...``: where a capture's time went, from its trace files.

Thin: find and summarise with ``sidecar.analysis``, print rich tables (or ``--json``). Exit 1
with the message when a file is unreadable or truncated (what could be read is still shown).
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import typer
from rich.markup import escape

from sidecar.analysis import CaptureSummary, SummaryBody, summarize_paths
from sidecar.analysis.models import DeviceStat, Finding
from sidecar.cli._app import (
    EXIT_ERROR,
    EXIT_UNREADABLE,
    app,
    cli_errors,
    console,
    err_console,
    reading_traces,
)
from sidecar.cli._layout import Column, print_table, print_text
from sidecar.errors import ConfigUnreadable, SidecarError
from sidecar.cli._memory import print_memory  # noqa: I001  (re-exported: stop and capture print it too)


class By(str, Enum):
    op = "op"
    kernel = "kernel"


def _print_error(err: SidecarError) -> None:
    """As ``cli_errors`` prints it, but one unwrapped line (as ``config_cmds`` does): the file path
    and message in it stay whole (greppable) whatever the terminal width."""
    err_console.print(f"[bold red]error[/]{escape(f'[{err.code}]')}: {escape(str(err))}", highlight=False, soft_wrap=True)
    for finding in err.findings:
        err_console.print(f"  {escape(str(finding))}", highlight=False, soft_wrap=True)


def _ms(us: float) -> str:
    return f"{us / 1000:,.3f}"


def _right(*headers: str) -> list[Column]:
    return [Column(h, "right") for h in headers]


def _tables(title: str, body: SummaryBody, by: By) -> None:
    w, t = body.window, body.totals
    steps = f", {w.steps} steps (mean {_ms(w.step_mean_us)} ms)" if w.steps and w.step_mean_us else ""
    if w.engine_steps and w.engine_step_mean_us:
        steps += f", {w.engine_steps} engine steps (mean {_ms(w.engine_step_mean_us)} ms)"
    print_text(
        console,
        f"[bold]{escape(title)}[/]: window {_ms(w.span_us)} ms{steps}; {t.events:,} events, "
        f"{t.cpu_ops:,} CPU ops, {t.kernels:,} kernels ({_ms(t.kernel_us)} ms)"
        + (" [red](truncated)[/]" if body.truncated else ""),
        hang="  ",
    )
    if by is By.op:
        print_table(console, "CPU ops by self CPU time",
                    [Column("CPU op"), *_right("count", "total ms", "self CPU ms", "self device ms")],
                    [[o.name, f"{o.count:,}", _ms(o.total_us), _ms(o.self_us), _ms(o.self_device_us)]
                     for o in body.cpu_ops])
        if body.cpu_ops_by_device:
            print_table(console, "CPU ops by GPU time they launched",
                        [Column("CPU op"), *_right("count", "self device ms", "self CPU ms")],
                        [[o.name, f"{o.count:,}", _ms(o.self_device_us), _ms(o.self_us)]
                         for o in body.cpu_ops_by_device])
    else:
        rows = [("kernel", k) for k in body.kernels] + [("memcpy", k) for k in body.memcpy] + [("memset", k) for k in body.memset]
        print_table(console, "GPU kernels, memcpy, memset by total time",
                    [Column("kind"), Column("name"), *_right("count", "total ms")],
                    [[kind, k.name, f"{k.count:,}", _ms(k.total_us)] for kind, k in sorted(rows, key=lambda r: -r[1].total_us)],
                    keys=2)
    if body.devices:
        def who(x: object) -> list[str]:
            return [str(v) if v is not None else "-" for v in (getattr(x, "stage_id"), getattr(x, "replica"), getattr(x, "rank"))]

        rows = [[*who(d), str(d.device), "all", "", _ms(d.busy_us), f"{d.busy_share:.1%}", f"{d.idle_share:.1%}"]
                for d in body.devices]
        rows += [[*who(st), str(st.device), str(st.stream), f"{st.count:,}", _ms(st.busy_us), "", f"{st.idle_share:.1%}"]
                 for st in body.streams]
        print_table(console, "GPU busy / idle",
                    [Column("stage"), Column("replica"), Column("rank"), Column("device"), Column("stream"),
                     *_right("activities", "busy ms", "busy share", "idle share")], rows, keys=5)
        g = body.gpu_split
        print_text(console, f"GPU time: kernels {_ms(g.kernel_us)} ms ({g.kernel_share:.1%}), memcpy {_ms(g.memcpy_us)} ms "
                   f"({g.memcpy_share:.1%}), memset {_ms(g.memset_us)} ms ({g.memset_share:.1%})", hang="  ", markup=False)
        _attribution(body.devices)
    if body.engine_step_kinds:
        print_table(console, "Engine steps by kind",
                    [Column("engine step kind"), *_right("count", "total ms", "mean ms", "share")],
                    [[k.kind, f"{k.count:,}", _ms(k.total_us), _ms(k.mean_us), f"{k.share:.1%}"]
                     for k in body.engine_step_kinds])
    print_memory(body.memory, getattr(body, "snapshots", []), body.memory_ops)


_SEVERITY = {"high": "bold red", "medium": "yellow", "low": "dim", "info": "cyan"}


def print_findings(findings: list[Finding]) -> None:
    """The capture's findings, ranked (sidecar/analysis/findings.py words them)."""
    if not findings:
        return
    print_text(console, "[bold]Findings[/] (most of the window first)")
    for f in findings:
        style = _SEVERITY.get(f.severity, "")
        print_text(console, f"[{style}]{f.severity:6}[/] {escape(f.message)}", indent="  ", hang="         ")


def _attribution(devices: list[DeviceStat]) -> None:
    rows = [d for d in devices if d.temporal is not None]
    if not rows:
        return
    cells = []
    for d in rows:
        t, i, lc = d.temporal, d.idle_breakdown, d.launch
        who = "·".join(str(v) if v is not None else "-" for v in (d.stage_id, d.replica, d.rank, d.device))
        delay = f"{lc.delay_p50_us:.1f} / {lc.delay_p95_us:.1f}" if lc and lc.delay_p50_us is not None and lc.delay_p95_us is not None else "-"
        split = " · ".join(f"{x * 100:.0f}" for x in (t.compute_share, t.communication_share, t.memory_share, t.idle_share))
        waits = " · ".join(f"{x * 100:.0f}" for x in (i.host_wait_share, i.kernel_wait_share, i.other_share)) if i else "-"
        cells.append([who, _ms(t.window_us), split, waits, delay, "yes" if lc and lc.cpu_bound else "no"])
    print_table(console, "Why, per stage·replica·rank·GPU (steady window, HTA definitions)",
                [Column("where"), *_right("window ms", "compute·comm·mem·idle %", "idle: host·kernel·other %",
                                          "launch µs p50/p95", "cpu-bound")], cells)


def merged_notes(summary: CaptureSummary) -> list[str]:
    """What a summary merged when one stage's traces come from session folders opened at
    different times (several captures under a stage dir): said, so a window over many captures is
    not read as one."""
    notes = []
    for st in summary.stages:
        folders = sorted({Path(f).parent.name for f in st.files})
        starts = sorted({name[:15] for name in folders if name[:8].isdigit()})  # YYYYmmdd-HHMMSS
        if len(starts) > 1:
            label = f"stage {st.stage_id}" if st.stage_id is not None else "stage ?"
            notes.append(f"{label} merges {len(st.files)} trace(s) from {len(folders)} session folders opened "
                         f"from {starts[0]} to {starts[-1]} (several captures?); pass one session folder to "
                         "summarise one capture")
    return notes


@app.command("summarize")
def summarize(
    paths: list[str] = typer.Argument(..., help="trace files (.json/.json.gz) or session/capture folders"),
    top: int = typer.Option(20, "--top", min=1, help="rows per table"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    by: By = typer.Option(By.op, "--by", help="op: CPU ops (self CPU / self device); kernel: GPU kernels"),
    workers: int | None = typer.Option(None, "--workers", min=1, help="processes summarising files in parallel (default: one per file, up to the cores)"),
) -> None:
    """Summarise torch.profiler traces: window and steps, top CPU ops, top kernels, GPU idle, per stage."""
    with cli_errors():
        try:
            with reading_traces("summarising") as on_file:
                summary: CaptureSummary = summarize_paths(paths, top=top, workers=workers, on_file=on_file)
        except SidecarError as err:
            _print_error(err)
            raise typer.Exit(EXIT_UNREADABLE if isinstance(err, ConfigUnreadable) else EXIT_ERROR) from None
    if as_json:
        console.print_json(json.dumps(summary.model_dump(mode="json")))
    else:
        if len(summary.stages) > 1 or len(summary.files) > 1:
            for st in summary.stages:
                label = f"stage {st.stage_id}" if st.stage_id is not None else "stage ?"
                _tables(f"{label} ({len(st.files)} file(s))", st, by)
        elif summary.files:
            _tables(summary.files[0].file, summary, by)
        if summary.stragglers:
            print_table(console, "Stragglers",
                        [Column("stage"), Column("measured by"), *_right("members"), Column("slowest (replica/rank)"),
                         *_right("slowest ms", "median ms", "slowest / median")],
                        [[str(g.stage_id if g.stage_id is not None else "?"), g.metric, str(g.members),
                          f"{g.slowest_replica if g.slowest_replica is not None else '-'}/"
                          f"{g.slowest_rank if g.slowest_rank is not None else '-'}",
                          _ms(g.slowest_us), _ms(g.median_us), f"{g.ratio:.2f}x"] for g in summary.stragglers])
        print_findings(summary.findings)
    for note in merged_notes(summary):
        err_console.print(f"[bold]note[/]: {escape(note)}", highlight=False, soft_wrap=True)
    for msg in summary.warnings:
        err_console.print(f"[bold yellow]warning[/]: {escape(msg)}", highlight=False, soft_wrap=True)
    for msg in summary.errors:
        err_console.print(f"[bold red]error[/]{escape('[trace_invalid]')}: {escape(msg)}", highlight=False, soft_wrap=True)
    if summary.errors:
        raise typer.Exit(EXIT_ERROR)
