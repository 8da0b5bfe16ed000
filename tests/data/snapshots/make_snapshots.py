"""Make the CUDA memory snapshot fixtures (``python tests/data/snapshots/make_snapshots.py``).

No GPU was at hand, so these are **hand-built in torch's documented snapshot format** (what
``torch.cuda.memory._snapshot()`` returns and ``_dump_snapshot`` pickles: ``segments`` with
``blocks`` {size, requested_size, state, frames}; ``device_traces`` entries {action, addr, size,
stream, frames, time_us}), and the tests check every figure the sidecar reads from them against
torch's own readers (``torch.cuda._memory_viz``: ``segsum``, ``memory``, ``trace``). A real CUDA
snapshot fixture awaits a GPU machine (vLLM-Omni writes ``memory_snapshot_rank<N>.pickle`` beside
the trace of a stage profiled with ``torch_profiler_with_memory``).

- ``two_devices.pickle``: a tiny caching allocator simulated on two devices: weights allocated
  before the history began (still live), an activation allocated before it and freed in it, a
  segment allocated and freed inside it, a block whose free is pending (``active_pending_free``),
  an out-of-memory entry, frames with the interpreter's and the allocator's frames mixed in (torch's
  readers leave those out). ``two_devices.truth.json`` holds what the simulator knows: per device
  the split at the end, the peak of the history, what was allocated before it, what was live at
  the peak.
- ``torch_profile.pickle``: a snapshot that torch itself built (``_memory_viz._profile_to_snapshot``)
  from a CPU run profiled with ``profile_memory``: torch's own writer of the format, no GPU needed.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

HERE = Path(__file__).parent
MiB = 1 << 20
PY = [  # an allocation's Python stack, innermost first, as the CUDA caching allocator records it
    {"filename": "/opt/torch/csrc/profiler/combined_traceback.cpp", "line": 0, "name": "CapturedTraceback::gather"},
    {"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
    {"filename": "Python/ceval.c", "line": 5100, "name": "_PyEval_EvalFrameDefault"},
    {"filename": "/usr/lib/python3.11/site-packages/vllm/model_executor/models/qwen2.py", "line": 210, "name": "forward"},
    {"filename": "/usr/lib/python3.11/site-packages/vllm/worker/model_runner.py", "line": 1500, "name": "execute_model"},
]


def frames(fn: str, line: int) -> list[dict]:
    """``PY`` with its second frame (the first one torch keeps) naming ``fn`` at ``line``."""
    out = [dict(f) for f in PY]
    out[1] = {"filename": f"/usr/lib/python3.11/site-packages/vllm/{fn}.py", "line": line, "name": fn}
    return out


class Device:
    """Segments at fixed addresses, allocations placed at given offsets; every change recorded in
    the history with a microsecond clock, and the allocated total followed for the truth."""

    def __init__(self, device: int, base: int) -> None:
        self.device, self.base, self.t = device, base, 1_000_000
        self.segments: dict[int, dict] = {}  # address -> {size, stream}
        self.allocs: dict[int, dict] = {}  # address -> {size, requested, frames, state}
        self.trace: list[dict] = []
        self.total = 0  # allocated by the history's reading (alloc .. free_completed)
        self.initial = 0
        self.peak = 0
        self.live_at_peak: list[int] = []

    def _log(self, action: str, addr: int, size: int, fr: list[dict] | None = None, **extra) -> None:
        self.t += 250
        self.trace.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": self.t,
                           "frames": fr or [], **extra})

    def _mark(self) -> None:
        if self.total > self.peak:
            self.peak = self.total
            self.live_at_peak = sorted((a["size"] for a in self.allocs.values()), reverse=True)

    def segment(self, offset: int, size: int, *, logged: bool) -> int:
        addr = self.base + offset
        self.segments[addr] = {"size": size, "stream": 0}
        if logged:
            self._log("segment_alloc", addr, size)
        return addr

    def segment_free(self, addr: int) -> None:
        self._log("segment_free", addr, self.segments.pop(addr)["size"])

    def alloc(self, addr: int, size: int, requested: int, fr: list[dict], *, logged: bool = True) -> int:
        self.allocs[addr] = {"size": size, "requested": requested, "frames": fr, "state": "active_allocated"}
        self.total += size
        if logged:
            self._log("alloc", addr, size, fr)
        else:
            self.initial += size
        self._mark()
        return addr

    def free(self, addr: int, *, complete: bool = True) -> None:
        a = self.allocs[addr]
        self._log("free_requested", addr, a["size"], a["frames"])
        a["state"] = "active_pending_free"
        if complete:
            self._log("free_completed", addr, a["size"], a["frames"])
            del self.allocs[addr]
            self.total -= a["size"]
            self._mark()

    def oom(self, size: int) -> None:
        self._log("oom", 0, size, device_free=3 * MiB)

    def snapshot(self) -> tuple[list[dict], list[dict]]:
        segs = []
        for addr, seg in sorted(self.segments.items()):
            blocks, at, end = [], addr, addr + seg["size"]
            for a_addr, a in sorted((k, v) for k, v in self.allocs.items() if addr <= k < end):
                if a_addr > at:
                    blocks.append({"address": at, "size": a_addr - at, "requested_size": 0, "state": "inactive", "frames": []})
                blocks.append({"address": a_addr, "size": a["size"], "requested_size": a["requested"],
                               "state": a["state"], "frames": a["frames"]})
                at = a_addr + a["size"]
            if at < end:
                blocks.append({"address": at, "size": end - at, "requested_size": 0, "state": "inactive", "frames": []})
            used = [b for b in blocks if b["state"] != "inactive"]
            segs.append({"device": self.device, "address": addr, "total_size": seg["size"], "stream": seg["stream"],
                         "segment_type": "large" if seg["size"] >= 20 * MiB else "small",
                         "allocated_size": sum(b["size"] for b in used if b["state"] == "active_allocated"),
                         "active_size": sum(b["size"] for b in used),
                         "requested_size": sum(b["requested_size"] for b in used), "is_expandable": False,
                         "blocks": blocks})
        return segs, self.trace

    def truth(self, segs: list[dict]) -> dict:
        blocks = [b for s in segs for b in s["blocks"]]
        by = {st: sum(b["size"] for b in blocks if b["state"] == st)
              for st in ("active_allocated", "active_pending_free", "inactive")}
        return {"device": self.device, "segments": len(segs), "reserved_bytes": sum(s["total_size"] for s in segs),
                "allocated_bytes": by["active_allocated"], "pending_free_bytes": by["active_pending_free"],
                "inactive_bytes": by["inactive"],
                "requested_bytes": sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated"),
                "history_peak_bytes": self.peak, "allocated_before_history_bytes": self.initial,
                "live_at_peak_sizes": self.live_at_peak,
                "ooms": sum(1 for e in self.trace if e["action"] == "oom")}


def two_devices() -> tuple[dict, dict]:
    d0 = Device(0, 0x7F00_0000_0000)
    big = d0.segment(0, 40 * MiB, logged=False)  # reserved before the history began
    small = d0.segment(64 * MiB, 2 * MiB, logged=False)
    d0.alloc(big, 16 * MiB, 16 * MiB - 1000, frames("load_weights", 88), logged=False)  # weights: live throughout
    early = d0.alloc(big + 16 * MiB, 4 * MiB, 4 * MiB, frames("warmup", 12), logged=False)  # freed in the history
    a1 = d0.alloc(big + 20 * MiB, 8 * MiB, 8 * MiB - 512, frames("qkv_proj", 125))
    s1 = d0.alloc(small, 512, 500, frames("rotary_emb", 40))
    d0.free(early)
    extra = d0.segment(80 * MiB, 20 * MiB, logged=True)
    a2 = d0.alloc(extra, 12 * MiB, 12 * MiB, frames("mlp_up", 300))
    a3 = d0.alloc(big + 28 * MiB, 2 * MiB, 2 * MiB - 4096, frames("logits", 77))  # the peak: 16 + 8 + 12 + 2 MiB + 512
    d0.free(a2)
    d0.segment_free(extra)
    d0.oom(64 * MiB)
    d0.free(a3, complete=False)  # stays active_pending_free: its stream has not finished with it
    d0.alloc(big + 30 * MiB, 3 * MiB, 3 * MiB, frames("sampler", 9))
    d0.free(s1)
    del a1  # a1 stays allocated to the end

    d1 = Device(1, 0x7E00_0000_0000)
    seg = d1.segment(0, 20 * MiB, logged=False)
    d1.alloc(seg, 6 * MiB, 6 * MiB, frames("load_weights", 88), logged=False)
    b1 = d1.alloc(seg + 6 * MiB, 6 * MiB, 5 * MiB, frames("kv_cache", 501))
    d1.free(b1)
    d1.alloc(seg + 12 * MiB, 1 * MiB, 1 * MiB, frames("sampler", 9))

    segs0, trace0 = d0.snapshot()
    segs1, trace1 = d1.snapshot()
    snap = {"segments": segs0 + segs1, "device_traces": [trace0, trace1],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}
    return snap, {"devices": [d0.truth(segs0), d1.truth(segs1)]}


def torch_profile() -> dict:
    """torch's own snapshot writer, from a CPU run (needs torch; its addresses vary per run)."""
    import torch
    from torch.cuda._memory_viz import _profile_to_snapshot
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        for _ in range(3):
            model(x).sum().backward()
    return _profile_to_snapshot(prof)


def main() -> None:
    snap, truth = two_devices()
    (HERE / "two_devices.pickle").write_bytes(pickle.dumps(snap))
    (HERE / "two_devices.truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    (HERE / "torch_profile.pickle").write_bytes(pickle.dumps(torch_profile()))
    for name in ("two_devices.pickle", "two_devices.truth.json", "torch_profile.pickle"):
        print(f"{HERE / name}: {(HERE / name).stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
