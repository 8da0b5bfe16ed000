"""The HTTP routes of the analysis: a capture's timeline and the diff of two captures, on the
real app and controller over a real fake-upstream socket (the ``api`` fixture of test_api)."""

from __future__ import annotations

import gzip
import json
import os
from typing import Any

from tests.fixtures.sidecar import AppClient, error_of  # noqa: F401  (the `api` fixture is a plugin)


async def _capture(client: Any, stages: list[int]) -> str:
    cap = (await client.post("/v1/captures", json={"stages": stages})).json()
    done = await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true", "timeout": 30})
    assert done.json()["state"] == "completed", done.json()
    return cap["id"]


async def test_timeline_route_serves_one_process_per_stage(api: AppClient) -> None:  # noqa: F811
    client = await api()
    cid = await _capture(client, [0, 2])
    reply = await client.get(f"/v1/captures/{cid}/timeline", timeout=60)
    doc = json.loads(gzip.decompress(reply.content))
    names = sorted(e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name")
    assert (reply.status_code, names) == (200, ["stage 0 · replica 0 · rank 0 (llm)", "stage 2 · replica 0 · rank 0 (llm)"])


async def test_timeline_of_one_stage_holds_that_stage_only_and_says_it_is_slim(api: AppClient) -> None:  # noqa: F811
    # the page's "Open in Perfetto" of a trace over 64 MiB asks for this; the route ignored ?stage=
    # and sent the whole merged timeline of every stage (docs/web.md promised a slim one, or 404)
    client = await api()
    cid = await _capture(client, [0, 2])
    reply = await client.get(f"/v1/captures/{cid}/timeline", params={"stage": 2}, timeout=60)
    doc = json.loads(gzip.decompress(reply.content))
    names = sorted(e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name")
    assert (reply.status_code, names) == (200, ["stage 2 · replica 0 · rank 0 (llm)"]), reply.text[:300]
    assert "omni_sidecar_slim" in doc["otherData"]
    assert f'filename="{cid}.timeline.stage2.json.gz"' in reply.headers["content-disposition"]
    whole = json.loads(gzip.decompress((await client.get(f"/v1/captures/{cid}/timeline", timeout=60)).content))
    assert len([e for e in whole["traceEvents"] if e.get("name") == "process_name"]) == 2  # each cached apart
    unknown = await client.get(f"/v1/captures/{cid}/timeline", params={"stage": 1}, timeout=60)
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (422, "stage_unknown"), unknown.text


async def test_diff_route_compares_two_captures_per_stage(api: AppClient) -> None:  # noqa: F811
    from sidecar.analysis.diff import diff_paths
    from sidecar.control import artifacts

    client = await api()
    a = await _capture(client, [0, 2])
    b = await _capture(client, [0])
    reply = await client.get(f"/v1/captures/{a}/diff/{b}", params={"top": 5}, timeout=60)
    body = reply.json()
    assert (reply.status_code, body["a"], [s["stage_id"] for s in body["stages"]]) == (200, a, [0, 2])
    # from the captures' one analysis each, shared with their summaries: a diff of the traces read
    # again with every row is the same
    controller = client.sidecar_app.state.controller
    fresh = diff_paths(*(artifacts.trace_files(controller.get(c).verdicts)[0] for c in (a, b)), top=5, label_a=a, label_b=b)
    assert body == fresh.model_dump(mode="json")
    assert body["total"]["ops_by_self_cpu"] and body["stages"][0]["kernels"] == []  # CPU traces
    analyses = controller._summaries.analyses
    assert analyses == 2  # one per capture
    again = await client.get(f"/v1/captures/{b}/diff/{a}", params={"top": 3}, timeout=60)
    summary = await client.get(f"/v1/captures/{a}/summary", params={"top": 7}, timeout=60)
    assert (again.status_code, summary.status_code, controller._summaries.analyses) == (200, 200, analyses)
    assert (again.json()["a"], again.json()["b"]) == (b, a)
    import httpx

    from sidecar.client import AsyncSidecarClient

    async with AsyncSidecarClient(str(client.base_url), transport=httpx.ASGITransport(app=client.sidecar_app)) as typed:
        assert (await typed.diff(a, b, top=5)).model_dump(mode="json") == body  # the client's call is the route's


async def test_diff_route_reads_the_traces_again_where_a_summary_table_was_cut(api: AppClient, monkeypatch) -> None:  # noqa: F811
    from sidecar.analysis.diff import diff_paths
    from sidecar.api.routes import analysis
    from sidecar.control import artifacts

    monkeypatch.setattr(analysis, "SUMMARY_TOP_MAX", 1)  # every table with a row is "cut" at one row
    client = await api()
    a = await _capture(client, [0, 2])
    b = await _capture(client, [0])
    reply = await client.get(f"/v1/captures/{a}/diff/{b}", params={"top": 5}, timeout=60)
    controller = client.sidecar_app.state.controller
    fresh = diff_paths(*(artifacts.trace_files(controller.get(c).verdicts)[0] for c in (a, b)), top=5, label_a=a, label_b=b)
    assert (reply.status_code, reply.json()) == (200, fresh.model_dump(mode="json"))


async def test_timeline_of_an_active_capture_is_409(api: AppClient) -> None:  # noqa: F811
    client = await api()
    cap = (await client.post("/v1/captures", json={"stages": [0]})).json()
    reply = await client.get(f"/v1/captures/{cap['id']}/timeline")
    assert (reply.status_code, error_of(reply)["code"]) == (409, "capture_not_terminal")


async def test_summary_route_serves_the_attribution_fields(api: AppClient) -> None:  # noqa: F811
    # the fake upstream writes CPU-only traces without baseTimeNanoseconds: the fields are there,
    # and say nothing (no GPU: no device, no finding, no common window), rather than made-up figures
    client = await api()
    cid = await _capture(client, [0])
    data = (await client.get(f"/v1/captures/{cid}/summary", timeout=60)).json()
    assert (data["findings"], data["common_window"], data["devices"]) == ([], None, [])
    assert data["totals"]["cpu_ops"] > 0


def _add_device_link(controller: Any, cid: str) -> str:
    """A trace-named link to a device in the capture's first session folder: a rank no one can read."""
    from pathlib import Path

    session = next(s for v in controller.get(cid).verdicts for s in v.sessions if s.local_path)
    folder = Path(session.local_path)
    (folder / "trace_rank7.json.gz").symlink_to("/dev/zero")
    for f in folder.iterdir():  # a trace touched: the summary made at collection is made again, now
        if f.name.startswith("trace_rank0"):
            os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000))
    return f"{folder.name}/trace_rank7.json.gz is a character device"


async def test_summary_route_names_a_trace_named_entry_it_cannot_read(api: AppClient) -> None:  # noqa: F811
    client = await api()
    cid = await _capture(client, [0])
    said = _add_device_link(client.sidecar_app.state.controller, cid)
    data = (await client.get(f"/v1/captures/{cid}/summary", timeout=60)).json()
    assert (data["totals"]["cpu_ops"] > 0, [w for w in data["warnings"] if said in w] != []) == (True, True), data["warnings"]


async def test_timeline_route_names_what_it_could_not_read_and_its_gzip_names_the_file(api: AppClient) -> None:  # noqa: F811
    client = await api()
    cid = await _capture(client, [0])
    said = _add_device_link(client.sidecar_app.state.controller, cid)
    reply = await client.get(f"/v1/captures/{cid}/timeline", timeout=60)
    not_read = json.loads(gzip.decompress(reply.content))["otherData"].get("omni_sidecar_not_read", [])
    assert (reply.status_code, [m for m in not_read if said in m] != []) == (200, True), not_read
    assert reply.content[10:reply.content.index(b"\0", 10)] == f"{cid}.timeline.json".encode()  # not ....json.gz.tmp
