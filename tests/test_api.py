"""HTTP API in process: the real FastAPI app and CaptureController over a real fake-upstream socket
(``FakeOmni``), driven through httpx's ASGI transport with the app's lifespan running."""

from __future__ import annotations

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
