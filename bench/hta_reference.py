"""Ground truth for the summary's attribution fields: HTA 0.5.0's own figures on the committed traces.

  /tmp/hta-venv/bin/python bench/hta_reference.py                  # every fixture in tests/data/traces
  /tmp/hta-venv/bin/python bench/hta_reference.py --time TRACE     # seconds HTA takes for the four analyses

Runs HTA's temporal breakdown, idle time breakdown, comm/comp overlap and kernel launch statistics
(``TraceAnalysis.get_temporal_breakdown`` / ``get_idle_time_breakdown`` / ``get_comm_comp_overlap``
/ ``get_cuda_kernel_launch_stats``, defaults, no plots) on each fixture and writes
``tests/data/traces/<name>.hta.json``, which tests/test_attribution_hta.py compares with the
sidecar's figures. Needs HTA beside torch (not the project's environment):
``python -m venv /tmp/hta-venv && /tmp/hta-venv/bin/pip install torch==2.13.0 holistictraceanalysis==0.5.0``.
Not part of the package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "tests" / "data" / "traces"
SHORT_US = 10.0  # the summary's "short kernel" bound (launch.short_share)


def _analysis(path: Path):
    """A TraceAnalysis over a folder holding only ``path`` (HTA reads every trace of a folder)."""
    from hta.trace_analysis import TraceAnalysis

    d = tempfile.mkdtemp(prefix="hta-")
    os.symlink(path.resolve(), os.path.join(d, path.name))
    # keep the last ProfilerStep: a capture's window is the one the user asked for (HTA's default drops
    # it as possibly cut short by a profiler schedule; docs/summaries.md, "Checked against HTA")
    return TraceAnalysis(trace_dir=d, include_last_profiler_step=True)


def four_analyses(ta) -> dict:
    """HTA's four analyses on every rank of ``ta``, reduced to the figures the summary reports."""
    import numpy as np

    ranks = sorted(ta.t.traces)
    out: dict = {"ranks": {}}
    temporal = ta.get_temporal_breakdown(visualize=False)
    try:
        overlap = ta.get_comm_comp_overlap(visualize=False)
    except Exception as exc:  # noqa: BLE001 - HTA divides by zero communication time
        overlap = None
        out["overlap_error"] = f"{type(exc).__name__}: {exc}"
    launch = ta.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False)
    sym = ta.t.symbol_table.get_sym_table()
    sym_id = ta.t.symbol_table.get_sym_id_map()
    for rank in ranks:
        r: dict = {}
        row = temporal[temporal["rank"] == rank].iloc[0]
        window = float(row["kernel_time(us)"])
        r["temporal"] = {
            "window_us": window,
            "idle_us": float(row["idle_time(us)"]),
            "compute_us": float(row["compute_time(us)"]),
            "non_compute_us": float(row["non_compute_time(us)"]),
            "idle_share": float(row["idle_time(us)"]) / window if window else 0.0,
            "compute_share": float(row["compute_time(us)"]) / window if window else 0.0,
            "non_compute_share": float(row["non_compute_time(us)"]) / window if window else 0.0,
        }
        idle, _ = ta.get_idle_time_breakdown(ranks=[rank], visualize=False)
        by_cat = idle.groupby("idle_category")["idle_time"].sum().to_dict()
        total = sum(by_cat.values())
        r["idle_breakdown"] = {
            "idle_us": float(total),
            **{f"{k}_us": float(by_cat.get(k, 0.0)) for k in ("host_wait", "kernel_wait", "other")},
            **{f"{k}_share": float(by_cat.get(k, 0.0) / total) if total else 0.0 for k in ("host_wait", "kernel_wait", "other")},
            "per_stream": {str(int(s)): {str(c): float(v) for c, v in g.groupby("idle_category")["idle_time"].sum().items()}
                           for s, g in idle.groupby("stream")},
        }
        if overlap is not None:
            o = overlap[overlap["rank"] == rank]
            r["overlap"] = {"comp_comm_overlap_share": float(o.iloc[0]["comp_comm_overlap_pctg"]) / 100.0} if len(o) else None
        df = launch.get(rank)
        if df is not None and len(df):
            delay = df["launch_delay"].to_numpy(dtype=float)
            r["launch"] = {
                "launches": int(len(df)),
                "delay_p50_us": float(np.percentile(delay, 50)),
                "delay_p95_us": float(np.percentile(delay, 95)),
                "gpu_shorter_than_launch_share": float((df["gpu_duration"] < df["cpu_duration"]).mean()),
            }
        trace = ta.t.get_trace(rank)
        kern = trace[(trace["stream"].ne(-1)) & (trace["cat"] == sym_id.get("kernel", -1000))]
        r.setdefault("launch", {})
        r["launch"]["kernels"] = int(len(kern))
        r["launch"]["short_share"] = float((kern["dur"] < SHORT_US).mean()) if len(kern) else 0.0
        r["kernel_names"] = int(kern["name"].nunique())
        r["gpu_events"] = int(trace["stream"].ne(-1).sum())
        del sym
        out["ranks"][str(rank)] = r
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", type=Path, help="time HTA's load + four analyses on this trace; write nothing")
    ap.add_argument("fixtures", nargs="*", help="fixture names (default: every *.json.gz in tests/data/traces)")
    a = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    # HTA rounds ns-resolution timestamps to whole µs (start up, end down) to work around overlapping
    # events of old PyTorch (pytorch#122425): a 0.9 µs kernel then lasts -1 µs and its temporal
    # breakdown fails an assertion (the host-bound fixture). Torch 2.11's traces need no such help.
    os.environ.setdefault("HTA_DISABLE_NS_ROUNDING", "1")
    import hta

    if a.time:
        t0 = time.perf_counter()
        ta = _analysis(a.time)
        t1 = time.perf_counter()
        four_analyses(ta)
        t2 = time.perf_counter()
        print(json.dumps({"load_s": t1 - t0, "analyses_s": t2 - t1, "seconds": t2 - t0}))
        return
    names = a.fixtures or sorted(p.name[: -len(".json.gz")] for p in TRACES.glob("*.json.gz"))
    for name in names:
        res = four_analyses(_analysis(TRACES / f"{name}.json.gz"))
        res["hta_version"] = getattr(hta, "__version__", "0.5.0")
        (TRACES / f"{name}.hta.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
        print(name, json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "per_stream"} if isinstance(v, dict) else v
                                for k, v in res["ranks"][next(iter(res["ranks"]))].items()}), file=sys.stderr)


if __name__ == "__main__":
    main()
