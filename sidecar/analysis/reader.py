"""Streaming reader for Chrome-trace JSON as torch.profiler / Kineto writes it (``.json``, ``.json.gz``).

``TraceReader(path).batches()`` yields lists of ``TraceEvent``, a few MB of raw JSON at a time, so
a trace is never in memory whole. It splits the ``traceEvents`` array at event boundaries and
decodes each slice with msgspec into typed ``TraceEvent`` structs holding only the fields the
summary needs (chosen by measurement: see docs/summaries.md). Header keys
(``distributedInfo``, ``deviceProperties``, ...) land in ``meta``. A file that ends early, or
holds a malformed byte inside its events (a damaged copy), sets ``truncated`` and ``error`` (which
names the byte) after yielding every complete event before it; unreadable input raises
``TraceError`` naming the file. The bytes come from ``stream`` (gunzip, read-ahead, the file's
kind), where events lie in them from ``scan``, what a slice decodes to from ``events``.

Limits are part of the contract (docs/summaries.md, "Limits"): at most ``max_bytes`` of
decompressed JSON, an event boundary at least every ``max_event_bytes``, a header (the keys
before ``traceEvents``, leading whitespace included) of at most 1 MB, JSON nested no deeper than
msgspec decodes. Input that breaks one raises ``TraceTooLarge`` (``trace_too_large``) or
``TraceError`` (``trace_invalid``, nesting), so memory stays bounded by about two slices whatever
the file holds, and time by the bytes read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgspec

from sidecar._child import usable_cores
from sidecar.analysis.events import (
    DECODE,
    DECODE_ANY,
    DECODE_COMPLETE,
    TraceEvent,
    decode_lenient,
    decode_raw,
)
from sidecar.analysis.scan import WS, array_closed, last_boundary, python_run
from sidecar.analysis.stream import INFLATE_ERRORS, GunzipStream, ReadAhead, not_regular, unreadable
from sidecar.errors import TraceError, TraceTooLarge

CHUNK = 4 << 20  # bytes of raw JSON parsed per batch: big enough to amortise, small for RSS
MAX_RAW_BYTES = 8 << 30  # decompressed JSON read from one trace (time bound: a few GB/min)
MAX_EVENT_BYTES = 4 << 20  # no event boundary within this many bytes: not a trace we read
_HEADER_LIMIT = 1 << 20  # metadata before "traceEvents" larger than this is not a trace
_MALFORMED = re.compile(r"JSON is malformed: (.*) \(byte (\d+)\)$")  # msgspec's words for a broken byte
_JSONError = msgspec.DecodeError
_WS_RUN = re.compile(rb"[ \t\r\n]*")


def _after_ws(buf: bytes, i: int) -> int:
    """The index of the first byte at or after ``i`` that is not whitespace (``len(buf)`` if none),
    found without copying ``buf`` (a slice and ``lstrip`` copy megabytes: 30 ms of page faults)."""
    return _WS_RUN.match(buf, i).end()  # type: ignore[union-attr]


def _malformed(err: BaseException) -> tuple[str, int] | None:
    """What msgspec found wrong and where (a byte of the document it was given), when the JSON is
    malformed (not merely cut short: a cut inside a string reads as truncated, with no byte)."""
    m = _MALFORMED.match(str(err))
    return (m.group(1), int(m.group(2))) if m else None


class TraceReader:
    """One pass over one trace file. Not reusable: call ``batches()`` once."""

    def __init__(
        self,
        path: str | Path,
        *,
        chunk_size: int = CHUNK,
        read_ahead: bool | None = None,
        skip_python: bool = False,
        complete_only: bool = False,
        max_bytes: int = MAX_RAW_BYTES,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_event_bytes = max_event_bytes
        # a read-ahead thread pays off only with a second core to run on
        self.read_ahead = usable_cores() > 1 if read_ahead is None else read_ahead
        # Python stack events (with_stack) are often most of a trace and no summary needs them:
        # runs of them are counted at the byte level and never decoded.
        self.skip_python = skip_python
        # events other than "X" become placeholders with ``cat`` None (the summary's reader)
        self.complete_only = complete_only
        self._decode_typed = DECODE_COMPLETE if complete_only else DECODE
        self.skipped = 0  # events counted but not decoded
        self.unusable = 0  # events left out: a number past the limits (TIME_LIMIT_US, 64-bit integers, dur < 0)
        self.chunk_size = chunk_size
        self.meta: dict[str, Any] = {}
        self.truncated = False
        self._why = ""
        self.events_read = 0
        self.raw_bytes = 0  # bytes of (decompressed) JSON consumed
        self._eof = False
        self._f: IO[bytes] | GunzipStream | None = None
        self._broken: tuple[int, str] | None = None  # the last malformed byte the decoder met (index, what)

    def unusable_note(self) -> str | None:
        """What was left out for numbers no profiler writes (see ``unusable``), or None."""
        if not self.unusable:
            return None
        n = self.unusable
        return (f"{n:,} event{'s' if n > 1 else ''} left out: a timestamp or duration past ±2^53 µs, a negative "
                "duration, or an allocator figure past 64 bits (not a number a profiler writes)")

    # --- raw input ---------------------------------------------------------------------------

    def _fail(self, what: str) -> TraceError:
        return TraceError(f"{self.path}: {what}", details={"file": str(self.path)})

    def _too_large(self, what: str, limit: int) -> TraceTooLarge:
        return TraceTooLarge(f"{self.path}: {what}", details={"file": str(self.path), "limit_bytes": limit})

    def _read(self) -> bytes:
        """Next chunk of decompressed bytes; b"" at the end. A broken gzip stream ends the input
        and marks it truncated (the bytes before the break are still used)."""
        if self._eof or self._f is None:
            return b""
        try:
            data = self._f.read(self.chunk_size)
        except INFLATE_ERRORS as err:
            self._eof = True
            if self.raw_bytes == 0:
                raise self._fail(f"cannot decompress: {err}") from None
            self._truncate(f"gzip data corrupt after {self.raw_bytes} bytes: {err}")
            return b""
        if not data:
            self._eof = True
            if getattr(self._f, "truncated", False):
                self._truncate("gzip stream ends early (file truncated while being written or copied?)")
        self.raw_bytes += len(data)
        if self.raw_bytes > self.max_bytes:
            self._eof = True
            raise self._too_large(
                f"more than {_mb(self.max_bytes)} of JSON (decompressed); the reader stops there. "
                "Summarise a smaller window (omni-sidecar slim) or a shorter capture",
                self.max_bytes,
            )
        return data

    def _damaged(self, offset: int, what: str) -> None:
        """Malformed JSON inside the events array: the read ends there, like a cut-off file."""
        self._truncate(f"invalid JSON at byte {offset:,} of the decompressed trace ({what}): the file is damaged "
                       "there, and nothing after it is read")

    def _truncate(self, why: str) -> None:
        if not self.truncated:
            self.truncated = True
            self._why = why

    @property
    def error(self) -> str | None:
        """Why the read ended early, with the events read before it: worded when asked, so the
        count includes the events still buffered when the end was met."""
        if not self.truncated:
            return None
        n = self.events_read
        return f"{self.path}: {self._why}; summary covers the {n:,} event{'' if n == 1 else 's'} read before it"

    # --- parsing -----------------------------------------------------------------------------

    def _open(self) -> IO[bytes]:
        """The file, opened only once ``stat`` says it is a regular one (opening a FIFO blocks),
        and without blocking, then checked again on the open descriptor (it may have been swapped)."""
        why = unreadable(self.path)
        if why is not None:
            raise self._fail(why)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise self._fail("no such file or folder") from None
        except OSError as err:
            raise self._fail(f"cannot be opened ({err.strerror or err})") from None
        f = os.fdopen(fd, "rb")
        st = os.fstat(fd)
        why = not_regular(st.st_mode) or ("is empty (0 bytes); the profiler may still be writing it" if st.st_size == 0 else None)
        if why is not None:
            f.close()
            raise self._fail(why)
        return f

    def batches(self) -> Iterator[list[TraceEvent]]:
        f = self._open()
        try:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
        except OSError as err:
            f.close()
            raise self._fail(f"cannot be read ({err.strerror or err})") from None
        src: Any = GunzipStream(f) if gz else f
        self._f = ReadAhead(src, self.chunk_size) if self.read_ahead else src
        try:
            yield from self._batches()
        finally:
            self._f.close()

    def _batches(self) -> Iterator[list[TraceEvent]]:
        buf = self._read()
        blank = 0  # whitespace chunks dropped before the first JSON byte
        while not self._eof and _after_ws(buf, 0) == len(buf):
            blank += len(buf)
            if blank > _HEADER_LIMIT:
                raise self._too_large(f"starts with more than {_mb(_HEADER_LIMIT)} of whitespace", _HEADER_LIMIT)
            buf = self._read()
        first = _after_ws(buf, 0)
        if first == len(buf):
            if self.truncated:
                raise self._fail("gzip stream ends before any data (file truncated?)")
            raise self._fail("holds only whitespace, no JSON")
        if buf[first : first + 1] == b"[":  # bare array form of the Chrome trace format
            pos = first + 1
        elif buf[first : first + 1] == b"{":
            pos = self._find_events(buf)
            buf = self._buf
        else:
            raise self._fail(self._not_an_object(buf))
        yield from self._event_slices(buf, pos)

    def _find_events(self, buf: bytes) -> int:
        """Position just after ``"traceEvents": [``; parse the header keys before it into meta."""
        key = b'"traceEvents"'
        while True:
            idx = buf.find(key)
            if idx >= 0:
                key_end = idx + len(key)
                j = _after_ws(buf, key_end)
                while len(buf) - j < 2 and not self._eof:
                    if len(buf) - key_end > _HEADER_LIMIT:
                        raise self._too_large(f"more than {_mb(_HEADER_LIMIT)} of whitespace after 'traceEvents'", _HEADER_LIMIT)
                    buf += self._read()
                    j = _after_ws(buf, j)
                k = _after_ws(buf, j + 1) if buf[j : j + 1] == b":" else j
                if k > j and buf[k : k + 1] == b"[":
                    pos = k + 1
                    head = buf[buf.find(b"{") + 1 : idx].strip(WS).rstrip(b",")
                    if head:
                        try:
                            self.meta.update(DECODE_ANY(b"{" + head + b"}"))
                        except (_JSONError, RecursionError, TypeError, ValueError):
                            pass  # metadata is a nicety; the events are what matter
                    self._buf = buf
                    return pos
            if self._eof:
                break
            if len(buf) > _HEADER_LIMIT:
                raise self._too_large(
                    f"no 'traceEvents' array in its first {_mb(_HEADER_LIMIT)} (not a Chrome trace, or a header "
                    "far larger than Kineto writes)",
                    _HEADER_LIMIT,
                )
            buf += self._read()
        # No traceEvents array: say what the file is instead.
        if self.truncated:
            raise TraceError(self.error or f"{self.path}: truncated", details={"file": str(self.path)})
        try:
            doc = DECODE_ANY(buf)
        except _JSONError as err:
            raise self._fail(f"is not valid JSON ({err})") from None
        except RecursionError:
            raise self._deep() from None
        if isinstance(doc, dict) and "traceEvents" in doc:
            raise self._fail(f"is JSON but not a Chrome trace: traceEvents is not an array (it is {_a(doc['traceEvents'])})")
        keys = ", ".join(list(doc)[:6]) if isinstance(doc, dict) else _a(doc)
        raise self._fail(f"is JSON but not a Chrome trace: no 'traceEvents' array (top-level keys: {keys})")

    def _not_an_object(self, buf: bytes) -> str:
        """What a file that starts with neither ``{`` nor ``[`` is: JSON of another kind (a null, a
        string, a number; decoded only when the whole file is within the header's limit), or not JSON."""
        while not self._eof and len(buf) <= _HEADER_LIMIT:
            buf += self._read()
        if self._eof and not self.truncated:
            try:
                return f"is JSON but not a Chrome trace ({_a(DECODE_ANY(buf))}; expected an object with traceEvents)"
            except (_JSONError, RecursionError):
                pass
        return "is not JSON (expected a Chrome trace object with traceEvents)"

    def _deep(self) -> TraceError:
        return self._fail("nests JSON deeper than the decoder allows (about 1000 levels); Kineto writes 3 or 4")

    def _decode_doc(self, doc: Any) -> list[Any]:
        """A whole JSON array of events (bytes or a memoryview) → events."""
        try:
            return self._decode(doc)
        except RecursionError:
            raise self._deep() from None

    def _decode(self, doc: Any) -> list[Any]:
        try:
            return self._decode_typed(doc)
        except msgspec.ValidationError:  # valid JSON, odd field types: take the slow path
            out, passed, unusable = decode_lenient(doc, complete_only=self.complete_only)
            self.skipped += passed  # counted, as the typed path's placeholders are
            self.events_read += passed
            self.unusable += unusable
            return out

    def _parse(self, body: bytes) -> list[Any]:
        body = body.lstrip(WS)
        if body[:1] == b",":
            body = body[1:]
        return self._decode_doc(b"[" + body + b"]")

    def _event_slices(self, first: bytes, pos: int) -> Iterator[list[Any]]:
        # One bytearray, parsed in place: the "," before a slice's first event becomes "[" and the
        # character after its last "}" becomes "]" for the decode, then both are put back. No
        # slice is copied; consumed bytes leave from the front (cheap for a bytearray).
        buf = bytearray(b",")
        with memoryview(first) as view:
            buf += view[pos:]
        more = True  # read before parsing: always at first and after a slice without a boundary
        while True:
            if not self._eof and (more or len(buf) < self.chunk_size):
                buf += self._read()
                if not self._eof and len(buf) < self.chunk_size // 2:
                    continue
            more = False
            if self._eof:
                # Python runs in the last slice are skipped too: slices up to the last "]" first
                while self.skip_python:
                    events, used = self._parse_in_place(buf, buf.rfind(b"]"))
                    if used <= 0:
                        break
                    del buf[:used]
                    if events:
                        self.events_read += len(events)
                        yield events
                yield from self._finish(bytes(buf))
                return
            events, used = self._parse_in_place(buf)
            if used < 0:  # malformed JSON: keep what came before it, and say where
                self._damaged(self.raw_bytes - len(buf) + self._broken[0], self._broken[1])
                return
            if used == 0:  # no complete boundary yet (one very large event): read more, within the limit
                if len(buf) > self.max_event_bytes + self.chunk_size:
                    raise self._too_large(
                        f"no event boundary within {_mb(self.max_event_bytes)} after byte "
                        f"{self.raw_bytes - len(buf)} (one value larger than that, or traceEvents is not "
                        "a list of event objects)",
                        self.max_event_bytes,
                    )
                more = True
                continue
            del buf[:used]
            if events:
                self.events_read += len(events)
                yield events

    def _parse_in_place(self, buf: bytearray, end: int | None = None, tries: int = 4) -> tuple[list[Any], int]:
        """Events up to the last boundary of ``buf`` (which starts with whitespace and ",") before
        ``end``. A ``},{`` inside a string makes a cut invalid: then try the boundary before it."""
        c = buf.find(b",")
        end = len(buf) if end is None else end
        if self.skip_python and c >= 0:
            b = last_boundary(buf, end)
            if b > c:
                cut, n = python_run(buf, c, b)
                if cut < 0:  # the slice starts with a run of Python events: count it, skip it
                    self.skipped += n
                    self.events_read += n
                    return [], -cut
                end = cut
        broken: tuple[int, str] | None = None  # where msgspec found malformed JSON (index in buf), and what
        for _ in range(tries):
            b = last_boundary(buf, end)
            if b <= c or c < 0:
                if broken is not None and not array_closed(buf, broken[0]):
                    self._broken = broken
                    return [], -1  # the first event of the slice is malformed
                return [], 0
            saved_c, saved_b = buf[c], buf[b]
            buf[c], buf[b] = 0x5B, 0x5D  # "[", "]"
            try:
                with memoryview(buf)[c : b + 1] as view:
                    return self._decode_doc(view), b
            except _JSONError as err:
                bad = _malformed(err)
                if bad is not None and c + bad[1] < b:  # all before that byte parsed: cut before it
                    broken = (c + bad[1], bad[0])
                    end = broken[0]
                else:
                    end = b - 1
            finally:
                buf[c], buf[b] = saved_c, saved_b
        return [], 0

    def _parse_prefix(self, data: bytes, tries: int = 4) -> tuple[list[TraceEvent], int]:
        """Parse complete events up to the last boundary. A ``},{`` inside a string makes a cut
        invalid: then try the boundary before it."""
        end = len(data)
        head = len(data) - len(data.lstrip(WS))  # what _parse strips before the "[" it adds
        head += data[head : head + 1] == b","
        for _ in range(tries):
            b = last_boundary(data, end)
            if b <= 0:
                return [], 0
            try:
                return self._parse(data[:b]), b
            except _JSONError as err:
                bad = _malformed(err)
                at = head + bad[1] - 1 if bad is not None else -1
                if 0 <= at < b and not array_closed(data, at):
                    self._broken = (at, bad[0])  # type: ignore[index]
                    end = at
                else:
                    end = b - 1
        return [], 0

    def _finish(self, data: bytes) -> Iterator[list[TraceEvent]]:
        """The rest of the file: last events, ``]``, then the trailing keys (``traceName``)."""
        j = data.rfind(b"]")
        for _ in range(64):
            if j < 0:
                break
            try:
                events = self._parse(data[:j])
            except _JSONError:
                j = data.rfind(b"]", 0, j)
                continue
            tail = data[j + 1 :].strip(WS)
            if tail.startswith(b","):
                try:
                    extra = DECODE_ANY(b"{" + tail[1:])
                    if isinstance(extra, dict):
                        self.meta.update(extra)
                except (_JSONError, RecursionError):
                    self._truncate("trailing keys after traceEvents are cut off")
            elif tail not in (b"}", b"") and not self.truncated:
                self._truncate("unexpected text after the traceEvents array")
            if events:
                self.events_read += len(events)
                yield events
            return
        # No closing bracket parses: the JSON stops mid-array. Keep every complete event.
        self._broken = None
        events, used = self._parse_prefix(data, tries=64)
        try:  # the last whole event, with at most a "," after it (the file cut off between events)
            events = events + self._parse(data[used:].rstrip(WS).rstrip(b","))
        except _JSONError:
            pass
        if events:
            self.events_read += len(events)
            yield events
        if self._broken is not None and self._broken[0] >= used:  # not cut off: damaged
            self._damaged(self.raw_bytes - len(data) + self._broken[0], self._broken[1])
        self._truncate("JSON ends inside the traceEvents array (file truncated?)")


class RawTraceReader(TraceReader):
    """``TraceReader`` that yields every event whole, as dicts (for tools that rewrite traces:
    timeline, slim). Slices are smaller, since dicts of every field take more memory."""

    def __init__(self, path: str | Path, *, chunk_size: int = 1 << 20, read_ahead: bool | None = None) -> None:
        super().__init__(path, chunk_size=chunk_size, read_ahead=read_ahead)

    def _decode(self, doc: Any) -> list[Any]:
        events, unusable = decode_raw(doc)
        self.unusable += unusable
        return events


def _a(value: Any) -> str:
    """The JSON kind of ``value``, with its article: ``a string``, ``an object``."""
    kind = {type(None): "a null", bool: "a boolean", str: "a string", int: "a number", float: "a number",
            dict: "an object", list: "an array"}
    return kind.get(type(value), f"a {type(value).__name__}")


def _mb(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MB" if n < 1 << 30 else f"{n / (1 << 30):,.0f} GB"


def read_header(path: str | Path) -> dict[str, Any]:
    """The keys of a trace before ``traceEvents`` (``baseTimeNanoseconds``, ``distributedInfo``,
    ``deviceProperties``, ...), reading only the first slice."""
    reader = RawTraceReader(path, chunk_size=256 << 10, read_ahead=False)
    gen = reader.batches()
    try:
        next(gen, None)
    finally:
        gen.close()
    return reader.meta


def trace_base_ns(header: dict[str, Any]) -> int | None:
    """What a trace's ``ts`` (µs) count from: its ``baseTimeNanoseconds`` (Kineto), or None where
    its ``ts`` are absolute: no base, or the emulator's synthetic traces, which write epoch-µs
    ``ts`` and a base beside them (``"emulator_synthetic": true``, sidecar/emulator/_synthetic.py)."""
    if header.get("emulator_synthetic") is True:
        return None
    base = header.get("baseTimeNanoseconds")
    return base if isinstance(base, int) and not isinstance(base, bool) else None


def trace_epoch_offset_us(header: dict[str, Any]) -> float | None:
    """What to add to a trace's ``ts`` (µs) for the host's wall clock (epoch µs): its base, 0 for
    the emulator's synthetic traces (epoch-µs ``ts``), None where the trace does not say."""
    if header.get("emulator_synthetic") is True:
        return 0.0
    base = trace_base_ns(header)
    return None if base is None else base / 1000.0
