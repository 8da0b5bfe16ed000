"""What a path that is no regular file is, in a user's words: the one wording for every reader of a
file the user names (traces, deploy and verl YAMLs, profiles) and for the folders the sidecar lists."""

from __future__ import annotations

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
