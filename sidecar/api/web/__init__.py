"""The web page the sidecar serves beside its API: ``/`` (captures), ``/captures/{id}`` (one
capture) and ``/stages`` all answer the same HTML shell; ``/web/<file>`` serves its static assets
from this package. The page only calls the JSON API, so it holds no rule of its own; nothing is
fetched from outside (the Content-Security-Policy says so to the browser too).
"""

from __future__ import annotations

import html
import mimetypes
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import FileResponse, HTMLResponse

import sidecar

STATIC = Path(__file__).with_name("static")
# the assets that exist when the package is built: a name outside this set is a 404, so the route
# can never be steered out of the folder
ASSETS = frozenset(p.name for p in STATIC.iterdir() if p.is_file() and p.name != "index.html")
MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}

# 'self' only: the page's own scripts, styles and the API. Opening ui.perfetto.dev is a new tab
# (window.open), which CSP does not govern; the trace is handed over by postMessage, not uploaded.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'self'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {  # nosniff and no framing: every reply's (sidecar/api/guard.py)
    "Content-Security-Policy": CSP,
    "Referrer-Policy": "no-referrer",
}

router = APIRouter(include_in_schema=False)


def _auth_required(request: Request) -> bool:
    """Whether the API wants the bearer token (the app's own check, ``sidecar.api.state``)."""
    api = getattr(request.app.state, "api", None)
    return bool(api is not None and api.auth.enabled)


def _shell(request: Request) -> HTMLResponse:
    # relative URLs everywhere + <base>: the page also works behind a proxy that mounts it on a prefix
    base = request.scope.get("root_path", "").rstrip("/") + "/"
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    page = (
        page.replace("{{base}}", html.escape(base, quote=True))
        .replace("{{version}}", html.escape(sidecar.__version__))
        .replace("{{auth}}", "required" if _auth_required(request) else "none")
    )
    return HTMLResponse(page, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


@router.get("/", response_class=HTMLResponse)
async def captures_page(request: Request) -> HTMLResponse:
    return _shell(request)


@router.get("/captures/{capture_id}", response_class=HTMLResponse)
async def capture_page(request: Request, capture_id: str) -> HTMLResponse:
    return _shell(request)


@router.get("/stages", response_class=HTMLResponse)
async def stages_page(request: Request) -> HTMLResponse:
    return _shell(request)


@router.get("/web/{name}")
async def asset(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(404, f"no web asset {name!r}; the page's assets are {sorted(ASSETS)}")
    path = STATIC / name
    media = MEDIA_TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return FileResponse(path, media_type=media, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


__all__ = ["ASSETS", "STATIC", "router"]
