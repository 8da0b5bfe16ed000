"""Upstream layer (docs/design.md §2): an async client for one vLLM-Omni / vLLM server."""

from sidecar.upstream.server import Flavor, ProbeResult, UpstreamServer, UpstreamTimeouts

__all__ = ["Flavor", "ProbeResult", "UpstreamServer", "UpstreamTimeouts"]
