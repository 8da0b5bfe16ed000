"""The OpenAPI document describes the API as it answers: the error shape on every route and the
statuses each route can give (from the error classes), the JSON-only request bodies, ``Allow`` on
405. ``/docs`` serves Swagger UI from the ``swagger-ui-bundle`` package's files, never a CDN.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
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
    # reads that run an analysis or return trace content: the bearer token too
    "token": _by_status(AuthError, **_AUTH),
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


def _nullable_body(op: dict[str, Any]) -> None:
    """The operation's JSON body as ``anyOf: [<its model>, null]``, however FastAPI wrote it."""
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
    schema = body.get("schema")
    if schema is None:
        return
    model = next((s for s in schema.get("anyOf", [schema]) if "$ref" in s), None)
    if model is not None:
        body["schema"] = {"anyOf": [{"$ref": model["$ref"]}, {"type": "null"}]}


def _documented(routes: Iterable[Any]) -> list[Any]:
    """The routes as the document shows them: the HEAD every GET route answers (app.py) is that GET
    without its body, not an operation of its own."""
    shown = []
    for route in routes:
        methods = getattr(route, "methods", None)
        if methods and {"GET", "HEAD"} <= methods:
            route = copy.copy(route)
            route.methods = methods - {"HEAD"}
        shown.append(route)
    return shown


def install_docs(app: FastAPI, stage_ids: list[int] | None = None, nullable_bodies: Iterable[str] = ()) -> None:
    """``/docs`` (Swagger UI from the package) and an ``/openapi.json`` that names the error shape.
    ``stage_ids``: the ids a request may name (the deploy's torch stages), so the document says
    what the API takes: a non-empty list of distinct ids among them. ``nullable_bodies``: the
    POST routes whose body may be JSON ``null`` (the defaults, as no body)."""
    nullable_bodies = tuple(nullable_bodies)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=_documented(app.routes)
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
            for path in nullable_bodies:
                _nullable_body(schema.get("paths", {}).get(path, {}).get("post", {}))
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


def describe_kinds(app: FastAPI, deploy: Any) -> None:
    """The document says which stages each capture ``kind`` takes (torch: ``profiler: torch``
    stages, nsys: ``profiler: cuda`` ones): ``CaptureRequest`` is one variant per kind that has
    stages in this deploy, so a schema-valid body is not refused ``stage_not_torch`` /
    ``stage_not_cuda``. Wraps the document ``install_docs`` builds (call it after)."""
    ids = {kind: sorted(s.stage_id for s in deploy.stages if s.profiler == profiler)
           for kind, profiler in (("torch", "torch"), ("nsys", "cuda"))}
    capped = any(s.profiler_config is not None and s.profiler_config.max_iterations > 0 for s in deploy.stages)
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        comps = schema.get("components", {}).get("schemas", {})
        model = comps.get("CaptureRequest")
        if model is None or "anyOf" in model:
            return schema
        variants = []
        for kind, stage_ids in ids.items():
            if not stage_ids and kind != "torch":
                continue
            variant = copy.deepcopy(model)
            props = variant.setdefault("properties", {})
            props["kind"] = {**props.get("kind", {}), "enum": [kind]}
            if kind != "torch":  # the default is torch: an nsys capture says so
                variant["required"] = sorted({*variant.get("required", []), "kind"})
            stages = props.get("stages", {})
            for option in stages.get("anyOf", [stages]):
                if option.get("type") == "array" and stage_ids:
                    option.update(minItems=1, uniqueItems=True, maxItems=len(stage_ids),
                                  items={"type": "integer", "enum": stage_ids})
            if kind == "torch" and not capped and "steps" in props:
                # no stage ends its own window (max_iterations): a steps window is refused unless
                # counted by name (steps_unbounded), so the document asks for steps_bound: count
                counted = copy.deepcopy(variant)
                counted["properties"]["steps_bound"] = {"type": "string", "enum": ["count"]}
                counted["required"] = sorted({*counted.get("required", []), "steps", "steps_bound"})
                variant["properties"]["steps"] = {"type": "null", "description": "(no stage of this deploy ends "
                                                  "its own window: a steps window needs steps_bound: count)"}
                variants.append(counted)
            variants.append(variant)
        comps["CaptureRequest"] = {"title": model.get("title", "CaptureRequest"),
                                   "description": model.get("description", ""), "anyOf": variants}
        plan = comps.get("PlanRequest", {}).get("properties", {}).get("stages", {})
        for option in plan.get("anyOf", [plan]):  # a plan probes torch stages, each once
            if option.get("type") == "array" and ids["torch"]:
                option.update(minItems=1, uniqueItems=True, maxItems=len(ids["torch"]),
                              items={"type": "integer", "enum": ids["torch"]})
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["ERROR_RESPONSES", "ERROR_SCHEMA", "describe_kinds", "error", "install_docs", "responses"]
