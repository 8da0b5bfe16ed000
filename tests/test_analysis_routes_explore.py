"""The analysis and download routes as a demanding client calls them, against a real
``omni-sidecar serve`` (with ``--token-file``) over the pooled emulator: a gzip trace is sent as
gzip, ``HEAD`` and ``Range`` on a download answer as HTTP says and errors keep the API's shape, a
capture's timeline outlives its deleted traces like its summary; and ``omni-sidecar summarize`` of
traces that were not recorded at one time says so."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.emulator import EmulatorPool, make_deploy
from tests.fixtures.sidecar import ModuleSidecar

pytestmark = pytest.mark.slow

STAGES = {0: {"profiler": "torch"}}
THREAD = ["--workers", "thread"]
FAST = {"OMNI_SIDECAR_COLLECT_TIMEOUT_S": "10", "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "20"}
WAIT = 120
TOKEN = "explore-token-1234"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRACES = Path(__file__).parent / "data" / "traces"
APART = "these traces do not come from one window"


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    root = tmp_path_factory.mktemp("routes-explore")
    deploy = make_deploy(root, STAGES)
    token = root / "token"
    token.write_text(TOKEN + "\n")
    yield from ModuleSidecar.for_module(emulator_pool, deploy, emulator_args=THREAD, timeout=WAIT, token=TOKEN,
                                        token_file=token, state_dir=root / "state", env=FAST)  # fmt: skip


@pytest.fixture
def shared(_shared: ModuleSidecar) -> Iterator[ModuleSidecar]:
    yield from _shared.each_test(settle_timeout=WAIT)


def _finished(shared: ModuleSidecar) -> tuple[str, str, Path]:
    """A completed capture with a gzip trace: its id, the trace's download path, its local path."""
    cid = httpx.post(f"{shared.url}/v1/captures", json={"stages": [0]}, headers=AUTH, timeout=WAIT).json()["id"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert shared.emulator.http.post("/v1/chat/completions", json=body, timeout=WAIT).status_code == 200
    done = httpx.post(f"{shared.url}/v1/captures/{cid}/stop", params={"wait": "true"}, headers=AUTH, timeout=WAIT).json()
    assert done["state"] == "completed", done
    session = done["verdicts"][0]["sessions"][0]
    local = Path(session["local_path"])
    name = next(f["name"] for f in session["files"] if f["name"].startswith("trace_rank0.json"))
    if not (local / name).exists():  # listed as .json, gzipped since
        name += ".gz"
    assert name.endswith(".gz") and (local / name).is_file(), name
    return cid, f"/v1/captures/{cid}/files/{session['path'].rsplit('/', 1)[-1]}/{name}", local / name


def _error(reply: httpx.Response) -> dict[str, Any]:
    assert reply.headers["content-type"] == "application/json", (reply.status_code, reply.headers, reply.content[:200])
    return reply.json()["error"]  # type: ignore[no-any-return]


def test_a_gzip_trace_is_sent_as_gzip_and_head_gives_its_size(shared: ModuleSidecar) -> None:
    _, url, local = _finished(shared)
    with httpx.Client(base_url=shared.url, headers=AUTH, timeout=WAIT) as c:
        got = c.get(url)
        # gzip bytes, never labelled JSON (no Content-Encoding is sent: the client keeps the .gz)
        assert (got.status_code, got.headers["content-type"], got.content) == (200, "application/gzip", local.read_bytes())
        assert "content-encoding" not in got.headers
        json.loads(gzip.decompress(got.content))
        head = c.head(url)
        assert (head.status_code, head.headers["content-type"], head.headers["content-length"], head.content) == (
            200, "application/gzip", str(local.stat().st_size), b"")
        missing = c.head(url + ".nope")
        assert missing.status_code == 404
    assert httpx.head(f"{shared.url}{url}", timeout=WAIT).status_code == 401  # the token, as GET


def test_a_range_past_the_end_is_416_in_the_error_shape_and_a_bad_one_is_ignored(shared: ModuleSidecar) -> None:
    _, url, local = _finished(shared)
    data, size = local.read_bytes(), local.stat().st_size
    with httpx.Client(base_url=shared.url, headers=AUTH, timeout=WAIT) as c:
        part = c.get(url, headers={"Range": "bytes=0-9"})
        assert (part.status_code, part.content, part.headers["content-range"]) == (206, data[:10], f"bytes 0-9/{size}")
        past = c.get(url, headers={"Range": f"bytes={size + 10}-"})
        assert (past.status_code, _error(past)["code"], past.headers["content-range"]) == (416, "http_error", f"bytes */{size}")
        for ignored in ("items=0-1", "bytes=5-2", "bytes=abc", "nonsense"):  # RFC 9110: may (another unit: must) ignore
            whole = c.get(url, headers={"Range": ignored})
            assert (whole.status_code, whole.content) == (200, data), ignored


def test_a_timeline_outlives_its_deleted_traces_as_the_summary_does(shared: ModuleSidecar) -> None:
    cid, _, local = _finished(shared)
    with httpx.Client(base_url=shared.url, headers=AUTH, timeout=WAIT) as c:
        first = c.get(f"/v1/captures/{cid}/timeline")
        summary = c.get(f"/v1/captures/{cid}/summary")
        assert (first.status_code, summary.status_code) == (200, 200)
        shutil.rmtree(local.parent)
        again = c.get(f"/v1/captures/{cid}/timeline")
        assert (again.status_code, again.content) == (200, first.content)
        assert c.get(f"/v1/captures/{cid}/summary").json() == summary.json()
        assert c.get("/v1/captures/nope/timeline").status_code == 404


def _summarize(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", "summarize", *args], capture_output=True, text=True,
                          timeout=WAIT, env={**os.environ, "COLUMNS": "200"})


def test_summarize_of_two_unrelated_bare_traces_says_they_are_not_one_window() -> None:
    a, b = str(TRACES / "cuda_small.json.gz"), str(TRACES / "host_bound.json.gz")
    as_json = _summarize(a, b, "--json")
    assert as_json.returncode == 0, as_json.stderr
    warned = [w for w in json.loads(as_json.stdout)["warnings"] if w.startswith(APART)]
    assert len(warned) == 1 and a in warned[0] and b in warned[0] and "32.4 h" in warned[0], warned
    table = _summarize(a, b)
    assert table.returncode == 0 and f"warning: {APART}" in table.stderr, table.stderr


def test_summarize_of_traces_that_belong_together_has_no_such_warning() -> None:
    for pair in (("fleet_rank0", "fleet_rank1"), ("comm_rank0", "comm_rank1")):  # the ranks of one job
        out = _summarize(*(str(TRACES / f"{n}.json.gz") for n in pair), "--json")
        assert out.returncode == 0, out.stderr
        assert not [w for w in json.loads(out.stdout)["warnings"] if w.startswith(APART)], pair


def test_a_capture_summary_over_http_has_no_such_warning(shared: ModuleSidecar) -> None:
    cid, _, _ = _finished(shared)
    reply = httpx.get(f"{shared.url}/v1/captures/{cid}/summary", headers=AUTH, timeout=WAIT)
    assert reply.status_code == 200 and not [w for w in reply.json()["warnings"] if w.startswith(APART)]
