"""``steps`` windows and the budget plan measured on a real vLLM 0.30 CPU server (issue 24), one
server per profiler flag set, each with its stat loggers on (its /metrics is the step counter):

- asked 5, 20 and 50 steps (light flags): the steps the server counted and the trace holds,
  beside the goal (N +- 2 at 20);
- per flag set (light, ops, stacks): ``plan`` (probes of 1 and 2 steps) for ``--budget-mb`` and
  ``--max-stop-s``, then a real window of the planned steps: predicted size and stop time beside
  the actual ones, as ratios, beside the goals (size within +-25%, stop within +-50%).

With ``--profiles light,ops,stacks`` the servers run the product's own stage profiles whole, as
``render --profile`` writes them (``ignore_frontend``, and stacks' ``max_iterations: 8``): where
the server ends every window itself the plan is held to its cap and predicts the trace write
inside the engine, and the window's actual is each verdict's ``trace_write_s``.

A load thread sends completions one after another for the whole run. Servers and sidecars bind
127.0.0.1 on free ports and are always shut down. Nothing is asserted; it prints.

    python bench/steps.py [--flags light,ops,stacks] [--asked 5,20,50] [--budget-mb 150] [--max-stop-s 60]
    python bench/steps.py --profiles light,ops,stacks --asked "" --max-tokens 16 --budget-mb 50 --max-stop-s 20
    python bench/steps.py --profiles stacks --asked "" --max-tokens 16 --budget-mb 50 --max-stop-s 20 --inproc
    python bench/steps.py --upstream http://127.0.0.1:8000 --profiler-config '{"profiler": "torch", ...}'
    python bench/steps.py --omni --profiles light,ops,stacks --asked "" --max-tokens 16 --budget-mb 50 --max-stop-s 60
    python bench/steps.py --omni --capped-asked 5,20,50 --idle 4/22

``--omni`` runs each on a real two-stage ``vllm serve --omni`` (vLLM-Omni 0.30 on CPU, the omni
group's server: tests/omni/conftest.py) instead, the profile on both stages, a trace dir each.
``--capped-asked`` starts one such server per N, rendered as ``render --profile light --steps N
--idle 1=<--idle>`` writes it (stage 1, fed by stage 0, given the share of its iterations it idles),
and prints the steps each stage's trace holds in ``--windows`` windows of N under two 8-token
requests at a time (tests/omni/test_steps_capped.py's load), beside the goal (N +- 2).

``--upstream`` measures a vLLM server you started (with its stat loggers on, and the profiler
config given as ``--profiler-config``): one flag set, the one it runs with.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.api.launcher import SidecarProcess  # noqa: E402
from sidecar.client import SidecarClient  # noqa: E402
from sidecar.config.profiles import load_profile  # noqa: E402
from sidecar.config.rules import max_iterations_for  # noqa: E402
from sidecar.control.budget import trace_bytes  # noqa: E402
from sidecar.control.models import Capture  # noqa: E402
from tests.fixtures.load import steady_load  # noqa: E402
from tests.live.conftest import VllmServer  # noqa: E402
from tests.omni.conftest import OmniServer, server_env, write_ar_deploy  # noqa: E402

FLAG_SETS: dict[str, dict[str, Any]] = {
    "light": {"torch_profiler_with_stack": False, "torch_profiler_record_shapes": False},
    "ops": {"torch_profiler_with_stack": False, "torch_profiler_record_shapes": True},
    "stacks": {"torch_profiler_with_stack": True, "torch_profiler_record_shapes": True},
}


def profile_config(name: str, root: Path) -> dict[str, Any]:
    """The product's stage profile ``name`` whole (stage_profiles/, what ``render --profile`` writes)."""
    return {**dict(load_profile(name).profiler_config), "torch_profiler_dir": str(root / f"traces-{name}")}


def venv_python(name: str) -> str:
    """The python of the group venv ``name`` (vllm-cpu, omni-cpu), built if it is not yet."""
    out = subprocess.run(["bash", str(ROOT / "tools" / "venvs.sh"), "wait", name], check=True,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def tiny_model(python: str, root: Path) -> Path:
    out = root / "model"
    subprocess.run([python, str(ROOT / "tests" / "live" / "make_tiny_model.py"), str(out)], check=True,
                   env=server_env(), capture_output=True, timeout=300)  # fmt: skip
    return out


@contextlib.contextmanager
def served(python: str, model: Path, root: Path, name: str, upstream: str | None = None,
           profiler_config: dict[str, Any] | None = None, omni: bool = False,
           stage_caps: tuple[int, int] | None = None) -> Iterator[tuple[str, SidecarProcess]]:
    """A server (started here, or ``upstream``) and a sidecar in front of it; ``omni``: a real
    two-stage vLLM-Omni server, ``profiler_config`` on both stages (a trace dir each), with
    ``stage_caps`` as their ``max_iterations`` where given."""
    pc = profiler_config or {"profiler": "torch", "torch_profiler_dir": str(root / f"traces-{name}"), **FLAG_SETS[name]}
    server: VllmServer | OmniServer | None = None
    deploy = None
    if omni:
        caps = [{"max_iterations": n} for n in stage_caps] if stage_caps else [{}, {}]
        deploy = write_ar_deploy(root / f"deploy-{name}.yaml",
                                 [{**pc, "torch_profiler_dir": f"{pc['torch_profiler_dir']}/stage{i}", **caps[i]}
                                  for i in (0, 1)])  # fmt: skip
        server = OmniServer(python, model, deploy, cwd=root, log_path=root / f"vllm-omni-{name}.log")
        upstream = server.start().url
    elif upstream is None:
        server = VllmServer(python, model, pc, cwd=root, log_path=root / f"vllm-{name}.log", log_stats=True)
        upstream = server.start().url
    sidecar = None
    try:
        if deploy is not None:
            sidecar = SidecarProcess(upstream, deploy, state_dir=root / f"state-{name}").start()
        else:
            sidecar = SidecarProcess(upstream, None, flavor="vllm", state_dir=root / f"state-{name}",
                                     extra_args=["--profiler-config", json.dumps(pc)]).start()  # fmt: skip
        yield upstream, sidecar
    finally:
        if sidecar is not None:
            sidecar.stop(grace=30)
        if server is not None:
            server.stop(grace=30)


def size_mb(cap: Capture) -> float:
    return trace_bytes(cap.verdicts) / 1e6


def stop_s(cap: Capture) -> float:
    if cap.stop_requested_at is None or cap.stopped_at is None:
        return float("nan")
    return (cap.stopped_at - cap.stop_requested_at).total_seconds()


def between(a: Any, b: Any) -> str:
    return "?" if a is None or b is None else f"{(b - a).total_seconds():.2f}s"


def window(client: SidecarClient, steps: int) -> Capture:
    cap = client.start_capture(steps=steps, label=f"bench-{steps}")
    return client.wait_capture(cap.id, timeout=1800)


def capped_asked(python: str, model: Path, root: Path, asked: list[int], idle: float, windows: int) -> None:
    """Per N of ``asked``: a vLLM-Omni server capped as ``render --steps N --idle 1=<idle>`` writes
    it, and ``windows`` windows of N on both stages: the steps each stage's trace holds."""
    for n in asked:
        stage_caps = (max_iterations_for(n), max_iterations_for(n, idle))
        name = f"capped-{n}"
        with served(python, model, root, name, None, profile_config("light", root) | {"torch_profiler_dir": str(
                root / f"traces-{name}")}, omni=True, stage_caps=stage_caps) as (url, sidecar), \
                SidecarClient(sidecar.url, timeout=1800) as client:
            with steady_load(url, max_tokens=8), steady_load(url, max_tokens=8):
                caps = [window(client, n) for _ in range(windows)]
            for cap in caps:
                traced = {v.stage_id: v.steps_traced for v in cap.verdicts}
                within = all(t is not None and abs(t - n) <= 2 for t in traced.values())
                print(f"  asked {n:3d} on max_iterations {stage_caps}: trace holds {traced} "
                      f"({'within' if within else 'outside'} N +- 2), stop reason {cap.stop_reason}, "
                      f"counted {cap.steps_counted}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flags", default="light,ops,stacks")
    ap.add_argument("--profiles", help="the product's stage profiles to run whole instead of --flags (e.g. light,ops,stacks)")
    ap.add_argument("--asked", default="5,20,50")
    ap.add_argument("--budget-mb", type=float, default=150.0)
    ap.add_argument("--max-stop-s", type=float, default=60.0)
    ap.add_argument("--max-tokens", default="1,16",
                    help="the load's tokens per request, one run of --asked each (1: one step per request, paced "
                         "by the request round trip; 16: back-to-back decode steps)")
    ap.add_argument("--upstream", help="a running vLLM server (stat loggers on) instead of starting one per flag set")
    ap.add_argument("--profiler-config", help="with --upstream: the JSON its --profiler-config got")
    ap.add_argument("--omni", action="store_true",
                    help="a real two-stage vllm serve --omni (vLLM-Omni 0.30 on CPU) per flag set, instead of vLLM")
    ap.add_argument("--capped-asked", help="with --omni: per N, a server capped as render --steps N --idle 1=<--idle> "
                                           "writes it, and --windows windows of N (e.g. 5,20,50)")
    ap.add_argument("--idle", default="4/22", help="with --capped-asked: the share of its iterations stage 1 idles")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--inproc", action="store_true",
                    help="the servers started here run their worker inside the engine's process "
                         "(VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's CPU platform then keeps the `uni` executor), as a "
                         "one-GPU server's does: no worker busy-waits on a queue between steps, which stacks record")
    args = ap.parse_args()
    if args.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # VllmServer passes this process's environment on
    if args.upstream and not args.profiler_config:
        ap.error("--upstream needs --profiler-config (the sidecar must know where the server writes)")
    if args.omni and args.upstream:
        ap.error("--omni starts its own servers: leave --upstream out")
    python = venv_python("omni-cpu" if args.omni else "vllm-cpu")
    asked = [int(n) for n in args.asked.split(",") if n]
    if args.capped_asked and not args.omni:
        ap.error("--capped-asked runs on vLLM-Omni servers: add --omni")
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp:
        root = Path(tmp)
        model = root / "model" if args.upstream else tiny_model(python, root)
        if args.capped_asked:
            num, _, den = args.idle.partition("/")
            print(f"steps asked vs held on vLLM-Omni capped per N (stage 1 given {args.idle} idle; goal: N +- 2)")
            capped_asked(python, model, root, [int(n) for n in args.capped_asked.split(",") if n],
                         int(num) / int(den) if den else float(num), args.windows)
            return
        rows: list[str] = []
        names = ["as-run"] if args.upstream else [n for n in (args.profiles or args.flags).split(",") if n]
        given = json.loads(args.profiler_config) if args.profiler_config else None
        for i, name in enumerate(names):
            pc = profile_config(name, root) if args.profiles and not args.upstream else given
            with served(python, model, root, name, args.upstream, pc, omni=args.omni) as (url, sidecar), \
                    SidecarClient(sidecar.url, timeout=1800) as client:
                for tokens in [int(t) for t in args.max_tokens.split(",") if t] if i == 0 else []:
                    print(f"steps asked vs held ({name} flags, load of {tokens}-token requests; goal: N +- 2 at 20)")
                    with steady_load(url, max_tokens=tokens):
                        caps = [window(client, n) for n in asked]
                    for n, cap in zip(asked, caps):
                        traced = [v.steps_traced for v in cap.verdicts]
                        print(f"  asked {n:3d}: server counted {cap.steps_counted}, trace holds {traced}, "
                              f"stop reason {cap.stop_reason}, start {between(cap.created_at, cap.started_at)}, "
                              f"window {between(cap.started_at, cap.stop_requested_at)}, stop {stop_s(cap):.2f}s",
                              flush=True)
                with steady_load(url, max_tokens=16):
                    plan = client.plan(budget_mb=args.budget_mb, max_stop_s=args.max_stop_s)
                    steps = plan.steps or 1
                    cap = window(client, steps)
                pred_mb, pred_stop = plan.predict(steps)
                mb, st = size_mb(cap), stop_s(cap)
                writes = [v.trace_write_s for v in cap.verdicts if v.trace_write_s is not None]
                at_cap = plan.server_cap_steps is not None and steps >= plan.server_cap_steps
                if at_cap:  # the server ended the window and wrote its trace inside the engine: that is its stop
                    st = max(writes) if writes else float("nan")
                spread = plan.predict_range(steps)  # the probes of the server's whole window, where taken
                if spread is not None:
                    (lo, hi), wr = spread
                    rows.append(f"  {name:6s} whole-window probes: {lo:.2f}-{hi:.2f} MB (actual {mb:.2f}: "
                                f"{'inside' if lo <= mb <= hi else 'outside'}, {mb / lo if lo else float('nan'):.2f}x the least), "
                                + ("write ?" if wr is None else f"write {wr[0]:.2f}-{wr[1]:.2f}s (actual {st:.2f}s: "
                                   f"{'inside' if wr[0] <= st <= wr[1] else 'outside'})"))
                rows.append(f"  {name:6s} plan {steps:4d} steps (by {plan.limited_by}): size {pred_mb:7.2f} MB "
                            f"predicted, {mb:7.2f} actual, ratio {pred_mb / mb if mb else float('nan'):.2f} "
                            f"(goal 0.75-1.25); {'write in the engine' if at_cap else 'stop'} {pred_stop:6.2f}s "
                            f"predicted, {st:6.2f}s actual, ratio {pred_stop / st if st else float('nan'):.2f} "
                            f"(goal 0.5-1.5); traced {[v.steps_traced for v in cap.verdicts]}, trace writes "
                            f"{[round(w, 2) for w in writes]}s")
                # the same line at the steps the window really held (a window that ran past its
                # steps is the counter's imprecision, not the size line's)
                held = max((v.steps_traced or 0 for v in cap.verdicts), default=0)
                if held:
                    h_mb, h_stop = plan.predict(held)
                    if at_cap:  # the lines at what the server's window held (predict() takes its most)
                        h_mb = sum(p.bytes_fixed + p.bytes_per_step * held for p in plan.per_stage) / 1e6
                        if plan.write_fixed_s is not None:
                            h_stop = plan.write_fixed_s + (plan.write_per_step_s or 0.0) * held
                    rows.append(f"  {'':6s} at the {held} steps held: size ratio {h_mb / mb if mb else float('nan'):.2f}, "
                                f"stop ratio {h_stop / st if st else float('nan'):.2f}")
                for pr in plan.probes:
                    rows.append(f"  {'':6s} probe {pr.steps_asked} asked: traced {pr.steps_traced}, "
                                f"{sum(pr.bytes.values()) / 1e6:.2f} MB, stop {pr.stop_s:.2f}s, trace write "
                                f"{'?' if pr.write_s is None else f'{pr.write_s:.2f}s'}")
                rows.append(f"  {'':6s} window: counted {cap.steps_counted}, notes {cap.notes}")
                print("\n".join(rows[-(len(plan.probes) + 2 + bool(held) + (spread is not None)):]), flush=True)
        print(f"plan vs actual (--budget-mb {args.budget_mb:g} --max-stop-s {args.max_stop_s:g})")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
