"""Fan-out benchmark: how long ``Fleet.start`` takes on 32 replicas compared with 1 (target: within
2x), and what a one-after-another loop (how trainers call start/stop) would take.

Method. 32 real emulators would need 32 torch workers: on a 2-core machine their start_profile
calls (each builds a torch profiler, ~2 s of CPU) would queue on the CPU and the benchmark would
measure the machine, not the fan-out. So each replica here is a stub server with vLLM-Omni's
profiler semantics (``/health``; ``GET /start_profile`` answers 405; ``POST /start_profile`` and
``/stop_profile`` take ``{"stages": [...]}``, hold for ``--latency`` seconds like a worker round
trip, and create/fill real session folders), all served by one child process on 32 ports. The
fleet side is the product's code: upstream targets driven in-process by ``CaptureController``
(the same controller a sidecar runs), so validation, journal-free state, snapshots and the artifact
check all run. Ratios are printed, never asserted.

    python bench/fanout.py [--replicas 32] [--latency 0.5] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# --- the stub replicas (child process) -----------------------------------------------------


def _stub_app(latency: float, root: Path):  # type: ignore[no-untyped-def]
    sessions: dict[int, Path] = {}

    async def respond(send, status: int, payload: dict) -> None:  # type: ignore[no-untyped-def]
        body = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path, method = scope["path"], scope["method"]
        if path == "/health":
            return await respond(send, 200, {})
        if path not in ("/start_profile", "/stop_profile"):
            return await respond(send, 404, {"detail": "Not Found"})
        if method != "POST":
            return await respond(send, 405, {"detail": "Method Not Allowed"})
        stages = (json.loads(body) if body else None) or {}
        ids = stages.get("stages") or [0]
        await asyncio.sleep(latency)  # the workers' round trip
        for sid in ids:
            if path == "/start_profile":
                folder = root / f"stage{sid}" / f"{time.strftime('%Y%m%d-%H%M%S')}_stage{sid}_rank0_{time.time_ns()}"
                folder.mkdir(parents=True)
                sessions[sid] = folder
            elif sid in sessions:
                trace = {"traceEvents": [{"ph": "X", "name": "step", "ts": 0, "dur": 1, "pid": 0, "tid": 0}]}
                (sessions.pop(sid) / "trace_rank0.json").write_text(json.dumps(trace))
        return await respond(send, 200, {"status": "SUCCESS"})

    return app


async def _serve(ports: list[int], latency: float, root: Path) -> None:
    import uvicorn

    servers = []
    for i, port in enumerate(ports):
        cfg = uvicorn.Config(_stub_app(latency, root / f"replica{i}"), host="127.0.0.1", port=port,
                             log_level="warning", lifespan="off")
        server = uvicorn.Server(cfg)
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        servers.append(server)
    await asyncio.gather(*(s.serve() for s in servers))


# --- the measurement ---------------------------------------------------------------------


def _deploys(root: Path, n: int) -> list[Path]:
    out = []
    for i in range(n):
        d = root / f"replica{i}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / "deploy.yaml"
        stage = {"stage_id": 0, "profiler_config": {"profiler": "torch", "torch_profiler_dir": str(d / "stage0"),
                                                     "torch_profiler_with_stack": False}}
        path.write_text(yaml.safe_dump({"stages": [stage]}))
        out.append(path)
    return out


async def _fleet_round(targets, settings) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    from sidecar.fleet import Fleet

    async with Fleet(targets, control_settings=settings) as fleet:
        t0 = time.perf_counter()
        fc = await fleet.start(label="bench")
        t_start = time.perf_counter() - t0
        t0 = time.perf_counter()
        fc = await fleet.stop(fc, wait_artifacts=False)
        t_stop = time.perf_counter() - t0
        await fleet.refresh(fc, wait=True, timeout=60)  # let the artifact checks end before close
        assert fc.ok, fc.failures()
    return t_start, t_stop


async def _serial_round(urls: list[str]) -> float:
    from sidecar.upstream.server import UpstreamServer

    servers = [UpstreamServer(u) for u in urls]
    t0 = time.perf_counter()
    for s in servers:  # one after another: what a per-replica loop does
        await s.start_profile([0])
    elapsed = time.perf_counter() - t0
    await asyncio.gather(*(s.stop_profile([0]) for s in servers))
    await asyncio.gather(*(s.aclose() for s in servers))
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--latency", type=float, default=0.5, help="seconds each stub holds a start/stop call")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--serve-stubs", help=argparse.SUPPRESS)  # child mode: "port,port,...:root"
    args = ap.parse_args()

    if args.serve_stubs:
        ports_s, root = args.serve_stubs.split(":", 1)
        asyncio.run(_serve([int(p) for p in ports_s.split(",")], args.latency, Path(root)))
        return

    from sidecar.control.controller import ControlSettings
    from sidecar.emulator.launcher import free_port
    from sidecar.fleet import Target

    n = args.replicas
    with tempfile.TemporaryDirectory(prefix="omni-fanout-") as tmp:
        root = Path(tmp)
        ports = [free_port() for _ in range(n)]
        deploys = _deploys(root, n)
        child = subprocess.Popen(
            [sys.executable, __file__, "--latency", str(args.latency),
             "--serve-stubs", ",".join(map(str, ports)) + ":" + str(root)],
            start_new_session=True,
        )
        try:
            import httpx

            urls = [f"http://127.0.0.1:{p}" for p in ports]
            deadline = time.monotonic() + 30
            for u in urls:
                while True:
                    try:
                        if httpx.get(f"{u}/health", timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise SystemExit("stub replicas did not come up")
                    time.sleep(0.1)
            settings = ControlSettings(settle_s=0.2, collect_timeout_s=30, summarize=False)
            targets = [Target.upstream(u, d) for u, d in zip(urls, deploys)]

            rows = {}
            for size in sorted({1, max(1, n // 4), n}):
                starts, stops = [], []
                for _ in range(args.repeat):
                    s, t = asyncio.run(_fleet_round(targets[:size], settings))
                    starts.append(s)
                    stops.append(t)
                rows[size] = (statistics.median(starts), statistics.median(stops))
            serial = statistics.median(asyncio.run(_serial_round(urls)) for _ in range(max(1, args.repeat // 2)))
        finally:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(10)

    one_start, one_stop = rows[1]
    print(f"fan-out over stub replicas (start/stop hold {args.latency:g}s each; median of {args.repeat}; "
          f"{os.cpu_count()} CPUs)")
    print(f"{'replicas':>8} {'start s':>9} {'vs 1':>6} {'stop s':>9} {'vs 1':>6}")
    for size, (s, t) in rows.items():
        print(f"{size:>8} {s:>9.3f} {s / one_start:>5.2f}x {t:>9.3f} {t / one_stop:>5.2f}x")
    print(f"{n:>8} replicas one after another (serial start): {serial:.3f}s = {serial / rows[n][0]:.1f}x "
          f"the fleet's concurrent start")
    print(f"target: start on {n} within 2x of one -> {'met' if rows[n][0] / one_start <= 2 else 'NOT met'} "
          f"({rows[n][0] / one_start:.2f}x)")


if __name__ == "__main__":
    main()
