"""Hostile traces under a real ``omni-sidecar serve`` (issue 20, items 9-11): a finished capture's
trace replaced by a 1 GiB gzip bomb, by JSON nested 1,000 deep, by a link out of its session folder
or by a FIFO. ``/summary``, ``/timeline`` and ``/diff`` answer 422 (``trace_too_large`` /
``trace_invalid``) or 404 naming why, the server's peak RSS stays where it was (the analysis runs
in a memory-capped worker), a live capture carries on, and the capture record is unchanged."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.emulator import EmulatorPool, make_deploy
from tests.fixtures.hostile import write_hostile
from tests.fixtures.sidecar import ModuleSidecar

pytestmark = pytest.mark.slow

STAGES = {0: {"profiler": "torch"}}
THREAD = ["--workers", "thread"]
FAST = {"OMNI_SIDECAR_COLLECT_TIMEOUT_S": "10", "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "20"}
WAIT = 120
FAMILY = {"trace_invalid", "trace_too_large"}


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    root = tmp_path_factory.mktemp("hostile-served")
    deploy = make_deploy(root, STAGES)
    yield from ModuleSidecar.for_module(emulator_pool, deploy, emulator_args=THREAD, timeout=WAIT,
                                        state_dir=root / "state", env=FAST)  # fmt: skip


@pytest.fixture
def shared(_shared: ModuleSidecar) -> Iterator[ModuleSidecar]:
    yield from _shared.each_test(settle_timeout=WAIT)


def _post(shared: ModuleSidecar, path: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{shared.url}{path}", timeout=WAIT, **kw)


def _get(shared: ModuleSidecar, path: str) -> httpx.Response:
    return httpx.get(f"{shared.url}{path}", timeout=WAIT)


def _finished(shared: ModuleSidecar) -> tuple[str, Path, dict[str, Any]]:
    """A completed capture with a real trace: its id, the trace's local path, and the record."""
    cid = _post(shared, "/v1/captures", json={"stages": [0]}).json()["id"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert shared.emulator.http.post("/v1/chat/completions", json=body, timeout=WAIT).status_code == 200
    done = _post(shared, f"/v1/captures/{cid}/stop", params={"wait": "true"}).json()
    assert done["state"] == "completed", done
    session = done["verdicts"][0]["sessions"][0]
    trace = next(f["name"] for f in session["files"] if f["name"].startswith("trace_rank0.json"))
    path = Path(session["local_path"]) / trace
    if not path.exists():  # listed as .json, gzipped since
        path = path.with_name(path.name + ".gz")
    assert path.is_file()
    return cid, path, done


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), from /proc: what any moment of the request cost."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc status")


def _replace(path: Path, make: Any) -> None:
    path.unlink()
    make(path)


def test_a_gzip_bomb_is_422_and_costs_the_server_nothing(shared: ModuleSidecar, tmp_path: Path) -> None:
    cid, trace, before = _finished(shared)
    bomb = write_hostile(tmp_path, "bomb", 1 << 30)  # 1 MB on disk, one 1 GiB string inside
    _replace(trace, lambda p: shutil.copyfile(bomb, p))
    live = _post(shared, "/v1/captures", json={"stages": [0]}).json()["id"]
    pid = shared.sidecar.pid
    assert pid is not None
    peak_before = _peak_rss_mb(pid)
    replies = [_get(shared, f"/v1/captures/{cid}/summary?top=7"), _get(shared, f"/v1/captures/{cid}/timeline"),
               _get(shared, f"/v1/captures/{cid}/diff/{cid}")]  # fmt: skip
    peak_after = _peak_rss_mb(pid)
    assert [r.status_code for r in replies] == [422, 422, 422], [r.text[:300] for r in replies]
    assert {r.json()["error"]["code"] for r in replies} <= FAMILY
    assert replies[0].json()["error"]["code"] == "trace_too_large"
    assert peak_after - peak_before < 50, (peak_before, peak_after)  # MB; the old reader took GBs here
    # the live capture carried on, and the finished one is as it was
    assert _get(shared, f"/v1/captures/{live}").json()["state"] == "active"
    assert _post(shared, f"/v1/captures/{live}/stop", params={"wait": "true"}).json()["state"] in ("completed", "degraded")
    after = _get(shared, f"/v1/captures/{cid}").json()
    assert (after["state"], after["verdicts"]) == (before["state"], before["verdicts"])


def test_json_nested_1000_deep_is_422_trace_invalid_everywhere(shared: ModuleSidecar, tmp_path: Path) -> None:
    cid, trace, _ = _finished(shared)
    deep = write_hostile(tmp_path, "deep")
    _replace(trace, lambda p: shutil.copyfile(deep, p))
    replies = [_get(shared, f"/v1/captures/{cid}/summary?top=6"), _get(shared, f"/v1/captures/{cid}/timeline"),
               _get(shared, f"/v1/captures/{cid}/diff/{cid}")]  # fmt: skip
    assert [(r.status_code, r.json()["error"]["code"]) for r in replies] == [(422, "trace_invalid")] * 3
    assert all("nests JSON deeper" in r.json()["error"]["message"] for r in replies)


def test_a_trace_linked_out_of_its_session_folder_is_not_read(shared: ModuleSidecar, tmp_path: Path) -> None:
    cid, trace, _ = _finished(shared)
    outside = tmp_path / "elsewhere" / trace.name
    outside.parent.mkdir()
    shutil.copyfile(trace, outside)  # a readable trace: only the rule can refuse it
    _replace(trace, lambda p: p.symlink_to(outside))
    summary = _get(shared, f"/v1/captures/{cid}/summary?top=5")
    timeline = _get(shared, f"/v1/captures/{cid}/timeline")
    download = _get(shared, f"/v1/captures/{cid}/files/{trace.parent.name}/{trace.name}")
    assert [r.status_code for r in (summary, timeline, download)] == [404, 404, 404]
    for r in (summary, timeline):
        assert r.json()["error"]["code"] == "summary_unavailable"
        assert "link out of its session folder" in r.json()["error"]["message"]


def test_a_fifo_in_place_of_a_trace_is_skipped_with_a_reason(shared: ModuleSidecar) -> None:
    cid, trace, _ = _finished(shared)
    _replace(trace, lambda p: os.mkfifo(p))
    summary = _get(shared, f"/v1/captures/{cid}/summary?top=4")
    timeline = _get(shared, f"/v1/captures/{cid}/timeline")
    assert [r.status_code for r in (summary, timeline)] == [404, 404]
    assert all("is a FIFO, not a trace file" in r.json()["error"]["message"] for r in (summary, timeline))
    assert _get(shared, "/healthz").status_code == 200


def test_a_number_no_profiler_writes_leaves_its_event_out_and_the_summary_says_so(shared: ModuleSidecar) -> None:
    """A memory event whose ``Bytes`` no 64-bit allocator holds (the analysis overflowed on it),
    and a kernel starting at ``1e400`` (no float64 holds it: the slice was read as cut off there)."""
    import gzip
    import json

    cid, trace, _ = _finished(shared)
    raw = gzip.decompress(trace.read_bytes()) if trace.name.endswith(".gz") else trace.read_bytes()
    doc = json.loads(raw)
    n = len(doc["traceEvents"])
    doc["traceEvents"][n // 2 : n // 2] = [
        {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": 1.0,
         "args": {"Bytes": 123456789.25, "Addr": 1, "Device Id": -1, "Device Type": 0}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 987654321.25, "dur": 1.0},
    ]
    text = json.dumps(doc).replace("123456789.25", str(10**23)).replace("987654321.25", "1e400").encode()
    _replace(trace, lambda p: p.write_bytes(gzip.compress(text) if p.name.endswith(".gz") else text))
    summary = _get(shared, f"/v1/captures/{cid}/summary?top=5")
    assert summary.status_code == 200, summary.text[:500]
    body = summary.json()
    assert any("2 events left out: a timestamp or duration past ±2^53 µs, a negative duration, or an allocator figure "
               "past 64 bits" in w
               for w in body["warnings"]), body["warnings"]
    assert not body["truncated"] and body["totals"]["events"] == n  # every other event read
    timeline = _get(shared, f"/v1/captures/{cid}/timeline")
    assert timeline.status_code == 200, timeline.text[:300]
