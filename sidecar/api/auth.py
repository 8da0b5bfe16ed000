"""Bearer-token check for mutating routes. The token comes from ``--token-file`` (read by
``SidecarSettings.read_token``); with no token configured every route is open (the default bind
is 127.0.0.1). Comparison is constant-time; the token is never logged or echoed.
"""

from __future__ import annotations

import hmac
from fastapi import Request

from sidecar.errors import AuthError


class BearerAuth:
    """FastAPI dependency: ``Authorization: Bearer <token>`` must match when a token is set."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    async def __call__(self, request: Request) -> None:
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise AuthError("this route needs `Authorization: Bearer <token>` (the token in the sidecar's --token-file)")
        if not hmac.compare_digest(given.strip().encode(), self._token):
            raise AuthError("bearer token rejected; use the token in the sidecar's --token-file")
