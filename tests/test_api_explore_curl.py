"""The HTTP API as people who ``curl`` it use it, through a real ``omni-sidecar serve`` (with
``--token-file``) in front of the emulator, over real sockets. An exploratory pass hit every route of
docs/api.md with bodies of the wrong type, form-encoded, empty, not UTF-8, with duplicate keys, a
top-level array, NaN / Infinity, too deep or too large; query parameters negative, NaN, inf, huge,
repeated and empty; capture ids that are unicode, very long, ``%2F``-encoded or ``..``; HEAD and
OPTIONS on every route; token header variants (``bearer``, extra spaces, Basic, a token in the query);
two starts and two stops at once; and ``/metrics`` against the captures' states. What it found is
tested here, each test failing before its fix:

- a body that is not JSON was answered before the bearer check (422 / 400 to a caller without the
  token), and not-UTF-8 or too-deep text was a bare 400 "There was an error parsing the body";
- a key given twice was read as the last one said: ``{"stages": [0], "stages": [2]}`` started a
  capture of stage 2 only;
- ``HEAD`` (``curl -I``) on every GET route was 405;
- a streamed (chunked) body over the limit was 413 without the limit;
- ``?before=`` (an empty id: an unset shell variable) answered an empty page, as if no history.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sidecar.api.guard import MAX_BODY
from tests.fixtures.emulator import EmulatorPool, emulator_state, make_deploy
from tests.fixtures.sidecar import ModuleSidecar, error_of

pytestmark = pytest.mark.slow

TOKEN = "tok-curl-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json"}
TIMEOUT = 60


@pytest.fixture(scope="module")
def _served(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    root = tmp_path_factory.mktemp("curl")
    deploy = make_deploy(root, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})
    (root / "token").write_text(TOKEN + "\n")
    yield from ModuleSidecar.for_module(
        emulator_pool, deploy, emulator_args=["--workers", "thread"], token=TOKEN, timeout=TIMEOUT,
        state_dir=root / "state", token_file=root / "token", env={"OMNI_SIDECAR_COLLECT_TIMEOUT_S": "5"},
    )  # fmt: skip


@pytest.fixture
def served(_served: ModuleSidecar) -> Iterator[ModuleSidecar]:
    yield from _served.each_test()


def post(served: ModuleSidecar, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", content=body, headers=headers, timeout=TIMEOUT)


def starts_sent(served: ModuleSidecar) -> int:
    calls = emulator_state(served.emulator)["calls"]
    return sum(c["method"] == "POST" and c["path"] == "/start_profile" for c in calls)


@pytest.mark.parametrize(("path", "body"), [
    pytest.param("/v1/captures", b'{"stages":', id="truncated"),
    pytest.param("/v1/captures", b"\xff\xfe{", id="not-utf8"),
    pytest.param("/start_profile", b"{'stages': [0]}", id="python-quotes"),
    pytest.param("/v1/captures/x/clock", b"nope", id="clock-word"),
])  # fmt: skip
def test_a_body_that_is_not_json_is_401_without_the_token(served: ModuleSidecar, path: str, body: bytes) -> None:
    # docs/api.md: the token is "checked before the request's parameters"; FastAPI reads a body first
    reply = post(served, path, body, JSON)
    assert (reply.status_code, error_of(reply)["code"]) == (401, "unauthorized"), reply.text
    assert reply.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(("body", "why"), [
    pytest.param(b'{"stages": [0], "stages": [2]}', "'stages' is given twice", id="duplicate-key"),
    pytest.param(b'{"label": "caf\xe9"}', "not UTF-8", id="latin-1"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, "nested too deeply", id="deep"),
    pytest.param(b'{"stages": [' + b"9" * 5000 + b"]}", "more than 4300 digits", id="huge-integer"),
    pytest.param(b'{"stages": [0, 2', "Expecting ',' delimiter", id="truncated"),
])  # fmt: skip
def test_a_body_the_api_cannot_read_is_422_saying_why_and_starts_nothing(served: ModuleSidecar, body: bytes,
                                                                         why: str) -> None:
    reply = post(served, "/v1/captures", body, {**JSON, **AUTH})
    err = error_of(reply)
    assert (reply.status_code, err["code"]) == (422, "request_invalid"), reply.text
    assert why in err["message"] and "content-type: application/json" in err["message"], err["message"]
    assert served.client().healthz()["active_capture"] is None
    assert starts_sent(served) == 0


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/v1/stages", "/v1/captures", "/metrics", "/", "/docs"])
def test_head_answers_every_get_route_as_get_without_the_body(served: ModuleSidecar, path: str) -> None:
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
        got, head = http.get(path), http.head(path)
    assert (head.status_code, head.content) == (got.status_code, b""), head.text
    assert head.headers["content-type"] == got.headers["content-type"]


def test_allow_names_head_where_get_is_and_only_there(served: ModuleSidecar) -> None:
    on_get = httpx.post(f"{served.url}/healthz", timeout=TIMEOUT)
    on_post = httpx.head(f"{served.url}/start_profile", headers=AUTH, timeout=TIMEOUT)
    assert (on_get.status_code, on_get.headers["allow"]) == (405, "GET, HEAD")
    assert (on_post.status_code, on_post.headers["allow"]) == (405, "POST")


def test_a_streamed_body_over_the_limit_is_413_naming_the_limit(served: ModuleSidecar) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked, as `curl -T -` does
        for _ in range(MAX_BODY // 65536 + 2):
            yield b" " * 65536

    reply = httpx.post(f"{served.url}/v1/captures", content=chunks(), headers={**JSON, **AUTH}, timeout=TIMEOUT)
    err = error_of(reply)
    assert (reply.status_code, err["code"], err["details"]) == (413, "body_too_large", {"max_bytes": MAX_BODY})
    assert str(MAX_BODY) in err["message"]


def test_an_empty_before_is_refused_not_an_empty_page(served: ModuleSidecar) -> None:
    with served.client() as client:
        cap = client.start_capture([0])
        client.stop_capture(cap.id, wait=True, timeout=TIMEOUT)
    reply = httpx.get(f"{served.url}/v1/captures", params={"before": ""}, timeout=TIMEOUT)
    err: dict[str, Any] = error_of(reply)
    assert (reply.status_code, err["code"]) == (422, "request_invalid"), reply.text
    assert "before" in err["message"]


@pytest.mark.parametrize(("path", "body", "field"), [
    pytest.param("/v1/captures", b'{"stages": [0], "duration_s": "10"}', "duration_s", id="duration-string"),
    pytest.param("/v1/captures", b'{"stages": [0], "duration_s": true}', "duration_s", id="duration-true"),
    pytest.param("/v1/captures", b'{"stages": [0], "lease_s": "30"}', "lease_s", id="lease-string"),
    pytest.param("/v1/plan", b'{"stages": [0], "budget_mb": "50"}', "budget_mb", id="budget-string"),
    pytest.param("/v1/plan", b'{"stages": [0], "max_stop_s": true}', "max_stop_s", id="max-stop-true"),
])  # fmt: skip
def test_seconds_and_megabytes_are_json_numbers_not_strings_or_booleans(served: ModuleSidecar, path: str,
                                                                        body: bytes, field: str) -> None:
    # as stages, steps and start_at are: "10" is not 10 seconds, true is not 1
    reply = post(served, path, body, {**JSON, **AUTH})
    err = error_of(reply)
    assert (reply.status_code, err["code"]) == (422, "request_invalid"), reply.text
    assert field in err["message"] and "must be a JSON number" in err["message"], err["message"]
    assert served.client().healthz()["active_capture"] is None
    assert starts_sent(served) == 0
