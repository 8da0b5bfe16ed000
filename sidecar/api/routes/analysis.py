"""Analyses of terminal captures (``sidecar.analysis``, in a memory-capped worker process
(``sidecar.analysis.isolated``), so a hostile trace cannot take the server down):

- ``GET /v1/captures/{id}/summary?top=N``: top ops per stage; analysed once per capture, at the
  most rows the API serves, and cut to ``top`` per request (``sidecar.control.summaries``);
- ``GET /v1/captures/{id}/timeline``: one Perfetto trace of every stage/replica/rank (built once,
  kept beside the journal's summary);
- ``GET /v1/captures/{a}/diff/{b}?top=N``: two captures compared per stage, from their summaries'
  one analysis (read again with every row only where a table of one had more than the API serves).

Each runs an analysis or returns trace content, so with ``--token-file`` each needs the bearer
token, like the mutating routes. Thin: the controller finds the capture and its traces
(``sidecar.control.artifacts.trace_files``); the analysis layer does the rest.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any, Optional

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from sidecar.analysis.isolated import run_isolated
from sidecar.api.openapi import error as openapi_error
from sidecar.api.openapi import responses
from sidecar.api.responses import SafeJSONResponse
from sidecar.api.state import TOKEN, Api, ApiState
from sidecar.control import artifacts
from sidecar.control.journal import CaptureJournal
from sidecar.control.summaries import SUMMARY_TOP, SUMMARY_TOP_MAX, complete
from sidecar.errors import (
    CaptureNotFound,
    CaptureNotTerminal,
    StageUnknown,
    SummaryUnavailable,
    TraceError,
    TraceTooLarge,
)

router = APIRouter(tags=["captures"], dependencies=[TOKEN])
# one stage's timeline for the page's "Open in Perfetto" of a large trace: Perfetto's in-browser
# JSON import is slow far above this much JSON
SLIM_TIMELINE_MB = 256.0

# what a capture's analysis raises (the capture, its state, its traces), for the OpenAPI document
_RESPONSES: dict[int | str, dict[str, Any]] = {
    **responses("token"),
    404: openapi_error(CaptureNotFound, SummaryUnavailable),
    409: openapi_error(CaptureNotTerminal),
    422: openapi_error(TraceError, TraceTooLarge),
}


@router.get("/v1/captures/{capture_id}/summary", summary="Top ops per stage (cached)", responses=_RESPONSES)
async def summary(api: Api, capture_id: str,
                  top: int = Query(SUMMARY_TOP, ge=1, le=SUMMARY_TOP_MAX)) -> SafeJSONResponse:
    return SafeJSONResponse(api.scrubber.data(await api.controller.summarize(capture_id, top=top)))


def _traces(api: ApiState, capture_id: str) -> list[Path]:
    return _traces_and_skipped(api, capture_id)[0]


def _terminal(api: ApiState, capture_id: str) -> Any:
    """The capture, once terminal: ``CaptureNotFound`` (404), ``CaptureNotTerminal`` (409)."""
    cap = api.controller.get(capture_id)  # CaptureNotFound -> 404
    if not cap.terminal:
        raise CaptureNotTerminal(
            f"capture {capture_id} is {cap.state.value}; its traces are there once it is terminal "
            f"(wait with POST /v1/captures/{capture_id}/stop?wait=true)",
            details={"state": cap.state.value},
        )
    return cap


def _traces_and_skipped(api: ApiState, capture_id: str, stage: int | None = None) -> tuple[list[Path], list[str]]:
    """The capture's readable trace files (``stage``: that stage's only), and why each other trace
    of it is not read."""
    cap = _terminal(api, capture_id)
    verdicts = [v for v in cap.verdicts if stage is None or v.stage_id == stage]
    if stage is not None and not verdicts:
        raise StageUnknown(f"capture {capture_id} has no stage {stage}; its stages: {', '.join(map(str, cap.stages))}",
                           details={"stage": stage, "stages": cap.stages})
    paths, skipped = artifacts.trace_files(verdicts)  # confined: what a download may read
    if not paths:
        raise SummaryUnavailable(
            f"capture {capture_id} has no readable trace{'' if stage is None else f' of stage {stage}'} (state "
            f"{cap.state.value}); see its verdicts" + "".join(f"; {why}" for why in skipped),
            details={"skipped": skipped},
        )
    return paths, skipped


def _timeline_file(api: ApiState, capture_id: str, stage: int | None) -> Path:
    journal = getattr(api.controller, "journal", None)
    folder = journal.summary_path(capture_id).parent if journal is not None else Path(tempfile.gettempdir()) / "omni-sidecar"
    return folder / f"{capture_id}.timeline{'' if stage is None else f'.stage{stage}'}.json.gz"


async def _build_timeline(api: ApiState, capture_id: str, out: Path, stage: int | None) -> Path:
    """Build the capture's timeline (``stage``: that stage's, slim) as ``out`` (kept beside its
    summary), or, where retention dropped the capture while it was built, as a file served once and
    then removed."""
    from sidecar.analysis.timeline import write_slim_timeline, write_timeline

    paths, skipped = _traces_and_skipped(api, capture_id, stage)
    journal = getattr(api.controller, "journal", None)
    built = journal.building(capture_id, out.name) if journal is not None else out
    # what was not read is named in the file (otherData.omni_sidecar_not_read)
    if stage is None:
        await asyncio.to_thread(run_isolated, write_timeline, paths, built, skipped=skipped)
    else:
        await asyncio.to_thread(run_isolated, write_slim_timeline, paths, built, max_mb=SLIM_TIMELINE_MB, skipped=skipped)
    if journal is None:
        return out
    return await asyncio.to_thread(journal.adopt, capture_id, built) or built


@router.get("/v1/captures/{capture_id}/timeline", summary="One Perfetto trace of every stage, replica and rank",
            responses={**_RESPONSES, 422: openapi_error(TraceError, TraceTooLarge, StageUnknown),
                       200: {"description": "the merged trace",
                                           "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}}}},
            response_class=FileResponse)
async def capture_timeline(
    api: Api, capture_id: str,
    stage: Optional[int] = Query(None, ge=0, description="one stage's traces only, made to fit "
                                 f"{SLIM_TIMELINE_MB:g} MB of JSON (the page's Open in Perfetto for a large trace)"),
) -> FileResponse:
    _terminal(api, capture_id)
    out = served = _timeline_file(api, capture_id, stage)
    if not out.is_file():  # built once: it outlives the traces, as the summary does
        lock = api.timeline_locks.setdefault(out.name, asyncio.Lock())
        try:
            async with lock:
                if not out.is_file():
                    served = await _build_timeline(api, capture_id, out, stage)
        finally:
            if not lock.locked():  # no request waits on it: one lock per timeline being built, not per one ever
                api.timeline_locks.pop(out.name, None)
    gone = None if served == out else BackgroundTask(CaptureJournal.discard, served)  # its capture left the history
    return FileResponse(served, media_type="application/gzip", filename=out.name, background=gone)


@router.get("/v1/captures/{a}/diff/{b}", summary="Per stage: ops and kernels by change in self CPU / device time (B - A)",
            responses=_RESPONSES)
async def capture_diff(api: Api, a: str, b: str, top: int = Query(20, ge=1, le=SUMMARY_TOP_MAX)) -> SafeJSONResponse:
    from sidecar.analysis.diff import diff_paths, diff_summaries
    from sidecar.analysis.models import CaptureSummary

    # each capture's one analysis, shared with its summary; where a table there was cut (more than
    # SUMMARY_TOP_MAX names), both captures are read again with every row, in a worker
    sa = await api.controller.summarize(a, top=SUMMARY_TOP_MAX)
    sb = await api.controller.summarize(b, top=SUMMARY_TOP_MAX)
    if complete(sa, SUMMARY_TOP_MAX) and complete(sb, SUMMARY_TOP_MAX):
        result = await asyncio.to_thread(lambda: diff_summaries(
            CaptureSummary.model_validate(sa), CaptureSummary.model_validate(sb), top=top, label_a=a, label_b=b))
    else:
        result = await asyncio.to_thread(run_isolated, diff_paths, _traces(api, a), _traces(api, b),
                                         top=top, label_a=a, label_b=b)
    return SafeJSONResponse(api.scrubber.data(result.model_dump(mode="json")))
