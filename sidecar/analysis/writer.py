"""Write a Chrome trace (``{header..., "traceEvents": [...]}``) as a stream of event batches, to
``.json`` or ``.json.gz`` (ISA-L's gzip when installed). Counts the raw JSON bytes written, the
number Perfetto's UI limit is about."""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import IO, Any

import msgspec

try:
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover
    _gzip = gzip  # type: ignore[assignment]

_ENCODE = msgspec.json.Encoder().encode


class TraceWriter:
    """``with TraceWriter(path, header) as w: w.write(events)``; the file appears complete or not
    at all (written to ``<path>.tmp``, renamed on a clean exit)."""

    def __init__(self, path: str | Path, header: dict[str, Any] | None = None, *, level: int = 3) -> None:
        self.path = Path(path)
        self.header = header or {}
        self.level = level
        self.raw_bytes = 0
        self.events = 0
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._f: IO[bytes] | None = None
        self._first = True

    def __enter__(self) -> TraceWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.suffix == ".gz":
            self._f = _gzip.open(self._tmp, "wb", compresslevel=self.level)
        else:
            self._f = open(self._tmp, "wb")
        head = _ENCODE(self.header)
        self._put(head[:-1] + (b', "traceEvents": [\n' if len(head) > 2 else b'"traceEvents": [\n'))
        return self

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
        assert self._f is not None
        try:
            if exc_type is None:
                self._put(b"\n]}\n")
        finally:
            self._f.close()
        if exc_type is None:
            os.replace(self._tmp, self.path)
        else:
            self._tmp.unlink(missing_ok=True)
