"""A finished fleet capture seen as one run: its traces on the fleet's clock (each through its
target's clock offset), the start skew and common window, one merged timeline, one Perfetto
archive, and the stragglers across replicas. The analysis is ``sidecar/analysis`` (aligned,
timeline, archive, diff); this module only says which trace is whose and on which clock.

Replica ``i`` is the ``i``-th target of the capture. A machine is a target's host; targets of one
host whose offsets disagree by more than their error bounds (+1 ms) are separate clocks (e.g. two
containers, or libfaketime in the tests) and get a machine each, ``host:port``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sidecar.analysis.aligned import Alignment, FleetSource, HostClock, Stragglers, align, stragglers
from sidecar.analysis.archive import ArchiveMode, ArchiveReport, write_archive
from sidecar.analysis.capture import find_sources
from sidecar.analysis.timeline import TimelineReport, write_timeline
from sidecar.errors import FleetResultInvalid, TraceError
from sidecar.fleet._results import FleetCapture, TargetResult
from sidecar.fleet._targets import server_key

# Two targets of one host are one clock when their offsets agree within their errors plus this.
SAME_CLOCK_NS = 1_000_000


def load_fleet_result(path: str | Path) -> FleetCapture:
    """A fleet result file: ``fleet capture --json`` output (targets as a list) or a
    ``FleetCapture`` dumped as JSON (targets by name). ``FleetResultInvalid`` otherwise."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
        targets = doc["targets"]
        if isinstance(targets, list):
            doc = {**doc, "targets": {t["target"]: t for t in targets}}
        return FleetCapture.model_validate(doc)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FleetResultInvalid(
            f"{p}: not a fleet result ({type(err).__name__}: {err}); write one with "
            "`omni-sidecar fleet capture ... --json > result.json`", details={"file": str(p)}) from None


def _machines(fc: FleetCapture) -> dict[str, HostClock]:
    """Each target's clock, named by its host (split per target where one host has two clocks)."""
    by_host: dict[str, list[tuple[str, TargetResult]]] = {}
    for name, r in fc.targets.items():
        host = server_key(name.split("=", 1)[-1]).split(":", 1)[0]
        by_host.setdefault(host, []).append((name, r))
    out: dict[str, HostClock] = {}
    for host, members in by_host.items():
        clocks = [r.clock for _, r in members]
        known = [c for c in clocks if c is not None]
        one = all(abs(a.offset_ns - b.offset_ns) <= a.error_ns + b.error_ns + SAME_CLOCK_NS
                  for a in known for b in known)
        for (name, r), c in zip(members, clocks):
            machine = host if one else server_key(name.split("=", 1)[-1]).split("/", 1)[0]
            out[name] = HostClock(host=machine, offset_ns=c.offset_ns if c else 0,
                                  error_ns=c.error_ns if c else None, method=c.method if c else "unmeasured")
    return out


def fleet_sources(fc: FleetCapture) -> list[FleetSource]:
    """Every trace of ``fc`` (its targets' session folders), replica = the target's index."""
    clocks = _machines(fc)
    out: list[FleetSource] = []
    for i, (name, r) in enumerate(fc.targets.items()):
        folders = [f for f in r.folders if Path(f).is_dir()]
        if not folders:
            continue
        for src in find_sources(folders):
            out.append(FleetSource(dataclasses.replace(src, replica=i), name, clocks[name]))
    if not out:
        raise TraceError("the fleet capture names no session folder that is here (run this where the "
                         "traces are, or map the sidecars' dirs with --artifact-root)",
                         details={"targets": list(fc.targets)})
    return out


def requested_start_ns(fc: FleetCapture) -> int | None:
    """The start asked for: ``start_at``, else when the prepared starts were sent (fleet clock)."""
    at = fc.start_at if fc.start_at is not None else fc.released_at
    return None if at is None else round(at * 1e9)


def align_fleet(fc: FleetCapture) -> Alignment:
    """Every trace's profiler span and first and last profiled event on the fleet's clock, the
    start skew against the requested start, its spread within each stage, each target's hand-overs
    from stage to stage, and the common window."""
    return align(fleet_sources(fc), requested_ns=requested_start_ns(fc))


def fleet_timeline(fc: FleetCapture, out: str | Path, *, common_window: bool = False) -> tuple[TimelineReport, Alignment | None]:
    """One merged Perfetto JSON of ``fc`` on the fleet's clock; with ``common_window`` every trace
    trimmed to the window all of them cover (``TraceError`` when they share none)."""
    sources = fleet_sources(fc)
    al = None
    window = None
    if common_window:
        al = align(sources, requested_ns=requested_start_ns(fc))
        if al.window_ns is None:
            raise TraceError("the traces of this fleet capture share no common window (the latest profiling "
                             "start is after the earliest profiling end); drop --common-window",
                             details={"spread_ms": al.spread_ms})
        window = al.window_ns
    offsets = {str(fs.source.path): fs.clock.offset_ns for fs in sources}
    report = write_timeline([fs.source for fs in sources], out, clock_offsets_ns=offsets, window_ns=window)
    return report, al


def fleet_archive(fc: FleetCapture, out: str | Path, *, mode: ArchiveMode = "named",
                  max_mb: float | None = None) -> ArchiveReport:
    """``out`` (a TAR): every trace of ``fc`` plus the ``perfetto_manifest.json`` that opens them
    merged and aligned in Perfetto (``sidecar/analysis/archive.py``)."""
    attrs: dict[str, Any] = {"omni_sidecar.targets": len(fc.targets)}
    if fc.label:
        attrs["omni_sidecar.label"] = fc.label
    req = requested_start_ns(fc)
    if req is not None:
        attrs["omni_sidecar.requested_start_ns"] = req
    return write_archive(fleet_sources(fc), out, mode=mode, max_mb=max_mb, attributes=attrs)


def fleet_stragglers(fc: FleetCapture, *, k: int = 3, top: int = 10) -> Stragglers:
    """The ``k`` slowest replicas of this capture (one step) against the median replica: wall time
    on the fleet's clock, the stage where each loses it, and the diff of their top ops."""
    sources = fleet_sources(fc)
    return stragglers(sources, align(sources, requested_ns=requested_start_ns(fc)), k=k, top=top)


__all__ = ["align_fleet", "fleet_stragglers", "fleet_archive", "fleet_sources", "fleet_timeline", "load_fleet_result", "requested_start_ns"]
