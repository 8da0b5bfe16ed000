"""How a controller paces its blocking work and a stop's follow-ups beside other controllers.

A sidecar runs one controller: :class:`Direct` runs its blocking work in a thread and its
follow-ups at once. A fleet that drives many controllers on one event loop injects its own pacing
(sidecar/fleet/_pacing.py: one thread hop for a tick's baselines, follow-ups after the loop's stops).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol


class Pacing(Protocol):
    async def run_blocking(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` off the event loop."""

    def stop_sent(self) -> Callable[[], None]:
        """One upstream stop sent; returns its ``answered`` callback (calling it again is harmless)."""

    async def before_follow_up(self) -> None:
        """Wait, if at all, before a stop's follow-up work (the after-window scrape, the artifact looks)."""


def _nothing() -> None:
    return None


class Direct:
    """One controller in its process: nothing to pace against."""

    async def run_blocking(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.to_thread(fn)

    def stop_sent(self) -> Callable[[], None]:
        return _nothing

    async def before_follow_up(self) -> None:
        return None


__all__ = ["Direct", "Pacing"]
