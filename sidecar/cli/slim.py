"""CLI: ``omni-sidecar slim TRACE -o OUT [--drop CAT,...] [--window step:N|START..END] [--max-mb M]``:
a smaller, valid copy of a trace that Perfetto's UI opens. Thin over ``sidecar.analysis.slim``."""

from __future__ import annotations

from pathlib import Path

import typer

from sidecar.analysis.slim import max_mb_problem, slim_trace
from sidecar.cli._app import EXIT_ERROR, app, cli_errors, console, err_console, waiting_line
from sidecar.cli._layout import print_text


def size_cap(value: float | None) -> float | None:
    """The check of a ``--max-mb`` (``slim``, ``fleet archive``): a usage error before any trace is read."""
    why = max_mb_problem(value)
    if why is not None:
        raise typer.BadParameter(why)
    return value


@app.command("slim")
def slim(
    trace: str = typer.Argument(..., help="a trace file (.json / .json.gz)"),
    out: Path = typer.Option(..., "-o", "--out", help="the smaller trace (.json or .json.gz)"),
    drop: str = typer.Option("", "--drop", help="categories to leave out, e.g. python_function,ac2g"),
    window: str | None = typer.Option(None, "--window", help="step:N (ProfilerStep#N) or START..END in ms from the trace start"),
    max_mb: float | None = typer.Option(None, "--max-mb", callback=size_cap,
                                        help="drop more (stacks, flows, API calls, then time) until the JSON fits"),
) -> None:
    """Write a smaller copy of a trace: fewer categories, one step or time window, a size cap."""
    cats = [c.strip() for c in drop.split(",") if c.strip()]
    with cli_errors():
        with waiting_line("slim: reading the trace") as say:
            r = slim_trace(trace, out, drop=cats, window=window, max_mb=max_mb, on_pass=lambda what: say(f"slim: {what}"))
    print_text(
        console,
        f"wrote {out}: {r.events_out:,} of {r.events_in:,} events, "
        f"{r.raw_bytes_out / 1e6:,.1f} MB of JSON (from {r.raw_bytes_in / 1e6:,.1f} MB)"
        + (f"; dropped {', '.join(r.dropped_categories)}" if r.dropped_categories else ""),
        hang="  ",
        markup=False,
    )
    if not r.fits:
        err_console.print(f"[bold red]error[/]: still larger than {max_mb} MB; use a narrower --window", highlight=False)
        raise typer.Exit(EXIT_ERROR)
