"""The summary of a capture, as pydantic models (JSON via ``model_dump(mode="json")``).

All times are microseconds, as in the trace. ``truncated`` says a file ended early and the numbers
cover the events read before that; ``errors`` says why, naming the file.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class OpStat(BaseModel):
    """A CPU-side event name (op, annotation or CUDA API call): torch key_averages' columns."""

    name: str
    count: int
    total_us: float
    self_us: float  # total minus the CPU events nested directly inside it on the same thread
    self_device_us: float = 0.0  # GPU time of the kernels/copies it launched itself (Self CUDA)


class GpuStat(BaseModel):
    """A kernel, memcpy or memset name."""

    name: str
    count: int
    total_us: float


class StreamStat(BaseModel):
    stage_id: int | None = None
    replica: int | None = None
    rank: int | None = None
    device: int
    stream: int
    count: int
    busy_us: float  # sum of activity durations (one stream runs one at a time)
    idle_share: float  # 1 - busy / window span


class Temporal(BaseModel):
    """HTA's temporal breakdown over the steady window: each share is of ``window_us``.
    ``compute`` = the union of computation kernels; ``communication`` = NCCL kernels not under
    compute; ``memory`` = memcpy/memset under neither; ``other`` = the rest of the busy time
    (kernels named ``*Sync``); ``idle`` = no GPU activity at all."""

    window_us: float = 0.0
    compute_us: float = 0.0
    communication_us: float = 0.0
    memory_us: float = 0.0
    other_us: float = 0.0
    idle_us: float = 0.0
    compute_share: float = 0.0
    communication_share: float = 0.0
    memory_share: float = 0.0
    other_share: float = 0.0
    idle_share: float = 0.0


class IdleBreakdown(BaseModel):
    """HTA's idle time breakdown: the gaps between consecutive GPU events of each stream, summed
    over streams. ``host_wait``: the next event's API call started after the gap began (the host
    had not launched it yet); ``kernel_wait``: a gap under 30 µs (launch overhead); ``other``."""

    idle_us: float = 0.0
    host_wait_us: float = 0.0
    kernel_wait_us: float = 0.0
    other_us: float = 0.0
    host_wait_share: float = 0.0
    kernel_wait_share: float = 0.0
    other_share: float = 0.0


class KernelCategory(BaseModel):
    """Device time of one kernel category (gemm, attention, communication, elementwise,
    reduction, memory, other): share of the device's GPU time, and its largest kernels."""

    category: str
    count: int = 0
    total_us: float = 0.0
    share: float = 0.0
    top: list[GpuStat] = Field(default_factory=list)


class Overlap(BaseModel):
    """HTA's comm/comp overlap: the share of communication time that computation overlaps."""

    communication_us: float = 0.0
    overlapped_us: float = 0.0
    share: float | None = None  # None: no communication kernel


class LaunchStats(BaseModel):
    """HTA's kernel launch statistics: delay from the end of the launch call (cudaLaunchKernel,
    cudaLaunchKernelExC, cudaMemcpyAsync, cudaMemsetAsync) to the start of its GPU event."""

    launches: int = 0
    delay_p50_us: float | None = None  # from a log-bucket sketch (1 % buckets)
    delay_p95_us: float | None = None
    kernels: int = 0
    short_share: float = 0.0  # kernels shorter than 10 µs
    gpu_shorter_than_launch_share: float = 0.0  # GPU event shorter than the call that launched it
    cpu_bound: bool = False
    rule: str = ""  # what decides cpu_bound, with its thresholds


class LeftOut(BaseModel):
    """A span left out of the steady window."""

    what: str  # profiler_start | cuda_graph_capture
    start_us: float
    end_us: float
    us: float = 0.0
    gpu_events: int = 0


class SteadyWindow(BaseModel):
    """The window the attribution fields cover: first to last GPU event of the device, less the
    profiler-start transient (GPU events before the first step annotation) and CUDA graph
    captures (``cudaStreamBeginCapture`` to ``cudaStreamEndCapture``)."""

    start_us: float | None = None
    end_us: float | None = None
    span_us: float = 0.0
    left_out: list[LeftOut] = Field(default_factory=list)


class DeviceStat(BaseModel):
    """One GPU of one process: stage, replica and rank tell apart the processes that all call
    their GPU ``cuda:0``."""

    stage_id: int | None = None
    replica: int | None = None
    rank: int | None = None
    device: int
    busy_us: float  # union of activity intervals over all streams of the device
    span_us: float = 0.0  # the window of the trace this device was recorded in
    busy_share: float = 0.0  # busy / span
    idle_share: float  # 1 - busy / span
    # why (docs/summaries.md, "Why a stage is slow"); None in summaries written before them
    temporal: Temporal | None = None
    idle_breakdown: IdleBreakdown | None = None
    kernel_categories: list[KernelCategory] = Field(default_factory=list)
    overlap: Overlap | None = None
    launch: LaunchStats | None = None
    steady: SteadyWindow | None = None
    first_event_epoch_us: float | None = None  # baseTimeNanoseconds / 1000 + the first event's ts: its first work
    # Kineto's own profiler span (``PyTorch Profiler (N)``) on the host's clock: when it started recording
    profiling_start_epoch_us: float | None = None
    # its profiling start (its first event where the trace has no span) against the capture's start,
    # else against the earliest device of its stage (docs/summaries.md, "When each device started")
    start_skew_us: float | None = None


class StepKindStat(BaseModel):
    """Engine steps of one kind: ``prefill`` (context tokens only), ``decode`` (generation only),
    ``mixed`` (both in one step), ``diffusion`` (one diffusion forward)."""

    kind: str
    count: int
    total_us: float
    mean_us: float
    share: float  # of all engine-step time


class GpuSplit(BaseModel):
    """GPU time by activity kind (sums over streams, so overlap counts twice)."""

    kernel_us: float = 0.0
    memcpy_us: float = 0.0
    memset_us: float = 0.0
    kernel_share: float = 0.0
    memcpy_share: float = 0.0
    memset_share: float = 0.0


class ReplicaStat(BaseModel):
    """One stage process (stage, replica, rank) of a capture, for telling stragglers apart."""

    stage_id: int | None = None
    replica: int | None = None
    rank: int | None = None
    files: list[str] = Field(default_factory=list)
    span_us: float = 0.0
    metric: str = "span"  # engine_step_mean | step_mean | device_busy | span
    value_us: float = 0.0


class Straggler(BaseModel):
    """Within one stage: the slowest of its replicas/ranks against their median."""

    stage_id: int | None = None
    metric: str
    slowest_replica: int | None = None
    slowest_rank: int | None = None
    slowest_us: float
    median_us: float
    ratio: float  # slowest / median (1.0 = no straggler)
    members: int


class Window(BaseModel):
    start_us: float | None = None
    end_us: float | None = None
    span_us: float = 0.0
    steps: int = 0  # ProfilerStep#N annotations (torch.profiler schedule steps)
    step_mean_us: float | None = None
    step_names: list[str] = Field(default_factory=list)  # the first few, to show which
    engine_steps: int = 0  # vLLM engine step markers: execute_context_*, diffusion_forward*
    engine_step_mean_us: float | None = None
    end_epoch_us: float | None = None  # the last event's end on the host's clock (baseTimeNanoseconds + end_us)


class TraceMeta(BaseModel):
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None
    host_name: str | None = None
    trace_name: str | None = None
    devices: list[str] = Field(default_factory=list)  # GPU names from deviceProperties
    extra: dict[str, Any] = Field(default_factory=dict)  # other small scalar header keys


class Totals(BaseModel):
    events: int = 0
    bytes_raw: int = 0
    cpu_ops: int = 0
    cpu_op_self_us: float = 0.0
    # self CPU of user annotations (record_function, ProfilerStep#N): time in them outside any op;
    # None in a summary made before it was counted
    annotation_self_us: float | None = None
    kernels: int = 0
    kernel_us: float = 0.0
    memcpy_us: float = 0.0
    memset_us: float = 0.0
    runtime_us: float = 0.0
    out_of_order: int = 0  # CPU events that started before an earlier one on their thread
    profiler_overhead_us: float = 0.0  # CUPTI buffer requests/flushes (Kineto "overhead" events)


class MemoryOpStat(BaseModel):
    """The memory events of one op name on one kind of device (torch key_averages' memory
    columns): allocations and frees made while it was the innermost op on its thread.
    ``self_bytes`` = allocated − freed = key_averages' ``self_cpu_memory_usage`` (CPU) or
    ``self_device_memory_usage`` (a GPU)."""

    name: str
    device_type: str  # cpu | cuda | ... (torch's c10 device type of the events)
    allocs: int = 0
    alloc_bytes: int = 0
    frees: int = 0
    freed_bytes: int = 0
    self_bytes: int = 0


class LiveOp(BaseModel):
    """Bytes one op name had live at a device's peak (allocated in the window, not yet freed)."""

    name: str
    bytes: int
    blocks: int
    stack: list[str] = Field(default_factory=list)  # ops enclosing one of its allocations, outermost first


class DeviceMemory(BaseModel):
    """What held memory on one device of one process over the window, from torch's memory events
    (``profile_memory``; docs/summaries.md, "What is holding memory"). Bytes; times as the
    trace's µs. ``allocated`` is the allocator's figure at the window's first event plus every
    event's ``Bytes`` since (checked against the ``Total Allocated`` torch writes into each event:
    ``allocator_peak_allocated_bytes``, ``accounting_drift_bytes``)."""

    stage_id: int | None = None
    replica: int | None = None
    rank: int | None = None
    device_type: str  # cpu | cuda | ...
    device: int  # torch's Device Id (-1: the CPU)
    capacity_bytes: int | None = None  # the GPU's memory (deviceProperties' totalGlobalMem)
    events: int = 0
    allocs: int = 0
    frees: int = 0
    alloc_bytes: int = 0
    freed_bytes: int = 0
    steps: int = 0  # engine steps, else ProfilerStep annotations, of the trace(s)
    alloc_bytes_per_step: float | None = None  # churn
    freed_bytes_per_step: float | None = None
    start_allocated_bytes: int = 0  # before the window's first memory event
    end_allocated_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_us: float | None = None  # the event that reached the peak (trace µs)
    peak_offset_us: float | None = None  # ... from the window's start
    peak_step: int | None = None  # the step it fell in (1 = the first step annotation; 0 = before it)
    reserved_at_peak_bytes: int | None = None  # the allocator's Total Reserved then (None: no caching allocator)
    free_at_peak_bytes: int | None = None  # reserved − allocated at the peak
    free_at_peak_share: float | None = None  # ... of reserved
    peak_reserved_bytes: int | None = None
    allocator_peak_allocated_bytes: int | None = None  # max of the events' Total Allocated
    accounting_drift_bytes: int = 0  # largest |allocated − Total Allocated| at the window's peaks
    before_window_bytes_at_peak: int = 0  # live at the peak but allocated before the window
    live_at_peak: list[LiveOp] = Field(default_factory=list)  # by bytes, the largest first
    ooms: int = 0  # [OutOfMemory] events: allocations that failed
    series: list[tuple[float, int, int]] = Field(default_factory=list)  # (µs from the window start, allocated, reserved)


class SnapshotBlock(BaseModel):
    """A block of a CUDA memory snapshot (or an allocation of its history), with where it was
    allocated: frames innermost first, ``file:line:function`` (torch's ``_memory_viz`` format)."""

    size: int
    requested_size: int | None = None
    address: int | None = None
    state: str | None = None  # active_allocated | active_pending_free | inactive
    stream: int | None = None
    frames: list[str] = Field(default_factory=list)


class SnapshotDevice(BaseModel):
    """One device of ``memory_snapshot_rank<N>.pickle`` (``torch.cuda.memory._snapshot()``): the
    allocator's segments at the stop, and the peak of its allocation history (``device_traces``,
    replayed as torch's MemoryViz does: alloc to free_completed)."""

    device: int
    segments: int = 0
    reserved_bytes: int = 0  # sum of segment sizes
    allocated_bytes: int = 0  # blocks active_allocated
    requested_bytes: int = 0  # what those allocations asked for
    pending_free_bytes: int = 0  # blocks active_pending_free
    inactive_bytes: int = 0  # blocks inactive (reserved, free)
    largest_blocks: list[SnapshotBlock] = Field(default_factory=list)
    trace_entries: int = 0
    peak_bytes: int | None = None  # None: no allocation history
    peak_index: int | None = None  # the history entry that reached it
    peak_time_us: float | None = None
    live_at_peak: list[SnapshotBlock] = Field(default_factory=list)
    ooms: int = 0


class SnapshotSummary(BaseModel):
    file: str
    stage_id: int | None = None
    replica: int | None = None
    rank: int | None = None
    devices: list[SnapshotDevice] = Field(default_factory=list)


class SummaryBody(BaseModel):
    """What every level (file, stage, capture) reports; tables hold the top N by time."""

    truncated: bool = False
    errors: list[str] = Field(default_factory=list)
    window: Window = Field(default_factory=Window)
    totals: Totals = Field(default_factory=Totals)
    cpu_ops: list[OpStat] = Field(default_factory=list)  # by self CPU time
    cpu_ops_by_device: list[OpStat] = Field(default_factory=list)  # by self device time
    annotations: list[OpStat] = Field(default_factory=list)  # user_annotation (steps, record_function)
    runtime: list[OpStat] = Field(default_factory=list)  # cuda_runtime / cuda_driver calls
    kernels: list[GpuStat] = Field(default_factory=list)
    memcpy: list[GpuStat] = Field(default_factory=list)
    memset: list[GpuStat] = Field(default_factory=list)
    devices: list[DeviceStat] = Field(default_factory=list)
    streams: list[StreamStat] = Field(default_factory=list)
    engine_step_kinds: list[StepKindStat] = Field(default_factory=list)
    gpu_split: GpuSplit = Field(default_factory=GpuSplit)
    memory: list[DeviceMemory] = Field(default_factory=list)  # per device, from profile_memory's events
    memory_ops: list[MemoryOpStat] = Field(default_factory=list)  # by bytes allocated
    warnings: list[str] = Field(default_factory=list)  # e.g. a trace too big to open in Perfetto


class TraceSummary(SummaryBody):
    file: str
    bytes_raw: int = 0  # decompressed JSON bytes read
    meta: TraceMeta = Field(default_factory=TraceMeta)
    stage_id: int | None = None
    replica: int | None = None
    too_big: bool = False  # raw JSON above the size Perfetto's UI opens comfortably
    slim_command: str | None = None  # what to run to get a trace that opens


class StageSummary(SummaryBody):
    """All files of one stage (every rank / replica / session folder of it) merged."""

    stage_id: int | None = None  # None: files whose stage could not be inferred
    files: list[str] = Field(default_factory=list)
    snapshots: list[SnapshotSummary] = Field(default_factory=list)  # memory_snapshot_rank<N>.pickle beside its traces


class Finding(BaseModel):
    """One ranked observation about a capture (sidecar/analysis/findings.py holds the rules)."""

    # host_bound | launch_bound | communication_exposed | memory_bound | straggler | start_skew | idle_other
    # | handover_latency
    rule: str
    severity: str  # high | medium | low; info for a figure that is no problem (handover_latency)
    score: float  # ranking key: the share of the window the finding explains
    message: str
    figures: dict[str, float] = Field(default_factory=dict)
    stage_id: int | None = None
    replica: int | None = None
    rank: int | None = None
    device: int | None = None


class CommonWindow(BaseModel):
    """The span every rank (device) of the capture was recording, on the hosts' clock (epoch µs):
    the latest profiling start to the earliest profiling end (Kineto's profiler spans)."""

    start_epoch_us: float | None = None
    end_epoch_us: float | None = None
    span_us: float = 0.0
    # what start_skew_us is measured from: requested_start | earliest_rank (of the device's own stage)
    reference: str = "earliest_rank"
    requested_start_epoch_us: float | None = None
    devices: int = 0


class StageStart(BaseModel):
    """When the ranks and replicas of one stage started profiling (Kineto's profiler span, else their
    first event), compared with each other only: stages start work at different times by design."""

    stage_id: int | None = None
    members: int  # devices (summary) or traces (fleet) compared
    earliest_epoch_us: float
    latest_epoch_us: float
    spread_us: float  # latest − earliest
    common_us: float = 0.0  # the span every member of the stage was recording
    latest_replica: int | None = None  # the member that started last
    latest_rank: int | None = None
    latest_device: int | None = None


class Handover(BaseModel):
    """A downstream stage's first work after its upstream stage's (the next lower stage id of the same
    pipeline): how long the pipeline took to hand it work, not a start skew."""

    pipeline: str | None = None  # whose stages hand work to each other (a fleet target); None: the capture's
    stage_id: int
    upstream_stage_id: int
    latency_us: float  # its first work − the upstream stage's first work (≥ 0)
    waited_us: float | None = None  # its first work − its own profiling start
    first_work_epoch_us: float
    upstream_first_work_epoch_us: float


class CaptureSummary(SummaryBody):
    """Every file merged, plus each stage and each file on its own."""

    findings: list[Finding] = Field(default_factory=list)
    common_window: CommonWindow | None = None
    snapshots: list[SnapshotSummary] = Field(default_factory=list)
    stage_starts: list[StageStart] = Field(default_factory=list)
    handovers: list[Handover] = Field(default_factory=list)

    stages: list[StageSummary] = Field(default_factory=list)
    files: list[TraceSummary] = Field(default_factory=list)
    replicas: list[ReplicaStat] = Field(default_factory=list)
    stragglers: list[Straggler] = Field(default_factory=list)
