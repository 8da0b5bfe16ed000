"""Errors leave the API as one shape, ``{"error": {"code", "message", "details"}}``, with the status
the error's class declares (``SidecarError.http_status``, inherited along the MRO): typed errors,
FastAPI's request validation and plain 404/405s alike. There is no table of codes to forget: a new
error class inherits its family's status. Secret values are scrubbed from anything that leaves.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sidecar.api.responses import SafeJSONResponse
from sidecar.errors import (
    AuthError,
    BodyTooLarge,
    InternalError,
    MethodNotAllowed,
    RequestError,
    RequestInvalid,
    RouteNotFound,
    SidecarError,
    error_classes,
)
from sidecar.scrub import Scrubber

# Starlette's own HTTP errors (no route, wrong method, ...) → the class that stands for them.
_HTTP_ERRORS: dict[int, type[SidecarError]] = {
    404: RouteNotFound,
    405: MethodNotAllowed,
    401: AuthError,
    413: BodyTooLarge,
}


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details or {}}}


def error_response(
    err: SidecarError,
    *,
    scrubber: Scrubber | None = None,
    status: int | None = None,
    headers: dict[str, str] | None = None,
) -> SafeJSONResponse:
    """The reply for ``err``: its body, and its class's status unless ``status`` overrides it."""
    payload = err.to_dict()
    body = error_body(payload["code"], payload["message"], payload["details"])
    if scrubber is not None:
        body = scrubber.data(body)
    if isinstance(err, AuthError):
        headers = {"WWW-Authenticate": "Bearer", **(headers or {})}
    return SafeJSONResponse(body, status_code=status or err.http_status, headers=headers)


def status_table() -> list[tuple[int, str, str]]:
    """``(status, code, class name)`` of every error class in ``sidecar.errors``, by status then code: the
    reference table docs/api.md shows (``python -m sidecar.api.errors`` prints it)."""
    rows = {(c.http_status, c.code, c.__name__) for c in error_classes() if c.__module__ == "sidecar.errors"}
    return sorted(rows)


def _methods_of(request: Request) -> list[str]:
    path = request.url.path
    methods: set[str] = set()
    for route in request.app.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(path) and getattr(route, "methods", None):
            methods |= set(route.methods)
    return sorted(methods)


def install_error_handlers(app: FastAPI, scrubber: Scrubber) -> None:
    """Every error leaves as ``{"error": {...}}``; clients never see FastAPI's ``{"detail": ...}``."""

    async def sidecar_error(_: Request, err: Exception) -> SafeJSONResponse:
        assert isinstance(err, SidecarError)
        return error_response(err, scrubber=scrubber)

    async def validation_error(_: Request, err: Exception) -> SafeJSONResponse:
        assert isinstance(err, RequestValidationError)
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in err.errors()
        ]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # no JSON at all: say why (sidecar/api/bodies.py), not "decode error"
            why = (err.errors()[0].get("ctx") or {}).get("error") or first["msg"]
            first["msg"] = why
            return error_response(
                RequestInvalid(
                    f"the body is not JSON the API reads: {why}. Send one JSON object, e.g. curl -H "
                    """'content-type: application/json' -d '{"stages": [0]}' (see /docs for the request schema)""",
                    details={"errors": [first]},
                ),
                scrubber=scrubber,
            )
        where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        return error_response(
            RequestInvalid(
                f"invalid request: {where}: {first['msg']} (see /docs for the request schema)",
                details={"errors": errors},
            ),
            scrubber=scrubber,
        )

    async def http_error(request: Request, err: Exception) -> SafeJSONResponse:
        assert isinstance(err, StarletteHTTPException)
        carried = getattr(err, "error", None)  # the guard's streamed-body limit carries its own error
        if isinstance(carried, SidecarError):
            return error_response(carried, scrubber=scrubber)
        message = err.detail if isinstance(err.detail, str) else "request failed"
        if err.status_code == 404 and message == "Not Found":
            message = "no such route; see /docs for the API"
        headers = dict(getattr(err, "headers", None) or {})
        if err.status_code == 405:
            # Starlette names the methods of the first route on the path only; GET and POST
            # /v1/captures are two routes, and Allow must name every method the path takes
            allowed = _methods_of(request)
            headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not allowed here; use {' or '.join(allowed)}"
        cls = _HTTP_ERRORS.get(err.status_code, RequestError)
        return error_response(cls(message), scrubber=scrubber, status=err.status_code, headers=headers or None)

    async def unexpected(_: Request, err: Exception) -> SafeJSONResponse:
        # a bug: logged with its traceback by uvicorn; the client gets the shape, not the trace
        return error_response(
            InternalError(f"internal error ({type(err).__name__}); see the sidecar log"), scrubber=scrubber
        )

    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(SidecarError, sidecar_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


if __name__ == "__main__":  # the table of docs/api.md
    print("| status | code | class |\n|---|---|---|")
    for status, code, name in status_table():
        print(f"| {status} | `{code}` | `{name}` |")
