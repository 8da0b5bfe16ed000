"""A stand-in vLLM-Omni 0.30 server that profiles for real on CPU (docs/design.md §2, §3).

``EmulatorProcess`` / ``free_port`` (from ``launcher``) start one as a child process and import
neither torch nor FastAPI; the server lives in ``server`` / ``app``, stage workers in ``worker``.
Exports are lazy so worker processes do not pay for the launcher's imports.
"""

from __future__ import annotations

from sidecar._lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__, globals(), {"sidecar.emulator.launcher": ("EmulatorProcess", "EmulatorStartError", "free_port")}
)
