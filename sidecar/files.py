"""What a path that is no regular file is, in a user's words: the one wording for every reader of a
file the user names (traces, deploy and verl YAMLs, profiles) and for the folders the sidecar lists."""

from __future__ import annotations

import os
import stat

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_file(mode: int) -> str | None:
    """What a path of ``st_mode`` ``mode`` is when it is no regular file ("a folder", "a character
    device", ...), None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


class FileProblem(Exception):
    """Why a small file the user named was not read: ``kind`` (``missing``, ``unopenable``,
    ``not_a_file``, ``unreadable``, ``too_large``) and ``why``, worded to follow its path."""

    def __init__(self, kind: str, why: str, *, what: str | None = None) -> None:
        super().__init__(why)
        self.kind, self.why, self.what = kind, why, what  # what: the non-file's kind ("a folder", ...)


def read_bounded(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them (``FileProblem``
    otherwise). One observation: opened without blocking (a FIFO would wait for a writer), then
    what was opened is checked, and never more than ``limit + 1`` bytes are read (a file may grow)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileProblem("missing", "does not exist") from None
    except OSError as exc:
        raise FileProblem("unopenable", f"cannot be opened ({exc.strerror or exc})") from None
    try:
        what = not_a_file(os.fstat(fd).st_mode)
        if what is not None:
            raise FileProblem("not_a_file", f"is {what}", what=what)
        data = os.read(fd, limit + 1)
    except OSError as exc:
        raise FileProblem("unreadable", f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileProblem("too_large", f"is larger than {limit:,} bytes")
    return data
