"""Real multi-process CUDA traces for the analysis tests: 2 processes (ranks of one job), each with
2 CUDA streams, an all-reduce between them, AdamW (its ``Optimizer.step#AdamW.step`` annotation)
and H2D/D2H copies, recorded by torch.profiler with CPU+CUDA activities.

  python3 bench/gen_fleet_traces.py --out $OUT            # on the GPU machine
  python3 bench/gen_fleet_traces.py --out $OUT --comm     # the communication fixture

Writes ``fleet_rank<R>.json.gz`` and ``fleet_rank<R>.key_averages.json`` per rank: torch's own
``key_averages()`` of the very same run (a list of rows keyed by name *and* device type, because
key_averages keeps a CPU row and a CUDA row for a user annotation). NCCL when the machine has a GPU
per rank; gloo (CUDA tensors, staged through the host) when both ranks share one GPU, as two vLLM
stage processes on one card do.

``--comm`` writes ``comm_rank<R>.*`` instead: always NCCL, so the traces hold real NCCL kernels.
Each step launches an all-reduce of a 16 MB gradient bucket on NCCL's stream while matmuls run on
the compute stream (overlapped), then all-reduces a small tensor that nothing overlaps. When both
ranks share one GPU, each rank gets its own ``NCCL_HOSTID``: NCCL refuses two ranks on one GPU of
one host ("Duplicate GPU detected"), and as two "hosts" the ranks talk through NCCL's socket
transport on the loopback, with the same ring kernels a two-host job runs. Not part of the package.
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


def worker(rank: int, out: str, port: int, steps: int, comm: bool = False) -> None:
    import torch

    n = torch.cuda.device_count()
    if comm and n < WORLD:  # two ranks on one GPU: two NCCL "hosts" over the loopback (see the docstring)
        os.environ.update(NCCL_HOSTID=f"omni-sidecar-rank{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    backend = "nccl" if comm or n >= WORLD else "gloo"
    dev = torch.device("cuda", rank % n)
    torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    if comm:
        _comm_job(rank, out, steps, dev)
        return
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
    _write(prof, Path(out), f"fleet_rank{rank}", {"backend": backend, "devices": n, "torch": torch.__version__})
    dist.destroy_process_group()


def _comm_job(rank: int, out: str, steps: int, dev) -> None:
    """Communication beside computation: the bucket's all-reduce overlaps matmuls, a small one does not."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    n = torch.cuda.device_count()
    bucket = torch.randn(4 << 20, device=dev)  # 16 MB of fp32 gradients
    small = torch.randn(1 << 10, device=dev)
    a = torch.randn(2048, 2048, device=dev)

    def step() -> None:
        with record_function("bucket_allreduce"):
            work = dist.all_reduce(bucket, async_op=True)
        with record_function("overlapped_matmuls"):
            for _ in range(8):
                a.copy_(a @ a * 1e-3)
        work.wait()
        with record_function("small_allreduce"):
            dist.all_reduce(small)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host = dist.new_group(backend="gloo")  # a barrier that launches no kernel
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        # the ranks' profilers start apart; without this, rank 0's first all-reduce waits that out
        dist.barrier(group=host)
        for i in range(steps):
            with record_function(f"ProfilerStep#{i + 1}"):
                step()
        torch.cuda.synchronize()
    _write(prof, Path(out), f"comm_rank{rank}", {"backend": "nccl", "devices": n, "torch": torch.__version__,
                                                 "nccl_hostid": os.environ.get("NCCL_HOSTID")})
    dist.destroy_process_group()


def _write(prof, outp: Path, name: str, meta: dict) -> None:
    path = outp / f"{name}.json"
    prof.export_chrome_trace(str(path))
    (outp / f"{name}.key_averages.json").write_text(json.dumps({**meta, "rows": key_averages_rows(prof)}, indent=1))
    with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    path.unlink()
    print(f"{name} ({meta['backend']}, {meta['devices']} GPU(s)): {path}.gz "
          f"{Path(str(path) + '.gz').stat().st_size / 1e6:.2f} MB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--comm", action="store_true", help="the NCCL communication fixture (comm_rank<R>)")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    a.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(worker, args=(str(a.out), port, a.steps, a.comm), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
