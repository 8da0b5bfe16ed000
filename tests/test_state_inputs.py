"""Inputs a sidecar, its CLI, client and rollout hook read from the user or from disk, refused as
typed errors (a code, a message naming the path or field and the fix), never a traceback: the
summaries cache, the state dir, the token file and token, a client's request fields and capture
ids, the rollout hook's options, a fleet's targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.sidecar import AppClient, error_of  # noqa: F401  (the `api` fixture is a plugin)

DEAD = "http://127.0.0.1:9"  # nothing listens: a call that reached the network would be `sidecar_unreachable`


def _cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "COLUMNS": "400"})


def _refused(result: subprocess.CompletedProcess[str], code: str) -> str:
    """The one-line error of a refused command (exit 1, the code, no traceback), unwrapped."""
    err = result.stderr.replace("\n", "")
    assert (result.returncode, f"[{code}]" in err, "Traceback" in result.stderr) == (1, True, False), result.stderr
    return err


@pytest.fixture
def deploy_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text("stages:\n"
                    + "".join(f"  - stage_id: {i}\n    engine_args:\n      profiler_config:\n        profiler: torch\n"
                              f"        torch_profiler_dir: {tmp_path / f'traces{i}'}\n" for i in (0, 1)))
    return path


def _serve(deploy: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # refused before it binds or reaches the upstream (nothing listens at DEAD)
    return _cli("serve", "--upstream", DEAD, "--deploy-config", str(deploy), "--port", "0", *args)


# --- 1. the summaries cache -----------------------------------------------------------------


async def _completed_capture(client: Any) -> str:
    cap = (await client.post("/v1/captures", json={"stages": [0]})).json()
    done = await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true", "timeout": 30})
    assert done.json()["state"] == "completed", done.json()
    return cap["id"]


@pytest.mark.parametrize("cached", [
    {"stages": [{"stage_id": "x", "cpu_ops": 3}], "summary_rows": 500},  # the wrong shape: was a 500
    {"not": "a summary"},  # no summary at all: was served as it is
    [1, 2],
], ids=["wrong-shape", "not-a-summary", "not-an-object"])
async def test_a_cached_summary_that_is_no_summary_is_set_aside_and_made_again(
        api: AppClient, tmp_path: Path, cached: Any) -> None:  # noqa: F811
    first = await api()
    cid = await _completed_capture(first)
    assert (await first.get(f"/v1/captures/{cid}/summary", timeout=60)).status_code == 200
    path = tmp_path / "state" / "summaries" / f"{cid}.json"
    path.write_text(json.dumps(cached))
    again = await api()  # a sidecar started later on the same state dir reads the cache back
    reply = await again.get(f"/v1/captures/{cid}/summary", params={"top": 1}, timeout=60)
    assert (reply.status_code, reply.json()["totals"]["cpu_ops"] > 0) == (200, True), reply.text
    assert (path.with_name(path.name + ".bad").read_text(), again.sidecar_app.state.controller._summaries.analyses) == (
        json.dumps(cached), 1)


# --- 2. the state dir ------------------------------------------------------------------------


def test_serve_names_a_folder_where_its_lock_file_belongs(deploy_yaml: Path, tmp_path: Path) -> None:
    (tmp_path / "sd" / "lock").mkdir(parents=True)
    err = _refused(_serve(deploy_yaml, "--state-dir", str(tmp_path / "sd")), "state_dir_unusable")
    assert f"{tmp_path / 'sd' / 'lock'} is a folder where" in err and "rmdir" in err


def test_serve_says_a_state_dir_that_is_a_file_is_no_folder(deploy_yaml: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    err = _refused(_serve(deploy_yaml, "--state-dir", str(tmp_path / "afile")), "state_dir_unusable")
    assert f"{tmp_path / 'afile'} is a file where a folder belongs" in err and "mkdir" not in err


def test_serve_names_the_file_inside_the_state_dir_at_fault(deploy_yaml: Path, tmp_path: Path) -> None:
    (tmp_path / "sd1").mkdir()
    (tmp_path / "sd1" / "captures").write_text("")
    err = _refused(_serve(deploy_yaml, "--state-dir", str(tmp_path / "sd1")), "state_dir_unusable")
    assert f"{tmp_path / 'sd1' / 'captures'} is a file where a folder belongs" in err and "File exists" not in err


@pytest.mark.parametrize("layout", ["file", "lock-folder"])
def test_fleet_refuses_an_unusable_state_dir_by_name(deploy_yaml: Path, tmp_path: Path, layout: str) -> None:
    state = tmp_path / "fsd"
    if layout == "file":
        state.write_text("")
    else:
        (state / "lock").mkdir(parents=True)
    result = _cli("fleet", "capture", "--targets", f"upstream={DEAD}", "--deploy-config", str(deploy_yaml),
                  "--stages", "0", "--duration", "1", "--state-dir", str(state))
    err = _refused(result, "state_dir_unusable")
    assert (f"{state} is a file where a folder belongs" if layout == "file" else f"{state / 'lock'} is a folder") in err


# --- 3. the token file and the token ---------------------------------------------------------


@pytest.mark.parametrize(("content", "said"), [
    (b"\xff\xfe", "not ASCII"),
    ("tökén\n".encode(), "not ASCII"),
    (b"abc\ndef\n", "'\\n' (whitespace)"),
    (b"abc def", "' ' (whitespace)"),
    (b"a" * 6000, "larger than"),
    (None, "is a folder"),
], ids=["not-utf8", "not-ascii", "inner-newline", "inner-space", "too-large", "folder"])
def test_serve_refuses_a_token_no_client_could_send(deploy_yaml: Path, tmp_path: Path, content: bytes | None,
                                                     said: str) -> None:
    token = tmp_path / "token"
    if content is None:
        token.mkdir()
    else:
        token.write_bytes(content)
    err = _refused(_serve(deploy_yaml, "--token-file", str(token), "--state-dir", str(tmp_path / "s")),
                   "token_file_unreadable")
    assert (str(token) in err, said in err) == (True, True), err


def test_the_cli_refuses_a_bad_token_file_before_any_call(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes("tökén".encode())
    err = _refused(_cli("list", "--sidecar", DEAD, "--token-file", str(token)), "token_file_unreadable")
    assert str(token) in err and "sidecar_unreachable" not in err


@pytest.mark.parametrize("token", ["tökén", "abc\ndef", "a b", "a" * 5000], ids=["not-ascii", "newline", "space", "long"])
def test_the_client_refuses_a_token_no_header_can_carry_when_built(token: str) -> None:
    from sidecar.client import AsyncSidecarClient, SidecarClient
    from sidecar.errors import TokenInvalid

    for make in (SidecarClient, AsyncSidecarClient):
        with pytest.raises(TokenInvalid) as err:
            make(DEAD, token=token)
        assert err.value.code == "token_invalid"


# --- 4. the client's request fields and capture ids -------------------------------------------


@pytest.mark.parametrize(("call", "field"), [
    (lambda c: c.start_capture(stages=[0], duration_s=float("nan")), "duration_s"),
    (lambda c: c.start_capture(stages=[0], lease_s=float("inf")), "lease_s"),
    (lambda c: c.plan(stages=[0], budget_mb=float("-inf")), "budget_mb"),
    (lambda c: c.plan(stages=[0], max_stop_s=float("nan")), "max_stop_s"),
])
def test_the_client_refuses_a_number_json_cannot_carry_before_sending(call: Any, field: str) -> None:
    from sidecar.client import SidecarClient
    from sidecar.errors import RequestInvalid

    with SidecarClient(DEAD) as client, pytest.raises(RequestInvalid) as err:
        call(client)
    assert (err.value.key, err.value.message.startswith(field)) == (field, True)


@pytest.mark.parametrize("call", [
    lambda c: c.get_capture(""), lambda c: c.stop_capture(" "), lambda c: c.heartbeat(""),
    lambda c: c.summary(""), lambda c: c.diff("", "x"), lambda c: c.diff("x", ""), lambda c: c.download("", "a/b"),
    lambda c: c.wait_capture(""), lambda c: c.wait_started(""),
], ids=["get", "stop", "heartbeat", "summary", "diff-a", "diff-b", "download", "wait", "wait-started"])
def test_every_call_with_a_capture_id_refuses_an_empty_one(call: Any) -> None:
    from sidecar.client import SidecarClient
    from sidecar.errors import CaptureNotFound

    with SidecarClient(DEAD) as client, pytest.raises(CaptureNotFound):  # not sent: not `sidecar_unreachable`
        call(client)


async def test_an_empty_capture_id_is_not_the_list_of_captures(api: AppClient) -> None:  # noqa: F811
    # ``/v1/captures/`` redirects to the list: a client that sent it got a JSONDecodeError
    from sidecar.client import AsyncSidecarClient
    from sidecar.errors import CaptureNotFound

    app = (await api()).sidecar_app
    async with AsyncSidecarClient("http://127.0.0.1:8092", transport=httpx.ASGITransport(app=app)) as client:
        with pytest.raises(CaptureNotFound):
            await client.get_capture("")


# --- 5. the rollout hook ---------------------------------------------------------------------


@pytest.mark.parametrize(("options", "code"), [
    ({"targets": None}, "target_invalid"),
    ({"lease_s": float("nan")}, "lease_invalid"),
    ({"lease_s": -5}, "lease_invalid"),
    ({"lease_s": "60"}, "lease_invalid"),
    ({"stages": [0, 0]}, "stages_invalid"),
    ({"stages": []}, "stages_invalid"),
    ({"stages": ["0"]}, "stages_invalid"),
], ids=["targets-none", "lease-nan", "lease-negative", "lease-text", "stages-twice", "stages-empty", "stages-text"])
def test_the_rollout_profiler_refuses_what_would_fail_every_step_when_built(options: dict[str, Any], code: str) -> None:
    from sidecar.errors import SidecarError
    from sidecar.rollout import RolloutProfiler

    kwargs = {"targets": [f"sidecar={DEAD}"], "steps": [1], **options}
    with pytest.raises(SidecarError) as err:
        RolloutProfiler(**kwargs).close()
    assert err.value.code == code, err.value


# --- 6. the fleet's targets --------------------------------------------------------------------


def test_a_server_that_is_no_sidecar_is_named_so_and_not_swept(fake_replica_factory: Any) -> None:
    (r,) = fake_replica_factory(1, stages=(0,))
    result = _cli("fleet", "capture", "--targets", f"sidecar={r.url}", "--stages", "0", "--duration", "1")
    err = _refused(result, "fleet_failed")
    assert ("not_a_sidecar" in err, f"upstream={r.url}" in err, "sweep" in err, "lease" in err) == (
        True, True, False, False), err
    assert r.calls("/start_profile") == []


def test_fleet_stop_with_nothing_recording_is_a_no_op(fake_replica_factory: Any, sidecar_factory: Any) -> None:
    (r,) = fake_replica_factory(1, stages=(0,))
    sc = sidecar_factory(r.url, r.deploy)
    result = _cli("fleet", "stop", "--targets", f"sidecar={sc.url}")
    assert (result.returncode, "nothing was recording" in result.stdout) == (0, True), result.stdout + result.stderr
    as_json = _cli("fleet", "stop", "--targets", f"sidecar={sc.url}", "--json")
    assert (as_json.returncode, json.loads(as_json.stdout)["nothing_recording"]) == (0, [f"sidecar={sc.url}"])
