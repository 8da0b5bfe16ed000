"""Summaries of many trace files at once: files and session folders in, one ``CaptureSummary`` out.

A folder is searched (recursively) for ``trace_rank*.json[.gz]``. Files are merged per stage when
the session folder's name gives the stage (``<ts>_stage<sid>_rank<r>_<epoch>`` for LLM stages,
``<ts>_stage_<sid>_rep_<rep>_diffusion_<epoch>`` for diffusion stages), and all into one total.
A bad file becomes an entry in ``errors``; it never hides the others.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from sidecar.analysis.models import CaptureSummary, StageSummary, TraceSummary
from sidecar.analysis.summary import Aggregate, aggregate_trace
from sidecar.errors import TraceError

_LLM_SESSION = re.compile(r"_stage(\d+)_rank(\d+)_\d+$")
_DIFFUSION_SESSION = re.compile(r"_stage_(\d+)_rep_(\d+)_diffusion_\d+$")
_TRACE = re.compile(r"^trace_rank\d+\.json(\.gz)?$")


def stage_of(path: Path) -> int | None:
    """Stage id from the session folder holding ``path`` (or from ``path`` if it is one)."""
    for part in (path.name, path.parent.name):
        m = _LLM_SESSION.search(part) or _DIFFUSION_SESSION.search(part)
        if m:
            return int(m.group(1))
    return None


def find_traces(paths: Iterable[str | Path]) -> list[Path]:
    """Trace files named by ``paths``: files as given, folders searched for ``trace_rank*``.

    When both ``trace_rankN.json`` and ``.json.gz`` exist the gzip is still being written (vLLM
    compresses after replying to stop): the plain file is the complete one.
    """
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            hits = sorted(f for f in p.rglob("trace_rank*") if f.is_file() and _TRACE.match(f.name))
            plain = {f for f in hits if f.suffix == ".json"}
            hits = [f for f in hits if not (f.suffix == ".gz" and f.with_suffix("") in plain)]
            if not hits:
                raise TraceError(f"{p}: no trace_rank*.json[.gz] in this folder or below it", details={"file": str(p)})
            found.extend(hits)
        elif p.exists():
            found.append(p)
        else:
            raise TraceError(f"{p}: no such file or folder", details={"file": str(p)})
    return found


def summarize_paths(paths: Iterable[str | Path], *, top: int = 20) -> CaptureSummary:
    """Summaries of every trace under ``paths``: per file, per stage, and all merged.

    Raises ``TraceError`` only when a path does not exist or a folder holds no trace; a file that
    cannot be read is reported in ``errors`` (and ``truncated`` where part of it was used).
    """
    files = find_traces(paths)
    total = Aggregate()
    stages: dict[int | None, Aggregate] = {}
    per_file: list[TraceSummary] = []
    errors: list[str] = []
    for f in files:
        try:
            agg, meta, raw = aggregate_trace(f)
        except TraceError as err:
            errors.append(str(err))
            continue
        per_file.append(TraceSummary(file=str(f), bytes_raw=raw, meta=meta, **agg.body(top)))
        stages.setdefault(stage_of(f), Aggregate()).merge(agg)
        total.merge(agg)
    body = total.body(top)
    body["errors"] = errors + body["errors"]
    return CaptureSummary(
        **body,
        stages=[
            StageSummary(stage_id=sid, files=agg.files, **agg.body(top))
            for sid, agg in sorted(stages.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
        ],
        files=per_file,
    )
