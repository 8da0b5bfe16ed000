"""Overhead of the sidecar (DESIGN.md §7: off the inference path, milliseconds per call, zero cost
when idle), measured side by side in one run against one emulator (2 torch stages, ``--gzip-delay 0``):

- start / stop sent straight to the emulator vs the same through the sidecar (p50/p95 over N
  rounds, short windows). Through the sidecar, "stop (ack)" is the 202 and "stop (done)" is
  ``?wait=true``: upstream stop plus the artifact check (``settle_s`` of unchanged listing);
- ``GET /v1/captures/{id}`` vs the emulator's ``GET /health`` (a bare HTTP round trip);
- the idle sidecar: RSS and CPU seconds over 10 s with no calls.

Servers bind 127.0.0.1 on free ports and are always shut down. Ratios are printed, never asserted.

    python bench/overhead.py [--rounds 20] [--window 0.2] [--gets 200] [--idle 10] [--settle 0.2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar.api.launcher import SidecarProcess  # noqa: E402
from sidecar.emulator.launcher import EmulatorProcess  # noqa: E402

STAGES = [0, 1]


def _deploy(root: Path) -> Path:
    stages = [
        {
            "stage_id": sid,
            "profiler_config": {
                "profiler": "torch",
                "torch_profiler_dir": str(root / "traces" / f"stage{sid}"),
                "torch_profiler_with_stack": False,
                "torch_profiler_dump_cuda_time_total": False,
            },
        }
        for sid in STAGES
    ]
    path = root / "deploy.yaml"
    path.write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    return path


def _timed(call: Callable[[], httpx.Response]) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    resp = call()
    ms = (time.perf_counter() - t0) * 1000
    resp.raise_for_status()
    return ms, resp


def _pct(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _direct_rounds(client: httpx.Client, emu: str, rounds: int, window: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"start": [], "stop": []}
    for _ in range(rounds):
        ms, _ = _timed(lambda: client.post(f"{emu}/start_profile", json={"stages": STAGES}))
        out["start"].append(ms)
        time.sleep(window)
        ms, _ = _timed(lambda: client.post(f"{emu}/stop_profile", json={"stages": STAGES}))
        out["stop"].append(ms)
    return out


def _sidecar_rounds(client: httpx.Client, sc: str, rounds: int, window: float) -> tuple[dict[str, list[float]], str]:
    out: dict[str, list[float]] = {"start": [], "stop_ack": [], "stop_done": []}
    last = ""
    for i in range(rounds):
        ms, resp = _timed(lambda: client.post(f"{sc}/v1/captures", json={"stages": STAGES}))
        out["start"].append(ms)
        cid = last = resp.json()["id"]
        time.sleep(window)
        # Alternate: the 202 alone (then wait untimed), and the whole stop until the verdicts.
        if i % 2 == 0:
            ms, _ = _timed(lambda: client.post(f"{sc}/v1/captures/{cid}/stop"))
            out["stop_ack"].append(ms)
            client.post(f"{sc}/v1/captures/{cid}/stop?wait=true")
        else:
            ms, resp = _timed(lambda: client.post(f"{sc}/v1/captures/{cid}/stop?wait=true"))
            out["stop_done"].append(ms)
            if resp.json()["state"] != "completed":
                raise SystemExit(f"capture {cid} ended {resp.json()['state']}: {resp.json()}")
    return out, last


def _gets(client: httpx.Client, url: str, n: int) -> list[float]:
    return [_timed(lambda: client.get(url))[0] for _ in range(n)]


def _idle(pid: int, seconds: float) -> tuple[float, float]:
    proc = psutil.Process(pid)
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    cpu = (after.user - before.user) + (after.system - before.system)
    return proc.memory_info().rss / 2**20, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="start/stop rounds per path")
    ap.add_argument("--window", type=float, default=0.2, help="seconds between start and stop")
    ap.add_argument("--gets", type=int, default=200, help="GET requests per endpoint")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle to measure")
    ap.add_argument("--settle", type=float, default=0.2, help="the sidecar's settle_s (artifact listing stable)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="omni-overhead-") as tmp:
        root = Path(tmp)
        deploy = _deploy(root)
        env = {"OMNI_SIDECAR_SETTLE_S": str(args.settle), "OMNI_SIDECAR_COLLECT_TIMEOUT_S": "30"}
        with EmulatorProcess(deploy, extra_args=["--gzip-delay", "0", "--step-ms", "1"], startup_timeout=120) as emu, \
             SidecarProcess(emu.url, deploy, state_dir=root / "state", env=env) as sc, \
             httpx.Client(timeout=120) as client:  # fmt: skip
            # One untimed round each: the first profiler start in a worker initialises torch's profiler.
            _direct_rounds(client, emu.url, 1, args.window)
            _sidecar_rounds(client, sc.url, 1, args.window)
            direct = _direct_rounds(client, emu.url, args.rounds, args.window)
            via, last_id = _sidecar_rounds(client, sc.url, args.rounds, args.window)
            health = _gets(client, f"{emu.url}/health", args.gets)
            capture_get = _gets(client, f"{sc.url}/v1/captures/{last_id}", args.gets)
            time.sleep(2.0)  # let the last capture's background summary finish
            rss_sc, cpu_sc = _idle(sc.pid or 0, args.idle)
            emu_rss = psutil.Process(emu.pid or 0).memory_info().rss / 2**20

    def row(name: str, sidecar: list[float], base: list[float], base_name: str) -> None:
        p50, p95, b50, b95 = _pct(sidecar, 50), _pct(sidecar, 95), _pct(base, 50), _pct(base, 95)
        print(f"{name:<26} {p50:>9.1f} {p95:>9.1f}   {base_name:<22} {b50:>9.1f} {b95:>9.1f}   "
              f"{p50 / b50:>6.2f}x {p95 / b95:>6.2f}x  {p50 - b50:>+8.1f}")

    print(f"sidecar overhead: {args.rounds} rounds of start/stop on stages {STAGES}, window {args.window:g}s, "
          f"settle_s {args.settle:g}, {args.gets} GETs, {os.cpu_count()} CPUs")
    print(f"{'through the sidecar':<26} {'p50 ms':>9} {'p95 ms':>9}   {'direct to the server':<22} {'p50 ms':>9} "
          f"{'p95 ms':>9}   {'p50':>7} {'p95':>7}  {'+ms p50':>8}")
    row("POST /v1/captures", via["start"], direct["start"], "POST /start_profile")
    row("stop (202 ack)", via["stop_ack"], direct["stop"], "POST /stop_profile")
    row("stop ?wait=true (verdicts)", via["stop_done"], direct["stop"], "POST /stop_profile")
    row("GET /v1/captures/{id}", capture_get, health, "GET /health (emulator)")
    extra = _pct(via["stop_done"], 50) - args.settle * 1000 - _pct(direct["stop"], 50)
    print(f"stop ?wait=true waits settle_s ({args.settle:g}s) of unchanged listing by design; beyond that and the "
          f"upstream stop it adds {extra:+.1f} ms (p50)")
    print(f"idle sidecar over {args.idle:g}s: RSS {rss_sc:.0f} MiB, CPU {cpu_sc:.3f} s "
          f"({cpu_sc / args.idle * 100:.2f}% of one core); emulator API process RSS {emu_rss:.0f} MiB for scale")


if __name__ == "__main__":
    main()
