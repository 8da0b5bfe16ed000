"""What the routes of one app share, and how they reach it: ``ApiState`` (the controller, the deploy,
the settings, the upstream, the scrubber, the bearer check) is built by ``create_app`` and kept on
``app.state.api``; a route asks for it with the ``Api`` dependency, and a route that needs the
token lists ``TOKEN`` in its ``dependencies``. No route closes over the factory's locals.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from sidecar.api.auth import BearerAuth
from sidecar.api.metrics import Metrics
from sidecar.api.responses import SafeJSONResponse
from sidecar.config.models import DeployConfig
from sidecar.control.models import Capture
from sidecar.scrub import Scrubber

if TYPE_CHECKING:
    from sidecar.config.settings import SidecarSettings
    from sidecar.control.controller import CaptureController
    from sidecar.upstream.server import UpstreamServer


@dataclass
class ApiState:
    controller: CaptureController
    deploy: DeployConfig
    settings: SidecarSettings | None
    upstream: UpstreamServer | None
    scrubber: Scrubber
    auth: BearerAuth
    metrics: Metrics
    hold_max_s: float  # the longest a GET ?until=started is held (the sidecar's hold_max_s)
    stages: dict[str, Any]  # GET /v1/stages: the deploy is fixed for the app's lifetime, so built once
    # one builder per capture's timeline at a time, however many requests ask for it
    timeline_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # the controller's close, once begun (app.begin_shutdown): the shutdown signal and the lifespan share it
    closing: asyncio.Task[None] | None = None

    def capture_json(self, cap: Capture) -> dict[str, Any]:
        return self.scrubber.data(cap.model_dump(mode="json"))

    def capture_response(self, cap: Capture, status: int = 200) -> SafeJSONResponse:
        return SafeJSONResponse(self.capture_json(cap), status_code=status)


def api_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.api
    return state


async def require_token(request: Request) -> None:
    """``Authorization: Bearer <token>`` when the sidecar has a ``--token-file`` (401 otherwise)."""
    await api_state(request).auth(request)


Api = Annotated[ApiState, Depends(api_state)]
TOKEN = Depends(require_token)  # for a route's ``dependencies=[TOKEN]``

__all__ = ["Api", "ApiState", "TOKEN", "api_state", "require_token"]
