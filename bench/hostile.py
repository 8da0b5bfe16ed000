"""Benchmark: hostile trace files (issue 20, items 9-10) vs the reader's memory and time.

  python3 bench/hostile.py                         # every kind, 1 GiB each (identical: 1 GiB too)
  python3 bench/hostile.py --size-mb 256 --base /tmp/old-checkout   # side by side with another tree

For each kind of tests/fixtures/hostile.py a file is written (about 1 MB of gzip whatever its
decompressed size), then ``summarize_trace`` runs on it in a fresh subprocess per tree: the table
prints the decompressed size, the outcome (error code or events read), the child's peak RSS
(ru_maxrss) and its time. A child runs with ``RLIMIT_AS`` at ``--limit-mb`` so an old reader that
would take gigabytes is stopped rather than taking the machine (shown as ``MemoryError``). Not a
test: nothing is asserted; the target is a peak RSS of at most 150 MB for every input.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, resource, sys, time
limit = int(sys.argv[2]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from sidecar.analysis import summarize_trace
from sidecar.errors import SidecarError
t = time.perf_counter()
try:
    s = summarize_trace(sys.argv[1])
    out = f"{s.totals.events:,} events" + (" (truncated)" if s.truncated else "") + (f", {len(s.warnings)} warning(s)" if s.warnings else "")
except SidecarError as e:
    out = e.code
except BaseException as e:
    out = type(e).__name__
print(json.dumps({"out": out, "s": time.perf_counter() - t,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(tree: Path, path: Path, limit_mb: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(limit_mb)], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"out": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", "s": 0.0, "rss_mb": 0.0}
    return json.loads(lines[-1])


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.hostile import KINDS, write_hostile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="decompressed size of each file")
    ap.add_argument("--kinds", nargs="*", default=list(KINDS))
    ap.add_argument("--base", type=Path, help="another checkout to run side by side (e.g. before the fix)")
    ap.add_argument("--limit-mb", type=int, default=3072, help="RLIMIT_AS of each child")
    args = ap.parse_args()
    trees = [("this tree", ROOT)] + ([("base", args.base.resolve())] if args.base else [])
    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as tmp:
        head = f"| kind | on disk | decompressed | " + " | ".join(f"{n}: outcome | peak RSS | time" for n, _ in trees) + " |"
        print(head)
        print("|" + "---|" * (3 + 3 * len(trees)))
        for kind in args.kinds:
            path = write_hostile(Path(tmp), kind, args.size_mb << 20)
            size = "2 KB" if kind == "deep" else f"{args.size_mb:,} MB"
            cells = []
            for _, tree in trees:
                r = run(tree, path, args.limit_mb)
                cells.append(f"{r['out']} | {r['rss_mb']:,.0f} MB | {r['s']:.2f} s")
            print(f"| {kind} | {path.stat().st_size / 1e6:,.2f} MB | {size} | " + " | ".join(cells) + " |", flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
