"""The Python client as a notebook or a script uses it, against a real ``omni-sidecar serve`` on
the emulator (free 127.0.0.1 ports, torn down also when a test fails): one AsyncSidecarClient
across two ``asyncio.run`` calls, arguments JSON cannot carry (numpy values, a set, a datetime),
a base URL with a query, and ids older than the sidecar's newest page of captures."""

from __future__ import annotations

import asyncio
import datetime
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from sidecar import AsyncSidecarClient, SidecarClient
from sidecar._loop_thread import LoopThread
from sidecar.api.launcher import SidecarProcess
from sidecar.control.models import Capture, CaptureState
from sidecar.errors import RequestInvalid, SettingInvalid
from tests.fixtures.emulator import EmulatorPool, make_deploy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_deploy(tmp_path_factory.mktemp("library"), {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})


@pytest.fixture(scope="module")
def emulator_url(deploy: Path, emulator_pool: EmulatorPool) -> str:
    return emulator_pool.get(deploy, extra_args=["--workers", "thread"], startup_timeout=120).url


@pytest.fixture(scope="module")
def sidecar_url(deploy: Path, emulator_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with SidecarProcess(emulator_url, deploy, state_dir=tmp_path_factory.mktemp("library-state"), env={}) as sc:
        yield sc.url


@pytest.fixture
def client(sidecar_url: str) -> Iterator[SidecarClient]:
    with SidecarClient(sidecar_url) as c:
        yield c
        if active := c.healthz()["active_capture"]:  # never left recording for the next test
            c.stop_capture(active, wait=True, timeout=60)


def _start_requests(sidecar_url: str) -> float:
    """How many ``POST /v1/captures`` the sidecar has received (its own /metrics, every status)."""
    text = httpx.get(f"{sidecar_url}/metrics", timeout=30, trust_env=False).text
    found = re.findall(r'^omni_sidecar_http_requests_total\{method="POST",route="/v1/captures",status="\d+"\} (\S+)$',
                       text, re.M)
    return sum(map(float, found))


# --- one async client, several event loops -----------------------------------------------------


def test_one_async_client_serves_two_asyncio_runs_and_closes_in_a_third(sidecar_url: str) -> None:
    # a script's pattern: the client made once, each call its own asyncio.run. The first run's
    # kept-alive connection died with its loop; reusing it raised "Event loop is closed" from httpcore
    client = AsyncSidecarClient(sidecar_url)
    first = asyncio.run(client.healthz())
    second = asyncio.run(client.healthz())
    asyncio.run(client.aclose())
    assert (first["status"], second["status"]) == ("ok", "ok")
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(client.healthz())


def test_an_async_client_in_use_on_another_running_loop_says_so_and_the_fix(sidecar_url: str) -> None:
    other = LoopThread()  # a loop that keeps running on its own thread (a notebook's, a trainer's)
    client = AsyncSidecarClient(sidecar_url)
    try:
        assert other.run(client.healthz())["status"] == "ok"
        with pytest.raises(RuntimeError) as refused:
            asyncio.run(client.healthz())
    finally:
        other.run(client.aclose())
        other.close()
    assert "async with AsyncSidecarClient(" in str(refused.value), refused.value  # the fix, as code to copy


# --- arguments JSON cannot carry -------------------------------------------------------------


def test_numpy_numbers_are_sent_as_the_numbers_they_hold(client: SidecarClient) -> None:
    # stage ids from a DataFrame or np.arange are numpy ints: json refused them with a TypeError
    cap = client.start_capture(stages=[np.int64(0), np.int32(2)], duration_s=np.float32(30.0))
    assert (cap.stages, cap.duration_s) == ([0, 2], 30.0)


@pytest.mark.parametrize(("kwargs", "field", "kind"), [
    ({"stages": {0, 2}}, "stages", "set"),
    ({"stages": np.array([0, 2])}, "stages", "ndarray"),
    ({"start_at": datetime.datetime.now(datetime.timezone.utc)}, "start_at", "datetime"),
    ({"stages": [0, object()]}, "stages[1]", "object"),
])
def test_a_value_json_cannot_carry_is_refused_naming_it_before_any_request(
    client: SidecarClient, sidecar_url: str, kwargs: dict[str, object], field: str, kind: str
) -> None:
    sent = _start_requests(sidecar_url)
    with pytest.raises(RequestInvalid) as refused:
        client.start_capture(**kwargs)
    assert (refused.value.details["field"], refused.value.details["type"], _start_requests(sidecar_url)) == (
        field, kind, sent), str(refused.value)


async def test_the_async_client_refuses_it_the_same_way(sidecar_url: str) -> None:
    async with AsyncSidecarClient(sidecar_url) as client:
        with pytest.raises(RequestInvalid) as refused:
            await client.plan(stages={0})
    assert refused.value.details["field"] == "stages"


# --- the base URL ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["?token=x", "#top", "/?x=1"])
def test_a_base_url_with_a_query_or_fragment_is_refused_when_the_client_is_built(sidecar_url: str, suffix: str) -> None:
    # every call appended its path after it: GET http://host:port?token=x/healthz reached the web page
    with pytest.raises(SettingInvalid) as refused:
        SidecarClient(sidecar_url + suffix)
    assert refused.value.details["url"] == sidecar_url + suffix


def test_a_base_url_with_a_trailing_slash_is_the_same_address(sidecar_url: str) -> None:
    with SidecarClient(sidecar_url + "/") as c:
        assert (c.base_url, c.healthz()["status"]) == (sidecar_url, "ok")


# --- ids older than the newest page --------------------------------------------------------------


OLD_HISTORY = 1001  # one past the most captures GET /v1/captures sends in one page


@pytest.fixture(scope="module")
def long_history(deploy: Path, emulator_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """A sidecar whose journal holds ``OLD_HISTORY`` finished captures (journaled by an earlier
    run), newest first: (its url, their ids)."""
    state = tmp_path_factory.mktemp("library-history")
    (state / "captures").mkdir()
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    ids = []
    for i in range(OLD_HISTORY):
        at = start + datetime.timedelta(minutes=i)
        cap = Capture(id=f"{at:%Y%m%d-%H%M%S}-{i:06x}", upstream=emulator_url, stages=[0], state=CaptureState.failed,
                      created_at=at, finished_at=at)
        (state / "captures" / f"{cap.id}.json").write_text(json.dumps(cap.model_dump(mode="json")))
        ids.append(cap.id)
    with SidecarProcess(emulator_url, deploy, state_dir=state, env={}, extra_args=["--keep", "5000"]) as sc:
        yield sc.url, ids[::-1]


def test_resolve_id_finds_a_capture_older_than_the_newest_page(long_history: tuple[str, list[str]]) -> None:
    url, ids = long_history
    oldest = ids[-1]
    with SidecarClient(url) as c:
        assert (c.resolve_id(oldest), c.resolve_id(oldest[:-2])) == (oldest, oldest)


async def test_the_async_resolve_id_reads_every_page_too(long_history: tuple[str, list[str]]) -> None:
    url, ids = long_history
    async with AsyncSidecarClient(url) as c:
        assert await c.resolve_id(ids[-1]) == ids[-1]

