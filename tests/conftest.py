"""Loads every fixture module in tests/fixtures/ (one per product area) as a pytest plugin."""

import pathlib

import pytest

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (pathlib.Path(__file__).parent / "fixtures").glob("*.py")
    if not p.stem.startswith("_")
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (the default group, Makefile): a test that uses a module- or
    class-scoped fixture (a module's sidecar, emulator or browser) runs on its module's worker, so
    that fixture starts once; every other test goes to whichever worker is free. ``loadfile`` kept
    whole files together, so the largest file (the docs blocks, each its own process) was the run's
    critical path. A module with ``XDIST_SPLIT = n`` deals its fixture-sharing tests round-robin into
    n groups: its fixtures start n times, its tests run n at a time."""
    if not (getattr(config.option, "loadgroup", False) or getattr(config.option, "dist", None) == "loadgroup"):
        return
    dealt: dict[str, int] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if not any(d[-1].scope in ("module", "class", "package") for d in defs if d):
            continue
        path = item.nodeid.split("::", 1)[0]
        split = getattr(getattr(item, "module", None), "XDIST_SPLIT", 1)
        n = dealt[path] = dealt.get(path, -1) + 1
        item.add_marker(pytest.mark.xdist_group(path if split <= 1 else f"{path}#{n % split}"))
