"""The API's defences, through the real app: CSRF / DNS rebinding (JSON only, Host/Origin
allow-list), body limit, bounded metric labels, paging, strict stage ids, downloads resolved at
serve time, secrets in URLs and labels, Swagger UI from the package."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.sidecar import TOKEN, AppClient, error_of

# --- CSRF / DNS rebinding ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "ctype", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"]
)
async def test_bodies_a_web_form_can_send_are_415(api: AppClient, fake_omni: Any, ctype: str) -> None:
    client = await api()
    reply = await client.post("/v1/captures", content=b'{"stages":[0,2],"duration_s":1e308}',
                              headers={"content-type": ctype})
    assert (reply.status_code, error_of(reply)["code"], fake_omni.starts()) == (415, "unsupported_media_type", [])


async def test_a_body_without_content_type_is_415(api: AppClient, fake_omni: Any) -> None:
    client = await api()
    reply = await client.post("/start_profile", content=b'{"stages":[0]}', headers={"content-type": ""})
    assert (reply.status_code, fake_omni.starts()) == (415, [])


async def test_json_with_charset_is_accepted(api: AppClient) -> None:
    client = await api()
    reply = await client.post("/v1/captures", content=b'{"stages":[0]}',
                              headers={"content-type": "application/json; charset=utf-8"})
    assert reply.status_code == 201


@pytest.mark.parametrize("host", ["evil.example", "attacker.test:8092", "10.0.0.5:8092"])
async def test_a_foreign_host_header_is_403(api: AppClient, fake_omni: Any, host: str) -> None:
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": [0]}, headers={"host": host})
    listing = await client.get("/v1/captures", headers={"host": host})
    assert (reply.status_code, listing.status_code, error_of(reply)["code"], fake_omni.starts()) == (
        403, 403, "host_not_allowed", [])


@pytest.mark.parametrize("host", ["localhost:8092", "127.0.0.1", "[::1]:8092", "sidecar.localhost"])
async def test_loopback_hosts_are_accepted(api: AppClient, host: str) -> None:
    client = await api()
    assert (await client.get("/healthz", headers={"host": host})).status_code == 200


async def test_allowed_host_adds_a_name(api: AppClient) -> None:
    client = await api(allowed_hosts=["sidecar.internal"])
    ok = await client.get("/healthz", headers={"host": "sidecar.internal:8092"})
    other = await client.get("/healthz", headers={"host": "other.internal"})
    assert (ok.status_code, other.status_code) == (200, 403)


@pytest.mark.parametrize("origin", ["https://evil.example", "null"])
async def test_a_cross_site_origin_is_403(api: AppClient, fake_omni: Any, origin: str) -> None:
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": [0]}, headers={"origin": origin})
    assert (reply.status_code, fake_omni.starts()) == (403, [])


async def test_a_same_host_origin_is_accepted(api: AppClient) -> None:
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": [0]}, headers={"origin": "http://localhost:8092"})
    assert reply.status_code == 201


# --- bounds ------------------------------------------------------------------------------------


async def test_a_json_null_body_starts_like_no_body(api: AppClient, fake_omni: Any) -> None:
    # the OpenAPI document allows the body to be absent; JSON null is read the same (issue 20, item 13)
    client = await api()
    reply = await client.post("/v1/captures", content=b"null", headers={"content-type": "application/json"})
    assert reply.status_code == 201, reply.text
    assert (reply.json()["stages"], [s["stages"] for s in fake_omni.starts()]) == ([0, 2], [[0, 2]])


async def test_a_json_null_plan_body_plans_like_no_body(api: AppClient) -> None:
    # POST /v1/plan has the same shape as POST /v1/captures (every field has a default)
    from sidecar.errors import StepsUnavailable

    client = await api()
    asked: list[Any] = []

    async def plan(stages: Any, **bounds: Any) -> Any:  # what the route hands the controller
        asked.append((stages, bounds))
        raise StepsUnavailable("recorded, not planned")

    client.sidecar_app.state.controller.plan = plan
    json_ = {"content-type": "application/json"}
    replies = [await client.post("/v1/plan", content=b"null", headers=json_), await client.post("/v1/plan"),
               await client.post("/v1/plan", json={})]
    spec = (await client.get("/openapi.json")).json()["paths"]
    defaults = (None, {"budget_mb": None, "max_stop_s": None, "probe_steps": (1, 2), "refine": True})
    assert [(r.status_code, error_of(r)["code"]) for r in replies] == [(422, "steps_unavailable")] * 3
    assert asked == [defaults] * 3
    for path in ("/v1/captures", "/v1/plan"):  # and the document says `null` is a body these take
        assert {"type": "null"} in spec[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["anyOf"]


@pytest.mark.parametrize(("bounds", "key"), [({"budget_mb": 0.005}, "budget_mb"), ({"max_stop_s": 0.001}, "max_stop_s"),
                                             ({"budget_mb": -1}, "budget_mb")])
async def test_a_plan_bound_no_window_can_meet_is_refused_by_the_schema(api: AppClient, fake_omni: Any,
                                                                     bounds: dict[str, float], key: str) -> None:
    # the schema publishes the plan's minimums (control/budget: OpenAPI says them, and a client
    # checked against the document is never refused a value it allows): over HTTP a bound below
    # them is request_invalid naming the field, before anything starts, as docs/captures.md says
    client = await api()
    reply = await client.post("/v1/plan", json=bounds)
    err = error_of(reply)
    assert (reply.status_code, err["code"], fake_omni.starts()) == (422, "request_invalid", []), reply.text
    assert key in err["message"], err


async def test_a_body_over_1_mib_is_413(api: AppClient) -> None:
    client = await api()
    big = b'{"label": "' + b"x" * (1024 * 1024 + 10) + b'"}'
    reply = await client.post("/v1/captures", content=big, headers={"content-type": "application/json"})
    assert (reply.status_code, error_of(reply)["code"]) == (413, "body_too_large")


async def test_a_streamed_body_over_1_mib_is_413(api: AppClient) -> None:
    client = await api()

    async def chunks() -> Any:
        yield b'{"label": "'
        for _ in range(20):
            yield b"x" * 65536
        yield b'"}'

    reply = await client.post("/v1/captures", content=chunks(), headers={"content-type": "application/json"})
    assert (reply.status_code, error_of(reply)["code"]) == (413, "body_too_large")


async def test_made_up_methods_do_not_grow_the_metrics(api: AppClient) -> None:
    client = await api()
    for i in range(40):
        await client.request(f"X{i}", "/healthz")
        await client.get(f"/no/such/{i}")
    text = (await client.get("/metrics")).text
    methods = {line.split('method="')[1].split('"')[0] for line in text.splitlines() if 'method="' in line}
    assert methods <= {"GET", "POST", "OTHER"} and "X1" not in text and "/no/such/1" not in text


async def test_paging_walks_the_history_newest_first(api: AppClient) -> None:
    client = await api()
    ids = []
    for _ in range(5):
        cap = (await client.post("/v1/captures", json={"stages": [0]})).json()
        await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true"})
        ids.append(cap["id"])
    seen: list[str] = []
    before = None
    while True:
        params = {"limit": 2, **({"before": before} if before else {})}
        page = (await client.get("/v1/captures", params=params)).json()
        seen += [c["id"] for c in page["captures"]]
        before = page["next_before"]
        if before is None:
            break
    assert seen == ids[::-1]


async def test_retention_keeps_the_newest(api: AppClient, tmp_path: Path) -> None:
    client = await api(control={"keep": 2})
    ids = []
    for _ in range(4):
        cap = (await client.post("/v1/captures", json={"stages": [0]})).json()
        await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true"})
        ids.append(cap["id"])
    listed = [c["id"] for c in (await client.get("/v1/captures")).json()["captures"]]
    await client.sidecar_app.state.controller.journal.flush()
    files = sorted(p.stem for p in (tmp_path / "state" / "captures").glob("*.json"))
    assert (listed, files) == (ids[:1:-1], sorted(ids[2:]))


# --- input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [[True], [0, False], ["0"], [0.5]])
async def test_stage_ids_are_strict_integers(api: AppClient, fake_omni: Any, stages: list[Any]) -> None:
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": stages})
    compat = await client.post("/start_profile", json={"stages": stages})
    assert (reply.status_code, compat.status_code, fake_omni.starts()) == (422, 422, [])


async def test_a_whole_float_is_the_integer_the_schema_says_it_is(api: AppClient, fake_omni: Any) -> None:
    # JSON Schema's (OpenAPI 3.1's) integer includes 0.0: a client that sends it means stage 0 (a
    # schemathesis run sent steps 37036.0 and flagged the refusal)
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": [0.0]})
    assert reply.status_code == 201 and reply.json()["stages"] == [0], reply.text
    assert [s["stages"] for s in fake_omni.starts()] == [[0]]


async def test_the_bearer_token_in_a_label_is_not_journaled(api: AppClient, tmp_path: Path) -> None:
    client = await api(token=True)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    cap = (await client.post("/v1/captures", json={"stages": [0], "label": f"x {TOKEN}"}, headers=headers)).json()
    await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true"}, headers=headers)
    raw = (tmp_path / "state" / "captures" / f"{cap['id']}.json").read_text()
    assert TOKEN not in raw and TOKEN not in cap["label"]


# --- downloads ---------------------------------------------------------------------------------


async def _finished_session(client: Any) -> tuple[str, Path, str]:
    cap = (await client.post("/v1/captures", json={"stages": [0]})).json()
    done = (await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true"})).json()
    session = done["verdicts"][0]["sessions"][0]
    name = next(f["name"] for f in session["files"] if f["name"].startswith("trace_"))
    return cap["id"], Path(session["local_path"] or session["path"]), name


async def test_a_session_folder_replaced_by_a_symlink_serves_nothing(api: AppClient, tmp_path: Path) -> None:
    client = await api()
    cid, folder, name = await _finished_session(client)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / name).write_text("the sidecar's token file")
    shutil.rmtree(folder)
    os.symlink(outside, folder)
    reply = await client.get(f"/v1/captures/{cid}/files/{folder.name}/{name}")
    assert (reply.status_code, error_of(reply)["code"]) == (404, "artifact_not_found")


async def test_a_file_the_capture_did_not_list_is_404(api: AppClient) -> None:
    client = await api()
    cid, folder, _ = await _finished_session(client)
    (folder / "later.txt").write_text("not an artifact of this capture")
    reply = await client.get(f"/v1/captures/{cid}/files/{folder.name}/later.txt")
    assert reply.status_code == 404


async def test_a_300_character_file_name_is_404(api: AppClient) -> None:
    client = await api()
    cid, folder, _ = await _finished_session(client)
    reply = await client.get(f"/v1/captures/{cid}/files/{folder.name}/{'a' * 300}")
    assert (reply.status_code, error_of(reply)["code"]) == (404, "artifact_not_found")


# --- docs --------------------------------------------------------------------------------------


async def test_docs_load_swagger_ui_from_the_sidecar_itself(api: AppClient) -> None:
    client = await api()
    html = (await client.get("/docs")).text
    js = await client.get("/docs/assets/swagger-ui-bundle.js")
    assert "cdn." not in html and "/docs/assets/swagger-ui-bundle.js" in html
    assert (js.status_code, len(js.content) > 100_000) == (200, True)


async def test_openapi_describes_the_error_shape_and_statuses(api: AppClient) -> None:
    client = await api()
    spec = (await client.get("/openapi.json")).json()
    start = spec["paths"]["/v1/captures"]["post"]["responses"]
    assert {"409", "413", "415", "422", "502", "503"} <= set(start)
    assert start["409"]["content"]["application/json"]["schema"]["$ref"].endswith("/SidecarErrorReply")
    assert "HTTPValidationError" not in spec["components"]["schemas"]
