"""CLI: what held memory, from a capture's summary (``memory``, ``snapshots``: sidecar/analysis/memory.py
and snapshot.py), as ``summarize`` prints it per stage and ``stop`` / ``capture`` after the verdicts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sidecar.analysis.memory import format_bytes
from sidecar.analysis.models import DeviceMemory, MemoryOpStat, SnapshotSummary

if TYPE_CHECKING:
    from sidecar.analysis.diff import MemoryDelta, MemoryOpDelta
from sidecar.cli._app import console
from sidecar.cli._layout import Column, print_table


def _right(*headers: str) -> list[Column]:
    return [Column(h, "right") for h in headers]


def _ms(us: float) -> str:
    return f"{us / 1000:,.3f}"


def _bytes(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def _signed(n: int | None) -> str:
    return "-" if n is None else ("+" if n > 0 else "") + format_bytes(n)


def _device(m: DeviceMemory | MemoryDelta) -> str:
    where = "·".join(str(v) if v is not None else "-" for v in (m.stage_id, m.replica, m.rank))
    return f"{where} {m.device_type}" + (f":{m.device}" if m.device >= 0 else "")


def print_memory(memory: Sequence[DeviceMemory], snapshots: Sequence[SnapshotSummary] = (),
                 ops: Sequence[MemoryOpStat] = ()) -> None:
    """What held memory (sidecar/analysis/memory.py): per device the peak, when, reserved but free
    then, the churn per step, then what was live at the peak by op, and ``ops`` by the bytes they
    allocated (key_averages' memory columns); then each CUDA snapshot's segments, largest live
    blocks and the peak of its history (sidecar/analysis/snapshot.py)."""
    if memory:
        print_table(console, "Memory per stage·replica·rank device (torch's memory events)",
                    [Column("where"), *_right("peak allocated", "reserved at peak", "free at peak", "peak at ms", "step",
                                              "alloc / step", "freed / step", "OOMs")],
                    [[_device(m), _bytes(m.peak_allocated_bytes), _bytes(m.reserved_at_peak_bytes),
                      "-" if m.free_at_peak_share is None else f"{m.free_at_peak_share:.0%}",
                      "-" if m.peak_offset_us is None else _ms(m.peak_offset_us),
                      "-" if m.peak_step is None else str(m.peak_step),
                      _bytes(m.alloc_bytes_per_step), _bytes(m.freed_bytes_per_step), str(m.ooms)] for m in memory])
        rows = [[_device(m), op.name, _bytes(op.bytes), str(op.blocks), " > ".join(op.stack)]
                for m in memory for op in m.live_at_peak[:5]]
        rows += [[_device(m), "(allocated before the window)", _bytes(m.before_window_bytes_at_peak), "", ""]
                 for m in memory if m.before_window_bytes_at_peak]
        print_table(console, "Live at the peak, by the op that allocated it",
                    [Column("where"), Column("op"), *_right("bytes", "blocks"), Column("ops around it", prose=True)],
                    rows, keys=2)
    if ops:
        print_table(console, "Ops by memory allocated (while innermost; self = allocated − freed)",
                    [Column("op"), Column("device"), *_right("allocs", "allocated", "frees", "freed", "self")],
                    [[o.name, o.device_type, f"{o.allocs:,}", _bytes(o.alloc_bytes), f"{o.frees:,}", _bytes(o.freed_bytes),
                      _signed(o.self_bytes)] for o in ops], keys=2)
    for sn in snapshots:
        print_table(console, f"CUDA memory snapshot {sn.file}",
                    [Column("device"), *_right("segments", "reserved", "allocated", "pending free", "inactive",
                                               "history peak", "OOMs")],
                    [[str(d.device), str(d.segments), _bytes(d.reserved_bytes), _bytes(d.allocated_bytes),
                      _bytes(d.pending_free_bytes), _bytes(d.inactive_bytes), _bytes(d.peak_bytes), str(d.ooms)]
                     for d in sn.devices])
        print_table(console, "Largest live blocks, and what was live at the history's peak",
                    [Column("device"), Column("when"), *_right("size"), Column("allocated at", prose=True)],
                    [[str(d.device), when, _bytes(b.size), " < ".join(b.frames[:4]) or "-"]
                     for d in sn.devices for when, blocks in (("at the stop", d.largest_blocks[:5]),
                                                              ("at the peak", d.live_at_peak[:5]))
                     for b in blocks], keys=2)


def print_memory_diff(memory: Sequence[MemoryDelta], ops: Sequence[MemoryOpDelta]) -> None:
    """``diff``'s memory part (sidecar/analysis/diff.py): per device the peak, reserved memory at
    it, the churn per step and failed allocations on both sides, with the op holding the most at
    each side's peak; then ops by the change in bytes they allocated."""
    if memory:
        print_table(console, "Memory per stage·replica·rank device, A → B",
                    [Column("where"), *_right("peak allocated A→B", "Δ peak", "reserved at peak A→B", "alloc / step A→B",
                                              "OOMs"), Column("most live at the peak A → B", prose=True)],
                    [[_device(m), f"{_bytes(m.peak_allocated_bytes_a)}→{_bytes(m.peak_allocated_bytes_b)}",
                      _signed(m.delta_peak_allocated_bytes),
                      f"{_bytes(m.reserved_at_peak_bytes_a)}→{_bytes(m.reserved_at_peak_bytes_b)}",
                      f"{_bytes(m.alloc_bytes_per_step_a)}→{_bytes(m.alloc_bytes_per_step_b)}", f"{m.ooms_a}→{m.ooms_b}",
                      " → ".join(f"{t.name} {_bytes(t.bytes)}" if t else "-" for t in (m.top_live_a, m.top_live_b))]
                     for m in memory])
    if ops:
        print_table(console, "ops by change in memory allocated",
                    [Column("op"), Column("device"), *_right("allocs A→B"),
                     *(Column(h, "right", group="bytes") for h in ("allocated A", "B", "Δ"))],
                    [[o.name, o.device_type, f"{o.allocs_a:,}→{o.allocs_b:,}", _bytes(o.alloc_bytes_a),
                      _bytes(o.alloc_bytes_b), _signed(o.delta_alloc_bytes)] for o in ops], keys=2)
