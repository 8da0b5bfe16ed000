"""An analysis in a fresh child process against one in a kept child (``sidecar.analysis.isolated``:
``KEEP_IDLE``), side by side in one run, on an idle machine and beside ``--busy`` processes that
keep cores busy (a CPU server beside its sidecar). Prints each way's median
wall time and CPU time per summary, and their ratios. Nothing is asserted; it prints.

    python bench/isolated.py [TRACE ...] [--runs 9] [--busy 4]

Default trace: tests/data/traces/cuda_small.json.gz (a small trace: the cost is the child's start).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.analysis import isolated, summarize_paths  # noqa: E402


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _measure(paths: list[Path], runs: int, keep: int) -> tuple[float, float]:
    """Median wall seconds per analysis, and the CPU seconds the children spent per analysis."""
    isolated.stop_all()  # no kept child from before
    isolated.KEEP_IDLE = keep
    walls = []
    cpu0 = _children_cpu()
    for _ in range(runs):
        t = time.perf_counter()
        isolated.run_isolated(summarize_paths, paths, top=500)
        walls.append(time.perf_counter() - t)
    isolated.stop_all()  # reaped: its CPU is counted
    return statistics.median(walls), (_children_cpu() - cpu0) / runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", type=Path, default=[ROOT / "tests/data/traces/cuda_small.json.gz"])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--busy", type=int, default=4, help="busy processes for the loaded rows (0: idle only)")
    args = ap.parse_args()
    size = sum(p.stat().st_size for p in args.traces)
    print(f"{len(args.traces)} trace(s), {size / 1e6:.2f} MB; {args.runs} summaries each way; {os.cpu_count()} cores")
    for busy in dict.fromkeys([0, args.busy]):
        # in a session of their own, as a server beside the sidecar is (the scheduler's autogroups)
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                    for _ in range(busy)]
        try:
            fresh_wall, fresh_cpu = _measure(args.traces, args.runs, keep=0)
            kept_wall, kept_cpu = _measure(args.traces, args.runs, keep=1)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
        print(f"busy {busy}: fresh child {fresh_wall:.3f}s wall {fresh_cpu:.3f}s cpu | kept child {kept_wall:.3f}s wall "
              f"{kept_cpu:.3f}s cpu | fresh/kept: wall x{fresh_wall / kept_wall:.1f}, cpu x{fresh_cpu / kept_cpu:.1f}")


if __name__ == "__main__":
    main()
