"""Emulator start-up time (to healthy) and memory (RSS of server + stage workers), printed side
by side with the targets (< 10 s, < 1.5 GB for 3 stages). A measurement, never an assertion.

    python3 bench/emulator_startup.py [--runs 3] [--deploy configs/qwen2_5_omni.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import httpx
import psutil
import yaml

from sidecar.emulator.launcher import EmulatorProcess

TARGET_STARTUP_S = 10.0
TARGET_RSS_MB = 1536.0


def three_stage_deploy(tmp: Path) -> Path:
    stages = [
        {"stage_id": 0, "profiler_config": {"profiler": "torch", "torch_profiler_dir": str(tmp / "s0")}},
        {"stage_id": 1, "profiler_config": {"profiler": "torch", "torch_profiler_dir": str(tmp / "s1")}},
        {"stage_id": 2, "emulator_stage_kind": "diffusion"},
    ]
    path = tmp / "deploy.yaml"
    path.write_text(yaml.safe_dump({"stages": stages}))
    return path


def cpu_s(pid: int) -> float:
    """CPU seconds spent so far by the server and its workers: start-up cost independent of load."""
    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])


def rss_mb(pid: int) -> tuple[float, int]:
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs) / 2**20, len(procs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deploy", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="emu-bench-"))
    deploy = args.deploy or three_stage_deploy(tmp)
    startups, cpus, rss, rss_busy = [], [], [], []
    nprocs = 0
    for _ in range(args.runs):
        t0 = time.perf_counter()
        with EmulatorProcess(deploy) as emu:
            startups.append(time.perf_counter() - t0)
            cpus.append(cpu_s(emu.pid))
            mb, nprocs = rss_mb(emu.pid)
            rss.append(mb)
            # after one profiled request: profiler buffers and traces are in memory too
            httpx.post(f"{emu.url}/start_profile", timeout=120)
            httpx.post(f"{emu.url}/v1/chat/completions", json={"messages": [], "max_tokens": 16}, timeout=120)
            rss_busy.append(rss_mb(emu.pid)[0])
            httpx.post(f"{emu.url}/stop_profile", timeout=120)
    rows = [
        ("start-up to healthy (s)", statistics.median(startups), max(startups), TARGET_STARTUP_S),
        ("start-up CPU time, all procs (s)", statistics.median(cpus), max(cpus), TARGET_STARTUP_S),
        ("RSS idle, all processes (MB)", statistics.median(rss), max(rss), TARGET_RSS_MB),
        ("RSS while profiling (MB)", statistics.median(rss_busy), max(rss_busy), TARGET_RSS_MB),
    ]
    load = psutil.getloadavg()[0]
    print(f"deploy: {deploy}  runs: {args.runs}  processes: {nprocs} (server + workers + helpers)")
    print(f"cores: {psutil.cpu_count()}  load average (1 min): {load:.1f}  (wall times grow with load)")
    print(f"{'metric':32} {'median':>9} {'max':>9} {'target':>9} {'max/target':>11}")
    for name, med, worst, target in rows:
        print(f"{name:32} {med:9.2f} {worst:9.2f} {target:9.1f} {worst / target:11.2f}")


if __name__ == "__main__":
    main()
