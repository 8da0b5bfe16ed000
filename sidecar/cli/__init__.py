"""CLI surface (typer). Each module registers its commands on ``sidecar.cli._app.app``."""

from sidecar.cli import (  # noqa: F401  (imported for their registrations)
    capture,
    config_cmds,
    demo,
    emulate,
    fleet,
    serve,
    summarize,
)
from sidecar.cli._app import app, main

__all__ = ["app", "main"]
