"""Benchmark: our streaming summarizer vs ``json.load`` + plain Python vs HTA, side by side, and
the speedup of a capture's files summarised in parallel.

  python3 bench/summarize.py TRACE.json.gz                      # one trace, every contender
  python3 bench/summarize.py TRACE.json.gz --files A B C D      # + 4 files on 1 core vs 2 cores
  python3 bench/summarize.py TRACE.json.gz --repeats 5 --no-hta
  python3 bench/summarize.py TRACE.json.gz --hta-python /tmp/hta-venv/bin/python --ready TRACE_100MB.json.gz
  python3 bench/summarize.py MEMORY_TRACE.json.gz --committed     # + ours and HTA on each committed real trace
  python3 bench/summarize.py TRACE.json.gz --baseline /tmp/before  # + another tree's code, side by side

``ours`` is the whole product path: ``summarize_paths`` (per-file summary, the attribution fields,
findings). ``ours, reader alone`` is its reader with no summary work (inflate, slice, decode, Python
runs skipped): the floor any pass over these events pays; the goal table says how many CPU seconds
that leaves the summary under the 300 MB/s line. ``ours, memory work off`` is the whole path with the
memory figures' work taken out (no op index, memory events decoded and passed over): the bound no
memory code can beat, printed in the goal table for a trace with memory events. ``hta, four analyses`` is HTA 0.5.0 loading the
trace and running the same four analyses (temporal and idle time breakdown, comm/comp overlap,
kernel launch statistics; see bench/hta_reference.py), in the Python given by ``--hta-python``
(HTA needs pandas and torch).
The trace line says how many memory events (``profile_memory``: what holds memory, summarised in
the same pass) the trace holds; ``bench/gen_traces.py cpu --memory`` makes one, ``replicate`` grows
it. ``--committed`` also runs ours and HTA's four analyses on each committed real H200 trace
(tests/data/traces, recorded without memory: the pass's cost where the memory events are absent).
HTA's four analyses need GPU kernels: on a trace without any (a CPU trace, such as the one
``gen_traces cpu --memory`` makes) they fail, and the HTA line is against HTA's load alone, the
least any HTA analysis costs. ``--baseline DIR`` runs ours from another source tree (``git archive
REV sidecar | tar -x -C DIR``) interleaved with this one, on one core, and prints the ratio: the
A/B of a change measured in the same minutes, on a shared machine the only comparison that holds.
``--ready`` times the work between a stop's reply and its summary + findings (the summary of
that file in a fresh process, its imports inside the time, as in the sidecar's analysis worker,
also a fresh interpreter). The last table puts each figure beside its goal.

Each measurement runs in its own fresh subprocess pinned to the cores it is given
(``sched_setaffinity``), so its peak RSS (ru_maxrss) is its own and "one core" means one core (our
read-ahead thread then shares it). Time is the work alone: imports are done before it, ours
those that the sidecar's analysis worker imports for a summary (``sidecar.analysis.capture``). Contenders are
interleaved, ``--repeats`` times, and the table shows medians; the load average before and after
is printed, since the machine may be shared. Not a test: nothing is asserted. Inputs: see
bench/gen_traces.py (``gpu --large-steps N`` for a real CUDA trace of any size).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
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


def run_ours(paths: list[str], workers: int = 1) -> dict:
    from sidecar.analysis import summarize_paths

    s = summarize_paths(paths, workers=workers)
    # getattr: a --baseline tree may predate the memory figures
    return {"events": s.totals.events, "findings": len(s.findings),
            "memory_events": sum(m.events for m in getattr(s, "memory", []))}


def run_ours_no_isal(paths: list[str]) -> dict:
    import zlib

    from sidecar.analysis import stream

    stream._inflate = zlib
    return run_ours(paths)


def run_ours_no_memory(paths: list[str]) -> dict:
    """The bound no memory code can beat: the same pass with the memory work taken out (no op index,
    the decoded memory events passed over; they are still read and decoded, as they are in the file)."""
    from sidecar.analysis import memory, summary

    index_ops = summary.Aggregate.index_ops

    def no_index(self, header):
        index_ops(self, header)
        self._index_ops = False

    summary.Aggregate.index_ops = no_index
    memory.MemoryTracker.events = lambda self, batch, index: None
    return run_ours(paths)


def run_reader(paths: list[str]) -> dict:
    """The floor of any pass over these events: the summary's reader alone (inflate, slice, decode,
    Python runs skipped), as the summary reads them, with no summary work on them."""
    import gc

    from sidecar.analysis.reader import TraceReader

    reader = TraceReader(paths[0], skip_python=True, complete_only=True)
    gc.disable()  # as the summary's pass does
    try:
        n = sum(len(b) for b in reader.batches())
    finally:
        gc.enable()
    return {"events": n + reader.skipped}


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def run_json_load(paths: list[str]) -> dict:
    """The obvious script: load it all, then count/total/self per name in plain Python."""
    with _open(paths[0]) as f:
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


def run_hta(paths: list[str]) -> dict:
    """HTA's load (TraceAnalysis parses every trace in a folder); its analyses are not timed."""
    from hta.trace_analysis import TraceAnalysis

    path = paths[0]
    with tempfile.TemporaryDirectory() as d:
        os.symlink(os.path.abspath(path), os.path.join(d, "rank0" + "".join(Path(path).suffixes[-2:])))
        t0 = time.perf_counter()
        ta = TraceAnalysis(trace_dir=d)
        load = time.perf_counter() - t0
        n = sum(len(t) for t in ta.t.traces.values()) if hasattr(ta.t, "traces") else -1
    return {"events": n, "seconds_override": load}


def run_hta_four(paths: list[str]) -> dict:
    """HTA's load + the four analyses the summary's attribution fields reproduce."""
    sys.path.insert(0, str(ROOT / "bench"))
    import hta_reference

    os.environ.setdefault("HTA_DISABLE_NS_ROUNDING", "1")
    t0 = time.perf_counter()
    out = hta_reference.four_analyses(hta_reference._analysis(Path(paths[0])))
    return {"events": len(out["ranks"]), "seconds_override": time.perf_counter() - t0}


CONTENDERS = {
    "hta, four analyses": run_hta_four,
    "ours": lambda p: run_ours(p),
    "ours, zlib instead of ISA-L": run_ours_no_isal,
    "ours, reader alone": run_reader,
    "ours, memory work off": run_ours_no_memory,
    "json.load+python": run_json_load,
    "hta": run_hta,
    "ours, files one by one": lambda p: run_ours(p, workers=1),
    "ours, files in 2 processes": lambda p: run_ours(p, workers=2),
    "ours, imports timed": lambda p: run_ours(p),
    "ours, baseline": lambda p: run_ours(p),  # the same, from the --baseline tree (measure sets PYTHONPATH)
}


def child(name: str, cpus: list[int], paths: list[str]) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    try:
        if name == "ours, imports timed":
            import sidecar.analysis  # noqa: F401  (the package only: its modules load lazily, in the time)
        elif name.startswith("ours"):
            import sidecar.analysis.capture  # noqa: F401  (what the analysis worker imports for a summary)
        if name.startswith("hta"):
            import hta.trace_analysis  # noqa: F401
    except ImportError as exc:
        print(json.dumps({"error": f"not installed: {exc}"}))
        return
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    c0 = _cpu()
    t0 = time.perf_counter()
    try:
        out = CONTENDERS[name](paths)
        err = None
    except Exception as exc:  # report, don't crash the table
        out, err = {}, f"{type(exc).__name__}: {str(exc)[:160]}"
    secs = out.pop("seconds_override", None) or (time.perf_counter() - t0)
    cpu = _cpu() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"seconds": secs, "cpu_seconds": cpu, "peak_rss_mb": max(peak, kids), "base_rss_mb": base, "error": err, **out}))


def _cpu() -> float:
    """CPU seconds of this process and its finished children: on a shared machine, wall time also
    counts the waits for a core; CPU time is the work."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# --- parent ----------------------------------------------------------------------------------


def measure(name: str, cpus: list[int], paths: list[Path]) -> dict:
    env = dict(os.environ)
    code = env.get("BENCH_BASELINE", "") if name == "ours, baseline" else str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code, env.get("HTA_PATH", "") if name == "hta" else "", env.get("PYTHONPATH", "")) if p)
    python = os.environ.get("HTA_PYTHON", sys.executable) if name.startswith("hta") else sys.executable
    cmd = [python, __file__, "--child", name, "--cpus", ",".join(map(str, cpus)), str(paths[0])]
    if len(paths) > 1:
        cmd += ["--files", *map(str, paths[1:])]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:160]}
    return json.loads(lines[-1])


def _runs(rs: list[dict]) -> str:
    return ", ".join(f"{r['seconds']:.2f}" if "seconds" in r else "-" for r in rs)


def _load() -> str:
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"
    except OSError:
        return "load average unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--files", type=Path, nargs="*", default=[], help="a capture's files, for the multi-file speedup")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hta-repeats", type=int, default=1)
    ap.add_argument("--no-hta", action="store_true")
    ap.add_argument("--hta-python", help="a Python with HTA (holistictraceanalysis) for the HTA contenders")
    ap.add_argument("--ready", type=Path, help="a ~100 MB trace: time from a stop's reply to its summary + findings")
    ap.add_argument("--no-json-load", action="store_true")
    ap.add_argument("--committed", action="store_true", help="also ours and HTA, one core, on each committed real trace")
    ap.add_argument("--baseline", type=Path, help="a source tree holding sidecar/ (other code): ours from it, side by side")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, [int(c) for c in a.cpus.split(",") if c], [str(a.trace), *map(str, a.files)])
        return
    if a.hta_python:
        os.environ["HTA_PYTHON"] = a.hta_python
    os.environ.setdefault("HTA_DISABLE_NS_ROUNDING", "1")  # see bench/hta_reference.py
    if a.baseline:
        if not (a.baseline / "sidecar" / "analysis").is_dir():
            ap.error(f"--baseline {a.baseline}: no sidecar/analysis there (git archive REV sidecar | tar -x -C DIR)")
        os.environ["BENCH_BASELINE"] = str(a.baseline.resolve())
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    one, two = cores[-1:], cores[-2:]
    print(f"before: {_load()}; one core = CPU {one}, two cores = CPUs {two}")
    single = [("ours", one), ("ours", two), ("ours, zlib instead of ISA-L", one), ("ours, imports timed", one),
              ("ours, reader alone", one), ("ours, memory work off", one)]
    if a.baseline:
        single.insert(1, ("ours, baseline", one))
    if not a.no_json_load:
        single.append(("json.load+python", one))
    raw_mb = _raw_size(a.trace) / 1e6
    results: dict[tuple[str, tuple[int, ...]], list[dict]] = {}
    for _ in range(a.repeats):
        for name, cpus in single:
            results.setdefault((name, tuple(cpus)), []).append(measure(name, cpus, [a.trace]))
    if not a.no_hta:
        for _ in range(a.hta_repeats):
            results.setdefault(("hta", tuple(one)), []).append(measure("hta", one, [a.trace]))
            results.setdefault(("hta, four analyses", tuple(one)), []).append(measure("hta, four analyses", one, [a.trace]))
    ready: list[dict] = []
    if a.ready:
        ready = [measure("ours, imports timed", one, [a.ready]) for _ in range(a.repeats)]
    multi: dict[str, list[dict]] = {}
    files_mb = 0.0
    if a.files:
        files_mb = sum(_raw_size(f) for f in a.files) / 1e6
        for _ in range(a.repeats):
            multi.setdefault("1 core, one by one", []).append(measure("ours, files one by one", one, a.files))
            multi.setdefault("2 cores, 2 processes", []).append(measure("ours, files in 2 processes", two, a.files))

    def med(rs: list[dict], key: str) -> float:
        vals = [r[key] for r in rs if key in r and not r.get("error")]
        return statistics.median(vals) if vals else float("nan")

    ref = med(results[("ours", tuple(one))], "seconds")
    mem = med(results[("ours", tuple(one))], "memory_events")
    print(f"\n{a.trace.name}: {raw_mb:.1f} MB raw JSON, {mem:,.0f} memory events; medians of {a.repeats} (HTA: "
          f"{a.hta_repeats}); time × = against ours on one core")
    print(f"{'contender':32} {'cores':>5} {'seconds':>8} {'MB/s':>7} {'CPU s':>7} {'MB/CPU s':>8} {'peak RSS MB':>11} {'time ×':>7}  runs / note")
    for (name, cpus), rs in results.items():
        s = med(rs, "seconds")
        c = med(rs, "cpu_seconds")
        err = next((r["error"] for r in rs if r.get("error")), "")
        print(f"{name:32} {len(cpus):5d} {s:8.2f} {raw_mb / s:7.1f} {c:7.2f} {raw_mb / c:8.1f} {med(rs, 'peak_rss_mb'):11.0f} {s / ref:7.1f}  "
              f"{_runs(rs)} {err}")
    if multi:
        base = med(multi["1 core, one by one"], "seconds")
        print(f"\n{len(a.files)} files, {files_mb:.1f} MB raw in all; speedup against 1 core")
        for label, rs in multi.items():
            s = med(rs, "seconds")
            print(f"{label:32} {s:8.2f} s {files_mb / s:7.1f} MB/s  peak RSS {med(rs, 'peak_rss_mb'):5.0f} MB  "
                  f"speedup {base / s:4.2f}x  runs {_runs(rs)}")
    goals(results, one, raw_mb, ready, _raw_size(a.ready) / 1e6 if a.ready else 0.0, med)
    if a.committed:
        committed(one, a.repeats, a.hta_repeats if not a.no_hta else 0, bool(a.baseline), med)
    print(f"\nafter: {_load()}")


def committed(one: list[int], repeats: int, hta_repeats: int, baseline: bool, med) -> None:
    """Ours (medians of ``repeats``, and the --baseline tree's interleaved) and HTA's four analyses
    (of ``hta_repeats``) on one core on each committed real trace (tests/data/traces), each figure
    of the speed lines per trace."""
    traces = sorted((ROOT / "tests" / "data" / "traces").glob("*.json.gz"))
    runs: dict[Path, list[dict]] = {}
    base: dict[Path, list[dict]] = {}
    hta: dict[Path, list[dict]] = {}
    for _ in range(repeats):
        for t in traces:
            runs.setdefault(t, []).append(measure("ours", one, [t]))
            if baseline:
                base.setdefault(t, []).append(measure("ours, baseline", one, [t]))
    for _ in range(hta_repeats):
        for t in traces:
            hta.setdefault(t, []).append(measure("hta, four analyses", one, [t]))
    print(f"\ncommitted real traces (tests/data/traces), one core, ours: medians of {repeats}, HTA's four analyses: "
          f"of {hta_repeats}; x HTA = HTA's time / ours (goals: >= 300 MB per CPU s, <= 150 MB RSS, >= 25 x HTA)")
    print(f"{'trace':28} {'MB raw':>7} {'seconds':>8} {'MB/s':>7} {'MB/CPU s':>8} {'peak RSS MB':>11} {'memory events':>13} "
          f"{'HTA s':>7} {'x HTA':>6} {'x HTA CPU':>9}" + (f" {'CPU s / baseline':>16}" if baseline else ""))
    for t, rs in runs.items():
        mb = _raw_size(t) / 1e6
        s, c = med(rs, "seconds"), med(rs, "cpu_seconds")
        hs, hc = med(hta.get(t, []), "seconds"), med(hta.get(t, []), "cpu_seconds")
        err = next((r["error"] for r in hta.get(t, []) if r.get("error")), "")
        print(f"{t.name:28} {mb:7.2f} {s:8.3f} {mb / s:7.1f} {mb / c:8.1f} {med(rs, 'peak_rss_mb'):11.0f} "
              f"{med(rs, 'memory_events'):13.0f} {hs:7.2f} {hs / s:6.1f} {hc / c:9.1f}"
              + (f" {c / med(base[t], 'cpu_seconds'):16.2f}" if baseline else "") + f"  {err}")


def goals(results: dict, one: list[int], raw_mb: float, ready: list[dict], ready_mb: float, med) -> None:
    """Each figure of the speed lines (issues 22 and 45) beside its goal, measured above in this run.
    The HTA line is against its four analyses, or its load alone where they fail (no GPU kernels)."""
    ours = results.get(("ours", tuple(one)), [])
    base = results.get(("ours, baseline", tuple(one)), [])
    hta4 = results.get(("hta, four analyses", tuple(one)), [])
    hta_load = results.get(("hta", tuple(one)), [])
    s = med(ours, "seconds")
    c = med(ours, "cpu_seconds")
    rows = [("MB/s raw per core (ours, 1 core)", raw_mb / s, ">= 300", raw_mb / s >= 300),
            ("  the same per CPU second (load-independent)", raw_mb / c, ">= 300", raw_mb / c >= 300),
            ("peak RSS MB (ours, 1 core)", med(ours, "peak_rss_mb"), "<= 150", med(ours, "peak_rss_mb") <= 150)]
    reader = results.get(("ours, reader alone", tuple(one)), [])
    if reader:  # what is left for the summary's own work under the line
        rc = med(reader, "cpu_seconds")
        rows.append(("  the reader alone (inflate + decode), MB per CPU s", raw_mb / rc, "", None))
        rows.append(("  CPU s the summary may add for 300 (the reader's left)", raw_mb / 300 - rc, "", None))
        rows.append(("  CPU s the summary adds (ours - the reader)", c - rc, "", None))
    no_mem = results.get(("ours, memory work off", tuple(one)), [])
    if no_mem and med(ours, "memory_events"):  # where the memory code's cost ends: ours at no cost for it
        nc = med(no_mem, "cpu_seconds")
        rows.append(("  ours, memory work off, MB per CPU s (its bound)", raw_mb / nc, ">= 300", raw_mb / nc >= 300))
        rows.append(("  CPU s the memory work adds (ours - the same off)", c - nc, "", None))
    if base:
        bc = med(base, "cpu_seconds")
        rows.append(("  the baseline tree, MB per CPU second", raw_mb / bc, ">= 300", raw_mb / bc >= 300))
        rows.append(("  ours / baseline, CPU seconds (same run)", c / bc, "", None))
    against, label = hta4, "HTA's four analyses"
    if hta4 and all(r.get("error") for r in hta4) and hta_load:
        against, label = hta_load, "HTA's load alone (its analyses failed)"
    if against:
        x = med(against, "seconds") / s
        rows.append((f"x faster than {label}", x, ">= 25", x >= 25))
        xc = med(against, "cpu_seconds") / c
        rows.append(("  the same in CPU seconds", xc, ">= 25", xc >= 25))
    if ready:
        r = med(ready, "seconds")
        rows.append((f"stop reply -> summary + findings, {ready_mb:.0f} MB trace, s", r, "<= 1.5", r <= 1.5))
        rc = med(ready, "cpu_seconds")
        rows.append(("  the same in CPU seconds", rc, "<= 1.5", rc <= 1.5))
    print("\ngoal (issues 22, 45)                                    measured   goal    met")
    for label, value, goal, ok in rows:
        met = "" if ok is None else "yes" if ok else "NO"
        print(f"{label:52} {value:9.2f}  {goal:7} {met}")


if __name__ == "__main__":
    main()
