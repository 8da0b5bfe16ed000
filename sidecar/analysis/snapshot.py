"""Read a CUDA memory snapshot (``memory_snapshot_rank<N>.pickle``) safely, and summarise it.

vLLM-Omni writes ``torch.cuda.memory._dump_snapshot`` beside each trace of a stage profiled with
``torch_profiler_with_memory`` on CUDA: a pickle of plain dicts, lists, strings and numbers
(``segments`` with their ``blocks``; ``device_traces``, the allocator's history). A pickle can run
any code on load, and a trace folder is input, so ``read_snapshot`` loads it with an unpickler that
refuses every global (no class, no function: nothing a pickle could call), within the same kind of
limits as the trace reader: at most ``MAX_SNAPSHOT_BYTES`` on disk, ``MAX_ITEMS`` items walked
(references may be shared, so a small file can name a list a million times) and ``MAX_SECONDS``.
Input that breaks one raises ``TraceTooLarge``; anything else unreadable ``TraceError``, naming the
file. ``summarize_snapshot`` gives per device the segments and their use, the largest live blocks
with their allocation stacks, and the peak of the history with what was live at it, computed as
torch's ``_memory_viz`` and MemoryViz read the same dict (docs/summaries.md).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
import time
from pathlib import Path
from typing import Any, NoReturn

from sidecar.analysis.models import SnapshotBlock, SnapshotDevice, SnapshotSummary
from sidecar.analysis.stream import not_regular
from sidecar.errors import TraceError, TraceTooLarge

MAX_SNAPSHOT_BYTES = 64 << 20  # on disk; a pickle of shared references can load to ~8x that
MAX_ITEMS = 5_000_000  # segments, blocks, history entries and frames walked, all together (a real one: < 1M)
MAX_SECONDS = 120.0
TOP_BLOCKS = 10
MAX_FRAMES = 16  # frames kept per block, innermost first, after torch's filter
SNAPSHOT_FILE = re.compile(r"^memory_snapshot_rank(?P<rank>\d+)\.pickle$")
STATES = ("active_allocated", "active_pending_free", "inactive")
# torch.cuda._memory_viz._frame_filter: frames of the interpreter and the allocator itself
_OMIT_FUNCTIONS = ("unwind::unwind", "CapturedTraceback::gather", "gather_with_cpp", "_start", "__libc_start_main",
                   "PyEval_", "PyObject_", "PyFunction_")
_OMIT_FILES = ("core/boxing", "/Register", "/Redispatch", "pythonrun.c", "Modules/main.c", "Objects/call.c",
               "Objects/methodobject.c", "pycore_ceval.h", "ceval.c", "cpython/abstract.h")


class _Refused(pickle.UnpicklingError):
    """A global named in a pickle: refused before it is looked up."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, bytes and numbers only: every global (a class, a
    function, ``os.system``) is refused before it is looked up, so no ``REDUCE``, ``BUILD``,
    ``NEWOBJ`` or ``INST`` can run anything. Persistent ids and out-of-band buffers are refused by
    ``pickle`` itself (no ``persistent_load``, no ``buffers``)."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise _Refused(f"it names the global {module}.{name}; a memory snapshot holds only plain data")


def _fail(path: Path, what: str) -> TraceError:
    return TraceError(f"{path}: {what}", details={"file": str(path)})


def read_snapshot(path: str | Path, *, max_bytes: int = MAX_SNAPSHOT_BYTES) -> dict[str, Any]:
    """The snapshot dict in ``path``, loaded without running anything (see the module docstring).
    A bare list (an old ``_snapshot()`` of segments only) becomes ``{"segments": it}``."""
    p = Path(path)
    try:
        mode = os.lstat(p).st_mode
        if stat.S_ISLNK(mode):  # a link could name any file: a snapshot is read only where it lies
            raise _fail(p, "is a symbolic link: not read")
        why = not_regular(mode)
        if why is not None:
            raise _fail(p, why.replace("trace file", "snapshot"))
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise _fail(p, "no such file") from None
    except OSError as err:
        raise _fail(p, f"cannot be opened ({err.strerror or err})") from None
    with os.fdopen(fd, "rb") as f:
        if not_regular(os.fstat(fd).st_mode) is not None:
            raise _fail(p, "is not a regular file: not read")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TraceTooLarge(
            f"{p}: larger than {max_bytes >> 20} MB, the limit for a memory snapshot; read it with torch's own "
            "tools (python -m torch.cuda._memory_viz stats FILE) on a machine you trust it on",
            details={"file": str(p), "limit_bytes": max_bytes})
    if not data:
        raise _fail(p, "is empty (0 bytes); the profiler may still be writing it")
    try:
        doc = _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as err:
        raise _fail(p, f"refused: not read as a memory snapshot because {err}") from None
    except RecursionError:
        raise _fail(p, "refused: nests deeper than a memory snapshot does") from None
    except MemoryError:
        raise TraceTooLarge(f"{p}: refused: loading it needs more memory than the analysis has",
                            details={"file": str(p), "limit_bytes": max_bytes}) from None
    except Exception as err:  # a pickle cut short or corrupt fails in many ways (EOFError, ValueError, ...)
        raise _fail(p, f"is not a readable pickle ({type(err).__name__}: {err})") from None
    if isinstance(doc, list):
        doc = {"segments": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("segments"), list):
        keys = ", ".join(map(str, list(doc)[:6])) if isinstance(doc, dict) else type(doc).__name__
        raise _fail(p, f"is a pickle but not a CUDA memory snapshot: no 'segments' list (holds: {keys})")
    return doc


class _Walk:
    """The item and time budget of one summary."""

    def __init__(self, path: Path, max_items: int, max_seconds: float) -> None:
        self.path, self.left, self.max_items = path, max_items, max_items
        self.deadline = time.monotonic() + max_seconds
        self.max_seconds = max_seconds

    def items(self, seq: Any) -> list[Any]:
        """``seq`` if it is a list (or tuple) within the budget, else []."""
        if not isinstance(seq, (list, tuple)):
            return []
        self.left -= len(seq)
        if self.left < 0:
            raise TraceTooLarge(f"{self.path}: more than {self.max_items:,} segments, blocks, history entries and "
                                "frames (a memory snapshot holds far fewer)",
                                details={"file": str(self.path), "limit_items": self.max_items})
        if time.monotonic() > self.deadline:
            raise TraceTooLarge(f"{self.path}: not summarised within {self.max_seconds:g}s",
                                details={"file": str(self.path), "limit_seconds": self.max_seconds})
        return list(seq)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _size(d: dict[str, Any]) -> int:
    return max(0, _int(d.get("size")) or 0)


def _keep(f: Any) -> bool:
    if not isinstance(f, dict):
        return False
    name, filename = str(f.get("name", "")), str(f.get("filename", ""))
    return not any(o in name for o in _OMIT_FUNCTIONS) and not any(o in filename for o in _OMIT_FILES)


def frames_text(frames: Any, walk: _Walk) -> list[str]:
    """``file:line:function`` per frame, innermost first, torch's uninteresting frames left out
    (``torch.cuda._memory_viz._frames_fmt``, file names cut to their last part)."""
    out = []
    for f in walk.items(frames):
        if _keep(f):
            out.append(f"{str(f.get('filename', '?')).split('/')[-1]}:{f.get('line', '?')}:{f.get('name', '?')}")
            if len(out) >= MAX_FRAMES:
                break
    return out


# a block or history entry, with what its segment tells about it: (size, it, its stream, its address)
Found = tuple[int, dict[str, Any], Any, Any]


def _block(b: dict[str, Any], walk: _Walk, *, stream: Any, address: Any, requested: bool) -> SnapshotBlock:
    frames = b.get("frames")
    if frames is None and isinstance(b.get("history"), list) and b["history"] and isinstance(b["history"][0], dict):
        frames = b["history"][0].get("frames")  # the snapshot format before torch 2.1
    return SnapshotBlock(size=_size(b), requested_size=_int(b.get("requested_size")) if requested else None,
                         address=_int(address), state=b.get("state") if isinstance(b.get("state"), str) else None,
                         stream=_int(b.get("stream", stream)), frames=frames_text(frames or [], walk))


def _top(found: list[Found], walk: _Walk, requested: bool = True) -> list[SnapshotBlock]:
    found.sort(key=lambda t: -t[0])
    return [_block(b, walk, stream=stream, address=addr, requested=requested) for _, b, stream, addr in found[:TOP_BLOCKS]]


def _history(dev: SnapshotDevice, trace: list[Any], live_at_end: list[Found], walk: _Walk) -> None:
    """The peak of ``device_traces[device]`` as MemoryViz replays it: an ``alloc`` is live until
    its ``free_completed``; a free of an address allocated before the history began, and a block
    still allocated at the end that the history never allocated, were live from its start."""
    elements: list[Found] = []  # alloc entries, and what was live before the history
    live: dict[Any, int] = {}  # addr -> its element, while allocated
    ops: list[tuple[int, int, int]] = []  # (+/- size, element, history index) per change of the total
    initially: list[int] = []
    for t, e in enumerate(trace):
        if not isinstance(e, dict):
            continue
        action = e.get("action")
        if action == "alloc":
            elements.append((_size(e), e, e.get("stream"), e.get("addr")))
            live[e.get("addr")] = len(elements) - 1
            ops.append((_size(e), len(elements) - 1, t))
        elif action == "free_completed":
            k = live.pop(e.get("addr"), None)
            if k is None:  # allocated before the history began
                elements.append((_size(e), e, e.get("stream"), e.get("addr")))
                k = len(elements) - 1
                initially.append(k)
            ops.append((-elements[k][0], k, t))
        elif action == "oom":
            dev.ooms += 1
    for found in live_at_end:
        if found[3] not in live:
            elements.append(found)
            initially.append(len(elements) - 1)
    total = sum(elements[k][0] for k in initially)
    peak, at = total, -1
    for i, (delta, _, _) in enumerate(ops):
        total += delta
        if total > peak:
            peak, at = total, i
    dev.trace_entries = len(trace)
    dev.peak_bytes = peak
    if at >= 0:
        dev.peak_index = ops[at][2]
        t_us = trace[dev.peak_index].get("time_us")
        dev.peak_time_us = float(t_us) if isinstance(t_us, (int, float)) and not isinstance(t_us, bool) else None
    alive = set(initially)
    for delta, k, _ in ops[: at + 1]:
        if delta > 0:
            alive.add(k)
        else:
            alive.discard(k)
    dev.live_at_peak = _top([elements[k] for k in alive], walk, requested=False)


def summarize_snapshot(path: str | Path, *, stage_id: int | None = None, replica: int | None = None,
                       max_bytes: int = MAX_SNAPSHOT_BYTES, max_items: int = MAX_ITEMS,
                       max_seconds: float = MAX_SECONDS) -> SnapshotSummary:
    """The ``SnapshotSummary`` of one snapshot file (see the module docstring); the rank is the
    one in its name."""
    p = Path(path)
    doc = read_snapshot(p, max_bytes=max_bytes)
    walk = _Walk(p, max_items, max_seconds)
    devices: dict[int, SnapshotDevice] = {}
    live_at_end: dict[int, list[Found]] = {}  # active_allocated blocks per device
    for seg in walk.items(doc.get("segments")):
        if not isinstance(seg, dict):
            continue
        did = _int(seg.get("device")) or 0
        dev = devices.setdefault(did, SnapshotDevice(device=did))
        dev.segments += 1
        dev.reserved_bytes += max(0, _int(seg.get("total_size")) or 0)
        at, stream = _int(seg.get("address")), seg.get("stream")  # a block without its address is next in line
        live = live_at_end.setdefault(did, [])
        for b in walk.items(seg.get("blocks")):
            if not isinstance(b, dict):
                continue
            size, state = _size(b), b.get("state")
            addr = _int(b.get("address"))
            if addr is None and at is not None:
                addr = at
            at = None if at is None else at + size
            if state == "active_allocated":
                dev.allocated_bytes += size
                asked = _int(b.get("requested_size"))
                dev.requested_bytes += size if asked is None else asked
                live.append((size, b, stream, addr))
            elif state == "active_pending_free":
                dev.pending_free_bytes += size
            else:
                dev.inactive_bytes += size
    traces = walk.items(doc.get("device_traces"))
    for did, trace in enumerate(traces):
        entries = walk.items(trace)
        if not entries and did not in devices:
            continue
        dev = devices.setdefault(did, SnapshotDevice(device=did))
        _history(dev, entries, live_at_end.get(did, []), walk)
    for did, dev in devices.items():
        dev.largest_blocks = _top(list(live_at_end.get(did, [])), walk)
    m = SNAPSHOT_FILE.match(p.name)
    return SnapshotSummary(file=str(p), stage_id=stage_id, replica=replica, rank=int(m.group("rank")) if m else None,
                           devices=[devices[k] for k in sorted(devices)])


__all__ = ["MAX_SNAPSHOT_BYTES", "SNAPSHOT_FILE", "read_snapshot", "summarize_snapshot"]
