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
from sidecar.analysis.capture import locate
from sidecar.analysis.timeline import TimelineReport, write_timeline
from sidecar.analysis.writer import output_path
from sidecar.errors import FleetResultInvalid, TraceError
from sidecar.fleet._results import FleetCapture, TargetResult
from sidecar.fleet._targets import TargetKind, server_key
from sidecar.urls import http_url

# Two targets of one host are one clock when their offsets agree within their errors plus this.
SAME_CLOCK_NS = 1_000_000


_KINDS = {k.value for k in TargetKind}
_WRITE_ONE = "write one with `omni-sidecar fleet capture ... --json > result.json`"


def load_fleet_result(path: str | Path) -> FleetCapture:
    """A fleet result file: ``fleet capture --json`` output (targets as a list) or a
    ``FleetCapture`` dumped as JSON (targets by name). ``FleetResultInvalid`` otherwise, also for a
    target listed twice or named otherwise than ``kind=URL`` (replica ``i`` is the ``i``-th target,
    and its host is read from its name: neither may be guessed)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
        targets = doc["targets"]
        if isinstance(targets, list):
            names = [t["target"] for t in targets]
            doc = {**doc, "targets": {t["target"]: t for t in targets}}
        else:
            names = list(targets)
        fc = FleetCapture.model_validate(doc)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FleetResultInvalid(
            f"{p}: not a fleet result ({type(err).__name__}: {err}); {_WRITE_ONE}", details={"file": str(p)}) from None
    twice = sorted({str(n) for n in names if names.count(n) > 1})
    if twice:
        raise FleetResultInvalid(f"{p}: target {', '.join(twice)} is listed more than once (one result per "
                                 f"replica); {_WRITE_ONE}", details={"file": str(p), "targets": twice})
    for name, r in fc.targets.items():
        kind, sep, url = name.partition("=")
        if not sep or kind not in _KINDS or http_url(url) is None:
            raise FleetResultInvalid(
                f"{p}: target {name!r} is not named kind=URL (e.g. sidecar=http://10.0.0.5:8092): its host, and so "
                f"its machine, cannot be told; {_WRITE_ONE}", details={"file": str(p), "target": name})
        if r.target != name:
            raise FleetResultInvalid(f"{p}: the result keyed {name!r} is target {r.target!r}; {_WRITE_ONE}",
                                     details={"file": str(p), "target": name})
    return fc


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
    return _sources(fc)[0]


def _sources(fc: FleetCapture) -> tuple[list[FleetSource], list[str]]:
    """Every readable trace of ``fc`` and what was not read: a target with no session folder in
    the result (its start failed, nothing written), a folder that is not here or holds no trace.
    Each is said, never dropped: a replica left out would make the rest look like the whole run."""
    clocks = _machines(fc)
    out: list[FleetSource] = []
    errors: list[str] = []
    for i, (name, r) in enumerate(fc.targets.items()):
        if not r.folders:
            why = f"{r.error.code}: {r.error.message}" if r.error else (r.state.value if r.state else r.outcome.value)
            errors.append(f"{name} (replica {i}): no session folder in this result ({r.outcome.value}; {why}); "
                          "it is left out of this analysis")
            continue
        seen: set[Path] = set()
        for folder in r.folders:
            try:
                found = locate([folder])
            except TraceError as err:
                errors.append(f"{name} (replica {i}): {err}")
                continue
            errors += [f"{name} (replica {i}): {w}" for w in found.unreadable]
            for src in found.sources:
                if src.path not in seen:
                    seen.add(src.path)
                    out.append(FleetSource(dataclasses.replace(src, replica=i), name, clocks[name]))
    if not out:
        raise TraceError("the fleet capture names no session folder that is here: run this where the traces "
                         "are (a sidecar started with `--artifact-root SERVER_PATH=LOCAL_PATH` names local "
                         "paths in its result): " + "; ".join(errors[:5]),
                         details={"targets": list(fc.targets), "errors": errors})
    return out, errors


def requested_start_ns(fc: FleetCapture) -> int | None:
    """The start asked for: ``start_at``, else when the prepared starts were sent (fleet clock)."""
    at = fc.start_at if fc.start_at is not None else fc.released_at
    return None if at is None else round(at * 1e9)


def align_fleet(fc: FleetCapture) -> Alignment:
    """Every trace's profiler span and first and last profiled event on the fleet's clock, the
    start skew against the requested start, its spread within each stage, each target's hand-overs
    from stage to stage, and the common window."""
    sources, errors = _sources(fc)
    al = align(sources, requested_ns=requested_start_ns(fc))
    al.errors[:0] = errors
    return al


def fleet_timeline(fc: FleetCapture, out: str | Path, *, common_window: bool = False) -> tuple[TimelineReport, Alignment | None]:
    """One merged Perfetto JSON of ``fc`` on the fleet's clock; with ``common_window`` every trace
    trimmed to the window all of them cover (``TraceError`` when they share none)."""
    sources, errors = _sources(fc)
    al = None
    window = None
    if common_window:
        al = align(sources, requested_ns=requested_start_ns(fc))
        al.errors[:0] = errors
        if al.window_ns is None:
            raise TraceError("the traces of this fleet capture share no common window (the latest profiling "
                             "start is after the earliest profiling end); drop --common-window",
                             details={"spread_ms": al.spread_ms})
        window = al.window_ns
    offsets = {str(fs.source.path): fs.clock.offset_ns for fs in sources}
    report = write_timeline([fs.source for fs in sources], out, clock_offsets_ns=offsets, window_ns=window,
                            skipped=errors)
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
    sources, errors = _sources(fc)
    out = output_path(out, [fs.source.path for fs in sources])  # never a folder, never one of the traces
    report = write_archive(sources, out, mode=mode, max_mb=max_mb, attributes=attrs)
    report.errors[:0] = errors
    return report


@dataclasses.dataclass
class FleetStragglers(Stragglers):
    """``Stragglers`` and what could not be read (a replica or a trace left out is said: the
    ranking is over the others only)."""

    errors: list[str] = dataclasses.field(default_factory=list)


def fleet_stragglers(fc: FleetCapture, *, k: int = 3, top: int = 10) -> FleetStragglers:
    """The ``k`` slowest replicas of this capture (one step) against the median replica: wall time
    on the fleet's clock, the stage where each loses it, and the diff of their top ops; ``errors``
    names every replica or trace left out."""
    sources, errors = _sources(fc)
    al = align(sources, requested_ns=requested_start_ns(fc))
    st = stragglers(sources, al, k=k, top=top)
    return FleetStragglers(**{f.name: getattr(st, f.name) for f in dataclasses.fields(st)},
                           errors=errors + al.errors)


__all__ = ["FleetStragglers", "align_fleet", "fleet_stragglers", "fleet_archive", "fleet_sources", "fleet_timeline", "load_fleet_result", "requested_start_ns"]
