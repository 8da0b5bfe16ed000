"""Fan-out at scale: ``Fleet.start``/``stop`` over N stub replicas against one replica, side by side
in one run, with the start skew across replicas (from the stubs' own receive timestamps), the
trainer-side cost (peak RSS, open fds/sockets, CPU seconds) and a one-after-another loop for
reference. Ratios are printed, never asserted.

Method. Each replica is a stub (``tests/fixtures/stubs.py``): vLLM-Omni's profiler endpoints
(``--kind upstream``: the fleet drives them in-process with ``CaptureController``, the RL path) or
the sidecar API (``--kind sidecar``), holding each start/stop ``--latency`` seconds like a worker
round trip. Stubs bind their own ports (port 0) and report them; one stub process per 256
replicas. 1,024 replicas need ~1,100 file descriptors in this process (``ulimit -n``).

    python bench/fanout.py --replicas 128 [--kind upstream|sidecar|both] [--latency 0.5] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar.control.controller import ControlSettings  # noqa: E402
from sidecar.fleet import Fleet, Target  # noqa: E402
from tests.fixtures.stubs import StubFleet, write_deploys  # noqa: E402

SETTINGS = ControlSettings(settle_s=0.2, collect_timeout_s=60, close_timeout_s=10, summarize=False)


def _fds() -> tuple[int, int]:
    """(open fds, of which sockets) in this process."""
    fds = socks = 0
    for fd in os.listdir("/proc/self/fd"):
        fds += 1
        try:
            socks += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return fds, socks


async def _round(targets: list[Target], stubs: StubFleet, size: int) -> dict[str, float]:
    stubs.reset()
    cpu0 = sum(os.times()[:2])
    async with Fleet(targets[:size], control_settings=SETTINGS, stop_budget_s=120, client_timeout_s=120) as fleet:
        t0 = time.perf_counter()
        fc = await fleet.start(label="bench")
        t_start = time.perf_counter() - t0
        fds, socks = _fds()
        t0 = time.perf_counter()
        fc = await fleet.stop(fc, wait_artifacts=False)
        t_stop = time.perf_counter() - t0
        fc = await fleet.refresh(fc, wait=True, timeout=120)  # the artifact checks end before close
        if not fc.ok:
            raise SystemExit(f"fan-out failed: {fc.rollup()}")
    cpu = sum(os.times()[:2]) - cpu0
    path = "/start_profile" if targets[0].kind.value == "upstream" else "/v1/captures"
    got = sorted(ts[0] for i, ts in stubs.received(path).items() if i < size and ts)
    skews = [(t - got[0]) / 1e6 for t in got]
    return {"start": t_start, "stop": t_stop, "skew_p50": statistics.median(skews), "skew_max": skews[-1],
            "fds": fds, "socks": socks, "cpu": cpu, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


async def _serial(urls: list[str]) -> float:
    from sidecar.upstream.server import UpstreamServer

    servers = [UpstreamServer(u) for u in urls]
    t0 = time.perf_counter()
    for s in servers:  # one after another: what a per-replica loop does
        await s.start_profile([0])
    elapsed = time.perf_counter() - t0
    await asyncio.gather(*(s.stop_profile([0]) for s in servers))
    await asyncio.gather(*(s.aclose() for s in servers))
    return elapsed


def _bench(kind: str, n: int, latency: float, repeat: int, serial_n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="omni-fanout-") as tmp:
        root = Path(tmp)
        with StubFleet(n, mode=kind, root=root, latency=latency) as stubs:
            if kind == "upstream":
                targets = [Target.upstream(u, d) for u, d in zip(stubs.urls, write_deploys(root, n))]
            else:
                targets = [Target.sidecar(u) for u in stubs.urls]
            rows = {}
            for size in (1, n):
                runs = [asyncio.run(_round(targets, stubs, size)) for _ in range(repeat)]
                rows[size] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                rows[size]["rss"] = max(r["rss"] for r in runs)
            serial = asyncio.run(_serial(stubs.urls[:serial_n])) if kind == "upstream" else None
    one = rows[1]
    print(f"\n{kind} targets: {n} stub replicas vs 1 (start/stop hold {latency:g}s; median of {repeat}; "
          f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f})")
    print(f"{'replicas':>8} {'start s':>8} {'vs 1':>6} {'stop s':>8} {'vs 1':>6} {'skew p50 ms':>11} "
          f"{'skew max ms':>11} {'peak RSS MiB':>12} {'fds':>6} {'sockets':>7} {'CPU s':>6}")
    for size, r in rows.items():
        print(f"{size:>8} {r['start']:>8.3f} {r['start'] / one['start']:>5.2f}x {r['stop']:>8.3f} "
              f"{r['stop'] / one['stop']:>5.2f}x {r['skew_p50']:>11.1f} {r['skew_max']:>11.1f} {r['rss']:>12.0f} "
              f"{r['fds']:>6.0f} {r['socks']:>7.0f} {r['cpu']:>6.2f}")
    if serial is not None:
        print(f"serial loop (start one after another) on {serial_n} replicas: {serial:.3f}s "
              f"= {serial / rows[n]['start']:.1f}x the fleet's concurrent start on {n}"
              + (f" (x{n / serial_n:.0f} for all {n})" if serial_n < n else ""))
    ratio = rows[n]["start"] / one["start"]
    print(f"target: start on {n} <= 2x one -> {'met' if ratio <= 2 else 'NOT met'} ({ratio:.2f}x); "
          f"skew p50 <= 20 ms -> {'met' if rows[n]['skew_p50'] <= 20 else 'NOT met'} ({rows[n]['skew_p50']:.1f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=128)
    ap.add_argument("--kind", choices=("upstream", "sidecar", "both"), default="both")
    ap.add_argument("--latency", type=float, default=0.5, help="seconds each stub holds a start/stop call")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--serial", type=int, default=64, help="replicas in the serial reference loop")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * args.replicas + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    for kind in (("upstream", "sidecar") if args.kind == "both" else (args.kind,)):
        _bench(kind, args.replicas, args.latency, args.repeat, min(args.serial, args.replicas))


if __name__ == "__main__":
    main()
