"""Fan-out at scale: ``Fleet.start``/``stop`` over N stub replicas against one replica, side by side
in one run, plain and with ``start_at``, with the start skew across replicas (from the stubs' own
receive timestamps), the trainer-side cost (peak RSS, open fds/sockets, CPU seconds) and a
one-after-another loop for reference. Ratios are printed, never asserted.

Method. Each replica is a stub (``tests/fixtures/stubs.py``): vLLM-Omni's profiler endpoints
(``--kind upstream``: the fleet drives them in-process with ``CaptureController``, the RL path) or
the sidecar API (``--kind sidecar``), holding each start/stop ``--latency`` seconds. The default
holds are 0.1 s and 0.5 s: vLLM-Omni answers start_profile after every targeted worker started its
torch profiler (a collective RPC round trip plus ``torch.profiler.start``: ~0.1 s on an idle
engine, ~0.5 s with several stages or a busy step); a hold of 0 would measure only the trainer's
CPU. Stubs bind their own ports (port 0) and report them; one stub process per 64 replicas (a
stub writes its traces on the event loop; more per process and the stubs are what is measured).
``--stub-cpus N`` pins the stubs to the last N CPUs and the fleet (and its workers) to the others,
as if the replicas ran on other hosts.
1,024 replicas need ~2,100 file descriptors here (the soft limit is raised).

Columns. ``start``: the call until every upstream accepted (plain: prepare + send + hold; with
start_at: from start_at). ``prep``: the call until the starts were released (the preparation
phase). ``skew``: first to p50 / last replica receiving its start (with start_at, a sidecar stub's
start is the one it sends at that time, as the sidecar does: the request came ahead); with start_at
also the earliest start relative to start_at (never below 0 by construction). The machine is shared: the
load average is printed with each table.

    python bench/fanout.py --replicas 128 [--kind upstream|sidecar|both] [--latency 0.1,0.5] [--repeat 3]

``--windows`` (issue 43): scheduled windows, ``Fleet.capture(duration, start_at=...)`` over
``--sizes`` stub targets (default 128 and 1,024) against one, in one fleet process: each target is
told ``start_at`` (on its own clock) and the duration, and starts and ends its window itself. The
start and stop skew are read from the stubs' own clocks (when each sent its server's start and its
stop: first to p50 and to p99), and the finish is the time from the window's end (``start_at`` +
duration) to every result gathered (every check over). With ``--driver ray`` the same over the
Ray driver: ``--per-node`` targets per node actor (a few actors each driving many targets).

``--driver ray`` (the verl venv: ``PYTHONPATH=$PWD $(tools/verl-env.sh) bench/fanout.py --driver ray``)
runs the same fan-out through the Ray driver on a local Ray cluster, ``--per-node`` replicas per
node actor (one process each, as one actor serves a node's replicas), beside the in-process HTTP
driver at the same scale: start skew, the finish (every node's artifact check) against one
deadline, and trainer-side RSS / CPU per step. Each actor is a process: one actor's memory is
measured first (USS/PSS, psutil) and the run is sized to ``--mem-gib``, printed with the projection
for the ``--nodes`` asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
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

STUBS_PER_PROCESS = 64  # stub replicas per stub process (--stubs-per-process)
SETTINGS = ControlSettings(collect_timeout_s=60, close_timeout_s=10, summarize=False)


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


def _lead(n: int) -> float:
    """How far ahead start_at is set: the preparation of n targets on this machine, with margin."""
    return 1.0 + 0.01 * n


async def _round(targets: list[Target], stubs: StubFleet, size: int, synced: bool) -> dict[str, float]:
    stubs.reset()
    cpu0 = sum(os.times()[:2])
    async with Fleet(targets[:size], control_settings=SETTINGS, stop_budget_s=120, client_timeout_s=120) as fleet:
        called = time.time()
        start_at = called + _lead(size) if synced else None
        t0 = time.perf_counter()
        fc = await fleet.start(label="bench", start_at=start_at)
        t_start = time.perf_counter() - t0 - (start_at - called if start_at else 0.0)
        fds, socks = _fds()
        stop_called = time.time_ns()
        t0 = time.perf_counter()
        fc = await fleet.stop(fc, wait_artifacts=False)
        t_stop = time.perf_counter() - t0
        answered = sorted(r.stop_s * 1e3 for r in fc.targets.values() if r.stop_s is not None)
        fc = await fleet.refresh(fc, wait=True, timeout=120)  # the artifact checks end before close
        if not fc.ok:
            raise SystemExit(f"fan-out failed: {fc.rollup()}")
    cpu = sum(os.times()[:2]) - cpu0
    # when each server's start left (a sidecar stub logs the start its sidecar sends)
    got = sorted(ts[0] for i, ts in stubs.received("/start_profile").items() if i < size and ts)
    skews = [(t - got[0]) / 1e6 for t in got]
    # where a stop's time goes: when the stubs received it, when the fleet had each answer
    def after_call(key: str) -> list[float]:
        return sorted((min(t for t in ts if t >= stop_called) - stop_called) / 1e6
                      for i, ts in stubs.received("/stop_profile", key=key).items()
                      if i < size and any(t >= stop_called for t in ts))

    sent, stubs_answered = after_call("calls"), after_call("answered")
    return {"start": t_start, "prep": (fc.released_at or called) - called, "stop": t_stop,
            "sent_first": sent[0], "sent_last": sent[-1], "stub_first": stubs_answered[0], "stub_last": stubs_answered[-1],
            "answered_first": answered[0], "answered_p50": statistics.median(answered), "answered_last": answered[-1],
            "skew_p50": statistics.median(skews), "skew_max": skews[-1],
            "early": (got[0] / 1e9 - start_at) * 1e3 if start_at else float("nan"),
            "fds": fds, "socks": socks, "cpu": cpu, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


async def _serial(urls: list[str]) -> float:
    from sidecar.fleet._drivers import FleetTransports
    from sidecar.upstream.server import UpstreamServer

    pools = FleetTransports()  # as the fleet's: a default client would build a TLS context each (RSS)
    servers = [UpstreamServer(u, transport=pools.for_target()) for u in urls]
    await asyncio.gather(*(s.warm() for s in servers))  # connected, as the fleet's are
    t0 = time.perf_counter()
    for s in servers:  # one after another: what a per-replica loop does
        await s.start_profile([0])
    elapsed = time.perf_counter() - t0
    await asyncio.gather(*(s.stop_profile([0]) for s in servers))
    await asyncio.gather(*(s.aclose() for s in servers))
    return elapsed


def _table(kind: str, n: int, latency: float, repeat: int, rows: dict[tuple[int, bool], dict[str, float]],
           serial: float | None, serial_n: int) -> None:
    one = rows[(1, False)]
    print(f"\n{kind} targets: {n} stub replicas vs 1, start/stop hold {latency:g}s (median of {repeat}; "
          f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f})")
    print(f"{'replicas':>8} {'start_at':>8} {'start s':>8} {'vs 1':>6} {'prep s':>7} {'stop s':>7} {'vs 1':>6} "
          f"{'skew p50 ms':>11} {'skew max ms':>11} {'1st-at ms':>9} {'RSS MiB':>8} {'fds':>5} {'socks':>5} "
          f"{'CPU s':>6}")
    for (size, synced), r in rows.items():
        early = f"{r['early']:>9.1f}" if synced else f"{'-':>9}"
        print(f"{size:>8} {'yes' if synced else 'no':>8} {r['start']:>8.3f} {r['start'] / one['start']:>5.2f}x "
              f"{r['prep']:>7.3f} {r['stop']:>7.3f} {r['stop'] / one['stop']:>5.2f}x {r['skew_p50']:>11.1f} "
              f"{r['skew_max']:>11.1f} {early} {r['rss']:>8.0f} {r['fds']:>5.0f} {r['socks']:>5.0f} {r['cpu']:>6.2f}")
    for (size, synced), r in rows.items():
        if size > 1:
            print(f"stop phases, {size} replicas, start_at {'yes' if synced else 'no'} (ms after the call): "
                  f"the stubs received it first {r['sent_first']:.0f}, last {r['sent_last']:.0f}, answered it first "
                  f"{r['stub_first']:.0f}, last {r['stub_last']:.0f}; the fleet had the "
                  f"answers first {r['answered_first']:.0f}, p50 {r['answered_p50']:.0f}, last "
                  f"{r['answered_last']:.0f}; the call returned {r['stop'] * 1e3:.0f} (one replica: "
                  f"{one['stop'] * 1e3:.0f})")
    if serial is not None:
        print(f"serial loop (start one after another) on {serial_n} replicas: {serial:.3f}s "
              f"= {serial / rows[(n, False)]['start']:.1f}x the fleet's concurrent start on {n}"
              + (f" (x{n / serial_n:.0f} for all {n})" if serial_n < n else ""))
    plain = rows[(n, False)]
    ratio = plain["start"] / one["start"]
    print(f"goal: start on {n} <= 2x one -> {'met' if ratio <= 2 else 'NOT met'} ({ratio:.2f}x); "
          f"skew p50 <= 20 ms -> plain {plain['skew_p50']:.1f} ms, start_at {rows[(n, True)]['skew_p50']:.1f} ms")


def _split_cpus(stub_cpus: int) -> tuple[set[int] | None, set[int] | None]:
    """(the stubs' CPUs, this process's) with the last ``stub_cpus`` CPUs for the stubs: the stubs
    stand in for servers on other hosts, and on this one they take the fleet's CPUs (a stop's
    burst runs 1,024 stub requests beside the fleet's workers on the same cores)."""
    if not stub_cpus:
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if stub_cpus >= len(cpus):
        raise SystemExit(f"--stub-cpus {stub_cpus}: this process has {len(cpus)} CPUs; leave the fleet some")
    return set(cpus[-stub_cpus:]), set(cpus[:-stub_cpus])


def _bench(kind: str, n: int, latencies: list[float], repeat: int, serial_n: int, stub_cpus: int = 0) -> None:
    stubs_on, fleet_on = _split_cpus(stub_cpus)
    own = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="omni-fanout-") as tmp, contextlib.ExitStack() as undo:
        undo.callback(os.sched_setaffinity, 0, own)
        root = Path(tmp)
        with StubFleet(n, mode=kind, root=root, latency=latencies[0], processes=-(-n // STUBS_PER_PROCESS),
                       cpus=stubs_on) as stubs:
            if fleet_on:
                os.sched_setaffinity(0, fleet_on)
                print(f"stubs on CPUs {min(stubs_on)}-{max(stubs_on)}, the fleet on "  # type: ignore[arg-type]
                      f"{min(fleet_on)}-{max(fleet_on)}")
            if kind == "upstream":
                targets = [Target.upstream(u, d) for u, d in zip(stubs.urls, write_deploys(root, n))]
            else:
                targets = [Target.sidecar(u) for u in stubs.urls]
            for latency in latencies:
                stubs.reset(latency=latency)
                rows: dict[tuple[int, bool], dict[str, float]] = {}
                for size in (1, n):
                    for synced in (False, True):
                        runs = [asyncio.run(_round(targets, stubs, size, synced)) for _ in range(repeat)]
                        rows[(size, synced)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                        rows[(size, synced)]["rss"] = max(r["rss"] for r in runs)
                serial = asyncio.run(_serial(stubs.urls[:serial_n])) if kind == "upstream" else None
                _table(kind, n, latency, repeat, rows, serial, serial_n)


async def _clock_round(targets: list[Target], stubs: StubFleet, size: int, synced: bool, clocks: bool) -> dict[str, float]:
    """One start/stop of ``size`` targets, with or without the clock exchange (issue 23): the start,
    the stop, the skew, and how long after the stop every offset is known, with its error bound."""
    stubs.reset()
    async with Fleet(targets[:size], control_settings=SETTINGS, stop_budget_s=120, client_timeout_s=120,
                     exchange_clocks=clocks) as fleet:
        called = time.time()
        start_at = called + _lead(size) if synced else None
        t0 = time.perf_counter()
        fc = await fleet.start(label="bench", start_at=start_at)
        t_start = time.perf_counter() - t0 - (start_at - called if start_at else 0.0)
        await asyncio.sleep(0.5)  # the window: the start's exchanges run in it
        t0 = time.perf_counter()
        fc = await fleet.stop(fc, wait_artifacts=False)
        t_stop = time.perf_counter() - t0
        t0 = time.perf_counter()
        fc = await fleet.refresh(fc, wait=True, timeout=120)  # joins the stop's exchanges
        t_known = time.perf_counter() - t0
        if not fc.ok:
            raise SystemExit(f"fan-out failed: {fc.rollup()}")
    got = sorted(ts[0] for i, ts in stubs.received("/start_profile").items() if i < size and ts)
    errors = sorted(r.clock.error_ns / 1e6 for r in fc.targets.values() if r.clock is not None)
    return {"start": t_start, "stop": t_stop, "known": t_known,
            "skew_p50": statistics.median((t - got[0]) / 1e6 for t in got),
            "measured": len(errors) / size, "err_p50": statistics.median(errors) if errors else float("nan"),
            "err_max": errors[-1] if errors else float("nan")}


def _clock_goals(n: int, latency: float, repeat: int) -> None:
    """Issue 23's figures at ``n`` sidecar stub replicas, each printed beside its goal."""
    with tempfile.TemporaryDirectory(prefix="omni-fanout-") as tmp, \
            StubFleet(n, mode="sidecar", root=Path(tmp), latency=latency, processes=-(-n // STUBS_PER_PROCESS)) as stubs:
        targets = [Target.sidecar(u) for u in stubs.urls]
        rows: dict[tuple[int, bool, bool], dict[str, float]] = {}
        for size in (1, n):
            for synced in (False, True):
                for clocks in (False, True):
                    runs = [asyncio.run(_clock_round(targets, stubs, size, synced, clocks))
                            for _ in range(repeat)]
                    rows[(size, synced, clocks)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"\nissue 23 at {n} sidecar stub replicas, hold {latency:g}s (median of {repeat}; {os.cpu_count()} CPUs; "
          f"load {os.getloadavg()[0]:.1f}); one fleet process")
    print(f"{'replicas':>8} {'start_at':>8} {'clocks':>6} {'start s':>8} {'stop s':>7} {'skew p50 ms':>11} "
          f"{'known s':>8} {'measured':>8} {'err p50 ms':>10} {'err max ms':>10}")
    for (size, synced, clocks), r in rows.items():
        print(f"{size:>8} {'yes' if synced else 'no':>8} {'on' if clocks else 'off':>6} {r['start']:>8.3f} "
              f"{r['stop']:>7.3f} {r['skew_p50']:>11.1f} {r['known'] if clocks else float('nan'):>8.3f} "
              f"{r['measured']:>8.0%} {r['err_p50']:>10.3f} {r['err_max']:>10.3f}")

    def goal(name: str, value: float, limit: float, unit: str) -> None:
        print(f"  {name}: {value:.2f}{unit} (goal <= {limit:g}{unit}) -> {'met' if value <= limit else 'NOT met'}")

    on, off = rows[(n, False, True)], rows[(n, False, False)]
    goal("offset exchange's cost to the start", 100 * (on["start"] / off["start"] - 1), 10, "%")
    goal("start with start_at vs one replica", rows[(n, True, True)]["start"] / rows[(1, True, True)]["start"], 3, "x")
    goal("skew p50 with start_at", rows[(n, True, True)]["skew_p50"], 20, " ms")
    goal("stop vs one replica", on["stop"] / rows[(1, False, True)]["stop"], 3, "x")
WINDOW_S = 1.0  # --windows: each window's duration


def _spread(ns: list[int]) -> tuple[float, float]:
    """(first to p50, first to p99) in ms."""
    got = sorted(ns)
    ms = [(t - got[0]) / 1e6 for t in got]
    return statistics.median(ms), ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)]


async def _window_round(fleet_args: dict, stubs: StubFleet, size: int, lead: float) -> dict[str, float]:
    """One scheduled window over ``size`` targets: the skews from the stubs' clocks, the finish."""
    stubs.reset()
    async with Fleet(**fleet_args) as fleet:
        start_at = time.time() + lead
        fc = await fleet.capture(WINDOW_S, start_at=start_at, artifact_timeout_s=FINISH_DEADLINE_S)
        finish = time.time() - (start_at + WINDOW_S)
        if not fc.ok:
            raise SystemExit(f"fan-out failed: {fc.rollup()}")
    starts = [ts[0] for i, ts in stubs.received("/start_profile").items() if i < size and ts]
    stops = [ts[0] for i, ts in stubs.received("/stop_profile").items() if i < size and ts]
    if len(starts) != size or len(stops) != size:
        raise SystemExit(f"{len(starts)} starts and {len(stops)} stops logged for {size} targets")
    (s50, s99), (e50, e99) = _spread(starts), _spread(stops)
    return {"start_p50": s50, "start_p99": s99, "stop_p50": e50, "stop_p99": e99, "finish": finish,
            "late_first": (min(starts) / 1e9 - start_at) * 1e3}


def _window_table(title: str, rows: dict[tuple[int, bool], dict[str, float]]) -> None:
    """Rows by (targets, clock exchange on); each finish against one target's with the same exchange."""
    print(f"\n{title} ({os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f})")
    print(f"{'targets':>8} {'clocks':>6} {'start skew p50 / p99 ms':>24} {'stop skew p50 / p99 ms':>23} "
          f"{'1st start after start_at ms':>27} {'finish s':>9} {'vs 1':>6}")
    for (size, clocks), r in sorted(rows.items()):
        one = rows[(1, clocks)]
        print(f"{size:>8} {'on' if clocks else 'off':>6} {r['start_p50']:>11.1f} / {r['start_p99']:>10.1f} "
              f"{r['stop_p50']:>10.1f} / {r['stop_p99']:>10.1f} {r['late_first']:>27.1f} {r['finish']:>9.3f} "
              f"{r['finish'] / one['finish']:>5.2f}x")
    n = max(size for size, _ in rows)
    for clocks in sorted({c for _, c in rows}, reverse=True):
        big, one = rows[(n, clocks)], rows[(1, clocks)]
        for name, value, goal, unit in (("start skew p50", big["start_p50"], 20, " ms"),
                                        ("stop skew p50", big["stop_p50"], 20, " ms"),
                                        ("finish vs one target", big["finish"] / one["finish"], 3, "x")):
            print(f"  goal at {n}, clock exchange {'on' if clocks else 'off'}: {name} {value:.2f}{unit} "
                  f"(<= {goal:g}{unit}) -> {'met' if value <= goal else 'NOT met'}")


def _windows(sizes: list[int], latency: float, repeat: int) -> None:
    """Issue 43's figures over sidecar stubs, in one fleet process."""
    n = max(sizes)
    with tempfile.TemporaryDirectory(prefix="omni-fanout-") as tmp, \
            StubFleet(n, mode="sidecar", root=Path(tmp), latency=latency, processes=-(-n // STUBS_PER_PROCESS)) as stubs:
        targets = [Target.sidecar(u) for u in stubs.urls]
        rows = {}
        for size in [1, *sizes]:
            for clocks in (True, False):  # the stop's clock exchanges are part of the results, or left out
                args = dict(targets=targets[:size], stop_budget_s=120, client_timeout_s=120, exchange_clocks=clocks)
                runs = [asyncio.run(_window_round(args, stubs, size, _lead(size))) for _ in range(repeat)]
                rows[(size, clocks)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    _window_table(f"scheduled windows: sidecar stubs, hold {latency:g}s, window {WINDOW_S:g}s, one fleet process, "
                  f"median of {repeat}", rows)


def _ray_windows(n: int, per_node: int, latency: float, repeat: int) -> None:
    """Issue 43's figures through the Ray driver: ``n`` upstream stubs, ``per_node`` per node actor."""
    import ray

    from sidecar.fleet import Placement, RayNodes

    os.environ.setdefault("RAY_worker_register_timeout_seconds", "600")
    root = Path(__file__).resolve().parents[1]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    node = ray.get_runtime_context().get_node_id()
    control = SETTINGS.model_dump(mode="json")
    try:
        with tempfile.TemporaryDirectory(prefix="omni-fanout-ray-") as tmp, \
                StubFleet(n, mode="upstream", root=Path(tmp), latency=latency, processes=-(-n // 64)) as stubs:
            deploys = write_deploys(Path(tmp), n)
            targets = [Target.ray(u, flavor="omni") for u in stubs.urls]
            rows = {}
            for size in (1, n):
                nodes = RayNodes({t.name: Placement(node, str(d)) for t, d in zip(targets[:size], deploys)},
                                 control=control, per_actor=per_node, top=0)
                t0 = time.perf_counter()
                nodes.launch(targets[:size], stop_budget_s=120, timeout_s=1800)
                up = time.perf_counter() - t0
                args = dict(targets=targets[:size], stages=[0], drivers=nodes, stop_budget_s=120)
                # the nodes prepare in their own processes: start_at leaves them the lead their start takes
                runs = [asyncio.run(_window_round(args, stubs, size, 2.0 + 0.02 * size)) for _ in range(repeat)]
                rows[(size, True)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                for actor in {id(a): a for a in nodes._launched.values()}.values():
                    ray.kill(actor)
                print(f"{size} targets: {-(-size // per_node)} node actor(s) up in {up:.1f}s")
        _window_table(f"scheduled windows through the Ray driver: {n} upstream stubs, {per_node} per node actor "
                      f"({-(-n // per_node)} actors), hold {latency:g}s, window {WINDOW_S:g}s, median of {repeat}", rows)
    finally:
        ray.shutdown()


FINISH_DEADLINE_S = 120.0  # one deadline for every node's artifact check after the stop


def _pss(pids: list[int]) -> tuple[float, float]:
    """(USS, PSS) MiB summed over ``pids``."""
    import psutil

    uss = pss = 0.0
    for pid in pids:
        m = psutil.Process(pid).memory_full_info()
        uss, pss = uss + m.uss / 2**20, pss + m.pss / 2**20
    return uss, pss


def _cpu_of(pids: list[int]) -> float:
    import psutil

    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


async def _steps(fleet_args: dict, stubs: StubFleet, size: int, node_pids: list[int],
                 lead_s: float | None = None) -> dict[str, dict[str, float]]:
    """Two fan-outs (two profiled steps) over one open fleet: plain, then with ``start_at``
    (``lead_s`` ahead; default :func:`_lead`)."""
    import psutil

    me = psutil.Process()
    out: dict[str, dict[str, float]] = {}
    async with Fleet(**fleet_args) as fleet:
        for synced in (False, True):
            stubs.reset()
            cpu0, node0 = sum(os.times()[:2]), _cpu_of(node_pids)
            called = time.time()
            start_at = called + (lead_s or _lead(size)) if synced else None
            t0 = time.perf_counter()
            fc = await fleet.start(label="bench", start_at=start_at)
            t_start = time.perf_counter() - t0 - (start_at - called if start_at else 0.0)
            rss_live = me.memory_info().rss / 2**20
            t0 = time.perf_counter()
            fc = await fleet.stop(fc, wait_artifacts=False)
            t_stop = time.perf_counter() - t0
            t0 = time.perf_counter()
            fc = await fleet.refresh(fc, wait=True, timeout=FINISH_DEADLINE_S)
            t_finish = time.perf_counter() - t0
            if not fc.ok:
                raise SystemExit(f"fan-out failed: {fc.rollup()}")
            got = sorted(ts[0] for i, ts in stubs.received("/start_profile").items() if i < size and ts)
            skews = [(t - got[0]) / 1e6 for t in got]
            out["+at" if synced else ""] = {
                "start": t_start, "stop": t_stop, "finish": t_finish, "done": float(fc.done),
                "skew_p50": statistics.median(skews), "skew_max": skews[-1], "rss": rss_live,
                "cpu": sum(os.times()[:2]) - cpu0, "node_cpu": _cpu_of(node_pids) - node0}
    return out


def _ray_bench(nodes_wanted: int, per_node: int, latency: float, mem_gib: float) -> None:
    import psutil
    import ray

    from sidecar.fleet import Placement, RayNodes

    os.environ.setdefault("RAY_worker_register_timeout_seconds", "600")  # 2 cores starting many processes
    root = Path(__file__).resolve().parents[1]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    control = SETTINGS.model_dump(mode="json")
    node = ray.get_runtime_context().get_node_id()
    try:
        with tempfile.TemporaryDirectory(prefix="omni-fanout-ray-") as tmp:
            # 1. one node actor with its replicas: what one actor costs
            with StubFleet(per_node, mode="upstream", root=Path(tmp) / "probe", latency=latency) as probe:
                deploys = write_deploys(Path(tmp) / "probe", per_node)
                targets = [Target.ray(u, flavor="omni") for u in probe.urls]
                one = RayNodes({t.name: Placement(node, str(d)) for t, d in zip(targets, deploys)}, control=control)
                one.launch(targets, stop_budget_s=120)
                actor = next(iter(one._launched.values()))
                pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))

                async def measured() -> tuple[float, float]:  # the actor's memory with its captures done
                    async with Fleet(targets, stages=[0], drivers=one) as fleet:
                        fc = await fleet.start(label="probe")
                        await fleet.refresh(await fleet.stop(fc, wait_artifacts=False), wait=True, timeout=60)
                        return _pss([pid])

                uss, pss = asyncio.run(measured())
                stub_uss, stub_pss = _pss([p.pid for p in probe.children])
            avail = psutil.virtual_memory().available / 2**30
            budget = min(mem_gib, avail - 4)  # leave 4 GiB to the machine's other users
            fixed = 1.0  # assumed for Ray's own processes, the trainer and the stub processes
            fit = int(max(0.0, budget - fixed) * 1024 // pss)
            n_nodes = min(nodes_wanted, fit)
            print(f"\none node actor holding {per_node} replicas: USS {uss:.0f} MiB, PSS {pss:.0f} MiB "
                  f"(a stub process: PSS {stub_pss:.0f} MiB); {nodes_wanted} node actors would need "
                  f"{nodes_wanted * pss / 1024:.1f} GiB of actors; budget {budget:.1f} GiB "
                  f"(--mem-gib {mem_gib:g}, {avail:.1f} GiB available) -> {n_nodes} node actors"
                  + ("" if n_nodes == nodes_wanted else f"  ** {nodes_wanted} do NOT fit: ran {n_nodes} **"))
            if n_nodes < 1:
                raise SystemExit("no room for a node actor")
            n = n_nodes * per_node
            # 2. the fleet at scale: n stub replicas, n_nodes node actors (each its per_node replicas)
            with StubFleet(n, mode="upstream", root=Path(tmp) / "fleet", latency=latency,
                           processes=-(-n // 64)) as stubs:
                deploys = write_deploys(Path(tmp) / "fleet", n)
                http = [Target.upstream(u, d) for u, d in zip(stubs.urls, deploys)]
                rtargets = [Target.ray(u, flavor="omni") for u in stubs.urls]
                nodes = RayNodes({t.name: Placement(node, str(d)) for t, d in zip(rtargets, deploys)},
                                 control=control, per_actor=per_node, top=0)  # no summaries, as the HTTP rows
                t0 = time.perf_counter()
                nodes.launch(rtargets, stop_budget_s=120, timeout_s=1800)
                launch_s = time.perf_counter() - t0
                actors = {id(a): a for a in nodes._launched.values()}
                pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors.values()])
                a_uss, a_pss = _pss(pids)
                rows: dict[str, dict[str, float]] = {}
                http_args = dict(targets=http, control_settings=SETTINGS, stop_budget_s=120, client_timeout_s=120)
                for kind, r in asyncio.run(_steps(http_args, stubs, n, [])).items():
                    rows[f"http{kind}"] = r
                # the nodes prepare in their own processes: give start_at the lead their start took
                lead = 2.0 + 0.05 * n
                for kind, r in asyncio.run(_steps(dict(targets=rtargets, stages=[0], drivers=nodes), stubs, n,
                                                  pids, lead)).items():
                    rows[f"ray{kind}"] = r
            used = psutil.virtual_memory().total / 2**30 - psutil.virtual_memory().available / 2**30
            print(f"{n_nodes} node actors x {per_node} = {n} stub replicas, start/stop hold {latency:g}s; actors "
                  f"up in {launch_s:.0f}s (at trainer start); actors' PSS {a_pss / 1024:.2f} GiB "
                  f"(USS {a_uss / 1024:.2f}); machine in use {used:.1f} GiB; load {os.getloadavg()[0]:.1f}")
            print(f"{'driver':>8} {'start s':>8} {'stop s':>7} {'finish s':>8} {'deadline':>8} {'skew p50 ms':>11} "
                  f"{'skew max ms':>11} {'trainer RSS MiB':>15} {'trainer CPU s':>13} {'node CPU s':>10}")
            for name, r in rows.items():
                print(f"{name:>8} {r['start']:>8.3f} {r['stop']:>7.3f} {r['finish']:>8.3f} "
                      f"{('met' if r['done'] and r['finish'] <= FINISH_DEADLINE_S else 'MISSED'):>8} "
                      f"{r['skew_p50']:>11.1f} {r['skew_max']:>11.1f} {r['rss']:>15.0f} {r['cpu']:>13.2f} "
                      f"{r['node_cpu']:>10.2f}")
            best = min(rows["ray"]["skew_p50"], rows["ray+at"]["skew_p50"])
            print(f"goal: skew p50 <= 20 ms -> ray {rows['ray']['skew_p50']:.1f} ms, ray+start_at "
                  f"{rows['ray+at']['skew_p50']:.1f} ms ({'met' if best <= 20 else 'NOT met'}); finish within one "
                  f"{FINISH_DEADLINE_S:g}s deadline -> {'met' if all(r['done'] for r in rows.values()) else 'NOT met'}; "
                  f"trainer CPU per step ray/http {rows['ray']['cpu'] / max(rows['http']['cpu'], 1e-9):.2f}x, "
                  f"RSS ray/http {rows['ray']['rss'] / rows['http']['rss']:.2f}x")
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=128)
    ap.add_argument("--kind", choices=("upstream", "sidecar", "both"), default="upstream")
    ap.add_argument("--latency", default="0.1,0.5", help="seconds each stub holds a start/stop call (comma list)")
    ap.add_argument("--repeat", type=int, default=None, help="rounds per row (default 3; 1 above 256 replicas)")
    ap.add_argument("--serial", type=int, default=64, help="replicas in the serial reference loop")
    ap.add_argument("--clocks", action="store_true",
                    help="issue 23's figures instead (sidecar stubs, the clock exchange on and off, each beside its goal)")
    ap.add_argument("--windows", action="store_true",
                    help="issue 43's figures: scheduled windows (start_at and a duration) over --sizes stub targets")
    ap.add_argument("--sizes", default="128,1024", help="--windows: the fleet sizes, each against one target")
    ap.add_argument("--driver", choices=("http", "ray"), default="http",
                    help="ray: the Ray driver beside the HTTP one (needs Ray: the verl venv)")
    ap.add_argument("--nodes", type=int, default=256, help="--driver ray: node actors wanted")
    ap.add_argument("--per-node", type=int, default=4, help="--driver ray: replicas per node actor")
    ap.add_argument("--mem-gib", type=float, default=10.0, help="--driver ray: memory the run may take")
    ap.add_argument("--stubs-per-process", type=int, default=64,
                    help="stub replicas per stub process: an upstream stub writes each stop's trace on its loop, "
                         "so many per process make the stubs, not the fleet, what a stop waits for")
    ap.add_argument("--stub-cpus", type=int, default=0,
                    help="pin the stubs to this many of the last CPUs and the fleet to the others (0: shared)")
    args = ap.parse_args()
    global STUBS_PER_PROCESS
    STUBS_PER_PROCESS = args.stubs_per_process
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * args.replicas + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    if args.windows:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        want = 4 * max(sizes) + 256
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
        latency = float(args.latency.split(",")[0])
        if args.driver == "ray":
            _ray_windows(max(sizes), args.per_node, latency, args.repeat or 1)
        else:
            _windows(sizes, latency, args.repeat or 1)
        return
    if args.driver == "ray":
        want = 4 * args.nodes * args.per_node + 256
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
        _ray_bench(args.nodes, args.per_node, float(args.latency.split(",")[0]), args.mem_gib)
        return
    repeat = args.repeat or (3 if args.replicas <= 256 else 1)
    latencies = [float(x) for x in args.latency.split(",") if x.strip()]
    if args.clocks:
        _clock_goals(args.replicas, latencies[0], repeat)
        return
    for kind in (("upstream", "sidecar") if args.kind == "both" else (args.kind,)):
        _bench(kind, args.replicas, latencies, repeat, min(args.serial, args.replicas), args.stub_cpus)


if __name__ == "__main__":
    main()
