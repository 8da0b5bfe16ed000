"""Per-replica trace dirs: ``{replica}`` and ``{host}`` placeholders in ``render --dir``, expanded at
render time (``/data/perf/{host}/replica{replica}`` -> ``/data/perf/node7/replica1``). The server
never expands them: a deploy that still holds one makes a folder literally named ``{replica}``,
shared by every replica, so ``validate`` refuses it (``profiler_dir_placeholder``).
"""

from __future__ import annotations

import re
import socket

from sidecar.errors import DirPlaceholderUnknown, DirPlaceholderUnset

__all__ = ["DIR_PLACEHOLDERS", "dir_placeholders", "expand_dir_placeholders"]

DIR_PLACEHOLDERS = ("replica", "host")
# `{name}` with an identifier inside; any other brace is refused when a dir is expanded.
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def dir_placeholders(path: str) -> list[str]:
    """The ``{name}`` placeholders left in ``path`` (known or not), in order, each once."""
    return list(dict.fromkeys(_PLACEHOLDER.findall(path)))


def expand_dir_placeholders(template: str, *, replica: int | None = None, host: str | None = None,
                            what: str = "--dir") -> str:
    """``template`` with ``{replica}`` (needs ``replica``) and ``{host}`` (``host``, else this
    machine's hostname) filled in; ``ConfigError`` for a missing value, an unknown placeholder or a
    brace that is no placeholder (``{0}``, an unclosed ``{replica``). ``what`` names the template in
    the messages (``--dir``, or a kept stage dir)."""
    names = dir_placeholders(template)
    unknown = [n for n in names if n not in DIR_PLACEHOLDERS]
    if unknown:
        raise DirPlaceholderUnknown(
            f"{what} {template!r}: unknown placeholder {{{unknown[0]}}}; the supported ones are "
            + ", ".join(f"{{{n}}}" for n in DIR_PLACEHOLDERS),
            key="dir",
            details={"placeholders": unknown},
        )
    if "replica" in names and replica is None:
        raise DirPlaceholderUnset(
            f"{what} {template!r} holds {{replica}}: pass --replica N (the index of the server this overlay is for, "
            "0, 1, ...), one render per replica",
            key="replica",
        )
    if replica is not None and (isinstance(replica, bool) or replica < 0):
        raise DirPlaceholderUnset(f"--replica must be a non-negative integer, got {replica!r}", key="replica")
    # A brace that is no known placeholder (`{0}`, an unclosed `{replica`) would reach the disk as is.
    stray = _PLACEHOLDER.sub("", template)
    if "{" in stray or "}" in stray:
        raise DirPlaceholderUnknown(
            f"{what} {template!r}: a brace that is no placeholder; the supported ones are "
            + ", ".join(f"{{{n}}}" for n in DIR_PLACEHOLDERS)
            + ", each written whole (a path here may hold no other brace)",
            key="dir",
            details={"placeholders": [], "supported": list(DIR_PLACEHOLDERS)},
        )
    values = {"replica": str(replica), "host": host or socket.gethostname()}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
