"""Loads every fixture module in tests/fixtures/ (one per product area) as a pytest plugin."""

import pathlib

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (pathlib.Path(__file__).parent / "fixtures").glob("*.py")
    if not p.stem.startswith("_")
)
