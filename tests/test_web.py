"""The web page (sidecar/api/web) in a real Chromium, against a real sidecar over the emulator:
the list and its badges, start and stop from the page, the detail's charts, downloads and the
Perfetto hand-over, validation messages, the token prompt, the stages page. Every test's browser
context aborts and reports any request that would leave 127.0.0.1 (fixtures/web.py)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.analysis import summarize_paths
from tests.fixtures.emulator import _pool_key, emulator_state
from tests.fixtures.web import WEB_TOKEN, WebStack, wait_for

pytestmark = pytest.mark.slow

TRACE_DATA = Path(__file__).parent / "data" / "traces"

# Replaces window.open before any page script runs: records the URL, returns a real (same-origin,
# blank) window whose postMessage records what the page sends and answers PING with a PONG that
# looks like it came from ui.perfetto.dev. Nothing is opened and nothing is fetched.
PERFETTO_STUB = """
(() => {
  const log = (window.__perfetto = { opened: [], pings: [], posted: [] });
  window.open = (url, target) => {
    log.opened.push({ url: String(url), target: target || null });
    const frame = document.createElement("iframe");
    frame.hidden = true;
    document.documentElement.append(frame);
    const fake = frame.contentWindow;
    fake.postMessage = (msg, origin) => {
      if (msg === "PING") {
        log.pings.push(origin);
        if (log.pings.length === 2) {
          window.dispatchEvent(new MessageEvent("message", { data: "PONG", origin: "https://ui.perfetto.dev", source: fake }));
        }
        return;
      }
      const p = msg && msg.perfetto;
      const entry = { origin, keys: Object.keys(msg || {}), title: p && p.title, fileName: p && p.fileName,
                      isArrayBuffer: !!p && p.buffer instanceof ArrayBuffer, byteLength: p && p.buffer ? p.buffer.byteLength : null };
      crypto.subtle.digest("SHA-256", p.buffer).then((d) => {
        entry.sha256 = [...new Uint8Array(d)].map((b) => b.toString(16).padStart(2, "0")).join("");
        log.posted.push(entry);
      });
    };
    return fake;
  };
})();
"""


def _row(page: Any, capture_id: str) -> Any:
    return page.locator(f'#captures-body tr[data-id="{capture_id}"]')


@pytest.fixture(scope="module")
def done_capture(web_stack: WebStack) -> dict[str, Any]:
    """One capture of stages 0 and 2 around a few requests, started and stopped through the API."""
    cap = web_stack.capture("from the API")
    assert cap["state"] == "completed", cap
    return cap


def _trace_file(cap: dict[str, Any], stage: int) -> tuple[str, Path]:
    """(<session folder>/<file>, local path) of a stage's trace in a capture."""
    v = next(v for v in cap["verdicts"] if v["stage_id"] == stage)
    s = v["sessions"][0]
    f = next(f for f in s["files"] if f["name"].startswith("trace_rank"))
    local = Path(s["local_path"]) / f["name"]
    return f"{local.parent.name}/{f['name']}", local


def test_list_renders_capture_with_badges(web_stack: WebStack, done_capture: dict[str, Any], open_page: Any, screenshot: Any) -> None:
    page = open_page(web_stack.url)
    page.goto("/")
    row = _row(page, done_capture["id"])
    row.wait_for()
    badges = {
        (b.get_attribute("data-stage"), b.get_attribute("data-verdict"))
        for b in row.locator(".badge.verdict").all()
    }
    assert page.title().startswith("omni-sidecar")
    assert row.locator(".badge.state").inner_text() == "completed"
    assert row.locator(".cap-label").inner_text() == "from the API"
    assert row.locator(f'a[href="captures/{done_capture["id"]}"]').count() == 1
    assert badges == {("0", "ok"), ("2", "ok")}
    screenshot(page, "web-captures")


def test_start_and_stop_from_the_page_completes_ok(web_stack: WebStack, open_page: Any, screenshot: Any) -> None:
    page = open_page(web_stack.url)
    page.goto("/")
    page.locator("#start-form input[name=stage]").first.wait_for()
    checked = sorted(int(b.get_attribute("value")) for b in page.locator("#start-form input[name=stage]:checked").all())
    page.fill("#start-form input[name=label]", "from the page")
    page.click("#start-button")
    link = page.locator("#start-result a")
    link.wait_for(timeout=300_000)
    capture_id = link.inner_text()
    row = _row(page, capture_id)
    row.wait_for()
    web_stack.chat()
    row.locator("button", has_text="Stop").click()
    page.wait_for_selector(f'#captures-body tr[data-id="{capture_id}"][data-state="completed"]', timeout=300_000)
    badges = {b.get_attribute("data-verdict") for b in _row(page, capture_id).locator(".badge.verdict").all()}
    posts = [r for r in page.requests if r.method == "POST"]
    assert checked == [0, 2]  # the torch stages are picked by default; stage 1 has no profiler
    assert badges == {"ok"}
    assert [urlpath(r.url) for r in posts] == ["/v1/captures", f"/v1/captures/{capture_id}/stop"]
    assert all(r.headers.get("content-type") == "application/json" for r in posts)
    assert json.loads(posts[0].post_data) == {"stages": [0, 2], "label": "from the page"}
    screenshot(page, "web-started-from-page")


def test_list_pages_newest_first(web_stack: WebStack, done_capture: dict[str, Any], open_page: Any) -> None:
    while len(ids := [c["id"] for c in httpx.get(f"{web_stack.url}/v1/captures", timeout=30).json()["captures"]]) < 2:
        web_stack.capture("for paging")
    page = open_page(web_stack.url)
    page.goto("/?limit=1")
    rows = page.locator("#captures-body tr[data-id]")
    rows.first.wait_for()
    first = [r.get_attribute("data-id") for r in rows.all()]
    page.click("button:has-text('Older')")
    page.wait_for_selector(f'#captures-body tr[data-id="{ids[1]}"]')
    second = [r.get_attribute("data-id") for r in rows.all()]
    page.click("button:has-text('Newer')")
    page.wait_for_selector(f'#captures-body tr[data-id="{ids[0]}"]')
    assert (first, second) == ([ids[0]], [ids[1]])


def test_lease_capture_is_kept_alive_by_the_page(web_stack: WebStack, open_page: Any) -> None:
    # a short lease: the page heartbeats every third of it (checked each second), so the capture
    # outlives its lease only while the tab is open
    lease_s = 3
    page = open_page(web_stack.url)
    page.goto("/")
    page.locator("#start-form input[name=stage]").first.wait_for()
    page.check("#start-form input[name=mode][value=lease]")
    page.fill("#start-form input[name=lease_s]", str(lease_s))
    page.click("#start-button")
    link = page.locator("#start-result a")
    link.wait_for(timeout=300_000)
    capture_id = link.inner_text()

    def get() -> dict[str, Any]:
        return httpx.get(f"{web_stack.url}/v1/captures/{capture_id}", timeout=30).json()

    def past_the_lease(cap: dict[str, Any]) -> bool:
        """Still active, with a heartbeat more than one lease after the start."""
        if cap["state"] != "active" or not cap["last_heartbeat_at"]:
            return False
        beat, started = (datetime.fromisoformat(cap[k]) for k in ("last_heartbeat_at", "started_at"))
        return (beat - started).total_seconds() > lease_s

    seen: list[dict[str, Any]] = []

    def kept_past_the_lease() -> bool:
        seen.append(get())
        return sent.done() and past_the_lease(seen[-1])

    # requests in the window (an idle window ends `empty`, the capture `degraded`), sent from a thread
    # so the page's heartbeats keep flowing (Playwright runs the page's routes only inside its calls)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(web_stack.chat)
        assert wait_for(kept_past_the_lease, timeout=120, page=page), seen[-1:]
        sent.result()
    cap = seen[-1]
    page.close()  # the tab goes away: no more heartbeats, the lease runs out and the sidecar stops it
    live = {"starting", "active", "stopping", "collecting"}
    assert wait_for(lambda: get()["state"] not in live, timeout=300)
    final = get()
    beats = [r for r in page.requests if r.url.endswith(f"/v1/captures/{capture_id}/heartbeat")]
    assert (cap["lease_s"], len(beats) >= 2) == (lease_s, True)
    assert (final["state"], final["stop_reason"]) == ("completed", "lease_expired"), final


def urlpath(url: str) -> str:
    return httpx.URL(url).path


def test_detail_draws_summary_charts(web_stack: WebStack, done_capture: dict[str, Any], open_page: Any, screenshot: Any) -> None:
    page = open_page(web_stack.url)
    page.goto(f"/captures/{done_capture['id']}")
    page.wait_for_selector("#capture-summary .summary-stage svg.chart-svg rect.bar", timeout=300_000)
    stages = page.locator("#capture-summary .summary-stage")
    first_chart = stages.first.locator("figure.chart").first
    bars = first_chart.locator("rect.bar").count()
    labels = first_chart.locator("text.bar-label").all_text_contents()
    api_top = httpx.get(f"{web_stack.url}/v1/captures/{done_capture['id']}/summary", timeout=300).json()["stages"][0]["cpu_ops"]
    assert stages.count() == 2
    assert first_chart.locator("figcaption").inner_text() == "Top ops by self CPU time"
    drawn = [o for o in api_top if o["self_us"] > 0]  # a bar per op with time to show (charts.js)
    assert bars == min(10, len(drawn)) > 0
    top = max(api_top, key=lambda o: o["self_us"])["name"]
    assert labels[0] == (top if len(top) <= 32 else top[:31] + "…")  # long names are clipped, in full in the tooltip
    assert page.locator('#capture-stages .stage-block[data-stage="0"] .badge.verdict').inner_text() == "ok"
    # the server the capture ran on, as the sidecar found it at connect (its record's `server`)
    server = done_capture["server"]
    facts = dict(zip(page.locator("dl.facts dt").all_text_contents(), page.locator("dl.facts dd").all_text_contents()))
    assert server["kind"] == "omni" and facts["Server"] == f"vLLM-Omni {server['omni']} on vLLM {server['vllm']}", facts
    screenshot(page, "web-capture")


def test_download_link_returns_the_file(web_stack: WebStack, done_capture: dict[str, Any], open_page: Any) -> None:
    relpath, local = _trace_file(done_capture, 0)
    page = open_page(web_stack.url)
    page.goto(f"/captures/{done_capture['id']}")
    link = page.locator(f'#capture-stages .stage-block[data-stage="0"] a.download[download="{local.name}"]')
    link.wait_for()
    href = link.get_attribute("href")
    with page.expect_download() as info:
        link.click()
    saved = Path(info.value.path())
    assert href == f"v1/captures/{done_capture['id']}/files/{relpath}"
    assert saved.read_bytes() == local.read_bytes()


def test_open_in_perfetto_hands_the_trace_over_by_postmessage(web_stack: WebStack, done_capture: dict[str, Any], open_page: Any) -> None:
    _, local = _trace_file(done_capture, 0)
    page = open_page(web_stack.url)
    page.add_init_script(PERFETTO_STUB)
    page.goto(f"/captures/{done_capture['id']}")
    button = page.locator('#capture-stages .stage-block[data-stage="0"] button.perfetto').first
    button.click()
    # polled from here: the page's CSP (no eval) rules out wait_for_function's string predicates
    assert wait_for(lambda: page.evaluate("() => window.__perfetto.posted.length") > 0, timeout=120, page=page)
    log = page.evaluate("window.__perfetto")
    posted = log["posted"][0]
    assert log["opened"] == [{"url": "https://ui.perfetto.dev", "target": "_blank"}]
    assert set(log["pings"]) == {"https://ui.perfetto.dev"}
    assert (posted["origin"], posted["keys"], posted["fileName"], posted["isArrayBuffer"]) == (
        "https://ui.perfetto.dev", ["perfetto"], local.name, True
    )
    assert (posted["byteLength"], posted["sha256"]) == (local.stat().st_size, hashlib.sha256(local.read_bytes()).hexdigest())
    assert "stage 0" in posted["title"]
    assert "sent the trace to Perfetto" in page.locator('.stage-block[data-stage="0"] .perfetto-status').inner_text()


def _render_summary(page: Any, summary: dict[str, Any], card_id: str) -> Any:
    """``summary`` drawn by the page's own renderer (capture.js) into a card ``card_id``."""
    page.goto("/stages")
    page.locator("#stages-card .stage-block").first.wait_for()
    page.evaluate(
        """async ([s, id]) => {
            const m = await import(new URL("web/capture.js", document.baseURI).href);
            const card = document.createElement("section");
            card.className = "card";
            card.id = id;
            document.getElementById("main").replaceChildren(card);
            m.renderSummary(card, s);
        }""",
        [summary, card_id],
    )
    return page


def test_gpu_summary_draws_kernels_busy_idle_and_steps(web_stack: WebStack, open_page: Any, screenshot: Any) -> None:
    # a real H200 trace through the product's summarizer, drawn by the page's own renderer
    summary = summarize_paths([TRACE_DATA / "cuda_small.json.gz"], top=20).model_dump(mode="json")
    page = _render_summary(open_page(web_stack.url), summary, "gpu-summary")
    captions = page.locator("#gpu-summary figcaption").all_inner_texts()
    kernels = page.locator("#gpu-summary figure.chart", has_text="Top kernels by GPU time").locator("rect.bar")
    busy = page.locator("#gpu-summary figure.chart", has_text="Busy vs idle per device (whole capture)")
    device = summary["devices"][0]
    assert {"Top kernels by GPU time", "Top ops by self device time", "Engine step time (mean)"} <= set(captions)
    assert kernels.count() == 10
    assert f"{round((1 - device['idle_share']) * 100)} % busy" in busy.locator("text.bar-value").first.text_content()
    screenshot(page, "web-gpu-summary")


def test_summary_shows_findings_first_then_why_bars_per_stage(web_stack: WebStack, open_page: Any, screenshot: Any) -> None:
    # real H200 traces as a 2-stage capture: stage 0 a busy GPU (matmuls), stage 1 host-bound (tiny kernels)
    from sidecar.analysis import TraceSource

    summary = summarize_paths([TraceSource(TRACE_DATA / "busy_gemm.json.gz", stage_id=0),
                               TraceSource(TRACE_DATA / "host_bound.json.gz", stage_id=1)], top=10).model_dump(mode="json")
    page = _render_summary(open_page(web_stack.url), summary, "why-summary")
    card = page.locator("#why-summary")
    # the findings come right after the heading, ranked as the summary ranks them
    assert card.locator(":scope > *").nth(1).evaluate("n => n.className") == "summary-findings"
    items = card.locator("ol.summary-findings li")
    assert items.first.get_attribute("class") == "sev-high"
    assert [i.get_attribute("data-rule") for i in items.all()] == [f["rule"] for f in summary["findings"]]
    host = card.locator('ol.summary-findings li[data-rule="host_bound"]')
    assert "stage 1: GPU idle 97% of the window, 100% of it waiting on the host" in host.inner_text()
    # the busy GPU has nothing to say: its trace started 1.9 s after stage 1's (two runs), and stages
    # are never compared for skew (stage 1 worked first: no hand-over either)
    assert {i.get_attribute("data-rule") for i in items.all() if "stage 0" in i.inner_text()} == set()
    for sid, dev in ((0, summary["stages"][0]["devices"][0]), (1, summary["stages"][1]["devices"][0])):
        stage = card.locator(f'.summary-stage[data-stage="{sid}"]')
        where = stage.locator("figure.chart", has_text="Where the steady window went")
        idle_seg = where.locator('rect.seg[data-part="idle_share"]')
        total = float(where.locator("rect.bar-track").get_attribute("width"))
        assert float(idle_seg.get_attribute("width")) == pytest.approx(dev["temporal"]["idle_share"] * total, abs=1.0)
        assert f"idle {dev['temporal']['idle_share'] * 100:.1f} %" in idle_seg.locator("title").text_content()
        why = stage.locator("figure.chart", has_text="Why the GPU was idle")
        host = why.locator('rect.seg[data-part="host_wait_share"]')
        assert float(host.get_attribute("width")) == pytest.approx(dev["idle_breakdown"]["host_wait_share"] * total, abs=1.0)
    screenshot(page, "web-summary-why")


def test_degraded_capture_shows_reason_and_what_to_do(web_stack: WebStack, open_page: Any, screenshot: Any) -> None:
    # stage 2's worker acknowledges the start, then exits: the capture ends degraded, stage 2 missing
    emu, url = web_stack.emulator, web_stack.url
    emu.set_faults(die_after_start=2)
    try:
        created = httpx.post(f"{url}/v1/captures", json={"stages": [0, 2]}, timeout=300).json()
        assert wait_for(lambda: not emulator_state(emu)["stages"]["2"]["alive"], timeout=120), (created, emulator_state(emu)["stages"])
        # a request in the window: stage 0 runs its steps (recorded), then stage 2's dead worker fails it
        chat = httpx.post(f"{emu.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=120)
        done = httpx.post(f"{url}/v1/captures/{created['id']}/stop?wait=true", timeout=300).json()
    finally:  # the worker back, the fault off, the stages still on this module's trace dirs
        emu.reset(profiler_dirs=_pool_key(web_stack.deploy)[1])
    reason = next(v["reason"] for v in done["verdicts"] if v["stage_id"] == 2)
    page = open_page(url)
    page.goto(f"/captures/{done['id']}")
    stage2 = page.locator('#capture-stages .stage-block[data-stage="2"]')
    stage2.wait_for()
    verdicts = {v["stage_id"]: v["verdict"] for v in done["verdicts"]}
    assert (chat.status_code, verdicts) == (500, {0: "ok", 2: "missing"}), done
    assert (done["state"], page.locator("#capture-head .badge.state").inner_text()) == ("degraded", "degraded")
    assert stage2.locator(".badge.verdict").inner_text() == "missing"
    assert stage2.locator(".reason").inner_text() == reason
    assert "worker is alive" in stage2.locator(".todo").inner_text()
    assert page.locator('#capture-stages .stage-block[data-stage="0"] .todo').count() == 0  # ok: nothing to do
    screenshot(page, "web-degraded")


def test_bad_stage_shows_the_api_validation_message(web_stack: WebStack, open_page: Any) -> None:
    expected = httpx.post(f"{web_stack.url}/v1/captures", json={"stages": [1]}, timeout=60).json()["error"]
    page = open_page(web_stack.url)
    page.goto("/")
    page.locator("#start-form input[name=stage]").first.wait_for()
    for box in page.locator("#start-form input[name=stage]").all():
        box.uncheck()
    page.check('#start-form input[name=stage][value="1"]')
    page.click("#start-button")
    box = page.locator("#start-result .error-box")
    box.wait_for()
    assert expected["code"] == "stage_not_profiled"
    assert box.locator("strong").inner_text() == expected["code"]
    assert box.locator(".error-message").inner_text() == expected["message"]
    assert httpx.get(f"{web_stack.url}/healthz", timeout=30).json()["active_capture"] is None


def test_stages_page_shows_config_and_findings(web_stack: WebStack, open_page: Any, screenshot: Any) -> None:
    page = open_page(web_stack.url)
    page.goto("/stages")
    page.locator("#stages-card .stage-block").first.wait_for()
    blocks = page.locator('#stages-card .stage-block[data-stage]')
    stage0 = page.locator('#stages-card .stage-block[data-stage="0"]')
    config = dict(
        zip(stage0.locator("table.config td.key").all_inner_texts(), stage0.locator("table.config td:not(.key)").all_inner_texts())
    )
    codes = stage0.locator(".findings code").all_inner_texts()
    assert blocks.count() == 3
    assert json.loads(config["torch_profiler_dir"]) == str(web_stack.deploy.parent / "traces" / "stage0")
    assert config["torch_profiler_with_stack"] == "false"
    assert "max_iterations_unbounded" in codes
    assert page.locator('#stages-card .stage-block[data-stage="1"]').get_by_text("no profiler").count() >= 1
    # what the server is, and which way a steps window is bounded there (GET /v1/stages' `server`)
    summary = httpx.get(f"{web_stack.url}/v1/stages", timeout=30).json()["server"]["summary"]
    assert summary.startswith("vLLM-Omni ") and page.locator("#server-line").inner_text() == f"Server {summary}"
    screenshot(page, "web-stages")


def test_token_is_asked_for_and_used(web_stack_token: WebStack, open_page: Any, screenshot: Any) -> None:
    page = open_page(web_stack_token.url)
    page.goto("/")
    page.locator("#start-form input[name=stage]").first.wait_for()
    before = page.locator("#token-state").inner_text()
    page.click("#start-button")
    dialog = page.locator("#token-dialog")
    dialog.wait_for(state="visible")
    page.fill("#token-input", "not-the-token")
    page.click("#token-ok")
    page.wait_for_selector("#token-error:has-text('rejected')")
    screenshot(page, "web-token-prompt")
    page.fill("#token-input", WEB_TOKEN)
    page.click("#token-ok")
    link = page.locator("#start-result a")
    link.wait_for(timeout=300_000)
    capture_id = link.inner_text()
    _row(page, capture_id).wait_for()
    web_stack_token.chat()
    _row(page, capture_id).locator("button", has_text="Stop").click()
    page.wait_for_selector(f'#captures-body tr[data-id="{capture_id}"][data-state="completed"]', timeout=300_000)
    posts = [r for r in page.requests if r.method == "POST"]
    auths = [r.headers.get("authorization") for r in posts]
    assert before.startswith("token needed")
    assert page.evaluate("sessionStorage.getItem('omni-sidecar.token')") == WEB_TOKEN
    assert auths[0] is None and auths[1] == "Bearer not-the-token"
    assert auths[-2:] == [f"Bearer {WEB_TOKEN}"] * 2  # the accepted start, then the stop
    assert page.locator("#token-state").inner_text().startswith("token set")


def test_with_a_token_file_the_page_reads_the_summary_and_downloads_with_the_token(
    web_stack_token: WebStack, open_page: Any, screenshot: Any
) -> None:
    # --token-file: the summary and the trace files need the token, which a plain link cannot send
    done = web_stack_token.capture("token reads")
    relpath, local = _trace_file(done, 0)
    page = open_page(web_stack_token.url)
    page.goto(f"/captures/{done['id']}")
    page.locator("#token-dialog").wait_for(state="visible")  # the summary asked for it
    page.fill("#token-input", WEB_TOKEN)
    page.click("#token-ok")
    page.locator("#capture-summary .summary-stage").first.wait_for(timeout=300_000)
    link = page.locator(f'#capture-stages .stage-block[data-stage="0"] a.download[download="{local.name}"]')
    with page.expect_download() as info:
        link.click()
    saved = Path(info.value.path())
    summaries = [r.headers.get("authorization") for r in page.requests if "/summary" in r.url]
    files = [(urlpath(r.url), r.headers.get("authorization")) for r in page.requests if "/files/" in r.url]
    assert summaries == [None, f"Bearer {WEB_TOKEN}"]  # refused without it, then asked for and sent
    assert files == [(f"/v1/captures/{done['id']}/files/{relpath}", f"Bearer {WEB_TOKEN}")]
    assert saved.read_bytes() == local.read_bytes()
    screenshot(page, "web-token-reads")


def test_no_request_leaves_localhost(web_stack: WebStack, done_capture: dict[str, Any], open_page: Any) -> None:
    page = open_page(web_stack.url)
    for path in ("/", f"/captures/{done_capture['id']}", "/stages"):
        page.goto(path)
        page.wait_for_load_state("networkidle")
    hosts = {httpx.URL(r.url).host for r in page.requests if not re.match(r"^(data|about|blob):", r.url)}
    assert len(page.requests) >= 10  # the shell, its modules, the API calls of three views
    assert page.outside == []
    assert hosts == {"127.0.0.1"}


def test_assets_are_served_from_the_package_with_a_strict_csp(web_stack: WebStack) -> None:
    shell = httpx.get(f"{web_stack.url}/captures/anything", timeout=30)
    js = httpx.get(f"{web_stack.url}/web/app.js", timeout=30)
    outside = httpx.get(f"{web_stack.url}/web/..%2F__init__.py", timeout=30)
    assert shell.status_code == 200 and "<title>omni-sidecar" in shell.text
    assert "default-src 'none'" in shell.headers["content-security-policy"]
    assert "connect-src 'self'" in shell.headers["content-security-policy"]
    assert (js.status_code, js.headers["content-type"].split(";")[0]) == (200, "text/javascript")
    assert outside.status_code == 404
    assert "/" not in httpx.get(f"{web_stack.url}/openapi.json", timeout=30).json()["paths"]


def test_a_trace_replaced_after_its_verdict_is_noted_on_the_page(web_stack: WebStack, open_page: Any) -> None:
    cap = web_stack.capture("replaced later")
    relpath, local = _trace_file(cap, 0)
    swap = local.with_name(local.name + ".swap")
    swap.write_bytes(local.read_bytes())
    os.replace(swap, local)  # the same bytes under a new inode: what a later window's write leaves
    page = open_page(web_stack.url)
    page.goto(f"/captures/{cap['id']}")
    changed = page.locator("#capture-head .notes li", has_text="files changed since the verdict")
    changed.wait_for()
    assert not any("files changed" in n for n in cap["notes"]), cap["notes"]  # the stop's own answer
    assert relpath in changed.inner_text()


# Read a TAR as a browser does (512-byte headers, ustar/GNU), find the manifest the way Perfetto's
# importer sniffs it (the first bytes, whitespace removed, start with {"perfetto_manifest"; see
# docs/fleet-clocks.md) and hand back the names, the gzip magic of each member and the manifest.
READ_ARCHIVE = """async (url) => {
  const buf = new Uint8Array(await (await fetch(url)).arrayBuffer());
  const text = (b) => new TextDecoder().decode(b).replace(/\\0[\\s\\S]*$/, '');
  const members = {};
  for (let off = 0; off + 512 <= buf.length;) {
    const h = buf.subarray(off, off + 512);
    if (h.every((b) => b === 0)) break;
    const size = parseInt(text(h.subarray(124, 136)).trim() || '0', 8);
    if (h[156] === 48 || h[156] === 0) members[text(h.subarray(0, 100))] = buf.subarray(off + 512, off + 512 + size);
    off += 512 + Math.ceil(size / 512) * 512;
  }
  const sniff = (b) => new TextDecoder().decode(b.subarray(0, 256)).replace(/\\s/g, '').startsWith('{"perfetto_manifest"');
  const manifests = Object.keys(members).filter((n) => sniff(members[n]));
  return {
    names: Object.keys(members),
    gzip: Object.fromEntries(Object.entries(members).map(([n, b]) => [n, b[0] === 0x1f && b[1] === 0x8b])),
    manifests,
    manifest: manifests.length ? JSON.parse(new TextDecoder().decode(members[manifests[0]])) : null,
  };
}"""


def test_a_fleet_archive_read_in_the_browser_has_one_manifest_that_fits_perfettos_schema(
        web_stack: WebStack, open_page: Any, tmp_path: Path) -> None:
    from sidecar.analysis.aligned import FleetSource, HostClock
    from sidecar.analysis.archive import write_archive
    from sidecar.analysis.capture import TraceSource

    clocks = [HostClock("gpu-node-a", offset_ns=250_000_000, error_ns=400_000, method="exchange"),
              HostClock("gpu-node-b", offset_ns=-1_200_000_000, error_ns=300_000, method="exchange")]
    sources = [FleetSource(TraceSource(TRACE_DATA / f"fleet_rank{i}.json.gz", stage_id=0, replica=i), f"t{i}", clocks[i])
               for i in (0, 1)]
    tar = tmp_path / "run.tar"
    write_archive(sources, tar)
    page = open_page(web_stack.url)
    page.route("**/fleet/run.tar", lambda route: route.fulfill(body=tar.read_bytes(), content_type="application/x-tar"))
    page.goto("/")
    got = page.evaluate(READ_ARCHIVE, "/fleet/run.tar")
    traces = [n for n in got["names"] if not n.startswith(".") and n != "perfetto_manifest.json"]
    assert got["manifests"] == ["perfetto_manifest.json"] and len(traces) == 2
    assert all(len(n) <= 99 for n in got["names"]) and all(got["gzip"][n] for n in traces)
    doc = got["manifest"]
    assert list(doc) == ["perfetto_manifest"]
    manifest = doc["perfetto_manifest"]
    assert manifest["version"] == 1 and set(manifest) <= {"version", "trace_time", "files", "attributes"}
    paths = [f["path"] for f in manifest["files"]]
    assert sorted(paths) == sorted(traces)  # every trace listed, each once
    for f in manifest["files"]:
        assert set(f) <= {"path", "machine", "clocks"} and isinstance(f["machine"]["name"], str) and f["machine"]["name"]
        if "clocks" in f:  # a clockless JSON pinned to another listed file's own timeline
            assert set(f["clocks"]) == {"sync_to", "offset_ns"} and f["clocks"]["sync_to"]["file"] in paths
            assert isinstance(f["clocks"]["offset_ns"], int) and f["clocks"]["offset_ns"] >= 0
    assert sum("clocks" not in f for f in manifest["files"]) == 1  # one reference
    assert {f["machine"]["name"] for f in manifest["files"]} == {"gpu-node-a", "gpu-node-b"}
    attrs = manifest["attributes"]
    assert all(k and isinstance(v, (str, int)) and not isinstance(v, bool) for k, v in attrs.items())
    assert (attrs["omni_sidecar.machine.gpu-node-a.offset_ns"], attrs["omni_sidecar.machine.gpu-node-b.offset_ns"]) == (
        250_000_000, -1_200_000_000)
