"""What a capture does with the server it found at connect (sidecar/versions.py): plain vLLM 0.32's
start body (the capture's file prefix), a session left open (this sidecar's own: stopped before the
next start; anyone else's, the server's 409: refused, named, never stopped), files told apart by their prefix
in a shared folder, and the server's version in GET /v1/stages and /metrics. FakeOmni on a real
socket, set to plain vLLM 0.32's surface (``version``, ``session_guard``); tests/live runs the real
server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.control.claims import ClaimRegistry
from sidecar.control.controller import CaptureController, ControlSettings
from sidecar.control.models import CaptureState, Verdict
from sidecar.errors import UpstreamSessionActive
from sidecar.upstream.server import Flavor, UpstreamServer
from sidecar.versions import profile_prefix
from tests.fixtures.control import FakeOmni

FAST = ControlSettings(collect_timeout_s=10, poll_s=0.02, gone_poll_s=0.05, gone_after_s=0.5, close_timeout_s=5)


# --- a capture on a plain vLLM 0.32 -------------------------------------------------------------


@pytest.fixture
def vllm032(control_deploy):
    with FakeOmni(control_deploy) as fake:
        fake.flat, fake.version, fake.session_guard = True, "0.32.0", True
        yield fake


async def _run(c: CaptureController, **kw):
    cap = await c.start(**kw)
    await c.stop(cap.id)
    return await c.wait(cap.id, timeout=20)


async def test_a_capture_sends_its_prefix_and_lists_only_the_files_named_with_it(vllm032, control_deploy, tmp_path):
    async with UpstreamServer(vllm032.url, flavor=Flavor.vllm) as up, \
            CaptureController(up, control_deploy, state_dir=tmp_path / "s", settings=FAST,
                              claims=ClaimRegistry()) as c:  # fmt: skip
        done = await _run(c, stages=[0])
    prefix = profile_prefix(done.id)
    names = [f.name for f in done.verdict(0).sessions[0].files]
    assert (vllm032.starts()[0]["raw"], done.verdict(0).verdict) == (
        f'{{"profile_prefix":"{prefix}"}}'.encode(), Verdict.ok)
    assert sorted(n.split(".")[-2] if n.endswith(".txt") else "trace" for n in names) == ["profiler_out", "trace"]
    assert all(n.startswith(f"{prefix}_dp0_pp0_tp0_dcp0_ep0_rank0.") for n in names), names
    assert (done.server["vllm"], done.server["start_options"], done.notes) == ("0.32.0", {"profile_prefix": prefix}, [])


async def test_two_sidecars_sharing_a_folder_tell_their_captures_apart_by_name(control_deploy, tmp_path):
    # two servers writing into one folder, each with its own sidecar: both windows open at once
    with FakeOmni(control_deploy) as a, FakeOmni(control_deploy) as b:
        for fake in (a, b):
            fake.flat, fake.version, fake.session_guard = True, "0.32.0", True
        async with UpstreamServer(a.url, flavor=Flavor.vllm) as ua, UpstreamServer(b.url, flavor=Flavor.vllm) as ub, \
                CaptureController(ua, control_deploy, settings=FAST, claims=ClaimRegistry()) as ca, \
                CaptureController(ub, control_deploy, settings=FAST, claims=ClaimRegistry()) as cb:  # fmt: skip
            first, second = await ca.start(stages=[0]), await cb.start(stages=[0])
            await ca.stop(first.id)
            await cb.stop(second.id)
            first, second = await ca.wait(first.id, timeout=20), await cb.wait(second.id, timeout=20)
    for cap in (first, second):
        names = [f.name for f in cap.verdict(0).sessions[0].files]
        assert (cap.verdict(0).verdict, len(names)) == (Verdict.ok, 2), cap.verdict(0)
        assert all(n.startswith(profile_prefix(cap.id) + "_") for n in names), names


async def test_a_session_left_open_by_another_client_is_refused_named_and_never_stopped(vllm032, control_deploy):
    async with httpx.AsyncClient() as client:  # someone else's window, by hand
        (await client.post(f"{vllm032.url}/start_profile")).raise_for_status()
    async with UpstreamServer(vllm032.url, flavor=Flavor.vllm) as up, \
            CaptureController(up, control_deploy, settings=FAST, claims=ClaimRegistry()) as c:  # fmt: skip
        with pytest.raises(UpstreamSessionActive) as err:
            await c.start(stages=[0])
        cap = c.get(err.value.details["capture_id"])
    assert (cap.state, err.value.details["open_session"], vllm032.stops(), vllm032.session_open) == (
        CaptureState.failed, "not this sidecar's", [], True)
    assert "409" in err.value.message and "another client started it" in err.value.message
    assert ".." not in err.value.message  # vLLM's own text ends with its period


async def _left_open(vllm032: Any, control_deploy: Any, state: Path) -> Any:
    """A capture whose stop the server answered 500: vLLM >= 0.32 keeps its session open then."""
    async with UpstreamServer(vllm032.url, flavor=Flavor.vllm, stop_budget_s=0.3, retry_wait_max_s=0.05) as up, \
            CaptureController(up, control_deploy, state_dir=state, settings=FAST, claims=ClaimRegistry()) as c:  # fmt: skip
        left = await c.start(stages=[0])
        vllm032.stop_status = 500
        await c.stop(left.id)
        left = await c.wait(left.id, timeout=20)
    vllm032.stop_status = 200
    return left


async def test_a_session_this_sidecar_left_open_is_stopped_before_the_next_start(vllm032, control_deploy, tmp_path):
    state = tmp_path / "state"
    left = await _left_open(vllm032, control_deploy, state)
    # a later sidecar on the same journal reads the stop as unconfirmed: it stops the stage first
    async with UpstreamServer(vllm032.url, flavor=Flavor.vllm) as up, \
            CaptureController(up, control_deploy, state_dir=state, settings=FAST, claims=ClaimRegistry()) as c:  # fmt: skip
        done = await _run(c, stages=[0])
    (first,) = done.fact("stopped_first")
    assert ([e.code for e in left.errors], first.figures["after"], done.state) == (
        ["stop_server_error"], left.id, CaptureState.completed), done.facts
    assert [c["path"] for c in vllm032.calls[-3:]] == ["/stop_profile", "/start_profile", "/stop_profile"]


async def test_a_session_left_open_by_an_older_journal_is_stopped_before_the_next_start(vllm032, control_deploy, tmp_path):
    """A journal written before stops were noted unconfirmed: its stop answered 5xx (vLLM >= 0.32
    keeps the session open then) reads as unconfirmed, and the stage is stopped before the start, so
    the server never answers 409 to this sidecar's own window."""
    state = tmp_path / "state"
    left = await _left_open(vllm032, control_deploy, state)
    record = state / "captures" / f"{left.id}.json"
    data = json.loads(record.read_text())
    data["facts"] = [f for f in data["facts"] if f["code"] != "stop_unconfirmed"]
    record.write_text(json.dumps(data))
    async with UpstreamServer(vllm032.url, flavor=Flavor.vllm) as up, \
            CaptureController(up, control_deploy, state_dir=state, settings=FAST, claims=ClaimRegistry()) as c:  # fmt: skip
        done = await _run(c, stages=[0])
    (first,) = done.fact("stopped_first")
    assert (first.figures["after"], done.state) == (left.id, CaptureState.completed), done.facts
    assert [c["path"] for c in vllm032.calls[-3:]] == ["/stop_profile", "/start_profile", "/stop_profile"]


# --- the HTTP surface: GET /v1/stages and /metrics say what the server is ---------------------------


def test_the_sidecar_says_what_its_server_is_in_stages_and_metrics(control_deploy, sidecar_factory) -> None:
    import json

    from tests.fixtures.waits import poll

    with FakeOmni(control_deploy) as fake:
        fake.flat, fake.version = True, "0.32.0"
        pc = control_deploy.stage(0).profiler_config.model_dump(include={"profiler", "torch_profiler_dir"})
        sidecar = sidecar_factory(fake.url, None, flavor="vllm", extra_args=["--profiler-config", json.dumps(pc)])
        with httpx.Client(base_url=sidecar.url, timeout=30) as client:
            assert poll(lambda: client.get("/v1/stages").json()["server"], timeout=30)
            server, metrics = client.get("/v1/stages").json()["server"], client.get("/metrics").text
    assert (server["kind"], server["vllm"], server["per_capture_bounds"], server["findings"]) == (
        "vllm", "0.32.0", True, []), server
    assert 'omni_sidecar_upstream_info{kind="vllm",omni="",vllm="0.32.0"} 1.0' in metrics, metrics


def test_what_the_servers_version_says_of_the_deploy_is_in_stages(control_deploy, sidecar_factory) -> None:
    import json

    from tests.fixtures.waits import poll

    with FakeOmni(control_deploy) as fake:
        fake.flat, fake.version = True, "0.34.0"  # capture_torch_profiler does nothing there
        pc = {**control_deploy.stage(0).profiler_config.model_dump(include={"profiler", "torch_profiler_dir"}),
              "capture_torch_profiler": True}
        sidecar = sidecar_factory(fake.url, None, flavor="vllm", extra_args=["--profiler-config", json.dumps(pc)])
        with httpx.Client(base_url=sidecar.url, timeout=30) as client:
            assert poll(lambda: client.get("/v1/stages").json()["server"], timeout=30)
            server = client.get("/v1/stages").json()["server"]
    assert [(f["code"], f["severity"]) for f in server["findings"]] == [("capture_torch_profiler_noop", "warning")]


# --- a stage preset for one capture: vLLM 0.33's profiler_kwargs --------------------------------


def test_a_preset_for_one_capture_goes_as_profiler_kwargs_on_0_33_and_is_refused_before_it(control_deploy,
                                                                                            sidecar_factory) -> None:
    import json

    from tests.fixtures.waits import poll

    pc = control_deploy.stage(0).profiler_config.model_dump(include={"profiler", "torch_profiler_dir"})
    for version in ("0.32.0", "0.33.0"):
        with FakeOmni(control_deploy) as fake:
            fake.flat, fake.version, fake.session_guard = True, version, True
            sidecar = sidecar_factory(fake.url, None, flavor="vllm", extra_args=["--profiler-config", json.dumps(pc)])
            with httpx.Client(base_url=sidecar.url, timeout=30) as client:
                assert poll(lambda: client.get("/v1/stages").json()["server"], timeout=30)
                r = client.post("/v1/captures", json={"stages": [0], "profile": "memory"})
                if version == "0.32.0":  # refused before anything reached the server, naming the restart
                    err = r.json()["error"]
                    assert (r.status_code, err["code"], fake.starts()) == (409, "profile_not_per_capture", []), r.text
                    assert "omni-sidecar render --profile memory" in err["message"] and "vLLM 0.32.0" in err["message"]
                    for name in ("nsys", "memroy"):  # no torch options / no such preset: the schema's own list
                        bad = client.post("/v1/captures", json={"stages": [0], "profile": name})
                        assert (bad.status_code, bad.json()["error"]["code"]) == (422, "request_invalid"), bad.text
                        assert "'memory'" in bad.json()["error"]["message"], bad.text
                    continue
                assert r.status_code == 201, r.text
                cid = r.json()["id"]
                client.post(f"/v1/captures/{cid}/stop")
                assert poll(lambda: client.get(f"/v1/captures/{cid}").json()["state"] in ("completed", "degraded"),
                            timeout=30)
                done = client.get(f"/v1/captures/{cid}").json()
    body = json.loads(fake.starts()[0]["raw"])
    assert body == {"profile_prefix": profile_prefix(cid),
                    "profiler_kwargs": {"profile_memory": True, "record_shapes": True, "with_stack": False}}, body
    assert done["server"]["start_options"] == body
    assert any("profile_memory=on, record_shapes=on, with_stack=off" in n for n in done["notes"]), done["notes"]
