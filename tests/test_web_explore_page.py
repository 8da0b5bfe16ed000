"""The web page (sidecar/api/web) used as a demanding user would, in a real Chromium against a real
sidecar over the emulator: a window typed into its field with the keyboard only, a Stop that
fails, long labels and a 360 px wide screen, a capture URL with a broken %-escape. Every browser
context fails its test on a script error or a request leaving 127.0.0.1 (fixtures/web.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fixtures.web import WebStack, wait_for

pytestmark = pytest.mark.slow

LIVE = {"starting", "active", "stopping", "collecting"}
BOOM = {"error": {"code": "internal_error", "message": "stop refused for the test", "details": {}}}


def _expect() -> Any:
    return pytest.importorskip("playwright.sync_api").expect


def _state(stack: WebStack, cid: str) -> dict[str, Any]:
    return httpx.get(f"{stack.url}/v1/captures/{cid}", timeout=30).json()


def _page_scrolls_sideways(page: Any) -> bool:
    return page.evaluate("() => document.documentElement.scrollWidth > document.documentElement.clientWidth")


def _failing_stop(route: Any) -> None:
    route.fulfill(status=500, content_type="application/json", body=json.dumps(BOOM))


def test_a_duration_typed_with_the_keyboard_only_bounds_the_capture(web_stack: WebStack, open_page: Any) -> None:
    # Tab to the duration field, type, Enter: the window is that duration, not "until I stop it"
    page = open_page(web_stack.url)
    page.goto("/")
    first = page.locator("#start-form input[name=stage]").first
    first.wait_for()
    first.focus()
    for _ in range(20):
        if page.evaluate("() => document.activeElement.name") == "duration_s":
            break
        page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.name") == "duration_s"
    page.keyboard.press("Control+A")
    page.keyboard.type("1")
    page.keyboard.press("Enter")
    link = page.locator("#start-result a")
    link.wait_for(timeout=300_000)
    cid = link.inner_text()
    try:
        start = next(r for r in page.requests if r.method == "POST" and r.url.endswith("/v1/captures"))
        assert page.locator("#start-form input[name=mode][value=duration]").is_checked()
        assert json.loads(start.post_data) == {"stages": [0, 2], "duration_s": 1}
        assert wait_for(lambda: _state(web_stack, cid)["state"] not in LIVE, timeout=300, page=page)
        assert _state(web_stack, cid)["stop_reason"] == "duration"
    finally:  # never leave the shared emulator with an active capture
        httpx.post(f"{web_stack.url}/v1/captures/{cid}/stop", params={"wait": "true"}, timeout=300)
    # the other fields pick their mode too, by the keyboard or the mouse
    page.locator("#steps-input").fill("7")
    assert page.locator("#start-form input[name=mode][value=steps]").is_checked()
    page.locator("#start-form input[name=lease_s]").click()
    assert page.locator("#start-form input[name=mode][value=lease]").is_checked()


@contextlib.contextmanager
def _failing_stops(web_stack: WebStack, open_page: Any, label: str) -> Iterator[tuple[dict[str, Any], Any]]:
    """A live capture and a page whose Stop requests the sidecar answers 500; the capture is
    stopped at the end whatever the test found."""
    cap = httpx.post(f"{web_stack.url}/v1/captures", json={"stages": [0, 2], "label": label}, timeout=300).json()
    try:
        page = open_page(web_stack.url)
        page.route("**/v1/captures/*/stop", _failing_stop)
        yield cap, page
    finally:
        httpx.post(f"{web_stack.url}/v1/captures/{cap['id']}/stop", params={"wait": "true"}, timeout=300)


def test_a_stop_that_fails_on_the_list_says_why_and_the_refresh_keeps_it(web_stack: WebStack, open_page: Any) -> None:
    expect = _expect()
    with _failing_stops(web_stack, open_page, "stop fails") as (cap, page):
        page.goto("/")
        row = page.locator(f'#captures-body tr[data-id="{cap["id"]}"]')
        row.locator("button", has_text="Stop").click()
        box = page.locator("#stop-notice .error-box")
        expect(box).to_contain_text("stop refused for the test")
        # the capture ends another way (the CLI, another tab): the list refreshes past it, the reason stays
        httpx.post(f"{web_stack.url}/v1/captures/{cap['id']}/stop", params={"wait": "true"}, timeout=300)
        page.locator(f'#captures-body tr[data-id="{cap["id"]}"]:not([data-state="active"])').wait_for(timeout=120_000)
        page.locator(f'#captures-body tr[data-id="{cap["id"]}"] .badge.verdict:not([data-verdict="pending"])').first.wait_for(
            timeout=120_000)
        expect(box).to_contain_text("stop refused for the test")
        assert cap["id"] in box.inner_text()


def test_a_stop_that_fails_on_the_capture_page_says_why(web_stack: WebStack, open_page: Any) -> None:
    expect = _expect()
    with _failing_stops(web_stack, open_page, "stop fails here") as (cap, page):
        page.goto(f"/captures/{cap['id']}")
        page.locator("#stop-button").click()
        box = page.locator("#capture-head .error-box")
        expect(box).to_contain_text("stop refused for the test")
        # the page keeps polling (every 1.5 s, the head drawn again): the reason stays on it
        httpx.post(f"{web_stack.url}/v1/captures/{cap['id']}/stop", params={"wait": "true"}, timeout=300)
        page.locator('#capture-head .badge.state[data-state="completed"], #capture-head .badge.state[data-state="degraded"]').wait_for(
            timeout=120_000)
        expect(box).to_contain_text("stop refused for the test")


def test_long_labels_and_a_360_px_screen_never_scroll_the_page_sideways(web_stack: WebStack, open_page: Any) -> None:
    label = "x" * 200  # the longest label the API takes, one word
    cap = web_stack.capture(label)
    page = open_page(web_stack.url)
    page.goto("/?limit=3")
    row = page.locator(f'#captures-body tr[data-id="{cap["id"]}"]')
    row.wait_for()
    assert row.locator(".cap-label").inner_text() == label  # shown whole, wrapped
    assert not _page_scrolls_sideways(page)
    page.set_viewport_size({"width": 360, "height": 800})
    assert not _page_scrolls_sideways(page)
    assert row.locator("a", has_text=cap["id"]).is_visible()
    page.goto(f"/captures/{cap['id']}")
    page.locator("#capture-summary .summary-stage").first.wait_for(timeout=300_000)
    page.locator("#window-metrics, #window-unavailable").first.wait_for()
    assert not _page_scrolls_sideways(page)
    page.set_viewport_size({"width": 1280, "height": 900})
    assert not _page_scrolls_sideways(page)
    page.goto("/stages")
    page.locator("#stages-card .stage-block").first.wait_for()
    page.set_viewport_size({"width": 360, "height": 800})
    assert not _page_scrolls_sideways(page)


def test_a_capture_url_with_a_broken_percent_escape_says_not_found(web_stack: WebStack, open_page: Any) -> None:
    expect = _expect()
    page = open_page(web_stack.url)  # a script error here fails the test (the fixture's check)
    page.goto("/captures/%E0%A4%A")
    expect(page.locator("#capture-head .error-box")).to_be_visible()
    assert page.locator("#main").inner_text() != "Loading…"


def test_a_right_to_left_label_reads_right_to_left_beside_its_id(web_stack: WebStack, open_page: Any) -> None:
    # A label in Hebrew or Arabic was laid out left to right: its words and digits came out in the
    # wrong order, and on the capture page the id after it was pulled into its run.
    label = "שלב 3 ארוך"
    cap = web_stack.capture(label)
    page = open_page(web_stack.url)
    page.goto("/?limit=3")
    shown = page.locator(f'#captures-body tr[data-id="{cap["id"]}"] .cap-label')
    shown.wait_for()
    assert (shown.inner_text(), shown.evaluate("e => getComputedStyle(e).direction")) == (label, "rtl")
    page.goto(f"/captures/{cap['id']}")
    title = page.locator("#capture-head .cap-title")
    title.wait_for()
    isolated = title.locator("bdi")
    assert (isolated.inner_text(), isolated.evaluate("e => getComputedStyle(e).direction")) == (label, "rtl")
    assert title.evaluate("e => getComputedStyle(e).direction") == "ltr" and cap["id"] in title.inner_text()


def test_older_stays_on_its_page_when_the_refresh_before_it_answers_late(web_stack: WebStack, open_page: Any) -> None:
    # The list refreshes itself every few seconds. A refresh of page 1 still in flight when "Older"
    # was clicked answered after page 2 and was drawn over it: page 2's label over page 1's rows
    # until the next refresh.
    older, newer = web_stack.capture("pager older"), web_stack.capture("pager newer")
    page = open_page(web_stack.url)
    page.goto("/?limit=1")
    page.locator(f'#captures-body tr[data-id="{newer["id"]}"]').wait_for()
    seen: list[Any] = []  # the list's requests from here on, in order: each held but the second

    def route(r: Any) -> None:
        seen.append(r)
        if len(seen) == 2:
            r.continue_()

    page.route("**/v1/captures?*", route)
    try:
        assert wait_for(lambda: len(seen) == 1, timeout=60, page=page)  # the page's own refresh of page 1: held
        page.locator("button", has_text="Older").click()  # the second: page 2, answered
        page.locator(f'#captures-body tr[data-id="{older["id"]}"]').wait_for()
        seen[0].continue_()  # page 1's answer, late; the refresh that asked for it then sets the next timer
        assert wait_for(lambda: len(seen) == 3, timeout=60, page=page)  # that next refresh: held
        rows = page.locator("#captures-body tr").evaluate_all("rows => rows.map((r) => r.dataset.id)")
        assert (rows, "page 2" in page.locator(".pager").inner_text()) == ([older["id"]], True)
    finally:
        page.unroute("**/v1/captures?*")
        for r in seen[2:]:
            with contextlib.suppress(Exception):
                r.continue_()
