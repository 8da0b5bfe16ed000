"""Make torch.profiler traces for tests and benchmarks: real ones (CPU here, CUDA on a GPU box)
and big ones by replicating a real trace's events with shifted timestamps and ids.

  python3 bench/gen_traces.py cpu --out /tmp/traces --steps 4 8 32     # one trace per step count
  python3 bench/gen_traces.py cpu --out /tmp/traces --steps 8 --memory  # profile_memory on (memory events)
  python3 bench/gen_traces.py gpu --out $OUT                           # on the GPU machine
  python3 bench/gen_traces.py gpu --out $OUT --memory --large-steps 90 # a large real CUDA trace with memory on
  python3 bench/gen_traces.py gpu --out $OUT --memory --no-stack --large-steps 90  # ... without stacks, and its twin without memory
  python3 bench/gen_traces.py replicate SRC.json[.gz] DST.json --size-mb 1000
  python3 bench/gen_traces.py hostbound --out $OUT                     # on the GPU machine

``hostbound`` writes three small real CUDA traces that exercise the attribution fields: a batch-1
loop of tiny elementwise kernels (the host cannot launch fast enough), the same with a CUDA graph
captured and replayed inside the window (``cuda_graph``), and a one-rank NCCL job whose 2048²
matmuls keep the GPU busy (``busy_gemm``; on one rank NCCL's all-reduce launches no kernel, so
the trace has no communication, only a GPU that is not idle).

Each real trace is written with ``<name>.key_averages.json`` beside it: torch's own per-key
count / self CPU / self device totals for the very same run (the correctness reference).
Imports torch only for ``cpu``/``gpu``; not part of the package.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path


def _model(torch, d_model: int, layers: int, device: str):
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=layers), torch.nn.Linear(d_model, 16))
    return model.to(device)


def key_averages_json(prof) -> dict:
    """Per key: count, self CPU and self device totals in µs, as torch's key_averages() reports them."""
    out = {}
    for evt in prof.key_averages():
        self_dev = getattr(evt, "self_device_time_total", None)
        if self_dev is None:
            self_dev = getattr(evt, "self_cuda_time_total", 0)
        out[evt.key] = {
            "count": int(evt.count),
            "self_cpu_us": float(evt.self_cpu_time_total),
            "cpu_total_us": float(evt.cpu_time_total),
            "self_device_us": float(self_dev),
            "device_type": str(evt.device_type),
        }
    return out


def profile_run(out: Path, name: str, *, device: str, steps: int, d_model: int, layers: int,
                batch: int, seq: int, with_stack: bool, gz: bool, memory: bool = False) -> Path:
    """Train ``steps`` steps of a small transformer under torch.profiler; write trace + key_averages."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = _model(torch, d_model, layers, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x_host = torch.randn(batch, seq, d_model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])

    def step():
        x = x_host.to(device, non_blocking=False)  # H2D memcpy on GPU
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach().to("cpu")  # D2H memcpy on GPU

    for _ in range(2):  # warm up outside the window (cuBLAS handles, allocator)
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities, with_stack=with_stack, profile_memory=memory) as prof:
        for i in range(steps):
            with record_function(f"ProfilerStep#{i + 1}"):
                step()
        if device == "cuda":
            torch.cuda.synchronize()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    prof.export_chrome_trace(str(path))
    (out / f"{name}.key_averages.json").write_text(json.dumps(key_averages_json(prof), indent=1))
    if gz:
        with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        path.unlink()
        path = Path(str(path) + ".gz")
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB", flush=True)
    return path


def _finish(prof, out: Path, name: str) -> Path:
    import torch

    torch.cuda.synchronize()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    prof.export_chrome_trace(str(path))
    (out / f"{name}.key_averages.json").write_text(json.dumps(key_averages_json(prof), indent=1))
    with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    path.unlink()
    path = Path(str(path) + ".gz")
    print(f"{path}: {path.stat().st_size / 1e6:.2f} MB", flush=True)
    return path


def host_bound(out: Path, name: str, *, steps: int, ops: int, graph: bool) -> Path:
    """Batch 1, ``ops`` × 3 tiny elementwise kernels per step: GPU idle, waiting on the launches.
    With ``graph``: a CUDA graph of the same step is captured inside the window, then replayed."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(1, 64, device="cuda")

    def step(y):
        for _ in range(ops):
            y = torch.relu(y * 1.0001 + 0.0001)
        return y

    for _ in range(2):
        step(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph() if graph else None
    side = torch.cuda.Stream()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if g is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(x)  # warm the side stream, as torch.cuda.graph's docs ask
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g):
                static = step(x)
        for i in range(steps):
            with record_function(f"ProfilerStep#{i + 1}"):
                if g is not None:
                    g.replay()
                    static.sum().item()
                else:
                    step(x).sum().item()
    return _finish(prof, out, name)


def busy_gemm(out: Path, name: str, *, steps: int) -> Path:
    """One-rank NCCL: each step all-reduces a 64 MB tensor (async) beside 2048² matmuls, then more
    matmuls: a busy GPU. (On one rank the all-reduce launches no kernel.)"""
    import os

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        buf = torch.randn(16 << 20, device="cuda")
        a = torch.randn(2048, 2048, device="cuda")

        def step():
            w = dist.all_reduce(buf, async_op=True)
            for _ in range(4):
                a.matmul(a)
            w.wait()
            for _ in range(4):
                a.matmul(a)
            torch.cuda.synchronize()

        for _ in range(2):
            step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(steps):
                with record_function(f"ProfilerStep#{i + 1}"):
                    step()
        return _finish(prof, out, name)
    finally:
        dist.destroy_process_group()


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


_ID_KEYS = ("External id", "correlation", "Record function id", "Ev Idx", "Python id", "Python parent id")


def replicate(src: Path, dst: Path, size_mb: float) -> Path:
    """Grow ``src`` to about ``size_mb`` MB of raw JSON by repeating its events.

    Copy k shifts every ``ts`` by k × (span + 1 ms) and every id-like field (``External id``,
    ``correlation``, flow ``id``, ...) by k × (that field's max + 1), so copies never overlap in
    time nor share ids: nesting, steps and correlations stay as in the original, k+1 times over.
    """
    with _open(src) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    meta = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M"]
    ts = [e["ts"] for e in body if isinstance(e.get("ts"), (int, float))]
    t0, t1 = min(ts), max(e.get("ts", 0) + e.get("dur", 0) for e in body if isinstance(e.get("ts"), (int, float)))
    shift = (t1 - t0) + 1000.0
    # each id space shifts by its own largest value + 1, so ids stay as dense as in a real trace
    id_shift = {k: 1 for k in (*_ID_KEYS, "id")}
    for e in body:
        args = e.get("args") or {}
        for k in _ID_KEYS:
            if isinstance(args.get(k), int):
                id_shift[k] = max(id_shift[k], args[k] + 1)
        if isinstance(e.get("id"), int):
            id_shift["id"] = max(id_shift["id"], e["id"] + 1)
    head = {k: v for k, v in doc.items() if k != "traceEvents"} if isinstance(doc, dict) else {}
    target = int(size_mb * 1e6)
    opener = gzip.open if dst.suffix == ".gz" else open
    copies = 0
    with opener(dst, "wt") as out:
        out.write("{\n")
        for k, v in head.items():
            out.write(f'  {json.dumps(k)}: {json.dumps(v)},\n')
        out.write('  "traceEvents": [\n')
        written = 0
        first = True
        for e in meta:
            s = json.dumps(e, indent=2)
            out.write(s if first else ",\n" + s)
            first = False
        while written < target:
            for e in body:
                e2 = dict(e)
                if isinstance(e2.get("ts"), (int, float)):
                    e2["ts"] = round(e2["ts"] + copies * shift, 3)
                if isinstance(e2.get("id"), int):
                    e2["id"] = e2["id"] + copies * id_shift["id"]
                args = e2.get("args")
                if args:
                    args = dict(args)
                    for k in _ID_KEYS:
                        if isinstance(args.get(k), int) and args[k] > 0:
                            args[k] = args[k] + copies * id_shift[k]
                    e2["args"] = args
                s = ",\n" + json.dumps(e2, indent=2)
                out.write(s)
                written += len(s)
            copies += 1
        out.write("\n  ]\n}\n")
    print(f"{dst}: {copies} copies, {dst.stat().st_size / 1e6:.1f} MB on disk", flush=True)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu", help="real CPU traces, one per step count")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--steps", type=int, nargs="+", default=[2])
    c.add_argument("--gz", action="store_true")
    c.add_argument("--memory", action="store_true", help="profile_memory: the allocator's memory events in the trace")
    g = sub.add_parser("gpu", help="real CUDA traces: a small one to commit, a large one to bench")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--large-steps", type=int, default=30)
    g.add_argument("--memory", action="store_true",
                   help="only the large one, with profile_memory on (cuda_large_memory): the bench's real memory trace")
    g.add_argument("--no-stack", action="store_true",
                   help="with --memory: the large one without stacks (cuda_nostack_memory), and the same run without "
                        "memory (cuda_nostack): what the memory figures cost where no Python events are skipped")
    h = sub.add_parser("hostbound", help="real CUDA traces: host-bound, CUDA graph, busy GPU")
    h.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("replicate", help="grow a trace to a size by repeating its events")
    r.add_argument("src", type=Path)
    r.add_argument("dst", type=Path)
    r.add_argument("--size-mb", type=float, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "gpu" and a.no_stack and not a.memory:
        ap.error("gpu --no-stack goes with --memory (it makes the pair with and without memory)")
    t = time.time()
    if a.cmd == "cpu":
        for s in a.steps:
            profile_run(a.out, f"cpu_steps{s}" + ("_memory" if a.memory else ""), device="cpu", steps=s, d_model=64,
                        layers=2, batch=4, seq=32, with_stack=False, gz=a.gz, memory=a.memory)
    elif a.cmd == "gpu":
        import torch

        print(f"torch {torch.__version__}, cuda {torch.version.cuda}, {torch.cuda.get_device_name(0)}", flush=True)
        if a.memory and a.no_stack:
            for name, memory in (("cuda_nostack_memory", True), ("cuda_nostack", False)):
                profile_run(a.out, name, device="cuda", steps=a.large_steps, d_model=512, layers=4,
                            batch=16, seq=256, with_stack=False, gz=True, memory=memory)
            return
        if a.memory:
            profile_run(a.out, "cuda_large_memory", device="cuda", steps=a.large_steps, d_model=512, layers=4,
                        batch=16, seq=256, with_stack=True, gz=True, memory=True)
            return
        profile_run(a.out, "cuda_small", device="cuda", steps=2, d_model=64, layers=1,
                    batch=4, seq=32, with_stack=False, gz=True)
        profile_run(a.out, "cuda_small_stack", device="cuda", steps=2, d_model=64, layers=1,
                    batch=4, seq=32, with_stack=True, gz=True)
        profile_run(a.out, "cuda_large", device="cuda", steps=a.large_steps, d_model=512, layers=4,
                    batch=16, seq=256, with_stack=True, gz=True)
    elif a.cmd == "hostbound":
        for label, make in (("host_bound", lambda: host_bound(a.out, "host_bound", steps=6, ops=100, graph=False)),
                            ("cuda_graph", lambda: host_bound(a.out, "cuda_graph", steps=6, ops=100, graph=True)),
                            ("busy_gemm", lambda: busy_gemm(a.out, "busy_gemm", steps=3))):
            try:  # one recipe failing must not cost the others
                make()
            except Exception as exc:  # noqa: BLE001 - reported, the next one runs
                print(f"{label}: failed: {type(exc).__name__}: {exc}", flush=True)
    else:
        replicate(a.src, a.dst, a.size_mb)
    print(f"done in {time.time() - t:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
