"""Real multi-process CUDA traces for the analysis tests: 2 processes (ranks of one job), each with
2 CUDA streams, an all-reduce between them, AdamW (its ``Optimizer.step#AdamW.step`` annotation)
and H2D/D2H copies, recorded by torch.profiler with CPU+CUDA activities.

  python3 bench/gen_fleet_traces.py --out $OUT            # on the GPU machine

Writes ``fleet_rank<R>.json.gz`` and ``fleet_rank<R>.key_averages.json`` per rank: torch's own
``key_averages()`` of the very same run (a list of rows keyed by name *and* device type, because
key_averages keeps a CPU row and a CUDA row for a user annotation). NCCL when the machine has a GPU
per rank; gloo (CUDA tensors, staged through the host) when both ranks share one GPU, as two vLLM
stage processes on one card do. Not part of the package.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
from pathlib import Path

WORLD = 2


def key_averages_rows(prof) -> list[dict]:
    rows = []
    for evt in prof.key_averages():
        self_dev = getattr(evt, "self_device_time_total", None)
        if self_dev is None:
            self_dev = getattr(evt, "self_cuda_time_total", 0)
        dev_total = getattr(evt, "device_time_total", None)
        if dev_total is None:
            dev_total = getattr(evt, "cuda_time_total", 0)
        rows.append({
            "key": evt.key,
            "device_type": str(evt.device_type),
            "is_user_annotation": bool(getattr(evt, "is_user_annotation", False)),
            "count": int(evt.count),
            "self_cpu_us": float(evt.self_cpu_time_total),
            "cpu_total_us": float(evt.cpu_time_total),
            "self_device_us": float(self_dev),
            "device_total_us": float(dev_total),
        })
    return rows


def worker(rank: int, out: str, port: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    n = torch.cuda.device_count()
    backend = "nccl" if n >= WORLD else "gloo"
    dev = torch.device("cuda", rank % n)
    torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(rank)
    d = 256
    model = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    side = torch.cuda.Stream(device=dev)
    x_host = torch.randn(64, d).pin_memory()
    w_side = torch.randn(512, 512, device=dev)
    buf = torch.empty(1 << 16, device=dev)

    def step() -> torch.Tensor:
        x = x_host.to(dev, non_blocking=True)  # H2D
        with torch.cuda.stream(side), record_function("side_stream_work"):
            y = w_side @ w_side  # a second stream, overlapping the main one
            buf.zero_()  # memset
        loss = model(x).pow(2).mean()
        loss.backward()
        with record_function("grad_allreduce"):
            for p in model.parameters():
                dist.all_reduce(p.grad)
        torch.cuda.current_stream().wait_stream(side)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return (loss.detach() + y[0, 0] * 0).to("cpu")  # D2H

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(f"ProfilerStep#{i + 1}"):
                step()
        torch.cuda.synchronize()
    outp = Path(out)
    path = outp / f"fleet_rank{rank}.json"
    prof.export_chrome_trace(str(path))
    (outp / f"fleet_rank{rank}.key_averages.json").write_text(json.dumps(
        {"backend": backend, "devices": n, "torch": torch.__version__, "rows": key_averages_rows(prof)}, indent=1))
    with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    path.unlink()
    print(f"rank {rank} ({backend}, {n} GPU(s)): {path}.gz {Path(str(path) + '.gz').stat().st_size / 1e6:.2f} MB", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    import torch.multiprocessing as mp

    a.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(worker, args=(str(a.out), port, a.steps), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
