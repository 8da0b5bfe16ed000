"""A smaller copy of a trace that Perfetto's UI opens: drop categories, keep a window, fit a size.

``slim_trace(src, out, drop=..., window=..., max_mb=...)`` streams the trace (one slice in memory)
and writes a valid Chrome trace. Metadata events (process and thread names) are always kept. A
window keeps the events that overlap it: ``step:N`` is the span of ``ProfilerStep#N`` (found by a
first, fast pass), ``START..END`` are milliseconds from the trace's first timestamp (where
Perfetto's ruler starts). With ``max_mb``, when the result is still larger, more goes, in this
order, one pass each: Python stack events, flow arrows, CUDA API calls, then the window is cut to
the share of the time that fits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.analysis.reader import MAX_RAW_BYTES, RawTraceReader, TraceReader, read_header
from sidecar.analysis.writer import TraceWriter, output_path
from sidecar.errors import SlimWindowInvalid, TraceError

ESCALATION: tuple[tuple[str, ...], ...] = (
    ("python_function",),
    ("ac2g", "fwdbwd", "async_cpu_to_gpu"),
    ("cuda_runtime", "cuda_driver"),
)
_WINDOW = re.compile(r"^\s*(?P<a>[0-9.]*)\s*\.\.\s*(?P<b>[0-9.]*)\s*$")
_STEP = re.compile(r"^step:(\d+)$")


@dataclass
class SlimReport:
    src: str
    out: str
    raw_bytes_in: int = 0
    raw_bytes_out: int = 0
    events_in: int = 0
    events_out: int = 0
    dropped_categories: list[str] = field(default_factory=list)
    window_us: tuple[float, float] | None = None  # in the trace's own ts
    passes: int = 0
    fits: bool = True


def max_mb_problem(max_mb: float | None) -> str | None:
    """Why ``max_mb`` is no size cap slim can aim for (not a number, not above 0, or past the most
    JSON the reader reads), or None. One rule for ``slim_trace`` and the CLI's ``--max-mb``."""
    if max_mb is None:
        return None
    most = MAX_RAW_BYTES / 1e6
    if not math.isfinite(max_mb) or not 0 < max_mb <= most:
        return f"give a size in MB above 0 and at most {most:,.0f} (the most JSON a trace may hold); leave it out for no cap"
    return None


def _scan(path: Path) -> tuple[float | None, float | None, dict[int, tuple[float, float]], int]:
    """First pass, typed and fast: first and last timestamp, ProfilerStep#N spans, raw bytes.
    ``TraceError`` for a trace cut short or holding no event: a copy of it would hide that."""
    reader = TraceReader(path)
    first = last = None
    steps: dict[int, tuple[float, float]] = {}
    events = 0
    for batch in reader.batches():
        events += len(batch)
        for e in batch:
            if e.ph == "M":
                continue
            ts = e.ts
            if ts and (first is None or ts < first):
                first = ts
            te = ts + e.dur
            if last is None or te > last:
                last = te
            if e.cat == "user_annotation" and e.name.startswith("ProfilerStep#"):
                try:
                    steps[int(e.name[len("ProfilerStep#"):])] = (ts, te)
                except ValueError:
                    pass
    if reader.truncated:
        raise TraceError(f"{reader.error}; slim copies whole traces only: nothing written",
                         details={"file": str(path)})
    if events == 0:
        raise TraceError(f"{path}: holds no trace event (an empty or non-event traceEvents array): nothing to slim",
                         details={"file": str(path)})
    return first, last, steps, reader.raw_bytes


def parse_window(spec: str, first: float | None, steps: dict[int, tuple[float, float]]) -> tuple[float, float]:
    """``step:N`` or ``START..END`` (ms from the first timestamp; either end may be empty)."""
    m = _STEP.match(spec.strip())
    if m:
        n = int(m.group(1))
        if n not in steps:
            have = ", ".join(str(k) for k in sorted(steps)[:10]) or "none"
            raise SlimWindowInvalid(f"--window step:{n}: the trace has no ProfilerStep#{n} (steps: {have})")
        return steps[n]
    m = _WINDOW.match(spec)
    if not m:
        raise SlimWindowInvalid(f"--window {spec!r}: use step:N or START..END in ms from the trace start (e.g. 0..500)")
    base = first or 0.0
    try:
        a = float(m.group("a")) * 1000 + base if m.group("a") else float("-inf")
        b = float(m.group("b")) * 1000 + base if m.group("b") else float("inf")
    except ValueError:
        raise SlimWindowInvalid(f"--window {spec!r}: START and END are numbers of ms") from None
    if b <= a:
        raise SlimWindowInvalid(f"--window {spec!r}: END must be after START")
    return a, b


def _one_pass(src: Path, out: Path, drop: frozenset[str], window: tuple[float, float] | None, header: dict[str, Any]) -> tuple[int, int, int]:
    lo, hi = window if window else (float("-inf"), float("inf"))
    events_in = 0
    reader = RawTraceReader(src)
    with TraceWriter(out, header) as w:
        for batch in reader.batches():
            events_in += len(batch)
            keep = []
            for e in batch:
                if e.get("ph") == "M":
                    keep.append(e)
                    continue
                cat = e.get("cat")
                if isinstance(cat, str) and cat in drop:
                    continue
                if window is not None:
                    ts = e.get("ts")
                    if not isinstance(ts, (int, float)):
                        continue
                    dur = e.get("dur")
                    te = ts + dur if isinstance(dur, (int, float)) else ts
                    if te < lo or ts > hi:
                        continue
                keep.append(e)
            w.write(keep)
    return events_in + reader.unusable, w.events, w.raw_bytes  # those left out for their numbers too


def slim_trace(
    src: str | Path,
    out: str | Path,
    *,
    drop: Iterable[str] = (),
    window: str | None = None,
    max_mb: float | None = None,
    on_pass: Callable[[str], None] | None = None,
) -> SlimReport:
    """Write a smaller, valid copy of ``src`` to ``out`` (``.json`` / ``.json.gz``). Raises
    ``TraceError`` for unreadable input, ``SlimWindowInvalid`` for a bad window. ``on_pass(what)``
    is told what each pass over the trace does, before it starts (for a progress line)."""
    if not str(src).strip():  # Path("") is the current folder
        raise TraceError("an empty path; give a trace file", details={"file": str(src)})
    src = Path(src)
    why = max_mb_problem(max_mb)
    if why is not None:
        raise TraceError(f"--max-mb {max_mb}: {why}", details={"max_mb": str(max_mb)})
    out = output_path(out, [src])
    tell = on_pass or (lambda _what: None)
    tell("pass 1: reading the trace's steps and span")
    first, last, steps, raw_in = _scan(src)
    win = parse_window(window, first, steps) if window else None
    header = {k: v for k, v in read_header(src).items() if k != "traceEvents"}
    header.setdefault("otherData", {})
    dropped = list(dict.fromkeys(drop))
    report = SlimReport(src=str(src), out=str(out), raw_bytes_in=raw_in)
    budget = int(max_mb * 1e6) if max_mb else None
    levels = list(ESCALATION)
    tell(f"pass 2: writing {out.name}")
    while True:
        if isinstance(header.get("otherData"), dict):
            header["otherData"] = {**header["otherData"], "omni_sidecar_slim": {"dropped": dropped, "window_us": win}}
        report.events_in, report.events_out, report.raw_bytes_out = _one_pass(src, out, frozenset(dropped), win, header)
        report.passes += 1
        if budget is None or report.raw_bytes_out <= budget:
            break
        over = f"pass {report.passes + 2}: {report.raw_bytes_out / 1e6:,.1f} MB is over {max_mb:,g} MB"
        if levels:
            dropped += [c for c in levels.pop(0) if c not in dropped]
            tell(f"{over}, writing it again without {', '.join(dropped)}")
            continue
        lo = win[0] if win else (first or 0.0)
        hi = win[1] if win and win[1] != float("inf") else (last or lo)
        if hi - lo <= 1.0 or report.passes > 12:
            report.fits = False
            break
        keep = (hi - lo) * max(0.05, 0.9 * budget / report.raw_bytes_out)
        win = (lo, lo + keep)
        tell(f"{over}, writing it again with the first {keep / 1000:,.1f} ms")
    report.dropped_categories = dropped
    report.window_us = win
    return report


__all__ = ["ESCALATION", "SlimReport", "SlimWindowInvalid", "max_mb_problem", "parse_window", "slim_trace"]
