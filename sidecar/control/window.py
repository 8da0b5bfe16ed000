"""The I/O around a ``steps`` window: reading the server's step counters, feeding the policy
(sidecar/control/steps.py) until it says stop, waiting out ``delay_steps``, recording a window's
reads as a fixture, and what the traces held afterwards. The decisions are the policy's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from sidecar.control.steps import Decision, Read, StepsWindow
from sidecar.errors import MetricsUnavailable, StepsNotReached
from sidecar.upstream.metrics import Labels, steps_since

log = logging.getLogger(__name__)

ReadCounts = Callable[[], Awaitable[Read]]


def reader(step_counts: Callable[[], Awaitable[dict[Labels, int]]], *,
           clock: Callable[[], float] = time.monotonic) -> ReadCounts:
    """A counter read: the engines' counts (None: the read failed) at the middle of the read (when
    the server counted, as near as the sidecar can tell)."""

    async def read() -> Read:
        t0 = clock()
        try:
            counts: dict[Labels, int] | None = await step_counts()
        except MetricsUnavailable as exc:
            log.debug("a step counter read failed after %.0f ms: %s", (clock() - t0) * 1000, exc.message)
            return Read(at=(t0 + clock()) / 2, counts=None, error=exc.message)
        return Read(at=(t0 + clock()) / 2, counts=counts)

    return read


async def count_window(window: StepsWindow, read: ReadCounts, *, poll_s: float,
                       clock: Callable[[], float] = time.monotonic) -> Decision:
    """Read, feed, repeat until the policy stops the window. A read that does not come back is
    not waited for past the policy's stall bound: the clock alone is fed then."""
    while True:
        try:
            got = await asyncio.wait_for(read(), timeout=max(window.stall_s / 2, poll_s))
        except asyncio.TimeoutError:
            got = Read(at=clock(), counts=None)  # not back: a failed read, so the clock decides (and it is recorded)
        decision = window.feed(got)
        if decision.stop:
            return decision
        await asyncio.sleep(poll_s)


async def wait_steps(read: ReadCounts, base: Mapping[Labels, int], stages: list[int], n: int, *,
                     wait_s: float, poll_s: float, clock: Callable[[], float] = time.monotonic) -> None:
    """Until the server has run ``n`` steps since ``base`` (a ``delay_steps`` start), within ``wait_s``.
    Refused as ``StepsNotReached``; where the counter could not be read at the end, the refusal says
    so and why, not that the server ran none (a server whose /metrics went slow or away)."""
    deadline = clock() + wait_s
    ran = 0
    unread_since: float | None = None  # the counter's reads failing, since when
    while True:
        t0 = clock()
        got = await read()
        if got.counts is not None:
            unread_since = None
            ran = steps_since(base, got.counts, stages)
            if ran >= n:
                return
        elif unread_since is None:
            unread_since = t0
        if clock() >= deadline:
            details: dict[str, Any] = {"delay_steps": n, "counted": ran}
            if unread_since is None:
                raise StepsNotReached(f"the server ran {ran} of the {n} delay_steps within {wait_s:g}s; send load "
                                      "to it, or ask for fewer delay_steps", details=details)
            unread = clock() - unread_since
            raise StepsNotReached(
                f"the server's step counter could not be read for the last {unread:.0f}s of the {wait_s:g}s this "
                f"start waited for {n} delay_steps ({got.error}): {ran} were counted before, what ran since is "
                "unknown; check the server and its /metrics, or ask for duration_s instead of steps",
                details={**details, "unreadable_s": round(unread, 3), "why": got.error})
        await asyncio.sleep(poll_s)


def record(folder: str | Path, capture_id: str, window: StepsWindow, decision: Decision) -> Path | None:
    """Write a window's reads and its end as a JSON fixture (tests/data/steps/ replays them)."""
    path = Path(folder).expanduser() / f"steps-{capture_id}.json"
    origin = window.answered_at

    def counts(c: Mapping[Labels, int] | None) -> list[Any] | None:
        return None if c is None else [[[list(kv) for kv in key], n] for key, n in sorted(c.items())]

    data = {
        "capture_id": capture_id, "steps": window.steps, "stages": window.stages, "bound": window.bound.value,
        "ends": {s: n for s, n in window.reach.items()}, "margin": window.margin, "stall_s": window.stall_s,
        "max_s": window.max_s,
        "reads": [[round(r.at - origin, 6), counts(r.counts)] for r in window.reads],
        "ended_by": decision.ended_by.value if decision.ended_by else None, "counted": decision.counted,
        "per_stage": dict(decision.per_stage),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    except OSError as exc:  # a fixture never changes a capture
        log.warning("steps window %s: its reads were not recorded: %s", capture_id, exc)
        return None
    return path


def load_recorded(path: str | Path) -> dict[str, Any]:
    """A recorded window (:func:`record`): its reads as :class:`Read` (``at`` from the start's answer)."""
    data = json.loads(Path(path).read_text())
    data["reads"] = [Read(at=at, counts=None if c is None else {tuple(tuple(kv) for kv in key): n for key, n in c})
                     for at, c in data["reads"]]
    return data


def trace_steps(files: list[dict[str, Any]], stages: list[int]) -> tuple[dict[int, int], dict[int, tuple[int, int]],
                                                                             dict[int, float]]:
    """Per stage, from a capture's trace summary files: the engine steps that scheduled work (the
    most of any of its files), its idle iterations of how many, and its trace's write time."""
    per_stage: dict[int, int] = {}
    idle: dict[int, tuple[int, int]] = {}
    writes: dict[int, float] = {}
    for f in files:
        sid = f.get("stage_id")
        if sid is None and len(stages) == 1:
            sid = stages[0]  # plain vLLM's traces carry no stage in their names: its one engine
        if sid is None:
            continue
        kinds = {k["kind"]: k["count"] for k in f.get("engine_step_kinds", [])}
        if (took := write_s(f)) is not None:
            writes[sid] = max(writes.get(sid, took), took)
        ran = f.get("window", {}).get("engine_steps", 0)
        worked = ran - kinds.get("idle", 0)
        if worked >= per_stage.get(sid, 0):
            per_stage[sid], idle[sid] = worked, (kinds.get("idle", 0), ran)
    return per_stage, idle, writes


def write_s(summary: dict[str, Any]) -> float | None:
    """Seconds from the last event of a trace file's summary to the file's last write (its mtime):
    how long the server took to write what it recorded. None where the trace has no wall-clock
    base (baseTimeNanoseconds) or the file is gone."""
    end_us = summary.get("window", {}).get("end_epoch_us")
    if end_us is None or not summary.get("file"):
        return None
    try:
        written_ns = os.stat(summary["file"]).st_mtime_ns
    except OSError:
        return None
    return max(written_ns / 1e9 - end_us / 1e6, 0.0)


__all__ = ["count_window", "load_recorded", "reader", "record", "trace_steps", "wait_steps", "write_s"]
