"""Where a Chrome trace's events lie in its bytes, found without decoding them: the boundaries
between events (``}`` ``,`` ``{``), the end of the events array, and the runs of Python stack events
that ``TraceReader`` passes over (Kineto writes them together, in runs of up to many MB, between the
ops and the GPU events; with memory on, after the memory events). Each search is a C-level
``find``/``count``/regex over a ``bytes``/``bytearray``; nothing here allocates per event.
"""

from __future__ import annotations

import re

# "}" "," "{" between two events; whitespace runs longer than GAP between them are not Kineto's
_BOUNDARY = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")
GAP = 4096
NEAR = 4 << 10  # bytes before the end searched first for the last boundary (events are ~0.3 kB)
_TAIL = 64 << 10  # then these, then the rest
WS = b" \t\r\n"
_PYFN = b'"cat": "python_function"'
# Python events are looked for every _PY_STRIDE bytes (in the next _PY_PROBE), so a run longer than
# the stride is found wherever it starts; a slice is cut at a run of at least _PY_MIN_RUN bytes
_PY_STRIDE = 32 << 10
_PY_PROBE = 2 << 10
_PY_MIN_RUN = 64 << 10
_PY_TRIES = 16  # short runs passed over in one slice before the rest is decoded as it is
_NOT_PYFN = re.compile(rb'"cat"[ \t\r\n]*:[ \t\r\n]*"(?!python_function")')  # an event of another category
_ARRAY_END = re.compile(rb"\}[ \t\r\n]*\]")  # the last event, then the end of the events array


def last_boundary(data: bytes | bytearray, end: int) -> int:
    """Index just past the last ``}`` before ``end`` that is followed by ``,`` and ``{``
    (an event boundary in the array), or -1. The regex runs in C: a run of ``}`` or of
    whitespace costs one linear scan, not a Python loop per byte. The last ``NEAR`` bytes
    are searched first (where a boundary almost always is), then the last ``_TAIL``, then the
    rest."""
    stop = min(len(data), end + GAP)
    lo = max(0, end - NEAR)
    while True:
        last = -1
        for m in _BOUNDARY.finditer(data, lo, stop):
            if m.start() >= end:
                break
            last = m.start() + 1
        if last >= 0 or lo == 0:
            return last
        stop, lo = min(len(data), lo + GAP), (max(0, end - _TAIL) if end - lo < _TAIL else 0)


def array_closed(buf: bytes | bytearray, at: int) -> bool:
    """Whether the decoder stopped at ``at`` because the events array had ended there and the
    trace's keys follow (``], "traceName": ...``), not at a damaged byte."""
    rest = bytes(buf[at : at + GAP]).lstrip(WS)
    return rest[:1] == b"}" or (rest[:1] == b"," and rest[1:].lstrip(WS)[:1] == b'"')


def python_run(buf: bytearray, c: int, b: int) -> tuple[int, int]:
    """Where ``buf[c:b]`` (whole events) meets Python events: ``(-e, n)`` when it starts with a
    run of ``n`` of them ending at ``e`` (skip it), else ``(i, 0)``, with ``i`` the index where a run of at least
    ``_PY_MIN_RUN`` bytes, or one that reaches the slice's end, starts (decode up to there;
    the next slice starts with the run), else ``b``. Verified by counting: every ``"ph"`` in
    a skipped run belongs to a python_function event, or nothing is skipped.

    Kineto writes a thread's Python events together, in runs of up to many MB, between the
    ops and the GPU events (with memory on, after the memory events): a slice is probed every
    ``_PY_STRIDE`` bytes, so a run is found wherever it starts at a few kB scanned per probe.
    Short runs are decoded like any other event (correct, only slower)."""
    first = buf.find(b'"ph"', c, b)
    if first < 0:
        return b, 0
    second = buf.find(b'"ph"', first + 4, b)
    if buf.find(_PYFN, c, b if second < 0 else second) >= 0:  # the slice starts with a Python event
        e = run_end(buf, first, b)
        last = array_end(buf, c, e)
        if last >= 0:  # the run ends the events array: skip it up to its last event
            e = last_boundary(buf, last)
        n = buf.count(b'"ph"', c, e) if e > c else 0
        if n and n == buf.count(_PYFN, c, e):
            return -e, n
        return b, 0
    lo = second if second > 0 else b
    for _ in range(_PY_TRIES):
        p = probe_python(buf, lo, b)
        if p < 0:
            return b, 0
        start = last_boundary(buf, p)
        e = run_end(buf, p, b)
        if start > c and (e - start >= _PY_MIN_RUN or e >= b):  # long, or on into the next slice
            return start, 0
        lo = max(e, p + 1)
    return b, 0


def array_end(buf: bytearray, lo: int, hi: int) -> int:
    """Where in ``buf[lo:hi]`` the events array ends (its last event's ``}``, then ``]``), or
    -1: a skip stops before it, since the keys after the array may hold ``},{`` too."""
    k = buf.find(b"]", lo, hi)
    while k >= 0:
        m = _ARRAY_END.search(buf, max(lo, k - GAP), k + 1)
        if m is not None:
            return m.start()
        k = buf.find(b"]", k + 1, hi)
    return -1


def probe_python(buf: bytearray, lo: int, hi: int) -> int:
    """The first Python event's ``cat`` in ``buf[lo:hi]`` after the last probe that missed
    one: exact for a run longer than the stride, -1 where no probe lands in a run."""
    q = lo
    while q < hi:
        if buf.find(_PYFN, q, min(hi, q + _PY_PROBE)) >= 0:
            return buf.find(_PYFN, max(lo, q - _PY_STRIDE), hi)
        q += _PY_STRIDE
    return -1


def run_end(buf: bytearray, p: int, b: int) -> int:
    """The boundary after the run of Python events holding ``p``: before the first event of
    another category, else ``b`` (the run reaches the slice's end). Probed like the start, and
    the bytes after the last probe searched whole: an event of another category that no probe
    lands on is caught by the caller's count."""
    q = p
    while True:
        hi = q + _PY_PROBE
        if hi >= b:  # the last stretch: search it all
            m = _NOT_PYFN.search(buf, max(p, q - _PY_STRIDE), b)
            break
        # the window reaches past the probe: a match the window's end cuts in two is none
        m = _NOT_PYFN.search(buf, q, hi + 64)
        if m is not None and m.start() < hi:
            m = _NOT_PYFN.search(buf, max(p, q - _PY_STRIDE), b)
            break
        q += _PY_STRIDE
    if m is None:
        return b
    e = last_boundary(buf, m.start())
    return e if e > p else b
