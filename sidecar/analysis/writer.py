"""Write a Chrome trace (``{header..., "traceEvents": [...]}``) as a stream of event batches, to
``.json`` or ``.json.gz`` (ISA-L's gzip when installed). Counts the raw JSON bytes written, the
number Perfetto's UI limit is about. ``output_path`` is the one rule for where a tool that reads
traces may write one: a file path, never a folder, a symlink loop or one of its inputs."""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import msgspec

from sidecar.analysis.stream import look
from sidecar.errors import TraceError

try:
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover
    _gzip = gzip  # type: ignore[assignment]

_ENCODE = msgspec.json.Encoder().encode


def output_path(out: str | Path, inputs: Iterable[str | Path] = ()) -> Path:
    """``out`` as the file a trace is written to, checked before anything is read: ``TraceError``
    when it is empty, a folder, a symlink loop, or the same file as one of ``inputs`` (by device
    and inode, so ``./a.json``, ``dir/../a.json`` and a link to it are caught too)."""
    text = os.fspath(out)
    if not text.strip() or Path(text).name in ("", ".", ".."):
        raise TraceError(f"the output {text!r} names no file; give a file path such as out.json.gz",
                         details={"file": text})
    path = Path(text)
    st, why = look(path)
    if st is None:
        if why is not None and why.startswith("is a symlink loop"):
            raise TraceError(f"{path}: the output {why}; give another file path", details={"file": text})
        return path  # a new file, or a broken link (written through)
    if os.path.isdir(path):
        raise TraceError(f"{path}: the output is a folder; give a file path (e.g. {path / 'out.json.gz'})",
                         details={"file": text})
    for src in inputs:
        sst, _ = look(src)
        if sst is not None and (sst.st_dev, sst.st_ino) == (st.st_dev, st.st_ino):
            raise TraceError(f"{path}: the output must not be the input trace ({src}); give another file path",
                             details={"file": text})
    return path


class TraceWriter:
    """``with TraceWriter(path, header) as w: w.write(events)``; the file appears complete or not
    at all (written to ``<path>.tmp``, renamed on a clean exit)."""

    def __init__(self, path: str | Path, header: dict[str, Any] | None = None, *, level: int = 3) -> None:
        self.path = Path(path)
        self.header = header or {}
        self.level = level
        self.raw_bytes = 0
        self.events = 0
        self._tmp = output_path(self.path).with_name(self.path.name + ".tmp")
        self._raw: IO[bytes] | None = None
        self._f: IO[bytes] | None = None
        self._first = True

    def __enter__(self) -> TraceWriter:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._raw = open(self._tmp, "wb")
            # the gzip header names the final file, not the temporary one it is written as
            self._f = _gzip.GzipFile(filename=str(self.path), mode="wb", compresslevel=self.level,
                                     fileobj=self._raw) if self.path.suffix.lower() == ".gz" else self._raw
            head = _ENCODE(self.header)
            self._put(head[:-1] + (b', "traceEvents": [\n' if len(head) > 2 else b'"traceEvents": [\n'))
        except OSError as err:
            self._discard()
            raise self._cannot(err) from None
        return self

    def _cannot(self, err: OSError) -> TraceError:
        return TraceError(f"{self.path}: cannot be written ({err.strerror or err}); nothing written",
                          details={"file": str(self.path)})

    def _discard(self) -> None:
        for f in (self._f, getattr(self, "_raw", None)):
            if f is not None:
                try:
                    f.close()
                except (OSError, ValueError):
                    pass
        self._tmp.unlink(missing_ok=True)

    def _put(self, data: bytes) -> None:
        assert self._f is not None
        self._f.write(data)
        self.raw_bytes += len(data)

    def write(self, events: list[Any]) -> None:
        if not events:
            return
        body = _ENCODE(events)[1:-1]
        self._put(body if self._first else b",\n" + body)
        self._first = False
        self.events += len(events)

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            self._put(b"\n]}\n")
            assert self._f is not None
            self._f.close()
            self._raw.close()
            os.replace(self._tmp, self.path)
        except OSError as err:  # the disk filled, the path became a folder: no half-written file stays
            self._discard()
            raise self._cannot(err) from None
