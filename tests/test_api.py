"""HTTP API in process: the real FastAPI app and CaptureController over a real fake-upstream socket
(``FakeOmni``), driven through httpx's ASGI transport with the app's lifespan running."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest

from sidecar.config.models import DeployConfig
from tests.fixtures.sidecar import TOKEN, AppClient, error_of


async def test_start_then_overlap_is_409_with_active_id(api: AppClient) -> None:
    client = await api()
    first = await client.post("/v1/captures", json={"stages": [0, 2]})
    assert first.status_code == 201
    second = await client.post("/v1/captures", json={"stages": [0]})
    assert second.status_code == 409
    err = error_of(second)
    assert (err["code"], err["details"]["active_id"]) == ("capture_active", first.json()["id"])


async def test_stop_wait_completes_with_ok_per_stage(api: AppClient) -> None:
    client = await api()
    cap = (await client.post("/v1/captures", json={"stages": [0, 2]})).json()
    reply = await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true"})
    assert reply.status_code == 200
    done = reply.json()
    assert done["state"] == "completed"
    assert {v["stage_id"]: v["verdict"] for v in done["verdicts"]} == {0: "ok", 2: "ok"}




async def test_post_without_body_captures_every_profiled_stage(api: AppClient) -> None:
    client = await api()
    reply = await client.post("/v1/captures")
    assert (reply.status_code, reply.json().get("stages")) == (201, [0, 2])


async def test_stop_without_wait_is_202(api: AppClient) -> None:
    client = await api()
    cap = (await client.post("/v1/captures", json={"stages": [0]})).json()
    reply = await client.post(f"/v1/captures/{cap['id']}/stop")
    assert (reply.status_code, reply.json()["state"]) == (202, "stopping")


@pytest.mark.parametrize(
    ("stages", "code"),
    [([], "stages_empty"), ([0, 0], "stage_duplicate"), ([7], "stage_unknown"), ([1], "stage_not_profiled")],
)
async def test_bad_stage_sets_are_422_without_upstream_call(
    api: AppClient, fake_omni: Any, stages: list[int], code: str
) -> None:
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": stages})
    assert (reply.status_code, error_of(reply)["code"], fake_omni.starts()) == (422, code, [])


async def test_request_validation_errors_use_the_error_shape(api: AppClient) -> None:
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": "all", "bogus": 1})
    assert (reply.status_code, error_of(reply)["code"]) == (422, "request_invalid")


async def test_unknown_route_is_404_in_the_error_shape(api: AppClient) -> None:
    client = await api()
    reply = await client.get("/v1/nope")
    assert (reply.status_code, error_of(reply)["code"]) == (404, "not_found")


async def test_unknown_capture_is_404(api: AppClient) -> None:
    client = await api()
    reply = await client.get("/v1/captures/does-not-exist")
    assert (reply.status_code, error_of(reply)["code"]) == (404, "capture_not_found")


async def test_upstream_500_on_start_is_502_and_capture_failed(api: AppClient, fake_omni: Any) -> None:
    client = await api()
    fake_omni.start_status = 500
    reply = await client.post("/v1/captures", json={"stages": [0]})
    listed = (await client.get("/v1/captures")).json()["captures"]
    assert (reply.status_code, [c["state"] for c in listed]) == (502, ["failed"])


async def test_mutating_routes_need_the_token(api: AppClient) -> None:
    client = await api(token=True)
    replies = [
        await client.post("/v1/captures", json={}),
        await client.post("/v1/captures/x/stop"),
        await client.post("/v1/captures/x/heartbeat"),
        await client.post("/start_profile"),
        await client.post("/stop_profile"),
    ]
    assert [(r.status_code, error_of(r)["code"]) for r in replies] == [(401, "unauthorized")] * 5


async def test_wrong_token_is_401_and_right_token_is_201(api: AppClient) -> None:
    client = await api(token=True)
    wrong = await client.post("/v1/captures", json={}, headers={"Authorization": "Bearer nope"})
    right = await client.post("/v1/captures", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert (wrong.status_code, right.status_code) == (401, 201)


async def test_read_routes_do_not_need_the_token(api: AppClient) -> None:
    client = await api(token=True)
    codes = [(await client.get(p)).status_code for p in ("/healthz", "/v1/captures", "/v1/stages", "/metrics")]
    assert codes == [200, 200, 200, 200]


async def test_file_download_serves_the_trace(api: AppClient) -> None:
    client = await api()
    cap = (await client.post("/v1/captures", json={"stages": [0]})).json()
    done = (await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true"})).json()
    session = done["verdicts"][0]["sessions"][0]
    name = next(f["name"] for f in session["files"] if f["name"].startswith("trace_"))
    rel = f"{Path(session['path']).name}/{name}"
    reply = await client.get(f"/v1/captures/{cap['id']}/files/{rel}")
    assert (reply.status_code, len(reply.content)) == (200, next(f["size"] for f in session["files"] if f["name"] == name))


async def test_file_download_is_confined(api: AppClient) -> None:
    client = await api()
    cap = (await client.post("/v1/captures", json={"stages": [0]})).json()
    await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true"})
    reply = await client.get(f"/v1/captures/{cap['id']}/files/..%2F..%2F..%2Fetc%2Fpasswd")
    assert (reply.status_code, error_of(reply)["code"]) == (404, "artifact_not_found")


async def _completed(client: Any, headers: dict[str, str] | None = None) -> tuple[str, str]:
    """A completed capture of stage 0: its id and its trace's ``<session folder>/<file>``."""
    cap = (await client.post("/v1/captures", json={"stages": [0]}, headers=headers)).json()
    done = (await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true"}, headers=headers)).json()
    session = done["verdicts"][0]["sessions"][0]
    name = next(f["name"] for f in session["files"] if f["name"].startswith("trace_"))
    return cap["id"], f"{Path(session['path']).name}/{name}"


def _content_reads(cid: str, rel: str) -> list[str]:
    """The reads that run an analysis or return trace content."""
    return [f"/v1/captures/{cid}/summary", f"/v1/captures/{cid}/summary?top=0", f"/v1/captures/{cid}/timeline",
            f"/v1/captures/{cid}/diff/{cid}", f"/v1/captures/{cid}/files/{rel}"]


async def test_with_a_token_file_reads_of_trace_content_need_the_token(api: AppClient) -> None:
    client = await api(token=True)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cid, rel = await _completed(client, auth)
    reads = _content_reads(cid, rel)
    without = [await client.get(path) for path in reads]  # ?top=0 too: the token is checked first
    wrong = [await client.get(path, headers={"Authorization": "Bearer nope"}) for path in reads]
    right = [await client.get(path, headers=auth) for path in reads]
    assert [(r.status_code, error_of(r)["code"]) for r in without + wrong] == [(401, "unauthorized")] * 10
    assert [r.status_code for r in right] == [200, 422, 200, 200, 200]
    # the document says which reads may answer 401: these, and not a capture's own record
    spec = (await client.get("/openapi.json")).json()["paths"]
    guarded = ["/v1/captures/{capture_id}/summary", "/v1/captures/{capture_id}/timeline", "/v1/captures/{a}/diff/{b}",
               "/v1/captures/{capture_id}/files/{relpath}", "/v1/captures/{capture_id}"]
    assert ["401" in spec[path]["get"]["responses"] for path in guarded] == [True, True, True, True, False]


async def test_without_a_token_file_reads_of_trace_content_stay_open(api: AppClient) -> None:
    client = await api()
    cid, rel = await _completed(client)
    assert [(await client.get(path)).status_code for path in _content_reads(cid, rel)] == [200, 422, 200, 200, 200]


def _count_summaries(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``top`` of each summary analysis from now on: each runs in the memory-capped worker."""
    from sidecar.analysis import isolated

    analyses: list[Any] = []
    run = isolated.run_isolated

    def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn.__name__ == "summarize_paths":
            analyses.append(kwargs.get("top"))
        return run(fn, *args, **kwargs)

    monkeypatch.setattr(isolated, "run_isolated", counted)
    return analyses


def _rich_trace(client: Any, cid: str) -> tuple[Path, Any]:
    """The capture's one trace rewritten with a real one (ops, kernels, memcpy; the fake server's
    holds one op): its path, and the capture."""
    from sidecar.control import artifacts

    cap = client.sidecar_app.state.controller.get(cid)
    (path,), _ = artifacts.trace_files(cap.verdicts)
    rich = (Path(__file__).parent / "data" / "traces" / "cuda_small.json.gz").read_bytes()
    path.write_bytes(rich if path.suffix == ".gz" else gzip.decompress(rich))
    return path, cap


async def test_summaries_of_many_tops_cost_one_analysis(api: AppClient, monkeypatch: pytest.MonkeyPatch) -> None:
    analyses = _count_summaries(monkeypatch)
    client = await api()
    cid, _ = await _completed(client)
    tops = [1, 2, 7, 20, 99, 250, 500, 3]
    replies = [await client.get(f"/v1/captures/{cid}/summary", params={"top": top}) for top in tops]
    again = await client.get(f"/v1/captures/{cid}/summary")  # the default, 20, as the page asks
    assert [r.status_code for r in [*replies, again]] == [200] * (len(tops) + 1)
    assert analyses == [500]  # one analysis, at the most rows the API serves; every top is cut from it
    assert again.json() == replies[tops.index(20)].json()


async def test_a_capture_is_analysed_again_only_when_its_trace_is_replaced(
    api: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    analyses = _count_summaries(monkeypatch)
    client = await api(control={"summarize": False})
    cid, _ = await _completed(client)
    url = f"/v1/captures/{cid}/summary"
    first = [(await client.get(url, params={"top": top})).json() for top in (5, 20)]
    path, _ = _rich_trace(client, cid)  # rewritten in place
    after = [(await client.get(url, params={"top": top})).json() for top in (5, 20)]
    path.unlink()  # gone: what was analysed is still the capture's summary
    gone = await client.get(url, params={"top": 7})
    assert analyses == [500, 500]  # once, then once more for the rewritten trace
    assert first[0]["totals"] == first[1]["totals"] != after[0]["totals"] == after[1]["totals"]
    assert (gone.status_code, gone.json()["totals"]) == (200, after[0]["totals"])


async def test_a_summary_cut_to_top_is_the_summary_analysed_at_top(api: AppClient) -> None:
    """The cut of the capture's one analysis is what an analysis at that ``top`` gives: every
    ranked table, at every level (capture, stage, file), in the same order."""
    from sidecar.analysis import summarize_paths

    client = await api(control={"summarize": False})
    cid, _ = await _completed(client)
    path, cap = _rich_trace(client, cid)
    full = (await client.get(f"/v1/captures/{cid}/summary", params={"top": 500})).json()
    cut = (await client.get(f"/v1/captures/{cid}/summary", params={"top": 2})).json()
    analysed = summarize_paths([path], top=2, requested_start=cap.started_at.timestamp()).model_dump(mode="json")
    tables = ("cpu_ops", "cpu_ops_by_device", "annotations", "runtime", "kernels", "memcpy")
    assert all(len(full[t]) > 2 for t in tables), {t: len(full[t]) for t in tables}  # so the cut cuts
    assert cut == analysed


async def test_summary_while_active_is_409(api: AppClient) -> None:
    client = await api()
    cap = (await client.post("/v1/captures", json={"stages": [0]})).json()
    reply = await client.get(f"/v1/captures/{cap['id']}/summary")
    assert (reply.status_code, error_of(reply)["code"]) == (409, "capture_not_terminal")


async def test_compat_start_and_stop_map_to_one_capture(api: AppClient, fake_omni: Any) -> None:
    client = await api()
    started = await client.post("/start_profile", json={"stages": [2]})
    stopped = await client.post("/stop_profile", json={"stages": [2]})
    assert (started.json()["status"], stopped.json()["status"], stopped.json()["capture_id"]) == (
        "SUCCESS",
        "SUCCESS",
        started.json()["capture_id"],
    )


async def test_compat_start_without_body_sends_every_profiled_stage(api: AppClient, fake_omni: Any) -> None:
    client = await api()
    await client.post("/start_profile")
    assert fake_omni.starts()[-1]["stages"] == [0, 2]


async def test_compat_stop_of_another_stage_set_is_409(api: AppClient) -> None:
    client = await api()
    await client.post("/start_profile", json={"stages": [0, 2]})
    reply = await client.post("/stop_profile", json={"stages": [0]})
    assert (reply.status_code, error_of(reply)["code"]) == (409, "stage_set_mismatch")


async def test_compat_stop_without_capture_is_a_noop_success(api: AppClient, fake_omni: Any) -> None:
    client = await api()
    reply = await client.post("/stop_profile")
    assert (reply.status_code, reply.json()["status"], fake_omni.stops()) == (200, "SUCCESS", [])


async def test_heartbeat_records_the_time(api: AppClient) -> None:
    client = await api()
    cap = (await client.post("/v1/captures", json={"stages": [0], "lease_s": 60})).json()
    reply = await client.post(f"/v1/captures/{cap['id']}/heartbeat")
    assert reply.status_code == 200 and reply.json()["last_heartbeat_at"] is not None


async def test_readyz_ready_when_profiler_mounted(api: AppClient) -> None:
    client = await api()
    reply = await client.get("/readyz")
    assert (reply.status_code, reply.json()["status"]) == (200, "ready")


async def test_readyz_503_with_reason_when_not_mounted(api: AppClient, fake_omni: Any) -> None:
    client = await api()
    fake_omni.mounted = False
    reply = await client.get("/readyz")
    err = error_of(reply)
    assert (reply.status_code, err["code"], bool(err["message"])) == (503, "upstream_not_ready", True)


async def test_readyz_503_when_the_probe_cannot_tell_the_profiler_is_mounted(api: AppClient, fake_omni: Any) -> None:
    # e.g. an auth proxy answering 401: not proven ready, and the reason says what was seen
    client = await api()
    fake_omni.probe_status = 401
    reply = await client.get("/readyz")
    err = error_of(reply)
    assert (reply.status_code, err["code"], "401" in err["message"]) == (503, "upstream_not_ready", True)


async def test_stages_lists_profilers_and_dirs(api: AppClient, control_deploy: DeployConfig) -> None:
    client = await api()
    stages = (await client.get("/v1/stages")).json()["stages"]
    assert [(s["stage_id"], s["profiler"], s["profiler_dir"]) for s in stages] == [
        (s.stage_id, s.profiler, s.profiler_dir) for s in control_deploy.stages
    ]


async def test_metrics_count_requests_and_captures(api: AppClient) -> None:
    client = await api()
    await client.post("/v1/captures", json={"stages": [0]})
    text = (await client.get("/metrics")).text
    assert 'omni_sidecar_captures{state="active"} 1.0' in text
    assert 'route="/v1/captures"' in text


async def test_secrets_from_the_environment_are_scrubbed(
    api: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a value no credential pattern matches: only the secret-named variable's rule can scrub it
    monkeypatch.setenv("MY_SERVICE_TOKEN", "some-plain-value-xyz")
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": [0], "label": "run some-plain-value-xyz"})
    assert (reply.status_code, reply.json()["label"]) == (201, "run ***")


async def test_openapi_docs_are_served(api: AppClient) -> None:
    client = await api()
    spec = (await client.get("/openapi.json")).json()
    assert {"/v1/captures", "/v1/captures/{capture_id}/stop", "/start_profile"} <= set(spec["paths"])
