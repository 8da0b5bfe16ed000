"""The one table mapping error codes to HTTP status, and the error body every reply uses:
``{"error": {"code", "message", "details"}}`` — for typed errors, FastAPI's request validation
and plain 404/405s alike. Secret values are scrubbed from anything that leaves the process.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sidecar.errors import SidecarError
from sidecar.scrub import Scrubber

# code → HTTP status. Unknown codes of a known family fall back on the family default below.
STATUS_BY_CODE: dict[str, int] = {
    # request / stage selection: the caller must change the request
    "request_invalid": 422,
    "stage_selection_invalid": 422,
    "stages_empty": 422,
    "stage_duplicate": 422,
    "stage_unknown": 422,
    "stage_not_profiled": 422,
    "stage_not_torch": 422,
    "stage_set_mismatch": 409,
    # captures
    "capture_active": 409,
    "capture_state": 409,
    "capture_not_terminal": 409,
    "capture_not_found": 404,
    "artifact_not_found": 404,
    "summary_unavailable": 404,
    "capture_error": 500,
    # upstream: the server behind us failed or is not there
    "upstream_not_ready": 503,
    "upstream_unreachable": 503,  # never delivered: the server is not there (yet)
    "upstream_timeout": 502,  # ambiguous; the controller rolled back
    "upstream_failed": 502,
    # config
    "config_invalid": 422,
    "config_unreadable": 422,
    "validation_failed": 422,
    "trace_invalid": 422,
    # surfaces
    "unauthorized": 401,
    "not_found": 404,
    "internal_error": 500,
    "method_not_allowed": 405,
}



def status_for(code: str) -> int:
    return STATUS_BY_CODE.get(code, 500)


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details or {}}}


def error_response(
    code: str,
    message: str,
    details: dict[str, Any] | None = None,
    *,
    scrubber: Scrubber | None = None,
    status: int | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = error_body(code, message, details)
    if scrubber is not None:
        body = scrubber.data(body)
    return JSONResponse(body, status_code=status or status_for(code), headers=headers)


def install_error_handlers(app: FastAPI, scrubber: Scrubber) -> None:
    """Every error leaves as ``{"error": {...}}``; clients never see FastAPI's ``{"detail": ...}``."""

    async def sidecar_error(_: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, SidecarError)
        payload = err.to_dict()
        headers = {"WWW-Authenticate": "Bearer"} if payload["code"] == "unauthorized" else None
        return error_response(
            payload["code"], payload["message"], payload["details"], scrubber=scrubber, headers=headers
        )

    async def validation_error(_: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, RequestValidationError)
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in err.errors()
        ]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        return error_response(
            "request_invalid",
            f"invalid request: {where}: {first['msg']} (see /docs for the request schema)",
            {"errors": errors},
            scrubber=scrubber,
        )

    async def http_error(_: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}.get(
            err.status_code, "http_error"
        )
        message = err.detail if isinstance(err.detail, str) else "request failed"
        if err.status_code == 404 and message == "Not Found":
            message = "no such route; see /docs for the API"
        return error_response(
            code, message, None, scrubber=scrubber, status=err.status_code, headers=getattr(err, "headers", None)
        )

    async def unexpected(_: Request, err: Exception) -> JSONResponse:
        # a bug: logged with its traceback by uvicorn; the client gets the shape, not the trace
        return error_response(
            "internal_error", f"internal error ({type(err).__name__}); see the sidecar log", scrubber=scrubber
        )

    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(SidecarError, sidecar_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
