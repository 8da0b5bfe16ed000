"""Make the real CUDA memory fixtures on a GPU machine (``python make_cuda_memory.py OUT_DIR``).

What vLLM-Omni writes for a stage profiled with ``torch_profiler_with_memory`` on CUDA, made with
torch's own APIs on one GPU, with torch's own figures of the same run kept beside them as the truth
the tests check against (``cuda_memory.truth.json``):

- ``memory_snapshot_rank0.pickle``: ``torch.cuda.memory._record_memory_history`` around a few
  training steps of a small transformer whose weights were on the GPU before the history began,
  then ``torch.cuda.memory._dump_snapshot`` (what vLLM-Omni's worker calls). The truth holds
  ``torch.cuda.memory_stats()`` at the dump: allocated, reserved, active, requested, inactive split,
  segments, and the allocator's peak since the history began.
- ``cuda_memory_rank0.json.gz``: ``torch.profiler`` with ``profile_memory=True`` and
  ``with_stack=True`` (the ``memory`` stage profile) over the same kind of steps; the truth holds the
  allocator's peak over the window (``max_memory_allocated`` reset at the window's start), what was
  allocated before it, and ``key_averages``' ``self_device_memory_usage`` per op.

Nothing here runs in the tests: they read the files this wrote (tests/test_memory.py, "real CUDA
fixtures"). Run 2026-12-05 on one NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130):
``python3 tests/data/cuda_memory/make_cuda_memory.py $OUT``, the three files committed as written.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda:0")
torch.manual_seed(0)


def model_and_batch() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    layer = torch.nn.TransformerEncoderLayer(256, nhead=4, dim_feedforward=1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(dev)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(8, 128, 256, device=dev)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, cache: list[torch.Tensor]) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    cache.append(torch.empty(4 << 20, dtype=torch.uint8, device=dev))  # a growing cache, kept live
    torch.cuda.synchronize()


def stats() -> dict[str, int]:
    s = torch.cuda.memory_stats(dev)
    return {"allocated_bytes": s["allocated_bytes.all.current"], "reserved_bytes": s["reserved_bytes.all.current"],
            "active_bytes": s["active_bytes.all.current"], "requested_bytes": s["requested_bytes.all.current"],
            "inactive_split_bytes": s["inactive_split_bytes.all.current"], "segments": s["segment.all.current"],
            "peak_allocated_bytes": s["allocated_bytes.all.peak"]}


truth: dict = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name(dev)}

# --- the snapshot ---------------------------------------------------------------------------
model, opt, x = model_and_batch()
cache: list[torch.Tensor] = []
step(model, opt, x, cache)  # optimizer state exists before the history: "allocated before it"
torch.cuda.synchronize()
before = torch.cuda.memory_allocated(dev)
torch.cuda.reset_peak_memory_stats(dev)
torch.cuda.memory._record_memory_history(max_entries=4000, stacks="python")
for _ in range(2):
    step(model, opt, x, cache)
scratch = torch.empty(24 << 20, dtype=torch.uint8, device=dev)  # allocated and freed in the history
del scratch
torch.cuda.synchronize()
snap = OUT / "memory_snapshot_rank0.pickle"
at_dump = stats()
torch.cuda.memory._dump_snapshot(str(snap))
torch.cuda.memory._record_memory_history(enabled=None)
truth["snapshot"] = {**at_dump, "allocated_before_history_bytes": before}
del model, opt, x, cache
torch.cuda.synchronize()
torch.cuda.empty_cache()

# --- the trace with memory events -----------------------------------------------------------
model, opt, x = model_and_batch()
cache = []
step(model, opt, x, cache)
torch.cuda.synchronize()
before = torch.cuda.memory_allocated(dev)
torch.cuda.reset_peak_memory_stats(dev)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True, record_shapes=True,
             with_stack=True) as prof:
    for i in range(3):
        with record_function(f"ProfilerStep#{i + 1}"):
            step(model, opt, x, cache)
window = stats()
raw = OUT / "cuda_memory_rank0.json"
prof.export_chrome_trace(str(raw))
with raw.open("rb") as src, gzip.open(OUT / "cuda_memory_rank0.json.gz", "wb", compresslevel=9) as dst:
    shutil.copyfileobj(src, dst)
os.unlink(raw)
truth["trace"] = {**window, "allocated_before_window_bytes": before, "steps": 3,
                  "self_device_memory_usage": {e.key: e.self_device_memory_usage for e in prof.key_averages()
                                               if e.self_device_memory_usage}}
(OUT / "cuda_memory.truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True) + "\n")
for p in sorted(OUT.iterdir()):
    print(p.name, p.stat().st_size)
print(json.dumps({k: v for k, v in truth.items() if k != "trace"}, indent=1))
print({k: v for k, v in truth["trace"].items() if k != "self_device_memory_usage"})
