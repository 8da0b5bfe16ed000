"""The one typer app every command module registers on, and how the CLI reports errors.

Commands stay thin: parse options, call the library, print. A ``SidecarError`` becomes a red
message (with file:line:col when known) and an exit code, never a traceback.
"""

from __future__ import annotations

import contextlib
import math
import re
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperOption
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from sidecar.errors import ConfigUnreadable, SidecarError

app = typer.Typer(
    name="omni-sidecar",
    help="Profiling controller for `vllm serve <model> --omni`: validate, capture, verify, summarise.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",  # help paragraphs reflow to the terminal instead of keeping the source's breaks
)


def _show_version(value: bool) -> None:
    if value:
        from sidecar import __version__

        typer.echo(f"omni-sidecar {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version,
                                 help="print the version and exit"),
) -> None:
    """Profiling controller for `vllm serve <model> --omni`: validate, capture, verify, summarise."""


# typer 0.29 shows a type after every option, `<bool>` after a flag too, which takes no value
_display_type = TyperOption.display_type_rich
TyperOption.display_type_rich = lambda self, ctx: None if self.is_flag else _display_type(self, ctx)  # type: ignore[method-assign]

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # an error line is never broken mid-path or mid-code

@contextlib.contextmanager
def waiting_line(first: str) -> Iterator[Callable[[str], None]]:
    """The CLI's waiting line on a terminal: a spinner, what it waits for (``first``, then what the
    yielded function is given; thread-safe), the time so far. When the output is piped, nothing at
    all (rich's would still end with a blank line)."""
    if not console.is_terminal:
        yield lambda _what: None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task(first, total=None)
        yield lambda what: progress.update(task, description=what)


@contextlib.contextmanager
def reading_traces(what: str = "reading") -> Iterator[Callable[[int, int], None]]:
    """A waiting line while trace files are summarised: ``what`` and the files read so far, as the
    ``on_file(done, total)`` the summary calls (from another thread where children read them)."""
    with waiting_line(f"{what} the traces") as say:
        yield lambda done, total: say(f"{what} {total:,} trace file{'s' if total != 1 else ''}: {done:,} done")


EXIT_OK = 0
EXIT_ERROR = 1  # invalid input / failed capture
EXIT_UNREADABLE = 2  # input could not be read at all


# The controller's hints name the HTTP routes (its callers are the API and the client); a CLI user
# is told the command that does the same.
_ROUTE_TO_CLI = [
    (re.compile(r"POST /v1/captures/([\w.-]+)/stop\?wait=true"), r"`omni-sidecar stop \1 --wait`"),
    (re.compile(r"POST /v1/captures/([\w.-]+)/stop"), r"`omni-sidecar stop \1`"),
    (re.compile(r"GET /v1/captures\b"), "`omni-sidecar list`"),
]


def cli_words(message: str) -> str:
    for route, command in _ROUTE_TO_CLI:
        message = route.sub(command, message)
    return message


def print_error(err: SidecarError) -> None:
    err_console.print(f"[bold red]error[/]{escape(f'[{err.code}]')}: {escape(cli_words(str(err)))}", highlight=False)
    for finding in err.findings:
        err_console.print(f"  {escape(str(finding))}", highlight=False)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn typed errors into a message and an exit code (2 for unreadable input, else 1)."""
    try:
        yield
    except SidecarError as err:
        print_error(err)
        raise typer.Exit(EXIT_UNREADABLE if isinstance(err, ConfigUnreadable) else EXIT_ERROR) from None
    except KeyboardInterrupt:
        err_console.print("interrupted")
        raise typer.Exit(130) from None


@contextlib.contextmanager
def ctrl_c_held(*, again_leaves: bool = False) -> Iterator[Callable[[], bool]]:
    """Hold Ctrl-C while a request that starts something is in flight, and say afterwards whether it
    came. Raised in the middle of the request, it would leave a capture the sidecar started and this
    command never learnt the id of, recording until its lease ran out. ``again_leaves``: a second
    Ctrl-C is Ctrl-C as usual (KeyboardInterrupt), for a user who will not wait for the first to be
    acted on. Where Ctrl-C is ignored (a shell's ``&``) or this is not the main thread, nothing changes."""
    came = threading.Event()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield came.is_set
        return
    previous = signal.getsignal(signal.SIGINT)

    def held(*_: Any) -> None:
        if again_leaves and came.is_set():
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        came.set()

    signal.signal(signal.SIGINT, held)
    try:
        yield came.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


def finite(value: float | None) -> float | None:
    """The check of every float option (``callback=finite``): inf and nan are refused here, named by
    their option. No duration, size or delay is endless, and JSON carries neither to a sidecar."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def not_blank(value: str | None) -> str | None:
    """A capture id argument given empty (``stop "$ID"`` with ``ID`` unset) is refused, not read as
    every capture's start or as "the active one"."""
    if value is not None and not value.strip():
        raise typer.BadParameter("an empty capture id; give the id or a unique start of it, or leave it out")
    return value


# One vocabulary: the options several commands take mean the same and default the same everywhere
# (start, capture, stop and fleet start|stop|capture).
StagesOpt = Annotated[
    Optional[str], typer.Option("--stages", help="comma-separated stage ids, e.g. 0,2 (default: every profiled stage)")
]
WaitOpt = Annotated[
    bool, typer.Option("--wait/--no-wait", help="wait until the traces are written and checked, then print the verdicts")
]
TimeoutOpt = Annotated[
    Optional[float],
    typer.Option("--timeout", min=0, callback=finite,
                 help="stop waiting for the traces after N s (the stop goes on; default: no limit)"),
]
WindowOpt = Annotated[
    Optional[float],
    typer.Option("--duration", callback=finite, help="profile N s, then stop (default: until Ctrl-C)"),
]


def parse_stage_list(value: str | None, option: str = "--stages") -> list[int] | None:
    """``"0,2"`` → ``[0, 2]``; ``None`` → ``None``. Bad items are a usage error, not a traceback."""
    if value is None:
        return None
    items = [v.strip() for v in value.split(",")]
    try:
        return [int(v) for v in items]
    except ValueError:
        why = "no stage ids" if not value.strip() else "an empty item: a stray comma?" if "" in items else None
        raise typer.BadParameter(f"stages must be comma-separated integers, e.g. 0,2 (got {value!r}"
                                 + (f": {why})" if why else ")"), param_hint=f"'{option}'") from None


