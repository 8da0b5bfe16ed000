"""``GET /v1/captures/{id}/files/<session folder>/<file>``: one artifact the capture listed,
resolved at serve time and confined to its session folders (the controller's rule). It returns
trace content, so with ``--token-file`` it needs the bearer token like the mutating routes."""

from __future__ import annotations

import os
from urllib.parse import unquote_to_bytes

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from sidecar.api.openapi import responses
from sidecar.api.state import TOKEN, Api
from sidecar.control import filenames

router = APIRouter(tags=["captures"])


def _raw_relpath(request: Request, capture_id: str, relpath: str) -> str:
    """``relpath`` as the bytes the client sent: the server decodes a URL's ``%FF`` to U+FFFD, so a
    file name that is not UTF-8 (listed with its ``name_quoted``) is taken from the raw path."""
    raw = request.scope.get("raw_path")
    if not isinstance(raw, bytes) or "\ufffd" not in relpath:
        return relpath
    head = f"/v1/captures/{capture_id}/files/".encode()
    path = unquote_to_bytes(raw.split(b"?", 1)[0])
    at = path.find(head)
    return os.fsdecode(path[at + len(head):]) if at >= 0 else relpath


@router.get(
    "/v1/captures/{capture_id}/files/{relpath:path}",
    dependencies=[TOKEN],
    summary="Download one artifact, confined to the capture's session folders",
    responses={
        **responses("token", "capture", "download"),
        200: {"description": "the file",
              "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
    },
    response_class=FileResponse,
)
async def download(api: Api, request: Request, capture_id: str, relpath: str) -> FileResponse:
    path = api.controller.artifact_path(capture_id, _raw_relpath(request, capture_id, relpath))
    return FileResponse(path, filename=filenames.shown(path.name))
