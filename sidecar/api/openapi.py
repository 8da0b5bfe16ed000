"""The OpenAPI document describes the API as it answers: the error shape on every route and the
statuses each route can give (from the error classes), the JSON-only request bodies, ``Allow`` on
405. ``/docs`` serves Swagger UI from the ``swagger-ui-bundle`` package's files, never a CDN.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from sidecar.errors import (
    ArtifactNotFound,
    BodyTooLarge,
    CaptureActive,
    CaptureNotFound,
    HostNotAllowed,
    InternalError,
    MediaTypeUnsupported,
    MethodNotAllowed,
    RequestError,
    RequestInvalid,
    SidecarError,
    UpstreamError,
    UpstreamUnreachable,
    AuthError,
)

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "details"],
            "properties": {
                "code": {"type": "string", "description": "stable; clients switch on it (docs/api.md)"},
                "message": {"type": "string", "description": "what went wrong and what to do"},
                "details": {"type": "object"},
            },
        }
    },
}


def error(*classes: type[SidecarError], headers: dict[str, Any] | None = None) -> dict[str, Any]:
    codes = ", ".join(f"`{c.code}`" for c in classes)
    out: dict[str, Any] = {
        "description": f"error ({codes})",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SidecarErrorReply"}}},
    }
    if headers:
        out["headers"] = headers
    return out


def _by_status(*classes: type[SidecarError], **headers: Any) -> dict[int | str, dict[str, Any]]:
    grouped: dict[int, list[type[SidecarError]]] = {}
    for cls in classes:
        grouped.setdefault(cls.http_status, []).append(cls)
    return {status: error(*group, headers=headers.get(str(status))) for status, group in sorted(grouped.items())}


_ALLOW = {"405": {"Allow": {"description": "the methods the route takes", "schema": {"type": "string"}}}}
_AUTH = {"401": {"WWW-Authenticate": {"schema": {"type": "string"}}}}

ERROR_RESPONSES: dict[str, dict[int | str, dict[str, Any]]] = {
    # every route: the request guard, schema validation, an unknown method, a bug
    "common": _by_status(RequestError, HostNotAllowed, RequestInvalid, MethodNotAllowed, InternalError, **_ALLOW),
    # routes with a JSON body and a bearer token
    "mutating": _by_status(AuthError, BodyTooLarge, MediaTypeUnsupported, **_AUTH),
    "capture": _by_status(CaptureNotFound),
    "start": _by_status(CaptureActive, UpstreamError, UpstreamUnreachable),
    "download": _by_status(ArtifactNotFound),
}


def responses(*groups: str) -> dict[int | str, dict[str, Any]]:
    """The error responses of the named groups, merged (codes joined where statuses meet)."""
    out: dict[int | str, dict[str, Any]] = {}
    for group in groups:
        for status, resp in ERROR_RESPONSES[group].items():
            if status in out:
                merged = dict(out[status])
                merged["description"] = out[status]["description"] + "; " + resp["description"]
                out[status] = merged
            else:
                out[status] = resp
    return out


def _restrict_stages(model: dict[str, Any] | None, stage_ids: list[int] | None) -> None:
    prop = (model or {}).get("properties", {}).get("stages")
    if prop is None:
        return
    for variant in prop.get("anyOf", [prop]):
        if variant.get("type") == "array":
            variant.update(minItems=1, uniqueItems=True)
            if stage_ids is not None:
                variant["maxItems"] = max(1, len(stage_ids))
                variant["items"] = {"type": "integer", "enum": sorted(stage_ids)}


def _swagger_ui_dir() -> str | None:
    try:
        from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]
    except ImportError:
        return None
    return str(swagger_ui_path)


def install_docs(app: FastAPI, stage_ids: list[int] | None = None) -> None:
    """``/docs`` (Swagger UI from the package) and an ``/openapi.json`` that names the error shape.
    ``stage_ids``: the ids a request may name (the deploy's torch stages), so the document says
    what the API takes: a non-empty list of distinct ids among them."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            comps["SidecarErrorReply"] = ERROR_SCHEMA
            # FastAPI's default 422 schema is its own {"detail": ...}; ours is the error shape
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    for status, resp in op.get("responses", {}).items():
                        ref = resp.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
                        if status == "422" and ref.endswith("/HTTPValidationError"):
                            op["responses"]["422"] = error(RequestInvalid)
            # a JSON `null` body means the defaults, as an omitted one does
            start = schema.get("paths", {}).get("/v1/captures", {}).get("post", {})
            body = start.get("requestBody", {}).get("content", {}).get("application/json", {})
            if "schema" in body:
                body["schema"] = {"anyOf": [body["schema"], {"type": "null"}]}
            if stage_ids is not None:
                for name in ("CaptureRequest", "CompatProfileRequest"):
                    _restrict_stages(comps.get(name), stage_ids)
            _restrict_stages(comps.get("CompatStopRequest"), None)  # any ids: a stop without a capture is a no-op
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    assets = _swagger_ui_dir()
    if assets is not None:
        app.mount("/docs/assets", StaticFiles(directory=assets), name="swagger-ui-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        if assets is None:
            return HTMLResponse(
                "<p>Swagger UI is not installed (pip install swagger-ui-bundle); the API document is at "
                '<a href="/openapi.json">/openapi.json</a>.</p>'
            )
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title} API",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon-32x32.png",
        )


__all__ = ["ERROR_RESPONSES", "ERROR_SCHEMA", "error", "install_docs", "responses"]
