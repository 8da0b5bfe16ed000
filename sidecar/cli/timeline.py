"""CLI: ``omni-sidecar timeline PATH... -o OUT.json.gz``: one Perfetto trace of a whole capture.

Thin: ``sidecar.analysis.timeline.write_timeline`` does the work; this prints one line per
process. Exit 1 when a source could not be read (the others are still merged)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape

from sidecar.analysis.timeline import write_timeline
from sidecar.cli._app import EXIT_ERROR, app, cli_errors, console, err_console, reading_traces
from sidecar.cli._layout import print_text


@app.command("timeline")
def timeline(
    paths: list[str] = typer.Argument(..., help="trace files, session folders or a capture's folder"),
    out: Path = typer.Option(..., "-o", "--out", help="the merged trace (.json or .json.gz)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Merge every stage/replica/rank trace into one timeline, each a named process, clocks aligned."""
    with cli_errors():
        with reading_traces("merging") as on_file:
            report = write_timeline(paths, out, on_file=on_file)
    if as_json:
        from dataclasses import asdict

        console.print_json(json.dumps(asdict(report)))
    else:
        for p in report.processes:
            print_text(console, f"pid {p.pid}: [bold]{escape(p.name)}[/] {p.events:,} events, {p.kernels:,} kernels, "
                       f"clock {p.offset_us:+,.1f} µs  ({escape(p.file)})", hang="  ")
        print_text(console, f"wrote {out}: {report.events:,} events, {report.raw_bytes / 1e6:,.1f} MB of JSON; "
                   "open it in https://ui.perfetto.dev", hang="  ", markup=False)
    for msg in report.warnings:
        err_console.print(f"[bold yellow]warning[/]: {escape(msg)}", highlight=False, soft_wrap=True)
    for msg in report.errors:
        err_console.print(f"[bold red]error[/]{escape('[trace_invalid]')}: {escape(msg)}", highlight=False)
    if report.errors:
        raise typer.Exit(EXIT_ERROR)
