"""The capture page's per-device rows name the stage (and replica, rank) they belong to: every
stage process calls its GPU cuda:0, so "device 0" alone cannot tell two stages' GPUs apart.

A real capture of stages 0 and 2 over the emulator, opened in a real Chromium. The emulator's
CPU workers record no GPU kernels, so the capture's summary is served, in place of its own, as
the product's summarizer makes it from real H200 traces attributed to those two stages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from sidecar.analysis import TraceSource, summarize_paths
from tests.fixtures.web import WebStack

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"
CUDA_MEMORY = DATA / "cuda_memory" / "cuda_memory_rank0.json.gz"  # one H100 run, profile_memory on
HOST_BOUND = DATA / "traces" / "host_bound.json.gz"


@pytest.fixture(scope="module")
def gpu_capture(web_stack: WebStack) -> dict[str, Any]:
    cap = web_stack.capture("two GPU stages", stages=[0, 2])
    assert cap["state"] == "completed", cap
    return cap


def _summary(*sources: TraceSource) -> dict[str, Any]:
    return summarize_paths(list(sources), top=10).model_dump(mode="json")


def _open_with_summary(open_page: Any, stack: WebStack, cap: dict[str, Any], summary: dict[str, Any]) -> Any:
    """The capture's page, its summary request answered with ``summary``; waits for the charts."""
    page = open_page(stack.url)
    body = json.dumps(summary)
    page.route(f"**/v1/captures/{cap['id']}/summary*",
               lambda route: route.fulfill(status=200, content_type="application/json", body=body))
    page.goto(f"/captures/{cap['id']}")
    page.locator("#capture-summary .summary-stage").first.wait_for(timeout=300_000)
    return page


def _labels(page: Any, where: str, caption: str) -> list[str]:
    chart = page.locator(f"{where} figure.chart", has_text=caption)
    return chart.locator("text.bar-label").all_text_contents()


def test_each_device_row_names_its_stage(web_stack: WebStack, gpu_capture: dict[str, Any], open_page: Any) -> None:
    summary = _summary(TraceSource(CUDA_MEMORY, stage_id=0), TraceSource(HOST_BOUND, stage_id=2))
    # the case the rows must tell apart: one cuda:0 per stage, no rank or replica in either trace
    assert [(d["stage_id"], d["replica"], d["rank"], d["device"]) for d in summary["devices"]] == [
        (0, None, None, 0), (2, None, None, 0)
    ]
    page = _open_with_summary(open_page, web_stack, gpu_capture, summary)
    whole = _labels(page, "#capture-summary", "Busy vs idle per device (whole capture)")
    assert whole == ["stage 0 · cuda:0", "stage 2 · cuda:0"]
    tips = page.locator("#capture-summary figure.chart", has_text="(whole capture)").locator("g.bar-row > title")
    assert [t.split(": busy ")[0] for t in tips.all_text_contents()] == whole
    for sid in (0, 2):
        stage = f'#capture-summary .summary-stage[data-stage="{sid}"]'
        for caption in ("Busy vs idle per device", "Where the steady window went", "Why the GPU was idle"):
            assert _labels(page, stage, caption) == [f"stage {sid} · cuda:0"], caption


def test_device_rows_name_replica_and_rank_where_the_summary_has_them(
    web_stack: WebStack, gpu_capture: dict[str, Any], open_page: Any, screenshot: Any
) -> None:
    summary = _summary(TraceSource(CUDA_MEMORY, stage_id=0), TraceSource(HOST_BOUND, stage_id=2))
    for row in summary["devices"] + [d for st in summary["stages"] for d in st["devices"]]:
        if row["stage_id"] == 2:
            row.update(replica=1, rank=3, device=5)
    page = _open_with_summary(open_page, web_stack, gpu_capture, summary)
    assert _labels(page, "#capture-summary", "Busy vs idle per device (whole capture)") == [
        "stage 0 · cuda:0", "stage 2 · replica 1 · rank 3 · cuda:5"
    ]
    where = _labels(page, '#capture-summary .summary-stage[data-stage="2"]', "Where the steady window went")
    assert where == ["stage 2 · replica 1 · rank 3 · cuda:5"]
    screenshot(page, "web-summary-devices")


def test_memory_charts_name_the_stage_of_their_device(
    web_stack: WebStack, gpu_capture: dict[str, Any], open_page: Any, tmp_path: Path
) -> None:
    # the same H100 run as stage 0 and as stage 2: two stages' memory that only the stage tells apart
    twin = tmp_path / "stage2" / CUDA_MEMORY.name
    twin.parent.mkdir()
    shutil.copy(CUDA_MEMORY, twin)
    summary = _summary(TraceSource(CUDA_MEMORY, stage_id=0), TraceSource(twin, stage_id=2))
    page = _open_with_summary(open_page, web_stack, gpu_capture, summary)
    for sid in (0, 2):
        stage = page.locator(f'#capture-summary .summary-stage[data-stage="{sid}"]')
        captions = [c for c in stage.locator("figcaption").all_text_contents() if c.startswith("Live at the peak")]
        assert captions == [f"Live at the peak by op (stage {sid} · {dev})" for dev in ("cpu", "cuda:0")]
        lines = stage.locator("figure.chart", has_text="Memory over the window").locator("g.series")
        assert f"stage {sid} · cuda:0 allocated" in [g.get_attribute("data-series") for g in lines.all()]
