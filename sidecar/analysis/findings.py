"""A capture's findings: which stage · replica · rank is slow and why, ranked.

Every rule is here, each a function of one device's attribution fields (or of the capture's
stragglers, each stage's profiling starts and the pipeline's hand-overs) returning its figures when
it fires; ``word`` is the one place that turns figures into a sentence. ``capture_findings`` ranks
them by ``score`` (the share of the window the finding explains); severity follows the score. A
hand-over latency is a figure, not a problem: severity ``info``, score 0, ranked last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sidecar.analysis.memory import format_bytes
from sidecar.analysis.models import DeviceMemory, DeviceStat, Finding, Handover, StageStart, Straggler

IDLE = 0.5  # GPU idle at least half of the steady window
HOST_WAIT = 0.5  # ... and at least half of that waiting on the host
OTHER_WAIT = 0.5  # ... or on something else
COMM_EXPOSED = 0.05  # communication not under compute, share of the window
OVERLAP_LOW = 0.5
MEMORY = 0.10  # memcpy/memset not under compute or communication, share of the window
STRAGGLER = 1.2  # slowest member / median of its stage
SKEW_US = 100_000.0  # profiling starts of one stage's ranks and replicas this far apart
HANDOVER_US = 10_000.0  # a downstream stage's first work this long after its upstream stage's
_SMALL_PEAK = 1 << 20  # bytes: a device whose peak is under this gets no memory_peak finding (nothing to act on)


def _host_bound(d: DeviceStat) -> dict[str, float] | None:
    t, i = d.temporal, d.idle_breakdown
    if t is None or i is None or t.idle_share < IDLE or i.host_wait_share < HOST_WAIT:
        return None
    return {"idle_share": t.idle_share, "host_wait_share": i.host_wait_share, "score": t.idle_share * i.host_wait_share}


def _launch_bound(d: DeviceStat) -> dict[str, float] | None:
    lc, t = d.launch, d.temporal
    if lc is None or t is None or not lc.cpu_bound:
        return None
    return {"short_share": lc.short_share, "gpu_shorter_than_launch_share": lc.gpu_shorter_than_launch_share,
            "delay_p50_us": lc.delay_p50_us or 0.0, "score": t.idle_share * lc.gpu_shorter_than_launch_share}


def _idle_other(d: DeviceStat) -> dict[str, float] | None:
    t, i = d.temporal, d.idle_breakdown
    if t is None or i is None or t.idle_share < IDLE or i.other_share < OTHER_WAIT:
        return None
    return {"idle_share": t.idle_share, "other_share": i.other_share, "score": t.idle_share * i.other_share}


def _communication_exposed(d: DeviceStat) -> dict[str, float] | None:
    t, o = d.temporal, d.overlap
    if t is None or o is None or t.communication_share < COMM_EXPOSED:
        return None
    share = o.share or 0.0
    if share >= OVERLAP_LOW:
        return None
    return {"communication_share": t.communication_share, "overlap_share": share, "score": t.communication_share}


def _memory_bound(d: DeviceStat) -> dict[str, float] | None:
    t = d.temporal
    if t is None or t.memory_share < MEMORY:
        return None
    return {"memory_share": t.memory_share, "score": t.memory_share}


DEVICE_RULES: dict[str, Callable[[DeviceStat], dict[str, float] | None]] = {
    "host_bound": _host_bound,
    "launch_bound": _launch_bound,
    "idle_other": _idle_other,
    "communication_exposed": _communication_exposed,
    "memory_bound": _memory_bound,
}


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def word(rule: str, f: dict[str, float], op: str | None = None) -> str:
    """The sentence for a rule's figures (without the stage · replica · rank); ``op``: the op a
    memory finding names."""
    if rule == "memory_peak":
        held = (f"peak {format_bytes(f['peak_allocated_bytes'])} allocated"
                + (f" of {format_bytes(f['reserved_at_peak_bytes'])} reserved" if "reserved_at_peak_bytes" in f else "")
                + (f" ({_pct(f['capacity_share'])} of the device's memory)" if "capacity_share" in f else ""))
        live = f"; {format_bytes(f['top_live_bytes'])} of it live from `{op}`" if op and f.get("top_live_bytes") else ""
        free = (f"; {_pct(f['free_at_peak_share'])} reserved but free at the peak"
                if f.get("free_at_peak_share") is not None and "reserved_at_peak_bytes" in f else "")
        return held + live + free
    if rule == "out_of_memory":
        return (f"{f['ooms']:.0f} allocation(s) failed: out of memory, with {format_bytes(f['peak_allocated_bytes'])} "
                "allocated at the peak" + (f" of {format_bytes(f['reserved_at_peak_bytes'])} reserved"
                                           if "reserved_at_peak_bytes" in f else ""))
    if rule == "host_bound":
        return f"GPU idle {_pct(f['idle_share'])} of the window, {_pct(f['host_wait_share'])} of it waiting on the host"
    if rule == "launch_bound":
        return (f"{_pct(f['short_share'])} of kernels shorter than 10 µs, {_pct(f['gpu_shorter_than_launch_share'])} "
                f"ran shorter than their launch call (launch delay p50 {f['delay_p50_us']:.1f} µs): launch-bound; "
                "fewer, larger kernels (fusion, a larger batch) or CUDA graphs help")
    if rule == "idle_other":
        return (f"GPU idle {_pct(f['idle_share'])} of the window, {_pct(f['other_share'])} of it neither on the host nor "
                "between kernels: waiting on another stream, an event or another stage")
    if rule == "communication_exposed":
        return (f"communication takes {_pct(f['communication_share'])} of the window with only "
                f"{_pct(f['overlap_share'])} of it overlapped by compute")
    if rule == "memory_bound":
        return f"memcpy/memset take {_pct(f['memory_share'])} of the window, not hidden under compute"
    if rule == "straggler":
        return f"{f['ratio']:.2f}× the median of its stage ({f['slowest_us'] / 1000:,.1f} vs {f['median_us'] / 1000:,.1f} ms)"
    if rule == "start_skew":
        return (f"the ranks and replicas of its stage started profiling up to {f['spread_us'] / 1000:,.0f} ms apart; "
                f"the window common to all of them is {f['common_us'] / 1000:,.0f} ms")
    if rule == "handover_latency":
        return (f"waited {f['latency_us'] / 1000:,.0f} ms for stage {f['upstream_stage_id']:.0f}'s first output "
                "(the pipeline's hand-over latency, not a start skew)")
    raise KeyError(rule)


def _where(stage: int | None, replica: int | None, rank: int | None) -> str:
    parts = [f"stage {stage}"] if stage is not None else []
    if replica is not None:
        parts.append(f"replica {replica}")
    if rank is not None:
        parts.append(f"rank {rank}")
    return " · ".join(parts) or "the trace"


def _severity(score: float) -> str:
    return "high" if score >= 0.5 else "medium" if score >= 0.2 else "low"


def _finding(rule: str, figures: dict[str, float], where: str, severity: str | None = None, **keys: int | None) -> Finding:
    score = min(1.0, figures.pop("score"))
    return Finding(rule=rule, severity=severity or _severity(score), score=score,
                   message=f"{where}: {word(rule, figures)}", figures=figures, **keys)


def memory_findings(memory: Sequence[DeviceMemory]) -> list[Finding]:
    """Per device with memory events: its peak and who held it (``memory_peak``, scored by the
    share of the device's memory it held, 0 where the capacity is unknown: a CPU; none for a peak
    under 1 MiB), and failed allocations (``out_of_memory``, score 1)."""
    out: list[Finding] = []
    for m in memory:
        held = m.reserved_at_peak_bytes if m.reserved_at_peak_bytes is not None else m.peak_allocated_bytes
        fig: dict[str, float] = {"peak_allocated_bytes": float(m.peak_allocated_bytes)}
        if m.reserved_at_peak_bytes is not None:
            fig["reserved_at_peak_bytes"] = float(m.reserved_at_peak_bytes)
        if m.free_at_peak_share is not None:
            fig["free_at_peak_share"] = m.free_at_peak_share
        if m.capacity_bytes:
            fig["capacity_share"] = held / m.capacity_bytes
        top = m.live_at_peak[0] if m.live_at_peak else None
        if top is not None:
            fig["top_live_bytes"] = float(top.bytes)
        where = _where(m.stage_id, m.replica, m.rank) + (f" ({m.device_type})" if m.device_type != "cuda" else "")
        keys = {"stage_id": m.stage_id, "replica": m.replica, "rank": m.rank, "device": m.device}
        if m.ooms:
            oom = {k: v for k, v in fig.items() if k in ("peak_allocated_bytes", "reserved_at_peak_bytes")}
            out.append(_finding("out_of_memory", {**oom, "ooms": float(m.ooms), "score": 1.0}, where, **keys))
        if m.peak_allocated_bytes < _SMALL_PEAK and not m.ooms:
            continue  # nothing to act on (a CUDA trace's CPU device holds a few bytes); the table has it
        score = fig.get("capacity_share", 0.0)
        f = Finding(rule="memory_peak", severity=_severity(score), score=min(1.0, score),
                    message=f"{where}: {word('memory_peak', fig, top.name if top else None)}", figures=fig, **keys)
        out.append(f)
    return out


def with_memory(findings: list[Finding], memory: Sequence[DeviceMemory]) -> list[Finding]:
    """``findings`` and the memory ones, ranked together as ``capture_findings`` ranks."""
    return sorted([*findings, *memory_findings(memory)], key=lambda f: (f.severity == "info", -f.score))


def handover_finding(h: Handover) -> Finding:
    """A downstream stage's hand-over latency as a finding (``fleet skew`` prints its message too)."""
    fig = {"latency_us": h.latency_us, "upstream_stage_id": float(h.upstream_stage_id), "score": 0.0}
    if h.waited_us is not None:
        fig["waited_us"] = h.waited_us
    return _finding("handover_latency", fig, _where(h.stage_id, None, None), "info", stage_id=h.stage_id)


def capture_findings(devices: Sequence[DeviceStat], stragglers: Sequence[Straggler] = (),
                     stage_starts: Sequence[StageStart] = (), handovers: Sequence[Handover] = ()) -> list[Finding]:
    """Every rule on every device, then the capture-wide ones, highest score first."""
    out: list[Finding] = []
    for d in devices:
        where = _where(d.stage_id, d.replica, d.rank)
        for rule, fires in DEVICE_RULES.items():
            fig = fires(d)
            if fig is not None:
                out.append(_finding(rule, fig, where, stage_id=d.stage_id, replica=d.replica, rank=d.rank, device=d.device))
    for s in stragglers:
        if s.ratio >= STRAGGLER:
            fig = {"ratio": s.ratio, "slowest_us": s.slowest_us, "median_us": s.median_us, "score": s.ratio - 1.0}
            out.append(_finding("straggler", fig, _where(s.stage_id, s.slowest_replica, s.slowest_rank),
                                stage_id=s.stage_id, replica=s.slowest_replica, rank=s.slowest_rank))
    for st in stage_starts:  # never across stages: a downstream stage starts work late by design
        if st.members >= 2 and st.spread_us >= SKEW_US:
            fig = {"spread_us": st.spread_us, "common_us": st.common_us, "members": st.members,
                   "score": st.spread_us / (st.spread_us + st.common_us)}
            out.append(_finding("start_skew", fig, _where(st.stage_id, st.latest_replica, st.latest_rank),
                                stage_id=st.stage_id, replica=st.latest_replica, rank=st.latest_rank,
                                device=st.latest_device))
    out += [handover_finding(h) for h in handovers if h.latency_us >= HANDOVER_US]
    return sorted(out, key=lambda f: (f.severity == "info", -f.score))


__all__ = ["DEVICE_RULES", "capture_findings", "handover_finding", "memory_findings", "with_memory", "word"]
