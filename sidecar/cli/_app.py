"""The one typer app every command module registers on, and how the CLI reports errors.

Commands stay thin: parse options, call the library, print. A ``SidecarError`` becomes a red
message (with file:line:col when known) and an exit code, never a traceback.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from sidecar.errors import ConfigUnreadable, SidecarError

app = typer.Typer(
    name="omni-sidecar",
    help="Profiling controller for `vllm serve <model> --omni`: validate, capture, verify, summarise.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # an error line is never broken mid-path or mid-code

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


def parse_stage_list(value: str | None) -> list[int] | None:
    """``"0,2"`` → ``[0, 2]``; ``None`` → ``None``. Bad items are a usage error, not a traceback."""
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip() != ""]
    try:
        return [int(v) for v in items]
    except ValueError:
        raise typer.BadParameter(f"stages must be comma-separated integers, e.g. 0,2 (got {value!r})") from None


def main() -> None:  # console script entry point
    from sidecar import cli as _cli  # noqa: F401  (registers every command module)

    sys.exit(app())
