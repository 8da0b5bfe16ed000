"""Emulator start-up, side by side: spawned workers (each imports torch: the old way), forkserver
workers (torch imported once, workers forked), thread workers (no torch), and what a pooled
emulator costs per test instead (``POST /emulator/reset``). Also CPU seconds and RSS of server +
workers. Rounds are interleaved so load hits every mode alike. A measurement, never an assertion.

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

import psutil
import yaml

from sidecar.emulator.launcher import EmulatorProcess

MODES = {
    "spawn (before)": ["--worker-start", "spawn"],
    "forkserver": ["--worker-start", "forkserver"],
    "thread": ["--workers", "thread"],
}
TARGET_RSS_MB = 1536.0


def three_stage_deploy(tmp: Path) -> Path:
    # stacks off, as the tests' make_deploy and the demo's profile have it
    torch = {"profiler": "torch", "torch_profiler_with_stack": False}
    stages = [
        {"stage_id": 0, "profiler_config": {**torch, "torch_profiler_dir": str(tmp / "s0")}},
        {"stage_id": 1, "profiler_config": {**torch, "torch_profiler_dir": str(tmp / "s1")}},
        {"stage_id": 2, "emulator_stage_kind": "diffusion"},
    ]
    path = tmp / "deploy.yaml"
    path.write_text(yaml.safe_dump({"stages": stages}))
    return path


def procs(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_s(pid: int) -> float:
    """CPU seconds spent so far by the server and its workers: start-up cost independent of load."""
    return sum(sum(p.cpu_times()[:2]) for p in procs(pid))


def rss_mb(pid: int) -> float:
    return sum(p.memory_info().rss for p in procs(pid)) / 2**20


def one_run(deploy: Path, args: list[str]) -> dict[str, float]:
    t0 = time.perf_counter()
    with EmulatorProcess(deploy, extra_args=args, startup_timeout=300) as emu:
        out = {"startup": time.perf_counter() - t0, "cpu": cpu_s(emu.pid), "rss": rss_mb(emu.pid)}
        t1 = time.perf_counter()
        emu.http.post("/start_profile")
        emu.http.post("/v1/chat/completions", json={"messages": [], "max_tokens": 16})
        emu.http.post("/stop_profile")
        out["first_capture"] = time.perf_counter() - t1  # a worker's first profiler start is its dearest
        out["ready_cpu"] = cpu_s(emu.pid)  # started and one capture done: what a test pays
        out["rss_busy"] = rss_mb(emu.pid)
        t1 = time.perf_counter()
        emu.reset()  # what a pooled emulator costs per test
        out["reset"] = time.perf_counter() - t1
        emu.set_faults(dead_stage=0)
        t2 = time.perf_counter()
        emu.reset()  # ... when the previous test killed a stage (the worker is replaced)
        out["reset_dead"] = time.perf_counter() - t2
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deploy", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="emu-bench-"))
    deploy = args.deploy or three_stage_deploy(tmp)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.runs):
        for mode, extra in MODES.items():
            results[mode].append(one_run(deploy, extra))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    load = psutil.getloadavg()[0]
    base = "spawn (before)"
    print(f"deploy: {deploy}  runs: {args.runs} per mode (interleaved)")
    print(f"cores: {psutil.cpu_count()}  load average (1 min): {load:.1f}  (wall times grow with load)")
    print(f"{'mode':16} {'start s':>8} {'vs spawn':>9} {'CPU s':>7} {'vs spawn':>9} {'1st cap s':>10} "
          f"{'+cap CPU s':>11} {'RSS MB':>7} {'busy MB':>8} {'reset s':>8} {'reset+respawn s':>16} "
          f"{'start/reset':>12}")  # fmt: skip
    for mode in MODES:
        s, c = med(mode, "startup"), med(mode, "cpu")
        print(
            f"{mode:16} {s:8.2f} {s / med(base, 'startup'):9.2f} {c:7.2f} {c / med(base, 'cpu'):9.2f} "
            f"{med(mode, 'first_capture'):10.2f} {med(mode, 'ready_cpu'):11.2f} "
            f"{med(mode, 'rss'):7.0f} {med(mode, 'rss_busy'):8.0f} {med(mode, 'reset'):8.3f} "
            f"{med(mode, 'reset_dead'):16.3f} {s / med(mode, 'reset'):12.0f}"
        )
    print(f"RSS target {TARGET_RSS_MB:.0f} MB for 3 stages; 'start/reset': how many resets one fresh start costs;")
    print("'1st cap s': the first start/request/stop after start-up; '+cap CPU s': CPU s of server + workers by then")


if __name__ == "__main__":
    main()
