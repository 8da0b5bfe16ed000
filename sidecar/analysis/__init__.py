"""Analysis layer: streaming, bounded-memory summaries of torch.profiler / Kineto traces.

``summarize_trace(path)`` summarises one ``.json``/``.json.gz`` file; ``summarize_paths(paths)``
takes files, session folders and ``TraceSource``s, summarises them in parallel and merges per
stage, replica and capture. ``timeline``, ``slim`` and ``diff`` (submodules) rewrite and compare
traces. Loading (``reader``, ``writer``) is apart from analysing. Depends on nothing above it.
"""

from sidecar.analysis.capture import (
    TraceSource,
    find_sources,
    find_traces,
    source_of,
    stage_of,
    stragglers,
    summarize_paths,
)
from sidecar.analysis.models import (
    CaptureSummary,
    DeviceStat,
    GpuSplit,
    GpuStat,
    OpStat,
    ReplicaStat,
    StageSummary,
    StepKindStat,
    Straggler,
    StreamStat,
    SummaryBody,
    Totals,
    TraceMeta,
    TraceSummary,
    Window,
)
from sidecar.analysis.reader import TraceReader
from sidecar.analysis.summary import summarize_trace

__all__ = [
    "CaptureSummary",
    "DeviceStat",
    "GpuSplit",
    "GpuStat",
    "OpStat",
    "ReplicaStat",
    "StepKindStat",
    "Straggler",
    "TraceSource",
    "StageSummary",
    "StreamStat",
    "SummaryBody",
    "TraceMeta",
    "TraceReader",
    "TraceSummary",
    "Totals",
    "Window",
    "find_sources",
    "find_traces",
    "source_of",
    "stragglers",
    "stage_of",
    "summarize_paths",
    "summarize_trace",
]
