"""What the rollout hook adds to a training step: a simulated trainer loop (generation inside the
hook's block, then training outside it) over N stand-in replicas, run bare and with the hook side
by side in one run. Printed per kind of step, never asserted:

- ``unprofiled``: a step not in ``steps`` (the hook returns a shared no-op);
- ``profiled``: a profiled step that is not the last: entering the block (the wait for the previous
  step's artifact check, then the start fan-out) and leaving it (the stop fan-out; the check goes
  on in the background, ``wait_artifacts=False`` as the verl hook runs);
- ``last``: the last profiled step: leaving it also waits for its own check (the verl hook does
  this so the step's result is on disk before a run that ends there exits).

Method. Replicas are stub vLLM-Omni servers (``tests/fixtures/stubs.py``, upstream mode: start and
stop answered after ``--latency`` s, a gzipped trace written on stop), driven by the fleet's
in-process driver (``--driver upstream``) or, where Ray is installed (the verl venv,
``tools/verl-env.sh``), by the Ray driver on this node (``--driver ray``: each controller in a Ray
actor, the path the verl integration takes). ``added`` = the step's wall time with the hook minus
the same step bare; ``x bare`` is the ratio. The machine is shared: the load average is printed.

    python bench/rollout_hook.py [--replicas 2,16] [--driver upstream|ray] [--gen 0.2] [--train 0.05]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar.control.controller import ControlSettings  # noqa: E402
from sidecar.fleet import Target  # noqa: E402
from sidecar.rollout import RolloutProfiler  # noqa: E402
from tests.fixtures.stubs import StubFleet, write_deploys  # noqa: E402

SETTINGS = ControlSettings(collect_timeout_s=60, close_timeout_s=10, summarize=False)


def _profiler(stubs: StubFleet, deploys: list[Path], steps: list[int], driver: str) -> RolloutProfiler:
    common: dict[str, Any] = dict(wait_artifacts=False, lease_s=None, stop_budget_s=60)
    if driver == "ray":
        import ray

        from sidecar.fleet import Placement, RayNodes

        node = ray.get_runtime_context().get_node_id()
        targets = [Target.ray(u, flavor="omni") for u in stubs.urls]
        nodes = RayNodes({t.name: Placement(node, str(d)) for t, d in zip(targets, deploys)},
                         control=SETTINGS.model_dump(mode="json"))
        nodes.launch(targets, stop_budget_s=60)  # at trainer start in the verl hook: not a step's cost
        return RolloutProfiler(targets, steps, [0], drivers=nodes, **common)
    targets = [Target.upstream(u, d) for u, d in zip(stubs.urls, deploys)]
    return RolloutProfiler(targets, steps, [0], control_settings=SETTINGS, **common)


def _loop(prof: RolloutProfiler | None, n_steps: int, last: int, gen_s: float, train_s: float) -> dict[int, float]:
    """Per step: wall seconds of one simulated training step (generation, then training)."""
    out: dict[int, float] = {}
    for step in range(1, n_steps + 1):
        t0 = time.perf_counter()
        if prof is None:
            time.sleep(gen_s)
        else:
            with prof.step(step):
                time.sleep(gen_s)
            if step == last:
                prof.wait(300)  # what the verl hook does at its last profiled step
        time.sleep(train_s)
        out[step] = time.perf_counter() - t0
    return out


def run(n: int, driver: str, gen_s: float, train_s: float, latency: float, repeat: int) -> list[list[str]]:
    steps, n_steps = [2, 4, 6], 7  # unprofiled 1, 3, 5, 7; profiled 2, 4; last 6
    added: dict[str, list[float]] = {"unprofiled": [], "profiled": [], "last": []}
    bare_of: dict[str, list[float]] = {"unprofiled": [], "profiled": [], "last": []}
    with tempfile.TemporaryDirectory(prefix="bench-hook-") as tmp:
        root = Path(tmp)
        with StubFleet(n, mode="upstream", root=root, latency=latency) as stubs:
            deploys = write_deploys(root, n)
            for _ in range(repeat):
                stubs.reset()
                bare = _loop(None, n_steps, steps[-1], gen_s, train_s)
                prof = _profiler(stubs, deploys, steps, driver)
                try:
                    hooked = _loop(prof, n_steps, steps[-1], gen_s, train_s)
                    results = prof.wait(300)
                finally:
                    prof.close()
                bad = [s for s, r in results.items() if not r.ok]
                if bad:
                    raise SystemExit(f"steps {bad} were not profiled ok: {results[bad[0]].model_dump_json()[:2000]}")
                for step in range(1, n_steps + 1):
                    kind = "last" if step == steps[-1] else "profiled" if step in steps else "unprofiled"
                    added[kind].append(hooked[step] - bare[step])
                    bare_of[kind].append(bare[step])
    rows = []
    for kind in ("unprofiled", "profiled", "last"):
        a, b = statistics.median(added[kind]), statistics.median(bare_of[kind])
        rows.append([str(n), driver, kind, f"{a * 1000:.2f}", f"{(a + b) / b:.3f}", str(len(added[kind]))])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="2,16")
    ap.add_argument("--driver", default="upstream", choices=["upstream", "ray"])
    ap.add_argument("--gen", type=float, default=0.2, help="seconds of generation per step (inside the block)")
    ap.add_argument("--train", type=float, default=0.05, help="seconds of training per step (outside it)")
    ap.add_argument("--latency", type=float, default=0.1, help="the stand-in servers' start/stop hold (s)")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if a.driver == "ray":
        import ray

        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    try:
        rows = [r for n in (int(x) for x in a.replicas.split(",")) for r in
                run(n, a.driver, a.gen, a.train, a.latency, a.repeat)]
    finally:
        if a.driver == "ray":
            ray.shutdown()
    print(f"load average {os.getloadavg()[0]:.2f}; generation {a.gen}s, training {a.train}s, server hold "
          f"{a.latency}s, median of {a.repeat} runs")
    head = ["replicas", "driver", "step", "added ms", "x bare", "n"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    for line in [head, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


if __name__ == "__main__":
    main()
