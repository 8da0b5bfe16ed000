"""CLI surface (typer). Each module registers its commands on ``sidecar.cli._app.app``; the import
order below is the order ``omni-sidecar --help`` lists them in (check, run, capture, analyse, try)."""

from sidecar.cli import config_cmds  # noqa: F401,I001  validate, render
from sidecar.cli import serve  # noqa: F401  serve
from sidecar.cli import capture  # noqa: F401  start, stop, status, list, capture
from sidecar.cli import summarize  # noqa: F401  summarize
from sidecar.cli import timeline  # noqa: F401  timeline
from sidecar.cli import slim  # noqa: F401  slim
from sidecar.cli import diff  # noqa: F401  diff
from sidecar.cli import fleet  # noqa: F401  fleet start|stop|capture
from sidecar.cli import emulate  # noqa: F401  emulate
from sidecar.cli import demo  # noqa: F401  demo
from sidecar.cli._app import app, main

__all__ = ["app", "main"]
