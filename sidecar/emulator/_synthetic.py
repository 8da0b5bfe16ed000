"""A torch-free backend (``--workers thread``, and plain vLLM's front-end trace): a workload that
"runs" a fixed list of ops per step and a recorder that writes what torch would, in the same
files: a Chrome trace (``cpu_op`` events inside an ``execute_model`` / ``diffusion_forward``
annotation per step, zero ops in an idle window), a key-averages style table, stacks.
For tests that check the sidecar, not the profiler; the traces say ``"emulator_synthetic": true``.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sidecar.config.profiler import ProfilerConfig

# (name, microseconds) per step: roughly what the real tiny workloads show.
LLM_OPS = [("aten::embedding", 8), ("aten::linear", 20), ("aten::layer_norm", 6), ("aten::softmax", 4),
           ("aten::linear", 20), ("aten::argmax", 3)]  # fmt: skip
DIFFUSION_OPS = [("aten::conv2d", 30), ("aten::silu", 4), ("aten::conv2d", 30), ("aten::sub", 2)]


def _now_us() -> float:
    return time.time_ns() / 1000


class SyntheticRecorder:
    def __init__(self, config: ProfilerConfig | None = None, name: str = "synthetic") -> None:
        self.config = config
        self.name = name
        self._lock = threading.Lock()
        self.recording = False
        self._events: list[dict[str, Any]] = []
        self._metadata: dict[str, Any] = {}
        self._t0 = self._t1 = 0.0
        # Per thread, where its last op ended: ops "run" for their nominal time, so the next one
        # starts after it (one thread runs one op at a time; overlapping ops would nest and give
        # the outer one a negative self time).
        self._ends: dict[int, float] = {}

    def start(self) -> None:
        with self._lock:
            self._events, self._t0, self.recording, self._ends = [], _now_us(), True, {}

    def stop(self) -> None:
        with self._lock:
            self._t1, self.recording = _now_us(), False

    def discard(self) -> None:
        self.stop()
        self._events = []

    def add_op(self, name: str, dur_us: float) -> None:
        if not self.recording:
            return
        tid = threading.get_native_id()
        with self._lock:
            ts = max(_now_us(), self._ends.get(tid, 0.0))
            self._ends[tid] = ts + dur_us
            self._events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": os.getpid(),
                                 "tid": tid, "ts": ts, "dur": dur_us,
                                 "args": {"External id": len(self._events) + 1}})  # fmt: skip

    @contextmanager
    def annotate(self, name: str) -> Iterator[None]:
        ts = _now_us()
        try:
            yield
        finally:
            if self.recording:
                tid = threading.get_native_id()
                with self._lock:
                    end = max(_now_us(), self._ends.get(tid, 0.0))  # the step holds every op it ran
                    self._events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": os.getpid(),
                                         "tid": tid, "ts": ts, "dur": end - ts,
                                         "args": {}})  # fmt: skip

    def add_metadata_json(self, key: str, value: str) -> None:
        self._metadata[key] = json.loads(value)

    def _ops(self) -> list[dict[str, Any]]:
        return [e for e in self._events if e["cat"] == "cpu_op"]

    def export_chrome_trace(self, path: str) -> None:
        span = {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
                "ts": self._t0, "dur": max(self._t1 - self._t0, 0.0), "args": {"Op count": 0}}  # fmt: skip
        doc = {
            "schemaVersion": 1,
            "deviceProperties": [],
            **self._metadata,
            "emulator_synthetic": True,
            "traceEvents": [*sorted(self._events, key=lambda e: e["ts"]), span],
            "traceName": path,
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": int(self._t0 * 1000),
        }
        data = json.dumps(doc).encode()
        if path.endswith(".gz"):
            data = gzip.compress(data)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def export_stacks(self, path: str, metric: str) -> None:
        counts: dict[str, float] = defaultdict(float)
        for e in self._ops() if "cuda" not in metric else []:  # CPU ops only, as torch on CPU
            counts[f"worker.py(1): execute_model;{e['name']}"] += e["dur"]
        with open(path, "w") as f:
            f.writelines(f"{k} {int(v)}\n" for k, v in counts.items())

    def table(self, sort_by: str, row_limit: int = 100) -> str:
        rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in self._ops():
            rows[e["name"]][0] += e["dur"]
            rows[e["name"]][1] += 1
        total = sum(r[0] for r in rows.values())
        cols = ["Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "# of Calls"]
        widths = [40, 12, 12, 12, 12, 12, 12]
        line = "-" * (sum(widths) + 2 * len(widths))

        def fmt(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        out = [line, fmt(cols), line]
        for name, (us, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:row_limit]:
            pct = f"{100 * us / total:.2f}%" if total else "0.00%"
            out.append(fmt([name, pct, f"{us:.3f}us", pct, f"{us:.3f}us", f"{us / n:.3f}us", str(int(n))]))
        out += [line, f"Self CPU time total: {total / 1000:.3f}ms"]
        return "\n".join(out)

    def write_excel(self, path: str, config: ProfilerConfig) -> None:
        return None  # thread mode stays light: no pandas in the API process (docs/emulator.md)


class SyntheticWorkload:
    """One step = the op list of the stage kind, "run" on the recorder of the stage, if any."""

    def __init__(self, kind: str, backend: SyntheticBackend) -> None:
        self.ops = DIFFUSION_OPS if kind == "diffusion" else LLM_OPS
        self.backend = backend
        self.n = 0

    def step(self) -> int:
        self.n += 1
        rec = self.backend.current
        if rec is not None:
            for name, us in self.ops:
                rec.add_op(name, us)
        return (self.n * 7) % 256


class SyntheticBackend:
    name = "synthetic"

    def __init__(self) -> None:
        self.current: SyntheticRecorder | None = None

    def workload(self, kind: str) -> SyntheticWorkload:
        return SyntheticWorkload(kind, self)

    def recorder(self, config: ProfilerConfig) -> SyntheticRecorder:
        self.current = SyntheticRecorder(config)
        return self.current
