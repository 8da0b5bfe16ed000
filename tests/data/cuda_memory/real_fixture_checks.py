"""The checks of the real CUDA fixtures, to go into tests/test_memory.py once make_cuda_memory.py
has run on a GPU and its three files are committed beside this one. Not collected (no ``test_``
file name): with no fixture files they could only skip, and a skipped test fails CI. Moving them
in is the whole step: they use test_memory.py's own helpers (``within``, ``_viz``, ``_size``).
"""

import json
import re
from pathlib import Path
from typing import Any

import pytest

from sidecar.analysis.snapshot import read_snapshot, summarize_snapshot
from sidecar.analysis import summarize_trace
from tests.test_memory import _size, _viz, within

# --- real CUDA fixtures (tests/data/cuda_memory/make_cuda_memory.py, run on one GPU) -----------

CUDA = Path(__file__).parent


@pytest.fixture(scope="module")
def cuda_truth() -> dict[str, Any]:
    return json.loads((CUDA / "cuda_memory.truth.json").read_text())


def test_a_real_cuda_snapshot_is_read_safely_and_matches_the_allocators_own_stats(cuda_truth: dict[str, Any]) -> None:
    viz = _viz()
    path = CUDA / "memory_snapshot_rank0.pickle"
    data = read_snapshot(path)  # torch's own dump: plain data only, no global refused
    [dev] = summarize_snapshot(path).devices
    t = cuda_truth["snapshot"]
    # the segments' split is the allocator's own at the dump (torch.cuda.memory_stats)
    assert (dev.device, dev.segments, dev.reserved_bytes) == (0, t["segments"], t["reserved_bytes"]), dev
    assert dev.allocated_bytes + dev.pending_free_bytes == t["active_bytes"]
    assert within(dev.requested_bytes, t["requested_bytes"])
    stats = dict(re.findall(r"^(total_reserved|total_allocated|segments): (\S+)", viz.segsum(data), re.M))
    assert within(dev.reserved_bytes, _size(stats["total_reserved"]))
    assert within(dev.requested_bytes, _size(stats["total_allocated"]))
    # the history's peak, with what was allocated before it began, is the allocator's peak
    assert within(dev.peak_bytes, t["peak_allocated_bytes"]), (dev.peak_bytes, t)
    assert any("make_cuda_memory.py" in f for b in dev.largest_blocks for f in b.frames), dev.largest_blocks


def test_a_real_cuda_trace_with_memory_matches_the_allocators_peak_and_key_averages(cuda_truth: dict[str, Any]) -> None:
    t = cuda_truth["trace"]
    s = summarize_trace(CUDA / "cuda_memory_rank0.json.gz", top=1000)
    [m] = [m for m in s.memory if m.device_type == "cuda"]
    assert (m.device, m.steps) == (0, t["steps"])
    assert within(m.peak_allocated_bytes, t["peak_allocated_bytes"]), (m.peak_allocated_bytes, t)
    assert within(m.start_allocated_bytes, t["allocated_before_window_bytes"])
    ours: dict[str, int] = {}
    for o in s.memory_ops:
        if o.device_type == "cuda":
            key = re.sub(r"^ProfilerStep#\d+$", "ProfilerStep*", o.name)
            ours[key] = ours.get(key, 0) + o.self_bytes
    ref = t["self_device_memory_usage"]
    top = sorted(ref, key=lambda k: -abs(ref[k]))[:10]
    assert len(top) >= 5 and {k: ours.get(k, 0) for k in top} == pytest.approx({k: ref[k] for k in top}, rel=0.02)
