"""Sending a capture's stop until the server answers it or is shown gone.

vLLM-Omni's stop blocks until every targeted stage has written its traces, with no timeout of its
own (docs/design.md §3): an unanswered stop is not a failed one. :func:`send_stop` sends it within
the upstream's stop budget and, when ``hold``, sends it again (the server answers a repeat once
its first stop is done) until it is answered or the server has been unreachable for
``gone_after_s`` (:func:`gone`). No capture state here: the controller publishes the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from sidecar.errors import UpstreamError, UpstreamTimeout, UpstreamUnreachable
from sidecar.upstream.server import UpstreamServer

Outcome = Literal["answered", "server_error", "failed", "gone"]


def is_server_error(exc: UpstreamError) -> bool:
    """A 5xx answer: the request reached the server (unlike unreachable) and it replied (unlike a hang)."""
    if isinstance(exc, (UpstreamTimeout, UpstreamUnreachable)):
        return False
    return int(exc.details.get("status", 0)) >= 500


async def gone(upstream: UpstreamServer, *, poll_s: float, after_s: float, waited: bool = False) -> str:
    """Returns (with the probe's reason) once the server has been unreachable for ``after_s``; a
    server that answers at all, however slowly, is not gone. ``waited``: the first poll interval
    has passed already (the first probe is sent at once)."""
    since: float | None = None
    while True:
        if not waited:
            await asyncio.sleep(poll_s)
        waited = False
        try:
            probe = await upstream.probe()
        except Exception:  # a closed client at shutdown: nothing is known, so not gone
            since = None
            continue
        if probe.reachable:
            since = None
            continue
        now = time.monotonic()
        since = now if since is None else since
        if now - since >= after_s:
            return probe.reason or f"{upstream.base_url} is not reachable"


async def send_stop(upstream: UpstreamServer, stages: list[int], *, hold: bool, timed_out: Callable[[], bool],
                    on_timeout: Callable[[UpstreamTimeout], Awaitable[None]], name: str, gone_poll_s: float,
                    gone_after_s: float) -> tuple[Outcome, Any]:
    """Send the stop until it is answered: ``("answered", None)``, ``("server_error", exc)`` (5xx
    after the retries), ``("failed", exc)`` (never answered within the budget and not held, or
    refused), or ``("gone", reason)``. With ``hold``, a stop that outlives its budget calls
    ``on_timeout`` once (the controller collects what was found so far and marks the capture),
    then is sent again until answered or gone; ``timed_out()`` says whether it has."""
    # The watcher for a server gone is started only once a stop has gone unanswered for a poll
    # interval: a stop answered sooner (nearly every one) costs no task beside it, nor the loop
    # turn its cancellation takes (a fleet answers many stops at once).
    watch: asyncio.Task[str] | None = None
    stop: asyncio.Task[None] | None = None
    try:
        while True:
            # Once the budget is spent, each repeat waits a whole read timeout: the server handles
            # stops one after another, so the repeat answers once the first one is done.
            budget = max(upstream.stop_budget_s, upstream.timeouts.stop) if timed_out() else None
            stop = asyncio.create_task(upstream.stop_profile(stages, budget_s=budget), name=f"stop-call-{name}")
            if watch is None:
                await asyncio.wait({stop}, timeout=gone_poll_s)
                if not stop.done():
                    watch = asyncio.create_task(gone(upstream, poll_s=gone_poll_s, after_s=gone_after_s, waited=True),
                                                name=f"gone-{name}")
            if not stop.done():
                assert watch is not None
                await asyncio.wait({stop, watch}, return_when=asyncio.FIRST_COMPLETED)
            if stop.done():
                try:
                    stop.result()
                    return "answered", None
                except UpstreamError as exc:
                    if is_server_error(exc):
                        return "server_error", exc
                    if hold and isinstance(exc, UpstreamTimeout):
                        if not timed_out():
                            await on_timeout(exc)
                        continue
                    return "failed", exc
            assert watch is not None
            return "gone", watch.result()
    finally:
        for task in (stop, watch):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


__all__ = ["Outcome", "gone", "is_server_error", "send_stop"]
