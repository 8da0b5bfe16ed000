"""A stand-in vLLM-Omni 0.30 server that profiles for real on CPU (docs/design.md §2, §3).

``EmulatorProcess`` / ``free_port`` (from ``launcher``) start one as a child process and import
neither torch nor FastAPI; the server lives in ``server`` / ``app``, stage workers in ``worker``.
Exports are lazy so worker processes do not pay for the launcher's imports.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EmulatorProcess", "EmulatorStartError", "free_port"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("sidecar.emulator.launcher"), name)
    raise AttributeError(f"module 'sidecar.emulator' has no attribute {name!r}")
