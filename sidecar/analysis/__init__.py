"""Analysis layer: streaming, bounded-memory summaries of torch.profiler / Kineto traces.

``summarize_trace(path)`` summarises one ``.json``/``.json.gz`` file; ``summarize_paths(paths)``
takes files, session folders and ``TraceSource``s, summarises them in parallel and merges per
stage, replica and capture, with what held memory where the traces recorded it (``memory``);
``summarize_snapshot`` reads a CUDA memory snapshot safely. ``timeline``, ``slim`` and ``diff``
(submodules) rewrite and compare traces. Loading (``reader`` over ``stream``, ``scan`` and
``events``; ``writer``) is apart from analysing. Depends on nothing above it.
"""

from __future__ import annotations

from sidecar._lazy import lazy_exports

# each module -> the public names it defines, imported on first use (sidecar/_lazy.py): importing
# one submodule of sidecar.analysis does not import the others
_EXPORTS = {
    "sidecar.analysis.capture": (
        "TraceSource", "source_of", "stragglers",
        "summarize_paths",
    ),
    "sidecar.analysis.models": (
        "CaptureSummary", "DeviceMemory", "DeviceStat", "GpuSplit", "GpuStat", "LiveOp", "MemoryOpStat", "OpStat",
        "ReplicaStat", "SnapshotBlock", "SnapshotDevice", "SnapshotSummary", "StageSummary", "StepKindStat",
        "Straggler", "StreamStat", "SummaryBody", "Totals", "TraceMeta", "TraceSummary", "Window",
    ),
    "sidecar.analysis.reader": ("TraceReader",),
    "sidecar.analysis.snapshot": ("read_snapshot", "summarize_snapshot"),
    "sidecar.analysis.report": ("summarize_trace",),
}

__all__, __getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
