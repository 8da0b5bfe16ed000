"""HTTP: a capture's merged timeline and the diff of two captures (``sidecar.analysis``).

``GET /v1/captures/{id}/timeline`` streams one Perfetto trace of every stage/replica/rank of a
terminal capture (built once, kept beside the journal's summary); ``GET /v1/captures/{a}/diff/{b}``
compares two terminal captures per stage. Thin: the controller finds the capture and its traces
(``sidecar.control.artifacts.trace_paths``); the analysis layer does the rest, in a memory-capped
worker process (``sidecar.analysis.isolated``), so a hostile trace cannot take the server down.
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse

from sidecar.analysis.isolated import run_isolated
from sidecar.api.openapi import error as openapi_error
from sidecar.api.responses import SafeJSONResponse
from sidecar.control import artifacts
from sidecar.errors import CaptureNotFound, CaptureNotTerminal, SummaryUnavailable, TraceError, TraceTooLarge
from sidecar.scrub import Scrubber

router = APIRouter(tags=["captures"])

# what _traces and the analyses raise, for the OpenAPI document
_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: openapi_error(CaptureNotFound, SummaryUnavailable),
    409: openapi_error(CaptureNotTerminal),
    422: openapi_error(TraceError, TraceTooLarge),
}


@functools.lru_cache(maxsize=1)
def _scrubber() -> Scrubber:
    return Scrubber()


def _traces(request: Request, capture_id: str) -> tuple[Any, list[Path]]:
    controller = request.app.state.controller
    cap = controller.get(capture_id)  # CaptureNotFound -> 404
    if not cap.terminal:
        raise CaptureNotTerminal(
            f"capture {capture_id} is {cap.state.value}; its traces are there once it is terminal "
            f"(wait with POST /v1/captures/{capture_id}/stop?wait=true)",
            details={"state": cap.state.value},
        )
    paths, skipped = artifacts.trace_files(cap.verdicts)  # confined: what a download may read
    if not paths:
        raise SummaryUnavailable(
            f"capture {capture_id} has no readable trace (state {cap.state.value}); see its verdicts"
            + "".join(f"; {why}" for why in skipped),
            details={"skipped": skipped},
        )
    return controller, paths


def _timeline_file(controller: Any, capture_id: str) -> Path:
    journal = getattr(controller, "journal", None)
    folder = journal.summary_path(capture_id).parent if journal is not None else Path(tempfile.gettempdir()) / "omni-sidecar"
    return folder / f"{capture_id}.timeline.json.gz"


_locks: dict[str, asyncio.Lock] = {}


@router.get("/v1/captures/{capture_id}/timeline", summary="One Perfetto trace of every stage, replica and rank",
            responses={**_RESPONSES, 200: {"description": "the merged trace",
                                           "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}}}},
            response_class=FileResponse)
async def capture_timeline(request: Request, capture_id: str) -> FileResponse:
    from sidecar.analysis.timeline import write_timeline

    controller, paths = _traces(request, capture_id)
    out = _timeline_file(controller, capture_id)
    async with _locks.setdefault(capture_id, asyncio.Lock()):
        if not out.is_file():
            await asyncio.to_thread(run_isolated, write_timeline, paths, out)
    return FileResponse(out, media_type="application/gzip", filename=f"{capture_id}.timeline.json.gz")


@router.get("/v1/captures/{a}/diff/{b}", summary="Per stage: ops and kernels by change in self CPU / device time (B - A)",
            responses=_RESPONSES)
async def capture_diff(request: Request, a: str, b: str, top: int = Query(20, ge=1, le=500)) -> SafeJSONResponse:
    from sidecar.analysis.diff import diff_paths

    _, pa = _traces(request, a)
    _, pb = _traces(request, b)
    result = await asyncio.to_thread(run_isolated, diff_paths, pa, pb, top=top, label_a=a, label_b=b)
    return SafeJSONResponse(_scrubber().data(result.model_dump(mode="json")))
