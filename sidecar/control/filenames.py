"""File names as the OS gives them, made safe to show and to send (docs/captures.md, "File names").

A name on disk is bytes; Python hands over the ones that are not UTF-8 with each bad byte as a
lone surrogate (``os.fsdecode``), which no JSON or HTTP encoder accepts. Inside the sidecar a name
stays that string (it opens the file). Leaving it, a name has two forms: ``shown`` (valid text,
each undecodable byte as ``\\xNN``) and, only for such names, ``quoted``: the name's bytes
percent-encoded, exactly the path a download URL carries, and what the journal keeps so the name
comes back byte for byte (``unquote``).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote as _quote
from urllib.parse import unquote_to_bytes


def is_text(name: str) -> bool:
    """Whether ``name`` is valid text (no undecodable byte in it)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown(name: str) -> str:
    """``name`` as valid text: each byte that is not UTF-8 written ``\\xNN``."""
    if is_text(name):
        return name
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def quoted(name: str) -> str | None:
    """The bytes of a name that is not valid text, percent-encoded (``/`` kept); None otherwise."""
    return None if is_text(name) else _quote(os.fsencode(name), safe="/")


def unquote(text: str) -> str:
    """The name whose ``quoted`` form is ``text``."""
    return os.fsdecode(unquote_to_bytes(text))


def shown_data(data: Any) -> Any:
    """``data`` (JSON-shaped) with every string made valid text by ``shown``."""
    if isinstance(data, str):
        return shown(data)
    if isinstance(data, dict):
        return {shown(k) if isinstance(k, str) else k: shown_data(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [shown_data(v) for v in data]
    return data


__all__ = ["is_text", "quoted", "shown", "shown_data", "unquote"]
