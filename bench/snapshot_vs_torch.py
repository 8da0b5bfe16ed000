"""Our reading of a CUDA memory snapshot beside torch's own tools' reading of the same file.

  python3 bench/snapshot_vs_torch.py memory_snapshot_rank0.pickle [more.pickle ...]

For any snapshot ``torch.cuda.memory._dump_snapshot`` wrote (what vLLM-Omni's workers write as
``memory_snapshot_rank<N>.pickle``): the file is read by the sidecar's safe unpickler (every global
refused) and summarised by ``summarize_snapshot``; then torch's ``torch.cuda._memory_viz`` readers,
which run on CPU, read it with the standard unpickler and each figure is put beside ours:

- segments, reserved, requested: ``segsum`` (``segments``, ``total_reserved``, ``total_allocated``);
- allocated, pending free, inactive: ``memory``'s flamegraph lines, summed by block state;
- the history's peak above its start: ``trace``'s replay (allocs in, completed frees out), against
  our peak less what was live before the history began;
- the largest live blocks: each one's frames are the innermost of a flamegraph line of that size.

Prints a row per figure and ``agree`` / ``DIFFER``; exits 1 if any differs. Needs torch (CPU is
enough). Unpickling runs code from the file in torch's reader: use it on files you trust (ours
refuses globals first; a file it refuses is not passed on).
"""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.analysis.snapshot import read_snapshot, summarize_snapshot  # noqa: E402
from sidecar.errors import TraceError  # noqa: E402


def torch_size(text: str) -> float:
    """A size as torch's ``_format_size`` writes it (``4.0MiB``)."""
    m = re.fullmatch(r"(-?[\d.]+)(|Ki|Mi|Gi|Ti)B", text.strip())
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * 1024 ** ["", "Ki", "Mi", "Gi", "Ti"].index(m.group(2))


def torch_history_high(text: str) -> float:
    """The highest total of one device's part of ``_memory_viz.trace``'s text, replayed as torch
    reads a history: allocs in, completed frees out, from 0 at its start."""
    total = high = 0.0
    for line in text.splitlines():
        if m := re.match(r"^\w+ = (?:seg_\d+|MEM|\w+)\[\d+:(\S+)\]$", line):
            total += torch_size(m.group(1))
        elif m := re.match(r"^# free completed for \S+ (\S+)$", line):
            total -= torch_size(m.group(1))
        high = max(high, total)
    return high


def _close(a: float, b: float, share: float) -> bool:
    return abs(a - b) <= share * max(abs(a), abs(b), 1.0)


def _before_history(trace: list[dict[str, Any]], segments: list[dict[str, Any]]) -> int:
    """Bytes live before the history began: freed in it without an alloc in it, or allocated at
    the dump without one (independently of sidecar.analysis.snapshot: the plain rule)."""
    live: set[Any] = set()
    before = 0
    for e in trace:
        if e.get("action") == "alloc":
            live.add(e.get("addr"))
        elif e.get("action") == "free_completed":
            if e.get("addr") in live:
                live.discard(e.get("addr"))
            else:
                before += e.get("size", 0)
    for seg in segments:
        addr = seg.get("address", 0)
        for b in seg.get("blocks", []):
            if b.get("state") in ("active_allocated", "active_pending_free") and addr not in live:
                before += b.get("size", 0)
            addr += b.get("size", 0)
    return before


def check(path: Path) -> bool:
    from torch.cuda import _memory_viz as viz

    try:
        read_snapshot(path)
        ours = summarize_snapshot(path)
    except TraceError as exc:
        print(f"{path}: refused by the sidecar's reader: {exc}")
        return False
    with path.open("rb") as f:
        data = pickle.load(f)
    ok = True
    print(f"{path}: {len(ours.devices)} device(s)")
    print(f"  {'device':>6}  {'figure':34} {'ours':>16} {'torch':>16}  verdict")

    def row(device: int, figure: str, mine: float | None, theirs: float | None, share: float = 0.0) -> None:
        nonlocal ok
        good = mine is not None and theirs is not None and _close(mine, theirs, share)
        ok &= good
        print(f"  {device:>6}  {figure:34} {mine if mine is not None else '-':>16} "
              f"{theirs if theirs is not None else '-':>16}  {'agree' if good else 'DIFFER'}")

    compared = 0

    def torch_reads(device: int, what: str, call: Any) -> Any:
        """torch's reader's answer, or None (said) where torch's own reader fails on the file."""
        try:
            return call()
        except Exception as exc:  # e.g. trace() on a snapshot _profile_to_snapshot made: no allocated_size
            print(f"  {device:>6}  {what:34} {'':>16} {'-':>16}  not compared: torch's reader failed "
                  f"({type(exc).__name__}: {str(exc)[:120]})")
            return None

    for dev in ours.devices:
        segs = [s for s in data.get("segments", []) if s.get("device") == dev.device]
        one = {**data, "segments": segs}
        text = torch_reads(dev.device, "segments, reserved, requested", lambda: viz.segsum(one))
        if text is not None:
            stats = dict(re.findall(r"^(total_reserved|total_allocated|segments): (\S+)", text, re.M))
            row(dev.device, "segments (segsum)", dev.segments, int(stats["segments"]))
            # segsum writes sizes with one decimal of their unit: agree within its rounding
            row(dev.device, "reserved bytes (segsum)", dev.reserved_bytes, torch_size(stats["total_reserved"]), 0.001)
            row(dev.device, "requested bytes (segsum)", dev.requested_bytes, torch_size(stats["total_allocated"]), 0.001)
            compared += 3
        lines = torch_reads(dev.device, "blocks by state (flamegraph)",
                            lambda: viz.memory(one, format_flamegraph=lambda x: x).splitlines())
        if lines is not None:
            by_state: dict[str, int] = {}
            flame: list[tuple[str, int]] = []
            for line in lines:
                _, state, *_ = line.split(";")
                size = int(line.rsplit(" ", 1)[1])
                by_state[state] = by_state.get(state, 0) + size
                if state == "active_allocated":
                    flame.append((line.rsplit(" ", 1)[0].split(";", 2)[2], size))
            row(dev.device, "allocated bytes (flamegraph)", dev.allocated_bytes, by_state.get("active_allocated", 0))
            row(dev.device, "pending-free bytes (flamegraph)", dev.pending_free_bytes, by_state.get("active_pending_free", 0))
            row(dev.device, "inactive bytes (flamegraph)", dev.inactive_bytes, by_state.get("inactive", 0))
            # torch writes a block's frames outermost first, joined by ";"; ours are its innermost
            found = sum(any(size == b.requested_size and stack.endswith(";".join(reversed(b.frames)))
                            for stack, size in flame) for b in dev.largest_blocks)
            row(dev.device, "largest blocks found in flamegraph", found, len(dev.largest_blocks))
            compared += 4
        traces = data.get("device_traces") or []
        trace = traces[dev.device] if dev.device < len(traces) else []
        history = torch_reads(dev.device, "history peak above its start (trace)", lambda: viz.trace(
            {**data, "device_traces": [trace if i == dev.device else [] for i in range(len(traces))]})) if trace else None
        if history is not None:
            above = dev.peak_bytes - _before_history(trace, segs) if dev.peak_bytes is not None else None
            row(dev.device, "history peak above its start (trace)", above, torch_history_high(history), 0.001)
            compared += 1
    if not compared:
        print("  nothing compared: torch's readers failed on every figure")
        ok = False
    return ok


def main() -> int:
    paths = [Path(p) for p in sys.argv[1:]]
    if not paths:
        print(__doc__)
        return 2
    results = [check(p) for p in paths]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
