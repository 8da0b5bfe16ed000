"""The fleet archive at scale: ``write_archive`` over N replicas of small traces (issue 23: 1,024
replicas in at most 200 MB RSS), each mode, in a fresh process each so its peak RSS is its own.
Prints time, peak RSS and the archive's size beside the goal; never asserted.

Method. N Kineto-shaped traces (``baseTimeNanoseconds`` each its own, ~300 events: steps of CPU
ops and GPU kernels) are written under ``replica_<i>/`` first; each replica has its own host
clock (offsets spread over ±1.5 s). Then a child process builds the archive.

    python bench/archive.py --replicas 1024 [--events 300]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar.analysis.aligned import FleetSource, HostClock  # noqa: E402
from sidecar.analysis.capture import TraceSource  # noqa: E402
from sidecar.analysis.writer import TraceWriter  # noqa: E402

GOAL_MB = 200


def _write_traces(root: Path, n: int, events: int) -> list[FleetSource]:
    out = []
    for i in range(n):
        path = root / f"replica_{i}" / "trace_rank0.json.gz"
        base = 1_796_000_000_000_000_000 + i * 7_919_000
        header = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1}, "baseTimeNanoseconds": base}
        batch = [{"ph": "M", "name": "process_name", "pid": 4242, "tid": 0, "args": {"name": "python3"}}]
        ts = 5_000_000.0
        for k in range(events):
            cat, pid = ("kernel", 0) if k % 3 == 2 else ("cpu_op", 4242)
            batch.append({"ph": "X", "cat": cat, "name": f"op{k % 17}", "pid": pid, "tid": 7, "ts": ts, "dur": 12.5,
                          "args": {"External id": k}})
            ts += 20.0
        with TraceWriter(path, header) as w:
            w.write(batch)
        offset = int((i % 31 - 15) * 1e8)  # -1.5 s .. +1.5 s
        out.append(FleetSource(TraceSource(path, stage_id=0, replica=i, kind="llm"), f"sidecar=http://10.0.{i // 250}.{i % 250}:8092",
                               HostClock(host=f"node{i}", offset_ns=offset, error_ns=250_000, method="exchange")))
    return out


def _archive(sources: list[FleetSource], out: str, mode: str, pipe: object) -> None:
    from sidecar.analysis.archive import write_archive

    t0 = time.perf_counter()
    report = write_archive(sources, out, mode=mode)  # type: ignore[arg-type]
    took = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    pipe.send((took, rss, len(report.members), len(report.errors)))  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=1024)
    ap.add_argument("--events", type=int, default=300)
    args = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="omni-archive-") as tmp:
        root = Path(tmp)
        sources = _write_traces(root, args.replicas, args.events)
        raw = sum(fs.source.path.stat().st_size for fs in sources)
        print(f"{args.replicas} replicas x {args.events} events: {raw / 1e6:.1f} MB of gzip traces "
              f"({os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f})")
        print(f"{'mode':>6} {'members':>7} {'errors':>6} {'seconds':>8} {'peak RSS MiB':>12} {'archive MB':>10}   goal")
        for mode in ("named", "raw", "slim"):
            out = root / f"run-{mode}.tar"
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_archive, args=(sources, str(out), mode, send))
            proc.start()
            took, rss, members, errors = recv.recv()
            proc.join()
            verdict = "met" if rss <= GOAL_MB else "NOT met"
            print(f"{mode:>6} {members:>7} {errors:>6} {took:>8.2f} {rss:>12.0f} {out.stat().st_size / 1e6:>10.1f}   "
                  f"RSS <= {GOAL_MB} MiB -> {verdict}")


if __name__ == "__main__":
    main()
