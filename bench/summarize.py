"""Benchmark: our streaming summarizer vs ``json.load`` + plain Python vs HTA, side by side.

  python3 bench/summarize.py TRACE.json [TRACE ...]             # ours, json.load, HTA (if importable)
  python3 bench/summarize.py --parsers TRACE.json               # the parser candidates alone
  HTA_PATH=/tmp/hta python3 bench/summarize.py TRACE.json       # HTA installed with pip --target

Every contender runs in its own fresh subprocess, so its peak RSS (ru_maxrss) is its own; the
time is the work alone (imports excluded). Prints seconds, MB/s of raw JSON, peak RSS, and ratios
against ours. Not a test: nothing is asserted. Make inputs with bench/gen_traces.py.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _raw_size(path: Path) -> int:
    if path.suffix != ".gz":
        return path.stat().st_size
    n = 0
    with gzip.open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            n += len(chunk)
    return n


# --- contenders (run in the child) -----------------------------------------------------------


def run_ours(path: str) -> dict:
    from sidecar.analysis import summarize_trace

    s = summarize_trace(path)
    return {"events": s.totals.events}


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def run_json_load(path: str) -> dict:
    """The obvious script: load it all, then count/total/self per name in plain Python."""
    with _open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    per_thread: dict = {}
    totals: dict = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        row = totals.setdefault((cat, e.get("name")), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += e.get("dur", 0.0)
        row[2] += e.get("dur", 0.0)
        if cat in ("cpu_op", "user_annotation"):
            per_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in per_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                totals[(stack[-1]["cat"], stack[-1]["name"])][2] -= e["dur"]
            stack.append(e)
    return {"events": len(events)}


def run_hta(path: str) -> dict:
    """HTA's load (TraceAnalysis parses every trace in a folder); its analyses are not timed."""
    from hta.trace_analysis import TraceAnalysis

    with tempfile.TemporaryDirectory() as d:
        os.symlink(os.path.abspath(path), os.path.join(d, "rank0" + "".join(Path(path).suffixes[-2:])))
        t0 = time.perf_counter()
        ta = TraceAnalysis(trace_dir=d)
        load = time.perf_counter() - t0
        n = sum(len(t) for t in ta.t.traces.values()) if hasattr(ta.t, "traces") else -1
    return {"events": n, "seconds_override": load}


def _parse_with(path: str, kind: str) -> dict:
    if kind == "ijson":
        import ijson

        with _open(path) as f:
            return {"events": sum(1 for _ in ijson.items(f, "traceEvents.item", use_float=True))}
    from sidecar.analysis import reader as r

    rd = r.TraceReader(path)
    if kind == "orjson":
        import orjson

        rd._parse = lambda body: orjson.loads(b"[" + body.lstrip(r._WS).lstrip(b",") + b"]")
    elif kind == "msgspec_untyped":
        rd._parse = lambda body: r._DECODE_ANY(b"[" + body.lstrip(r._WS).lstrip(b",") + b"]")
    return {"events": sum(len(b) for b in rd.batches())}


CONTENDERS = {
    "ours": run_ours,
    "json.load+python": run_json_load,
    "hta": run_hta,
    "parse:ijson(yajl2_c)": lambda p: _parse_with(p, "ijson"),
    "parse:chunks+orjson": lambda p: _parse_with(p, "orjson"),
    "parse:chunks+msgspec": lambda p: _parse_with(p, "msgspec_untyped"),
    "parse:chunks+msgspec-typed": lambda p: _parse_with(p, "msgspec_typed"),
}


def _prepare(name: str) -> None:
    """Imports happen before the clock starts: we time the work, not the interpreter."""
    if name in ("ours",) or name.startswith("parse:"):
        import sidecar.analysis  # noqa: F401
    if name == "parse:ijson(yajl2_c)":
        import ijson  # noqa: F401
    if name == "parse:chunks+orjson":
        import orjson  # noqa: F401
    if name == "hta":
        import hta.trace_analysis  # noqa: F401


def child(name: str, path: str) -> None:
    fn = CONTENDERS[name]
    try:
        _prepare(name)
    except ImportError as exc:
        print(json.dumps({"error": f"not installed: {exc}"}))
        return
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    try:
        out = fn(path)
        err = None
    except Exception as exc:  # report, don't crash the table (HTA on CPU-only traces)
        out, err = {}, f"{type(exc).__name__}: {str(exc)[:160]}"
    secs = out.pop("seconds_override", None) or (time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": secs, "peak_rss_mb": peak, "base_rss_mb": base, "error": err, **out}))


# --- parent ----------------------------------------------------------------------------------


def measure(name: str, path: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("HTA_PATH", "") if name == "hta" else "", env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, __file__, "--child", name, str(path)], capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:160]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--parsers", action="store_true", help="compare the parser candidates instead")
    ap.add_argument("--no-hta", action="store_true")
    ap.add_argument("--no-json-load", action="store_true", help="skip json.load (needs RAM ~10x the file)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, str(a.traces[0]))
        return
    names = [n for n in CONTENDERS if n.startswith("parse:")] if a.parsers else ["ours", "json.load+python", "hta"]
    if a.no_hta and "hta" in names:
        names.remove("hta")
    if a.no_json_load and "json.load+python" in names:
        names.remove("json.load+python")
    ref_name = "ours" if "ours" in names else names[0]
    print(f"ratios are against {ref_name!r}; base = RSS after imports, before the work")
    print(f"{'trace':22} {'raw MB':>7} {'contender':27} {'seconds':>8} {'MB/s':>7} {'peak RSS MB':>11} {'base MB':>7} {'time ×':>7} {'RSS ×':>6}  note")
    for path in a.traces:
        raw_mb = _raw_size(path) / 1e6
        results = {n: measure(n, path) for n in names}
        ref = results[ref_name]
        for n in names:
            r = results[n]
            if r.get("error") and "seconds" not in r:
                print(f"{path.name:22} {raw_mb:7.1f} {n:27} {'-':>8} {'-':>7} {'-':>11} {'-':>7} {'-':>7} {'-':>6}  {r['error']}")
                continue
            note = r.get("error") or f"{r.get('events', '?')} events"
            tx = r["seconds"] / ref["seconds"] if ref.get("seconds") else float("nan")
            rx = r["peak_rss_mb"] / ref["peak_rss_mb"] if ref.get("peak_rss_mb") else float("nan")
            print(
                f"{path.name:22} {raw_mb:7.1f} {n:27} {r['seconds']:8.2f} {raw_mb / r['seconds']:7.1f} "
                f"{r['peak_rss_mb']:11.0f} {r.get('base_rss_mb', 0):7.0f} {tx:7.1f} {rx:6.1f}  {note}"
            )


if __name__ == "__main__":
    main()
