"""Analysis layer: streaming, bounded-memory summaries of torch.profiler / Kineto traces.

``summarize_trace(path)`` summarises one ``.json``/``.json.gz`` file; ``summarize_paths(paths)``
takes files and session folders and merges per stage and per capture. Depends on nothing above it.
"""

from sidecar.analysis.capture import find_traces, stage_of, summarize_paths
from sidecar.analysis.models import (
    CaptureSummary,
    DeviceStat,
    GpuStat,
    OpStat,
    StageSummary,
    StreamStat,
    SummaryBody,
    TraceMeta,
    TraceSummary,
    Totals,
    Window,
)
from sidecar.analysis.reader import TraceReader
from sidecar.analysis.summary import summarize_trace

__all__ = [
    "CaptureSummary",
    "DeviceStat",
    "GpuStat",
    "OpStat",
    "StageSummary",
    "StreamStat",
    "SummaryBody",
    "TraceMeta",
    "TraceReader",
    "TraceSummary",
    "Totals",
    "Window",
    "find_traces",
    "stage_of",
    "summarize_paths",
    "summarize_trace",
]
