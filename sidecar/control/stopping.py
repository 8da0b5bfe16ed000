"""Sending a capture's stop until the server answers it or is shown gone.

vLLM-Omni's stop blocks until every targeted stage has written its traces, with no timeout of its
own (docs/design.md §3): an unanswered stop is not a failed one. :func:`send_stop` sends it within
the upstream's stop budget and, when ``hold``, sends it again (the server answers a repeat once
its first stop is done) until it is answered or the server has been unreachable for
``gone_after_s`` (:func:`gone`). No capture state here: the controller publishes the outcome.
:class:`Unconfirmed` is the one record of the stages whose stop the server did not confirm (they may
still be recording), and the stop sent again before the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from sidecar.control.models import Capture
from sidecar.control.notes import note
from sidecar.errors import StopUnconfirmed, UpstreamError, UpstreamTimeout, UpstreamUnreachable
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


class Unconfirmed:
    """Stage id -> the capture whose stop the server did not confirm (a 5xx, no answer, a failed
    rollback): the stage may still be recording, so the next start stops it first (``sweep``; a no-op
    where it is idle). Rebuilt from the journal (``track``), so a restart keeps it."""

    def __init__(self) -> None:
        self.stages: dict[int, str] = {}

    def track(self, cap: Capture) -> None:
        """What a journaled capture says of its stages' recording: swept first, then its own stop
        confirmed (stopped) or not (``stop_unconfirmed``; in a journal written before that note, a
        stop answered 5xx, which vLLM >= 0.32 answers with its session still open)."""
        for n in cap.facts:
            if n.code == "stopped_first":
                self.confirmed(n.figures.get("stages", []))
        if any(n.code == "stop_unconfirmed" for n in cap.facts) or (
                cap.started_at is not None and any(e.code == "stop_server_error" for e in cap.errors)):
            self.stages.update(dict.fromkeys(cap.stages, cap.id))
        elif cap.stopped_at is not None:
            self.confirmed(cap.stages)

    def unconfirm(self, cap: Capture, why: str) -> None:
        cap.facts.append(note("stop_unconfirmed", stages=list(cap.stages), why=why))
        self.stages.update(dict.fromkeys(cap.stages, cap.id))

    def confirmed(self, stages: list[int]) -> None:
        for sid in stages:
            self.stages.pop(sid, None)

    def clear(self) -> None:
        """The server went away: a server that is gone records nothing any more."""
        self.stages.clear()

    async def sweep(self, upstream: UpstreamServer, budget_s: float) -> tuple[list[int], str] | None:
        """Before a start: the unconfirmed stages stopped again, and the capture whose stop left them
        so (None: there were none). A stage still recording would otherwise carry its old window into
        the new capture's trace, and the verdict would call that trace ok. ``StopUnconfirmed``
        (nothing started) when the server fails this stop too."""
        if not self.stages:
            return None
        stages = sorted(self.stages)
        after = self.stages[stages[-1]]
        try:
            await upstream.stop_profile(stages, budget_s=budget_s)
        except UpstreamError as exc:
            raise StopUnconfirmed(
                f"stages {stages} may still be recording on {upstream.base_url}: the server did not confirm the "
                f"stop of capture {after}, and the stop sent again now failed too ({exc.code}: {exc.message}). "
                "Nothing was started. Check the server (its log; a restart ends every recording), or POST "
                f"/stop_profile {{\"stages\": {stages}}} there, then start again",
                details={"stages": stages, "after": after, "upstream": upstream.base_url, "cause": exc.code},
            ) from None
        self.confirmed(stages)
        return stages, after


__all__ = ["Outcome", "Unconfirmed", "gone", "is_server_error", "send_stop"]
