"""A stand-in vLLM-Omni 0.30 server that profiles for real on CPU (DESIGN.md §2, §3).

``EmulatorProcess`` / ``free_port`` (from ``launcher``) start one as a child process and import
neither torch nor FastAPI; the server itself lives in ``server`` / ``app``, workers in ``worker``.
"""

from sidecar.emulator.launcher import EmulatorProcess, EmulatorStartError, free_port

__all__ = ["EmulatorProcess", "EmulatorStartError", "free_port"]
