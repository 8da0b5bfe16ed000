"""What a trace event decodes to: the msgspec structs the summary reads (only the fields it needs),
the decoders of a slice of events, and the slow path for a slice they refuse (fields of odd types,
numbers past a float64), which keeps what is usable and counts what it leaves out.

The numbers an event may hold are part of the contract: a ``ts``/``dur`` within ``TIME_LIMIT_US``,
a ``dur`` of a complete event not negative, an allocator figure within 64 bits. Past them the event is left out and counted, so nothing
downstream meets an infinity or an overflow (docs/summaries.md, "Limits").
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Union

import msgspec

# The numbers a trace's events may hold: a ``ts``/``dur`` within ±2^53 µs (285 years: an epoch-µs
# timestamp is 2^51), integers the allocator's figures fit (64 bits). An event past them is left
# out and counted (``unusable``): nothing downstream then meets an infinity or an overflow.
TIME_LIMIT_US = float(1 << 53)
_Time = Annotated[float, msgspec.Meta(ge=-TIME_LIMIT_US, le=TIME_LIMIT_US)]
# a duration is never negative: a slice that holds one takes the slow path, which leaves that event out
_Duration = Annotated[float, msgspec.Meta(ge=0.0, le=TIME_LIMIT_US)]
_I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class EventArgs(msgspec.Struct, gc=False):
    """The ``args`` keys the summary reads; every other key is skipped by the decoder."""

    external_id: int | None = msgspec.field(default=None, name="External id")
    correlation: int | None = None
    device: int | None = None
    stream: int | None = None


class _EventFields(msgspec.Struct, gc=False):
    cat: str | None = None
    name: str = ""
    pid: int | str | None = None
    tid: int | str | None = None
    ts: _Time = 0.0
    dur: _Duration = 0.0
    args: EventArgs | None = None


class TraceEvent(_EventFields, gc=False):
    ph: str = ""


DECODE = msgspec.json.Decoder(list[TraceEvent]).decode


class CompleteEvent(_EventFields, tag_field="ph", tag="X", gc=False):
    """A ``"ph": "X"`` event, for readers that use nothing else (the summary)."""

    ph: ClassVar[str] = "X"


class MemoryArgs(msgspec.Struct, gc=False):
    """The ``args`` of torch's ``[memory]`` / ``[OutOfMemory]`` instant events (profile_memory):
    the allocator's own figures at that event; a free has negative ``Bytes``."""

    device_type: _I64 | None = msgspec.field(default=None, name="Device Type")
    device_id: _I64 | None = msgspec.field(default=None, name="Device Id")
    addr: _I64 | None = msgspec.field(default=None, name="Addr")
    nbytes: _I64 | None = msgspec.field(default=None, name="Bytes")
    total_allocated: _I64 | None = msgspec.field(default=None, name="Total Allocated")
    total_reserved: _I64 | None = msgspec.field(default=None, name="Total Reserved")


class InstantEvent(msgspec.Struct, tag_field="ph", tag="i", gc=False):
    """A ``"ph": "i"`` event, for the summary's reader: torch writes its memory events so (name
    ``[memory]``). Its category is not decoded: every instant reads as ``cpu_instant_event``, and
    the summary tells them apart by name."""

    ph: ClassVar[str] = "i"
    cat: ClassVar[str] = "cpu_instant_event"
    name: str = ""
    pid: int | str | None = None
    tid: int | str | None = None
    ts: _Time = 0.0
    args: MemoryArgs | None = None


def _placeholder(ph: str) -> type:
    """An event of phase ``ph`` decoded to nothing (no strings, no numbers): its phase and a
    ``cat`` of None, so that a loop over complete events passes it by its category alone."""
    ns = {"__annotations__": {"ph": ClassVar[str], "cat": ClassVar[None]}, "ph": ph, "cat": None}
    return type(f"Phase_{ord(ph)}", (msgspec.Struct,), ns, tag_field="ph", tag=ph, gc=False)


# Every phase of the Chrome trace format: flows (s, t, f), instants, counters, metadata... decode
# to empty placeholders (a third of a Kineto trace's events are flows); an unknown phase makes the
# slice take the untyped path, as any odd event does.
# Instants ("i") are decoded whole: torch's memory events are instants.
_PHASES = "B E I C b n e s t f P N O D M V v R c ( )".split()
DECODE_COMPLETE = msgspec.json.Decoder(list[Union[(CompleteEvent, InstantEvent, *map(_placeholder, _PHASES))]]).decode  # type: ignore[misc]
DECODE_ANY = msgspec.json.Decoder().decode


_I64_RANGE = range(-(1 << 63), 1 << 63)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_or_none(v: Any) -> int | None:
    return v if _is_int(v) and v in _I64_RANGE else None


def _time(v: Any) -> float | None:
    """A ``ts``/``dur`` as a float: 0.0 where it is not a number, None where it is one past the
    limit (±inf and NaN too): the event is not usable."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0.0
    return float(v) if -TIME_LIMIT_US <= v <= TIME_LIMIT_US else None


def _finite(v: Any) -> bool:
    """No ±inf or NaN anywhere in ``v`` (JSON has none: the standard library makes them of numbers
    past a float64)."""
    if isinstance(v, float):
        return v - v == 0.0
    if isinstance(v, dict):
        return all(map(_finite, v.values()))
    if isinstance(v, list):
        return all(map(_finite, v))
    return True


def _lenient(doc: Any, err: msgspec.ValidationError) -> list[Any]:
    """Valid JSON that msgspec refuses even untyped (a number past a float64, ``1e400``): the
    standard library reads it (such numbers as ±inf, which the coercion leaves out)."""
    try:
        raw = json.loads(bytes(doc))
    except (ValueError, RecursionError):
        raise err from None
    return raw if isinstance(raw, list) else []


def _coerce_instant(d: dict[str, Any]) -> InstantEvent | None:
    """Slow path for an instant event (a memory event with odd field types): keep what is usable
    (None: its ``ts`` or an allocator figure is a number past the limits)."""
    a = d.get("args")
    args = None
    if isinstance(a, dict):
        vals = [a.get(k) for k in ("Device Type", "Device Id", "Addr", "Bytes", "Total Allocated", "Total Reserved")]
        if any(_is_int(v) and v not in _I64_RANGE for v in vals):
            return None  # an allocator figure past 64 bits
        args = MemoryArgs(*map(_int_or_none, vals))
    ts, pid, tid = _time(d.get("ts")), d.get("pid"), d.get("tid")
    if ts is None:
        return None
    return InstantEvent(
        name=str(d.get("name", "")),
        pid=pid if isinstance(pid, (int, str)) else None,
        tid=tid if isinstance(tid, (int, str)) else None,
        ts=ts,
        args=args,
    )


def _coerce(d: Any) -> TraceEvent | None:
    """Slow path for an event whose fields have unexpected types: keep what is usable (None: its
    ``ts`` or ``dur`` is a number past the limit, or it is a complete event of a negative ``dur``)."""
    if not isinstance(d, dict):
        return None
    a = d.get("args")
    args = None
    if isinstance(a, dict):
        args = EventArgs(
            external_id=_int_or_none(a.get("External id")),
            correlation=_int_or_none(a.get("correlation")),
            device=_int_or_none(a.get("device")),
            stream=_int_or_none(a.get("stream")),
        )
    ts, dur = _time(d.get("ts")), _time(d.get("dur"))
    if ts is None or dur is None:
        return None
    if dur < 0:  # no span ends before it starts: a complete event of one is not usable, elsewhere dur means nothing
        if d.get("ph") == "X":
            return None
        dur = 0.0
    pid, tid = d.get("pid"), d.get("tid")
    return TraceEvent(
        ph=d.get("ph") if isinstance(d.get("ph"), str) else "",
        cat=d.get("cat") if isinstance(d.get("cat"), str) else None,
        name=str(d.get("name", "")),
        pid=pid if isinstance(pid, (int, str)) else None,
        tid=tid if isinstance(tid, (int, str)) else None,
        ts=ts,
        dur=dur,
        args=args,
    )


def decode_lenient(doc: Any, *, complete_only: bool) -> tuple[list[Any], int, int]:
    """A slice the typed decoder refused (valid JSON, a field of an odd type): its events as
    ``TraceEvent`` (``complete_only``: complete events as ``TraceEvent``, instants as
    ``InstantEvent``, the other phases passed over), the count of those passed over, and of those
    left out for a number past the limits."""
    try:
        raw = DECODE_ANY(doc)
    except msgspec.ValidationError as err:
        raw = _lenient(doc, err)
    events = [d for d in raw if isinstance(d, dict)]
    if complete_only:
        wanted = [d for d in events if d.get("ph") in ("X", "i")]
        out = [e for e in (_coerce_instant(d) if d.get("ph") == "i" else _coerce(d) for d in wanted) if e is not None]
    else:
        wanted = events
        out = [e for e in map(_coerce, wanted) if e is not None]
    return out, len(events) - len(wanted), len(wanted) - len(out)


def decode_raw(doc: Any) -> tuple[list[dict[str, Any]], int]:
    """A slice's events as dicts, as they are (``slim``, ``timeline``), and how many were left out:
    those holding a number past a float64, which no JSON number can be written as."""
    try:
        raw = DECODE_ANY(doc)
    except msgspec.ValidationError as err:
        events = [e for e in _lenient(doc, err) if isinstance(e, dict)]
        out = [e for e in events if _finite(e)]
        return out, len(events) - len(out)
    return [e for e in raw if isinstance(e, dict)], 0
