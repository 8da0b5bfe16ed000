"""The bytes of a trace file: gzip inflated incrementally (ISA-L when installed, else zlib), read
ahead in a thread where a second core can run it, and what kind of file a path is (only regular
files are read)."""

from __future__ import annotations

import errno
import os
import queue
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from sidecar.files import not_a_file

try:  # ISA-L's inflate is 2-3x zlib's; same API (python-isal), optional
    from isal import isal_zlib as _inflate
except ImportError:  # pragma: no cover - the fallback is the standard library
    _inflate = zlib  # type: ignore[assignment]

INFLATE_ERRORS: tuple[type[BaseException], ...] = (zlib.error, OSError) + (
    (_inflate.error,) if _inflate is not zlib else ()
)


class GunzipStream:
    """Decompress a gzip file incrementally (ISA-L when installed, else zlib), so the bytes before
    a cut-off end are kept (``gzip.GzipFile.read`` drops them when it raises). ``truncated`` is set
    at such an end."""

    def __init__(self, f: IO[bytes], raw_chunk: int = 1 << 20) -> None:
        self._f = f
        self._d = _inflate.decompressobj(wbits=31)
        self._raw_chunk = raw_chunk
        self.truncated = False

    def read(self, n: int) -> bytes:
        out: list[bytes] = []
        size = 0
        while size < n:
            d = self._d
            if d.eof:  # end of a gzip member: another may follow (concatenated gzip)
                rest = d.unused_data
                if not rest:
                    rest = self._f.read(self._raw_chunk)
                    if not rest:
                        break
                d = self._d = _inflate.decompressobj(wbits=31)
                inp = rest
            elif d.unconsumed_tail:
                inp = d.unconsumed_tail
            else:
                inp = self._f.read(self._raw_chunk)
                if not inp:
                    self.truncated = True  # the stream stops before its end-of-member marker
                    break
            piece = d.decompress(inp, n - size)  # bounded: a 1 MB block can inflate to 100 MB+
            out.append(piece)
            size += len(piece)
        return b"".join(out)

    def close(self) -> None:
        self._f.close()


class ReadAhead:
    """Reads (and decompresses) the next chunks in a thread while the caller decodes this one.
    zlib, ISA-L and file reads release the GIL, so on two cores inflate and decode overlap; the
    queue holds at most ``depth`` chunks (bounded memory). Errors surface on the caller's read."""

    _END = object()

    def __init__(self, src: Any, chunk: int, depth: int = 2) -> None:
        self._src = src
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.truncated = False
        self._done = False
        self._t = threading.Thread(target=self._run, args=(chunk,), name="trace-read-ahead", daemon=True)
        self._t.start()

    def _run(self, chunk: int) -> None:
        try:
            while not self._stop.is_set():
                data = self._src.read(chunk)
                self._put(data)
                if not data:
                    break
        except BaseException as err:  # handed to the reader, which decides what it means
            self._put(err)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def read(self, n: int) -> bytes:
        if self._done:
            return b""
        item = self._q.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if not item:
            self._done = True
            self.truncated = getattr(self._src, "truncated", False)
        return item

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)
        self._src.close()


def not_regular(mode: int) -> str | None:
    """Why a file of this ``st_mode`` is not read (a folder, FIFO, device, socket), or None for a
    regular file: the one wording for the reader and for ``control.artifacts.confined``."""
    kind = not_a_file(mode)
    if kind is None:
        return None
    return f"is {kind}, not a trace file" + ("" if kind == "a folder" else ": not read")


def look(path: str | Path) -> tuple[os.stat_result | None, str | None]:
    """One ``stat`` of ``path`` (links followed): its result, or None and why it cannot be looked at
    (gone, a broken link, a symlink loop). The one wording for every reader and writer of traces."""
    try:
        return os.stat(path), None
    except FileNotFoundError:
        return None, "is a broken symlink (its target is gone)" if os.path.islink(path) else "no such file or folder"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return None, "is a symlink loop (a link that leads back to itself)"
        return None, f"cannot be looked at ({err.strerror or err})"
    except ValueError as err:  # a NUL byte in the name
        return None, f"cannot be looked at ({err})"


def unreadable(path: str | Path) -> str | None:
    """Why ``path`` is not a trace file that can be read (see ``look`` and ``not_regular``), or None."""
    st, why = look(path)
    return why if st is None else not_regular(st.st_mode)


def trace_entries(folder: str | Path, named: Callable[[str], bool]) -> tuple[list[tuple[Path, os.stat_result]], list[tuple[Path, str]]]:
    """Every entry under ``folder`` (links to folders not followed) whose name ``named`` accepts:
    the regular files (with their ``stat``), and each other one with why it is not read (a folder, a
    device, a broken link, a symlink loop), so a trace that cannot be read is said, never lost."""
    files: list[tuple[Path, os.stat_result]] = []
    problems: list[tuple[Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in sorted(filenames + dirnames):
            if not named(name):
                continue
            full = Path(dirpath) / name
            st, why = look(full)
            why = why if st is None else not_regular(st.st_mode)
            if why is None:
                files.append((full, st))  # type: ignore[arg-type]
            else:
                problems.append((full, why))
        dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
    files.sort(key=lambda f: f[0])
    return files, problems
