"""CLI: demo commands (thin: parse, call the library, print)."""

from sidecar.cli._app import app  # noqa: F401
