"""CLI: ``omni-sidecar diff A B [--json]``: which ops and kernels changed between two captures, and
what holds memory on each side (with memory on).

A and B are trace files or folders, or with ``--sidecar URL`` capture ids on a running sidecar
(its ``GET /v1/captures/{a}/diff/{b}``). Thin over ``sidecar.analysis.diff``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.markup import escape

from sidecar.analysis.diff import CaptureDiff, StageDiff, diff_paths
from sidecar.cli._app import EXIT_ERROR, app, cli_errors, console, err_console, reading_traces, waiting_line
from sidecar.cli._layout import Column, print_table, print_text
from sidecar.cli._memory import print_memory_diff
from sidecar.control.summaries import SUMMARY_TOP_MAX


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:,.3f}"


def _d(us: float) -> str:
    return f"{us / 1000:+,.3f}"


def _print_stage(title: str, s: StageDiff) -> None:
    t = s.totals
    print_text(
        console,
        f"[bold]{escape(title)}[/]: window {_ms(t.span_us_a)} → {_ms(t.span_us_b)} ms; self CPU of ops "
        f"{_ms(t.cpu_op_self_us_a)} → {_ms(t.cpu_op_self_us_b)} ms, of annotations {_ms(t.annotation_self_us_a)} → "
        f"{_ms(t.annotation_self_us_b)} ms; GPU {_ms(t.gpu_us_a)} → {_ms(t.gpu_us_b)} ms; "
        f"kernels {t.kernels_a:,} → {t.kernels_b:,}; step {_ms(t.step_mean_us_a)} → {_ms(t.step_mean_us_b)} ms",
        hang="  ",
    )
    # A, B and their difference stay in one table when a narrow terminal splits it
    figures = [Column("count A→B", "right"), *(Column(h, "right", group="ms") for h in ("ms A", "B", "Δ"))]
    print_table(console, "ops and annotations by change in self CPU time",
                [Column("op"), *figures[:1], Column("self CPU ms A", "right", group="ms"), *figures[2:]],
                [[o.name, f"{o.count_a:,}→{o.count_b:,}", _ms(o.self_us_a), _ms(o.self_us_b), _d(o.delta_self_us)]
                 for o in s.ops_by_self_cpu])
    if s.ops_by_self_device:
        print_table(console, "ops by change in self device time",
                    [Column("op"), *figures[:1], Column("self device ms A", "right", group="ms"), *figures[2:]],
                    [[o.name, f"{o.count_a:,}→{o.count_b:,}", _ms(o.self_device_us_a), _ms(o.self_device_us_b),
                      _d(o.delta_self_device_us)] for o in s.ops_by_self_device])
    if s.kernels:
        print_table(console, "kernels / memcpy / memset by change in time", [Column("kind"), Column("name"), *figures],
                    [[k.kind, k.name, f"{k.count_a:,}→{k.count_b:,}", _ms(k.total_us_a), _ms(k.total_us_b),
                      _d(k.delta_us)] for k in s.kernels], keys=2)
    print_memory_diff(s.memory, s.memory_ops)


def _one_sided(s: StageDiff) -> bool:
    """A stage found in A only or B only (compared with an empty side)."""
    t = s.totals
    return not (t.span_us_a or t.cpu_ops_a or t.kernels_a) or not (t.span_us_b or t.cpu_ops_b or t.kernels_b)


def _remote(url: str, a: str, b: str, top: int) -> CaptureDiff:
    from sidecar.client import SidecarClient

    if top > SUMMARY_TOP_MAX:  # what the sidecar's route allows: said before anything is sent
        raise typer.BadParameter(f"at most {SUMMARY_TOP_MAX} rows per table with --sidecar (the most the "
                                 "sidecar keeps); for more, give the two capture folders instead of ids",
                                 param_hint="'--top'")
    with SidecarClient(url, token=os.environ.get("OMNI_SIDECAR_TOKEN")) as client:
        # ids may be given by a unique start of them
        ids = client.resolve_id(a), client.resolve_id(b)
        with waiting_line(f"comparing {ids[0]} and {ids[1]} on the sidecar (it analyses each capture's traces once)"):
            return client.diff(*ids, top)


def _path_like(text: str) -> bool:
    """``text`` names a file, not a capture id: it has a folder separator or a trace's suffix."""
    return "/" in text or os.sep in text or text.endswith((".json", ".json.gz", ".gz"))


@app.command("diff")
def diff(
    a: str = typer.Argument(..., help="capture A: a trace file or folder (or a capture id, or its unique start, with --sidecar)"),
    b: str = typer.Argument(..., help="capture B, the same way"),
    top: int = typer.Option(20, "--top", min=1, help="rows per table"),
    as_json: bool = typer.Option(False, "--json", help="print the diff as JSON"),
    sidecar: str | None = typer.Option(None, "--sidecar", envvar="OMNI_SIDECAR_URL", help="A and B are capture ids on this sidecar (unless both are paths here)"),
) -> None:
    """Per stage: ops and kernels ranked by the change in self CPU and self device time, and memory, B − A."""
    with cli_errors():
        # files win: an exported OMNI_SIDECAR_URL must not turn two trace folders into capture ids,
        # nor a mistyped path beside a real one (a capture id has no "/" and no trace suffix)
        on_disk = all(p.strip() and (Path(p).exists() or _path_like(p)) for p in (a, b))
        if sidecar and not on_disk:
            result = _remote(sidecar, a, b, top)
        else:
            with reading_traces("comparing") as on_file:
                result = diff_paths([a], [b], top=top, on_file=on_file)
    if as_json:
        console.print_json(json.dumps(result.model_dump(mode="json")))
    else:
        print_text(console, f"A = {result.a}", hang="    ", markup=False)
        print_text(console, f"B = {result.b}", hang="    ", markup=False)
        if len(result.stages) > 1:
            for s in result.stages:
                _print_stage(f"stage {s.stage_id if s.stage_id is not None else '?'}", s)
            if all(_one_sided(s) for s in result.stages):  # no stage to compare: A with B as a whole
                _print_stage("all", result.total)
        else:
            _print_stage("all", result.total)
    for msg in result.warnings:
        err_console.print(f"[bold yellow]warning[/]: {escape(msg)}", highlight=False, soft_wrap=True)
    for msg in result.errors:
        err_console.print(f"[bold red]error[/]: {escape(msg)}", highlight=False)
    if result.errors:
        raise typer.Exit(EXIT_ERROR)
