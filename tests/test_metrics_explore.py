"""What an operator's Prometheus and log collector meet of a running ``omni-sidecar serve``: the
``/metrics`` text read by prometheus_client's own parser (never by pattern), the counters an alert
is built on, across captures, failures, pruned history and a restart on the same state dir, and
the log lines of expected failures. A real sidecar over a socket in front of the pooled emulator;
every wait is a poll.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.emulator import make_deploy
from tests.fixtures.sidecar import TOKEN
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow

STAGES = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}
THREAD = ["--workers", "thread"]
TERMINAL = ("completed", "degraded", "failed")
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def start(tmp_path: Path, shared_emulator_factory: Callable[..., Any],
          sidecar_factory: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:  # fmt: skip
    """``start(**opts) -> (emulator, sidecar)``: a sidecar of this test's own, with a token file,
    its log in ``tmp_path/sidecar-<n>.log``; ``opts`` go to ``SidecarProcess``."""
    deploy = make_deploy(tmp_path, STAGES)
    (tmp_path / "token").write_text(TOKEN + "\n")
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    made: list[Any] = []

    def make(**opts: Any) -> tuple[Any, Any]:
        opts.setdefault("state_dir", tmp_path / "state")
        opts.setdefault("log_path", tmp_path / f"sidecar-{len(made)}.log")
        sidecar = sidecar_factory(emu.url, deploy, token_file=tmp_path / "token", **opts)
        made.append(sidecar)
        return emu, sidecar

    return make


def scrape(url: str) -> dict[str, Any]:
    """``GET /metrics`` parsed: family name -> family."""
    reply = httpx.get(f"{url}/metrics", timeout=60)
    assert reply.status_code == 200, reply.text
    return {f.name: f for f in text_string_to_metric_families(reply.text)}


def counters(families: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter sample (``_total``) of a scrape, keyed by name and labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families.values() if f.type == "counter" for s in f.samples if s.name.endswith("_total")}


def ends(url: str) -> dict[str, float]:
    """``omni_sidecar_capture_ends_total`` per state (empty when the family is not served)."""
    family = scrape(url).get("omni_sidecar_capture_ends")
    return {s.labels["state"]: s.value for s in family.samples if s.name.endswith("_total")} if family else {}


def history(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/v1/captures", timeout=60).json()["captures"]  # type: ignore[no-any-return]


def gauge_by_state(url: str) -> dict[str, float]:
    return {s.labels["state"]: s.value for s in scrape(url)["omni_sidecar_captures"].samples}


def test_capture_ends_are_counted_though_history_is_pruned(start: Callable[..., tuple[Any, Any]]) -> None:
    """With ``--keep 1`` the history (and the per-state gauge) holds one failed capture after two
    failed starts; an alert on failures reads the counter, which says two."""
    emu, sidecar = start(extra_args=["--keep", "1"])
    assert ends(sidecar.url) == {"completed": 0, "degraded": 0, "failed": 0}  # every state there from the start
    emu.set_faults(start_500=True)
    for _ in range(2):
        reply = httpx.post(f"{sidecar.url}/v1/captures", json={}, headers=AUTH, timeout=60)
        assert reply.status_code == 502, reply.text
    assert poll(lambda: [c["state"] for c in history(sidecar.url)] == ["failed"])
    assert gauge_by_state(sidecar.url)["failed"] == 1
    assert poll(lambda: ends(sidecar.url).get("failed") == 2)


def test_counters_never_go_down_during_a_capture_and_agree_with_the_history(
        start: Callable[..., tuple[Any, Any]]) -> None:  # fmt: skip
    """Scraped by several scrapers at once all through a capture's life: every counter sample only
    grows, and at the end the per-state gauge, the ends counter and ``/v1/captures`` say the same."""
    _, sidecar = start()
    reply = httpx.post(f"{sidecar.url}/v1/captures", json={"duration_s": 1}, headers=AUTH, timeout=60)
    assert reply.status_code == 201, reply.text
    seen: list[dict[Any, float]] = []

    def ended() -> bool:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            seen.extend(pool.map(lambda _: counters(scrape(sidecar.url)), range(4)))
        return history(sidecar.url)[0]["state"] in TERMINAL

    assert poll(ended, timeout=90)
    seen.append(counters(scrape(sidecar.url)))
    # Each render is atomic and counters only grow, so the scrapes are ordered by their sums, and in
    # that order no counter sample may fall.
    highest: dict[Any, float] = {}
    for sample in sorted(seen, key=lambda c: sum(c.values())):
        for key, value in sample.items():
            assert value >= highest.get(key, 0), (key, value, highest.get(key))
            highest[key] = value
    state = history(sidecar.url)[0]["state"]
    assert gauge_by_state(sidecar.url)[state] == 1
    assert ends(sidecar.url)[state] == 1
    assert scrape(sidecar.url)["omni_sidecar_capture_active"].samples[0].value == 0


def test_a_restart_counts_from_zero_and_the_recovered_end_once(start: Callable[..., tuple[Any, Any]]) -> None:
    """A sidecar killed with a capture live, then started on the same state dir: its counters start
    at zero (Prometheus reads the drop as a reset), the recovered capture's end is counted once,
    and the per-state gauge still holds the history the journal kept."""
    _, first = start()
    reply = httpx.post(f"{first.url}/v1/captures", json={"duration_s": 600}, headers=AUTH, timeout=60)
    assert reply.status_code == 201, reply.text
    first.kill()
    _, second = start()
    assert poll(lambda: history(second.url)[0]["state"] in TERMINAL, timeout=90)
    state = history(second.url)[0]["state"]
    assert history(second.url)[0]["stop_reason"] == "stopped_on_recovery"
    assert ends(second.url) == {s: (1 if s == state else 0) for s in TERMINAL}
    assert gauge_by_state(second.url)[state] == 1


def test_families_follow_the_conventions_and_labels_stay_bounded(start: Callable[..., tuple[Any, Any]]) -> None:
    """Every family has HELP and a type; counters end in ``_total``; latencies are in seconds; a
    capture label with quotes, a newline escape and unicode, odd paths and made-up methods give no
    label outside the route templates, the known methods and the capture states; the token is never
    in the log and an expected failure logs no traceback."""
    emu, sidecar = start()
    label = 'a "quoted" \\n label } {x="y"} ünï ‮'
    reply = httpx.post(f"{sidecar.url}/v1/captures", json={"label": label, "duration_s": 1}, headers=AUTH, timeout=60)
    assert reply.status_code == 201, reply.text
    assert poll(lambda: history(sidecar.url)[0]["state"] in TERMINAL, timeout=90)
    emu.set_faults(start_500=True)
    assert httpx.post(f"{sidecar.url}/v1/captures", json={}, headers=AUTH, timeout=60).status_code == 502
    with httpx.Client(base_url=sidecar.url, timeout=60) as http:
        for path in ('/v1/captures/%22%7D%0Aevil%7B', "/nope/%E2%80%AE", "/v1/captures/x/files/a/b/c"):
            http.get(path)
        http.request("PURGE", "/healthz")
        http.post("/v1/captures", json={}, headers={"authorization": "Bearer wrong"})
    families = scrape(sidecar.url)
    for family in families.values():
        assert family.documentation, family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        for sample in family.samples:
            labels = sample.labels
            assert label not in labels.values()
            assert labels.get("method", "GET") in {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "OTHER"}
            assert labels.get("state", "failed") in {"starting", "active", "stopping", "collecting", *TERMINAL}
            route = labels.get("route")
            assert route is None or route == "<unmatched>" or route.startswith("/"), route
            assert "\n" not in "".join(labels.values())
    assert families["omni_sidecar_http_request_seconds"].type == "histogram"
    # a stop?wait=true or a held GET lasts minutes: buckets past the library's default 10 s
    bounds = {s.labels["le"] for s in families["omni_sidecar_http_request_seconds"].samples if s.name.endswith("_bucket")}
    assert {"10.0", "60.0", "600.0", "+Inf"} <= bounds, bounds
    assert {s.labels["route"] for s in families["omni_sidecar_http_requests"].samples} >= {"<unmatched>"}
    log = Path(sidecar.log_path).read_text()
    assert TOKEN not in log
    assert "Traceback" not in log, log


def test_a_token_sent_in_a_url_never_reaches_the_log(start: Callable[..., tuple[Any, Any]]) -> None:
    # curl 'http://sidecar/v1/captures?token=...' (a guess at how to pass it), or pasted as an id:
    # uvicorn's access line logged the URL as it came
    _, sidecar = start()
    with httpx.Client(base_url=sidecar.url, timeout=60) as http:
        http.get("/v1/captures", params={"token": TOKEN})
        http.get(f"/v1/captures/{TOKEN}")
        http.get("/healthz", params={"api_key": "not-the-token-but-a-key"})
        http.get("/healthz", params={"marker": "after-the-secrets"})
    log_path = Path(sidecar.log_path)
    assert poll(lambda: "after-the-secrets" in log_path.read_text())  # every line above is written
    log = log_path.read_text()
    assert TOKEN not in log and "not-the-token-but-a-key" not in log, log
    assert '"GET /v1/captures?token=*** HTTP/1.1" 200' in log, log  # a read: open without the token
