"""Trace summaries of finished captures: computed by ``sidecar.analysis`` in a memory-capped worker
process (``sidecar.analysis.isolated``), cached in
memory and beside the journal (``<state_dir>/summaries/<id>.json``, ``<id>.top<N>.json``), one
summarizer per capture at a time. A summary never changes a verdict.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from sidecar.control import artifacts
from sidecar.control.journal import CaptureJournal, atomic_write_text
from sidecar.control.models import Capture
from sidecar.errors import CaptureNotTerminal, SummaryUnavailable

log = logging.getLogger(__name__)

# The summary computed after completion and served by default; other ``top``s are computed on demand.
SUMMARY_TOP = 20


class SummaryCache:
    def __init__(self, journal: CaptureJournal | None) -> None:
        self.journal = journal
        self._data: dict[tuple[str, int], dict[str, Any]] = {}  # (capture id, top) -> summary
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _file(self, capture_id: str, top: int) -> Path | None:
        if self.journal is None:
            return None
        path = self.journal.summary_path(capture_id)
        return path if top == SUMMARY_TOP else path.with_name(f"{capture_id}.top{top}.json")

    def cached(self, capture_id: str, top: int = SUMMARY_TOP) -> dict[str, Any] | None:
        data = self._data.get((capture_id, top))
        path = self._file(capture_id, top)
        if data is None and path is not None:
            try:
                data = self._data[(capture_id, top)] = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
        return data

    async def get(self, cap: Capture, top: int = SUMMARY_TOP, *, live: bool = False) -> dict[str, Any]:
        """The cached summary of a terminal capture, else one computed now and cached. ``live``:
        the controller's own call while collecting (its verdicts are final, the state not yet)."""
        if not cap.terminal and not live:
            raise CaptureNotTerminal(
                f"capture {cap.id} is {cap.state.value}; the summary exists once it is terminal "
                f"(wait with POST /v1/captures/{cap.id}/stop?wait=true)",
                details={"state": cap.state.value},
            )
        async with self._locks.setdefault(cap.id, asyncio.Lock()):
            data = await asyncio.to_thread(self.cached, cap.id, top)  # a file read: off the loop
            if data is None:
                data = await self._compute(cap, top)
        return data

    async def _compute(self, cap: Capture, top: int) -> dict[str, Any]:
        paths, skipped = artifacts.trace_files(cap.verdicts)
        if not paths:
            raise SummaryUnavailable(
                f"capture {cap.id} has no readable trace (state {cap.state.value}); see its verdicts"
                + "".join(f"; {why}" for why in skipped),
                details={"skipped": skipped},
            )
        try:
            from sidecar.analysis import summarize_paths
            from sidecar.analysis.isolated import run_isolated
        except ImportError:
            raise SummaryUnavailable(
                "this sidecar has no trace summarizer installed; download the traces instead",
            ) from None
        # in a memory-capped worker: a hostile trace costs that worker, never the server
        started = cap.started_at.timestamp() if cap.started_at else None  # start_skew_us is measured from it
        result = await asyncio.to_thread(run_isolated, summarize_paths, paths, top=top, requested_start=started)
        data: dict[str, Any] = result.model_dump(mode="json")
        data["warnings"] = skipped + data.get("warnings", [])
        path = self._file(cap.id, top)
        if path is not None:
            try:
                await asyncio.to_thread(atomic_write_text, path, json.dumps(data))
            except OSError as exc:  # the summary is served anyway; only its cache is lost
                log.warning("capture %s: cannot cache the summary in %s: %s", cap.id, path, exc)
        self._data[(cap.id, top)] = data
        return data

    def schedule(self, cap: Capture) -> None:
        """Compute the default summary in the background."""

        async def run() -> None:
            try:
                await self.get(cap)
            except asyncio.CancelledError:
                raise
            except SummaryUnavailable:  # no summarizer or no trace: nothing to cache
                pass
            except Exception as exc:  # a summary never changes the verdict
                log.warning("capture %s: summary failed: %s", cap.id, exc)

        task = asyncio.create_task(run(), name=f"summary-{cap.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget(self, capture_id: str) -> None:
        """Drop a capture's cached summaries (retention)."""
        self._locks.pop(capture_id, None)
        for key in [k for k in self._data if k[0] == capture_id]:
            del self._data[key]

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
