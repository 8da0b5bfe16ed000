"""Upstream layer (docs/design.md §2): an async client for one vLLM-Omni / vLLM server."""

from __future__ import annotations

from sidecar._lazy import lazy_exports

# each module -> the public names it defines, imported on first use (sidecar/_lazy.py): importing
# one submodule of sidecar.upstream does not import the others
_EXPORTS = {
    "sidecar.upstream.server": ("Flavor", "ProbeResult", "UpstreamServer", "UpstreamTimeouts"),
}

__all__, __getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
