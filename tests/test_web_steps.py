"""The web page's steps windows and window metrics (sidecar/api/web/static/steps.js) in a real
Chromium, against a real sidecar over the emulator: a capture started "for N engine steps" from
the page ends by itself, and its page shows the steps and the server metrics table."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.client import SidecarClient
from tests.fixtures.emulator import make_deploy
from tests.fixtures.load import steady_load
from tests.fixtures.web import WebStack, start_sidecar

pytestmark = pytest.mark.slow


def test_a_steps_window_from_the_page_shows_its_steps_and_server_metrics(web_stack: WebStack, open_page: Any,
                                                                         screenshot: Any) -> None:  # fmt: skip
    page = open_page(web_stack.url)
    page.goto("/")
    page.locator("#steps-input").wait_for()
    page.check("#start-form input[name=mode][value=steps]")
    page.fill("#steps-input", "12")
    page.check("#count-steps")  # these stages have no max_iterations cap: a best-effort count, asked by name
    with steady_load(web_stack.emulator.url, max_tokens=1, chat=True):  # steady engine steps on every stage
        page.click("#start-button")
        # the link, or the page's error box: a refused start fails here with its reason, not at the bound
        page.locator("#start-result a, #start-result .error-box").first.wait_for(timeout=300_000)
        assert not page.locator("#start-result .error-box").count(), page.locator("#start-result").inner_text()
        link = page.locator("#start-result a")
        page.goto(f"/captures/{link.inner_text()}")
        page.locator("#window-metrics tbody tr").first.wait_for(timeout=300_000)
    start = next(r for r in page.requests if r.method == "POST")
    rows = [r.inner_text().split("\t")[0] for r in page.locator("#window-metrics tbody tr").all()]
    assert json.loads(start.post_data) == {"stages": [0, 2], "steps": 12, "steps_bound": "count"}
    assert page.locator("#steps-line").inner_text().startswith("Steps: 12 asked, ")
    assert "(ended by the sidecar's count" in page.locator("#steps-line").inner_text()
    assert {"stage 0", "stage 2"} <= set(rows), rows
    screenshot(page, "web-steps-window")


def test_the_page_shows_the_range_of_a_plan_of_the_servers_whole_window(tmp_path_factory: pytest.TempPathFactory,
                                                                        emulator_pool: Any, open_page: Any) -> None:
    # Both stages end each window after 10 iterations: the plan is their whole window (8 steps
    # asked), probed three times; the page's prediction for 8 steps shows the least and most those
    # probes held beside the median (GET /v1/plan?steps=8's mb_range)
    root = tmp_path_factory.mktemp("web-capped")
    deploy = make_deploy(root, {0: {"profiler": "torch", "max_iterations": 10}, 1: None,
                                2: {"profiler": "torch", "max_iterations": 10}})  # fmt: skip
    emu = emulator_pool.get(deploy, extra_args=["--workers", "thread"], startup_timeout=180)
    sidecar = start_sidecar(emu, deploy, root, None)
    try:
        with steady_load(emu.url, max_tokens=1, chat=True), SidecarClient(sidecar.url, timeout=300) as client:
            plan = client.plan(stages=[0, 2], budget_mb=500, max_stop_s=600)
        assert plan.steps == 8 and plan.predicted_mb_range is not None, plan
        lo, hi = plan.predicted_mb_range
        page = open_page(sidecar.url)
        page.goto("/")
        page.locator("#steps-input").wait_for()
        page.check("#start-form input[name=mode][value=steps]")
        page.fill("#steps-input", "8")
        shown = page.locator("#steps-prediction", has_text="in its probes")
        shown.wait_for(timeout=60_000)
        assert f"MB ({lo:.2f}-{hi:.2f} in its probes), stop " in shown.inner_text(), shown.inner_text()
    finally:
        sidecar.stop(grace=30)
