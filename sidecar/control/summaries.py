"""Trace summaries of finished captures: computed by ``sidecar.analysis`` in a memory-capped worker
process (``sidecar.analysis.isolated``), once per capture, with ``SUMMARY_TOP_MAX`` rows per table
(the most the API serves); a request for ``top`` rows gets that summary cut to ``top`` (``cut``),
so N different ``top``s cost one analysis. The capture is analysed again only when its trace files
were replaced since (``replaced``). Kept beside the journal (``<state_dir>/summaries/<id>.json``)
and, for the captures read last, in memory; one summarizer per capture at a time. A summary never
changes a verdict.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from sidecar.control import artifacts
from sidecar.control.journal import CaptureJournal, set_aside
from sidecar.control.models import Capture
from sidecar.errors import CaptureNotTerminal, SummaryUnavailable

log = logging.getLogger(__name__)

# The rows per table a summary is served with by default (the page, the CLI, the client).
SUMMARY_TOP = 20
# The most rows per table the API serves (``GET /v1/captures/{id}/summary?top=1..500``): each
# capture is analysed once with this many, and every smaller ``top`` is a cut of it.
SUMMARY_TOP_MAX = 500
# The ranked tables ``top`` cuts, at every level (the capture, each stage, each file). The analysis
# sorts each table (stably) and keeps its first ``top`` rows, so the first N rows of a summary made
# with more are the summary made with N.
TABLES = ("cpu_ops", "cpu_ops_by_device", "annotations", "runtime", "kernels", "memcpy", "memset", "memory_ops")
LEVELS = ("stages", "files")  # the lists of bodies under the capture's own
# What a cached file records beside the summary (stripped before serving): the rows per table it
# was made with (a file without it was written when a capture was analysed per ``top``: it holds
# SUMMARY_TOP rows) and the trace files it read (``identity``).
ROWS_KEY = "summary_rows"
FILES_KEY = "summary_files"
# Summaries kept in memory (the rest are read back from their file): a summary with every table
# at SUMMARY_TOP_MAX rows for every file of a large capture is tens of MB.
MEMORY_CAPTURES = 8


# Every summary ever written had these (a file without them is not one, whatever else it holds).
_ALWAYS = ("window", "totals")
_FILES = TypeAdapter(dict[str, list[int]])


def read_cached(text: str) -> tuple[int, dict[str, list[int]] | None, dict[str, Any]]:
    """A cached summary file's (rows per table, files read, the summary), checked as the journal
    checks its files: the summary must validate as a ``CaptureSummary`` and hold no key the model
    does not have (``ValueError`` / ``ValidationError`` otherwise). A summary written before a
    field existed lacks it and is still served (the model's default), so old caches stay valid."""
    from sidecar.analysis.models import CaptureSummary

    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    rows, files = data.pop(ROWS_KEY, SUMMARY_TOP), data.pop(FILES_KEY, None)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"{ROWS_KEY} is not a whole number >= 1: {rows!r}")
    strange = sorted(set(data) - set(CaptureSummary.model_fields))
    missing = [k for k in _ALWAYS if k not in data]
    if strange or missing:
        raise ValueError(f"not a capture summary (keys it has no field for: {strange}; missing: {missing})")
    summary = CaptureSummary.model_validate(data).model_dump(mode="json")
    return rows, None if files is None else _FILES.validate_python(files), summary


def _bodies(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [data, *(b for level in LEVELS for b in data.get(level) or [] if isinstance(b, dict))]


def complete(data: dict[str, Any], rows: int) -> bool:
    """Whether a summary made with ``rows`` rows per table holds every row: no table was cut."""
    return all(len(b.get(t) or []) < rows for b in _bodies(data) for t in TABLES)


def _cut_body(body: dict[str, Any], top: int) -> dict[str, Any]:
    out = dict(body)
    for t in TABLES:
        if isinstance(out.get(t), list):
            out[t] = out[t][:top]
    return out


def cut(data: dict[str, Any], top: int) -> dict[str, Any]:
    """``data`` with every ranked table, at every level, cut to its first ``top`` rows (a new dict;
    the rows themselves are shared)."""
    out = _cut_body(data, top)
    for level in LEVELS:
        if isinstance(out.get(level), list):
            out[level] = [_cut_body(b, top) if isinstance(b, dict) else b for b in out[level]]
    return out


@dataclass
class Analysis:
    """A capture's one analysis: ``rows`` per table it was made with (None: every row, no table was
    cut), the trace files it read (path -> [size, mtime ns, inode]; None: not recorded), the summary."""

    rows: int | None
    files: dict[str, list[int]] | None
    data: dict[str, Any]

    def serves(self, top: int) -> bool:
        return self.rows is None or top <= self.rows


def identity(paths: list[Path]) -> dict[str, list[int]]:
    """What tells a trace file from its replacement: its size, modification time and inode."""
    out: dict[str, list[int]] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out[str(p)] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def replaced(analysed: dict[str, list[int]] | None, paths: list[Path]) -> bool:
    """Whether the trace files ``paths`` (readable now) are no longer the ones an analysis read: one
    rewritten, one there but refused now (a FIFO, a link out of its folder), or one new (a gzip that
    finished since). A file that is simply gone is not: the summary outlives the traces."""
    if analysed is None:
        return False
    now = identity(paths)
    if any(name not in analysed for name in now):
        return True
    return any(now[name] != ident if name in now else os.path.lexists(name) for name, ident in analysed.items())


def _replaced_since(held: Analysis, cap: Capture) -> bool:
    return replaced(held.files, artifacts.trace_files(cap.verdicts)[0])


class SummaryCache:
    def __init__(self, journal: CaptureJournal | None) -> None:
        self.journal = journal
        self._data: OrderedDict[str, Analysis] = OrderedDict()  # capture id -> its analysis, most recent last
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.quarantined: list[str] = []  # summary files set aside as ``.bad``
        self.analyses = 0  # analyses started: one per capture (and per replacement of its traces), whatever ``top``s

    def _file(self, capture_id: str) -> Path | None:
        return self.journal.summary_path(capture_id) if self.journal is not None else None

    def _keep(self, capture_id: str, rows: int, files: dict[str, list[int]] | None, data: dict[str, Any]) -> Analysis:
        held = Analysis(None if complete(data, rows) else rows, files, data)
        self._data[capture_id] = held
        self._data.move_to_end(capture_id)
        while self.journal is not None and len(self._data) > MEMORY_CAPTURES:  # the file keeps the rest
            self._data.popitem(last=False)
        return held

    def _load(self, capture_id: str) -> tuple[int, dict[str, list[int]] | None, dict[str, Any]] | None:
        """The capture's summary file: (rows per table, files read, the summary), or None (no file,
        or one that is no summary: set aside as ``<name>.bad``, as the journal does, and the
        capture is analysed again)."""
        path = self._file(capture_id)
        if path is None:
            return None
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # unreadable or not UTF-8
            return self._set_aside(path, exc)
        try:
            return read_cached(text)
        except (ValueError, TypeError, ValidationError) as exc:
            return self._set_aside(path, exc)

    def _set_aside(self, path: Path, exc: BaseException) -> None:
        set_aside(path, exc, what="summaries", after=", the capture is analysed again")
        self.quarantined.append(path.name)
        return None

    def _held(self, capture_id: str, loaded: tuple[int, dict[str, list[int]] | None, dict[str, Any]] | None,
              ) -> Analysis | None:
        held = self._data.get(capture_id)
        if held is not None:
            self._data.move_to_end(capture_id)
            return held
        return self._keep(capture_id, *loaded) if loaded is not None else None

    def cached(self, capture_id: str, top: int = SUMMARY_TOP) -> dict[str, Any] | None:
        """The summary with ``top`` rows per table when the capture's analysis is at hand (in
        memory or in its file), else None."""
        loaded = None if capture_id in self._data else self._load(capture_id)
        held = self._held(capture_id, loaded)
        return cut(held.data, top) if held is not None and held.serves(top) else None

    async def get(self, cap: Capture, top: int = SUMMARY_TOP, *, live: bool = False) -> dict[str, Any]:
        """The summary of a terminal capture with ``top`` rows per table: cut from the capture's one
        analysis, which is run now when there is none yet (or its trace files were replaced since).
        ``live``: the controller's own call while collecting (its verdicts are final, the state not yet)."""
        if not cap.terminal and not live:
            raise CaptureNotTerminal(
                f"capture {cap.id} is {cap.state.value}; the summary exists once it is terminal "
                f"(wait with POST /v1/captures/{cap.id}/stop?wait=true)",
                details={"state": cap.state.value},
            )
        async with self._locks.setdefault(cap.id, asyncio.Lock()):
            # files are read and stat'ed off the loop; the memory is only touched on it
            loaded = None if cap.id in self._data else await asyncio.to_thread(self._load, cap.id)
            held = self._held(cap.id, loaded)
            if held is None or not held.serves(top) or await asyncio.to_thread(_replaced_since, held, cap):
                # a caller in process may ask past the API's bound: then that many rows, kept instead
                rows = max(top, SUMMARY_TOP_MAX)
                files, data = await self._compute(cap, rows)
                if not await self._store(cap.id, rows, files, data):  # dropped by retention meanwhile
                    return cut(data, top)
                held = self._keep(cap.id, rows, files, data)
        return cut(held.data, top)

    async def _compute(self, cap: Capture, rows: int) -> tuple[dict[str, list[int]], dict[str, Any]]:
        """The analysis with ``rows`` per table, and the trace files it read."""
        paths, skipped = await asyncio.to_thread(artifacts.trace_files, cap.verdicts)
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
        files = await asyncio.to_thread(identity, paths)  # before the read: a file rewritten meanwhile is read again
        # and the entries that cannot be read, listed again after it: one that came before a file's
        # change is said with the analysis that change brings, never left out of it
        skipped = (await asyncio.to_thread(artifacts.trace_files, cap.verdicts))[1]
        self.analyses += 1
        result = await asyncio.to_thread(run_isolated, summarize_paths, paths, top=rows, requested_start=started)
        data: dict[str, Any] = result.model_dump(mode="json")
        data["warnings"] = skipped + data.get("warnings", [])
        return files, data

    async def _store(self, capture_id: str, rows: int, files: dict[str, list[int]], data: dict[str, Any]) -> bool:
        """Cache a new analysis in its file; False when the capture left the history while it was
        analysed (retention: its files are deleted, and a summary written now would stay for good)."""
        if self.journal is None:
            return True
        text = json.dumps({**data, ROWS_KEY: rows, FILES_KEY: files})
        try:
            kept = await asyncio.to_thread(self.journal.write_summary, capture_id, text)
        except OSError as exc:  # the summary is served anyway; only its cache is lost
            log.warning("capture %s: cannot cache the summary in %s: %s", capture_id, self._file(capture_id), exc)
            return True
        if not kept:
            log.info("capture %s: summary not cached: the capture left the history (retention) while it was "
                     "analysed", capture_id)
        return kept

    def schedule(self, cap: Capture) -> None:
        """Analyse the capture in the background (the default summary is a cut of it)."""

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
        """Drop a capture's cached summary (retention)."""
        self._locks.pop(capture_id, None)
        self._data.pop(capture_id, None)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
