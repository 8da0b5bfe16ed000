"""CLI surface (typer). Each module registers its commands on ``sidecar.cli._app.app``.

``COMMANDS`` maps each module to the commands it registers, in the order ``omni-sidecar --help``
lists them (check, run, capture, analyse, try). A run of one command imports only that command's
module (``main``): every CLI call, ``serve`` and the emulator (``python -m sidecar.emulator``)
would otherwise import the whole CLI, about 0.3 s of CPU each. ``--help``, an unknown command and
``sidecar.cli.app`` load every module. ``tests/test_cli_help.py`` checks the map against what the
modules register.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

COMMANDS: dict[str, tuple[str, ...]] = {
    "config_cmds": ("validate", "render"),
    "serve": ("serve",),
    "capture": ("start", "stop", "status", "list", "capture", "plan"),
    "summarize": ("summarize",),
    "timeline": ("timeline",),
    "slim": ("slim",),
    "diff": ("diff",),
    "emulate": ("emulate",),
    "demo": ("demo",),
    "fleet": ("fleet",),
}
_MODULE_OF = {command: module for module, commands in COMMANDS.items() for command in commands}


def load(command: str | None = None) -> None:
    """Register ``command``'s module on the app, or every module (``None``, or a name no module
    registers: typer then lists them all in its error)."""
    module = _MODULE_OF.get(command) if command else None
    for name in [module] if module else COMMANDS:
        importlib.import_module(f"sidecar.cli.{name}")


def _command_in(argv: list[str]) -> str | None:
    """The command a command line runs: its first word that is not an option (the root takes only
    flags: ``--version``, ``--help``)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main() -> None:  # console script entry point
    load(_command_in(sys.argv[1:]))
    from sidecar.cli._app import app

    sys.exit(app())


def __getattr__(name: str) -> Any:
    if name == "app":  # the whole CLI, for typer's CliRunner and the docs' tests
        load()
        from sidecar.cli._app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["COMMANDS", "app", "load", "main"]
