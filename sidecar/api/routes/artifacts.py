"""``GET /v1/captures/{id}/files/<session folder>/<file>``: one artifact the capture listed,
resolved at serve time and confined to its session folders (the controller's rule). It returns
trace content, so with ``--token-file`` it needs the bearer token like the mutating routes."""

from __future__ import annotations

import mimetypes
import os
from urllib.parse import unquote_to_bytes

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from starlette.exceptions import HTTPException

from sidecar.api.openapi import responses
from sidecar.api.state import TOKEN, Api
from sidecar.control import filenames
from sidecar.errors import ArtifactNotFound

router = APIRouter(tags=["captures"])

# A file is whatever was written into a session folder (a `.html` or `.svg` too): as an attachment,
# sandboxed (and unsniffed, as every reply: sidecar/api/guard.py) it is never a page of the
# sidecar's origin, whose scripts could call the API.
DOWNLOAD_HEADERS = {"Content-Security-Policy": "default-src 'none'; sandbox"}

try:  # Starlette that answers Range requests (0.39 on) reads them with these; older ones send the whole file
    from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable

    _RANGES: tuple[type[Exception], type[Exception]] | None = (MalformedRangeHeader, RangeNotSatisfiable)
except ImportError:  # pragma: no cover
    _RANGES = None


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


def _media_type(name: str) -> str | None:
    """What the file is, as sent: ``trace_rank0.json.gz`` is gzip bytes, never JSON (the server
    sends no ``Content-Encoding``). None: guessed from the name."""
    kind, encoding = mimetypes.guess_type(name)
    if encoding == "gzip":
        return "application/gzip"
    if encoding is not None:
        return "application/octet-stream"
    return kind


def _check_range(request: Request, size: int) -> None:
    """A ``Range`` the file cannot answer, in the API's error shape: past the end, 416 with
    ``Content-Range: bytes */size``; one that is not a byte range this server reads (another unit,
    no range in it, a start after its end) is ignored, as RFC 9110 lets it: the whole file, 200."""
    value = request.headers.get("range")
    if value is None or _RANGES is None:
        return
    malformed, unsatisfiable = _RANGES
    try:
        FileResponse._parse_range_header(value, size)  # type: ignore[attr-defined]
    except unsatisfiable:
        raise HTTPException(416, f"range {value!r} is past the end of the file ({size} bytes)",
                            headers={"Content-Range": f"bytes */{size}"}) from None
    except malformed:
        request.scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"range"]


def _send(api: Api, request: Request, capture_id: str, relpath: str) -> FileResponse:
    path = api.controller.artifact_path(capture_id, _raw_relpath(request, capture_id, relpath))
    try:
        st = os.stat(path)
    except OSError:  # gone since it was resolved: a 404 as any other, never the response's 500
        raise ArtifactNotFound(f"{relpath!r} of capture {capture_id} is gone",
                               details={"capture_id": capture_id, "path": relpath}) from None
    _check_range(request, st.st_size)
    return FileResponse(path, filename=filenames.shown(path.name), media_type=_media_type(path.name),
                        stat_result=st, headers=DOWNLOAD_HEADERS)


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
    return _send(api, request, capture_id, relpath)
