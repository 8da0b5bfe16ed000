"""One archive of a fleet capture that opens merged and aligned in Perfetto: every trace, plus a
``perfetto_manifest.json`` that names one machine per host and places each file on one timeline.

The manifest is Perfetto's (version 1; docs/fleet-clocks.md quotes the fields used). A Chrome
JSON trace is *clockless* to Perfetto (its ``ts`` are read as they are, ``baseTimeNanoseconds``
is not used), so every file but one gets ``clocks: {sync_to: {file: <reference>}, offset_ns:
N}``: N is how much later than the reference file's own ``ts`` its ``ts`` sit, i.e. the
difference of their ``base − host offset`` (``sidecar/analysis/aligned.py``). The reference is
the file with the smallest one, so no file moves before the timeline's start (Perfetto drops
such events).

Streamed into the tar: one trace at a time (a named copy is written to a temporary file, added,
removed), so memory does not grow with the number of traces. Modes: ``named`` (default: every
event kept at its own ``ts``; its process renamed ``stage 0 · replica 3 · rank 0 (llm)``, one
per trace), ``raw`` (the files byte for byte), ``slim`` (``slim_trace`` with ``max_mb``).
"""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from sidecar.analysis.aligned import FleetSource, clock_shift_ns, trace_base_ns
from sidecar.analysis.reader import RawTraceReader, read_header
from sidecar.analysis.timeline import TimelineProcess, _rank, _SourceRewriter, process_name
from sidecar.analysis.writer import TraceWriter
from sidecar.errors import TraceError

MANIFEST = "perfetto_manifest.json"
# Perfetto skips archive members with a path component starting with "." (docs/fleet-clocks.md):
# the index of what each member is travels beside the traces without being parsed as one.
INDEX = ".omni-sidecar/index.json"
ArchiveMode = Literal["named", "raw", "slim"]


@dataclass
class ArchiveMember:
    name: str  # the member's path in the archive
    file: str  # the trace it came from
    target: str
    machine: str
    process: str
    offset_ns: int  # the host clock's offset applied (host − reference clock)
    error_ns: int | None
    manifest_offset_ns: int  # its ``offset_ns`` against the reference file in the manifest


@dataclass
class ArchiveReport:
    out: str
    mode: str
    reference: str | None = None  # the member every other is placed against
    members: list[ArchiveMember] = field(default_factory=list)
    machines: dict[str, int] = field(default_factory=dict)  # machine name -> its clock offset (ns)
    errors: list[str] = field(default_factory=list)


def _member_name(i: int, fs: FleetSource, rank: int | None, suffix: str) -> str:
    # Short: the Perfetto UI's TAR reader takes member names of at most 99 characters.
    s = fs.source
    sid = "x" if s.stage_id is None else s.stage_id
    return f"{i:05d}-stage{sid}-replica{s.replica or 0}-rank{rank or 0}{suffix}"


def manifest(members: Sequence[ArchiveMember], *, attributes: Mapping[str, str | int] | None = None) -> dict[str, Any]:
    """The ``perfetto_manifest`` document for ``members`` (the first one is the reference)."""
    files: list[dict[str, Any]] = []
    ref = members[0].name if members else None
    for m in members:
        entry: dict[str, Any] = {"path": m.name, "machine": {"name": m.machine}}
        if m.name != ref:
            entry["clocks"] = {"sync_to": {"file": ref}, "offset_ns": m.manifest_offset_ns}
        files.append(entry)
    doc: dict[str, Any] = {"version": 1, "files": files}
    if attributes:
        doc["attributes"] = dict(attributes)
    return {"perfetto_manifest": doc}


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _named_copy(fs: FleetSource, header: dict[str, Any], rank: int | None, pid: int, out: Path) -> None:
    """``fs`` with every event at its own ``ts``, its processes one named process ``pid``."""
    proc = TimelineProcess(pid=pid, name=process_name(fs.source, rank), file=str(fs.source.path),
                           stage_id=fs.source.stage_id, replica=fs.source.replica, rank=rank,
                           kind=fs.source.kind, offset_us=0.0)
    keep = {k: v for k, v in header.items() if k != "traceEvents"}
    rw = _SourceRewriter(proc, pid - 1)
    with TraceWriter(out, keep) as w:
        w.write([
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0, "args": {"name": proc.name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0, "args": {"sort_index": pid}},
        ])
        for batch in RawTraceReader(fs.source.path).batches():
            w.write(rw.rewrite(batch))


def write_archive(
    sources: Sequence[FleetSource], out: str | Path, *, mode: ArchiveMode = "named", max_mb: float | None = None,
    attributes: Mapping[str, str | int] | None = None,
) -> ArchiveReport:
    """Write ``out`` (a TAR): every readable trace of ``sources`` and the manifest that merges them.
    A trace that cannot be read is left out and named in ``errors``; ``TraceError`` when none can."""
    if mode not in ("named", "raw", "slim"):
        raise TraceError(f"archive mode must be named, raw or slim, got {mode!r}")
    report = ArchiveReport(out=str(out), mode=mode)
    heads: list[tuple[FleetSource, dict[str, Any], int | None]] = []
    for fs in sources:
        try:
            h = read_header(fs.source.path)
        except TraceError as err:
            report.errors.append(str(err))
            continue
        heads.append((fs, h, _rank(h, fs.source.path)))
    if not heads:
        raise TraceError("no readable trace to archive: " + "; ".join(report.errors[:5]),
                         details={"errors": report.errors})
    heads.sort(key=lambda x: (x[0].source.stage_id if x[0].source.stage_id is not None else 1 << 30,
                              x[0].source.replica or 0, x[2] or 0, str(x[0].source.path)))
    shifts = [clock_shift_ns(trace_base_ns(h), fs.clock) for fs, h, _ in heads]
    ref = min(range(len(heads)), key=lambda i: shifts[i])
    members: list[ArchiveMember] = []
    for i, ((fs, h, rank), shift) in enumerate(zip(heads, shifts)):
        name = fs.source.path.name
        suffix = ".json.gz" if mode == "named" or name.endswith(".gz") else ".json"
        members.append(ArchiveMember(
            name=_member_name(i, fs, rank, suffix), file=str(fs.source.path), target=fs.target, machine=fs.clock.host,
            process=process_name(fs.source, rank), offset_ns=fs.clock.offset_ns, error_ns=fs.clock.error_ns,
            manifest_offset_ns=shift - shifts[ref],
        ))
        report.machines.setdefault(fs.clock.host, fs.clock.offset_ns)
    order = [ref] + [i for i in range(len(members)) if i != ref]  # the reference first in the manifest
    report.reference = members[ref].name
    attrs = {"omni_sidecar.reference_clock": "the fleet's realtime clock (ns)", **(attributes or {})}
    for host, off in report.machines.items():
        attrs[f"omni_sidecar.machine.{host}.offset_ns"] = off
    doc = manifest([members[i] for i in order], attributes=attrs)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar, \
            tempfile.TemporaryDirectory(prefix="omni-sidecar-archive-") as tmp:
        _add_bytes(tar, MANIFEST, json.dumps(doc).encode())
        kept: list[ArchiveMember] = []
        for i, ((fs, h, rank), m) in enumerate(zip(heads, members)):
            try:
                if mode == "raw":
                    tar.add(fs.source.path, arcname=m.name, recursive=False)
                else:
                    copy = Path(tmp) / m.name
                    if mode == "named":
                        _named_copy(fs, h, rank, i + 1, copy)
                    else:
                        from sidecar.analysis.slim import ESCALATION, slim_trace

                        slim_trace(fs.source.path, copy, drop=ESCALATION[0], max_mb=max_mb)
                    tar.add(copy, arcname=m.name, recursive=False)
                    copy.unlink()
            except (TraceError, OSError) as err:  # the manifest names it; Perfetto ignores a missing file
                report.errors.append(f"{fs.source.path}: {err}")
                continue
            kept.append(m)
        report.members = kept
        index = {"reference": report.reference, "mode": mode, "machines": report.machines,
                 "members": [asdict(m) for m in kept], "errors": report.errors}
        _add_bytes(tar, INDEX, json.dumps(index, indent=1).encode())
    return report


__all__ = ["INDEX", "MANIFEST", "ArchiveMember", "ArchiveReport", "ArchiveMode", "manifest", "write_archive"]
