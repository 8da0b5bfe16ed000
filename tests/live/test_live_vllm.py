"""The sidecar against a real vLLM CPU server (`pytest -m live`, the version tests/live/conftest.py
names): real file names, a busy window `ok`, an idle window `empty`, `--profiler-config` without a
deploy YAML, kill -9 recovery, and a verified stop that does not sit out a fixed settle wait; on
vLLM >= 0.32 a capture's files named by its prefix (two servers sharing a folder told apart), and
a session opened by someone else refused with the server's 409, never stopped. No stand-ins here.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.versions import TRACE_BY_INSTANCE, TRACE_BY_RANK_SUFFIX, VllmDialect, profile_prefix
from tests.live.conftest import complete

# vLLM 0.30: <instance>-rank-0.<ns>...; 0.31 on: [<prefix>_][dp0_pp0_tp0_dcp0_ep0_]rank0.<ns>...
WORKER_TRACE = re.compile("|".join(f"(?:{re.sub(r'[(][?]P<[a-z]+>', '(', p.pattern)})"
                                   for p in (TRACE_BY_INSTANCE, TRACE_BY_RANK_SUFFIX)))
FRONTEND_TRACE = re.compile(r"^.+\.async_llm\.\d+\.pt\.trace\.json\.gz$")
TERMINAL = ("completed", "degraded", "failed")


@pytest.fixture(scope="module")
def live(vllm_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    trace_dir = tmp_path_factory.mktemp("vllm-traces")
    # Stacks off: with stacks a stop takes minutes on 2 cores (docs/design.md §3).
    pc = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False}
    server = vllm_factory(pc)
    return {"server": server, "dir": trace_dir, "profiler_config": pc}


@pytest.fixture
def sidecar(live: dict[str, Any], sidecar_factory: Any, tmp_path: Path) -> Any:
    # The plain-vLLM way: the JSON given to `vllm serve --profiler-config`, no deploy YAML.
    return sidecar_factory(
        live["server"].url, None, flavor="vllm",
        extra_args=["--profiler-config", json.dumps(live["profiler_config"])],
        state_dir=tmp_path / "state",
    )  # fmt: skip


def _wait_terminal(client: httpx.Client, cid: str, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cap = client.get(f"/v1/captures/{cid}").json()
        if cap["state"] in TERMINAL:
            return cap
        time.sleep(0.2)
    raise AssertionError(f"capture {cid} not terminal within {timeout}s: {cap}")


def _capture(sidecar: Any, busy_url: str | None) -> dict[str, Any]:
    with httpx.Client(base_url=sidecar.url, timeout=300) as client:
        r = client.post("/v1/captures", json={"label": "live"})
        assert r.status_code == 201, r.text
        cid = r.json()["id"]
        if busy_url:
            complete(busy_url)
        r = client.post(f"/v1/captures/{cid}/stop")
        assert r.status_code in (200, 202), r.text
        return _wait_terminal(client, cid)


def _files(cap: dict[str, Any]) -> list[str]:
    return [f["name"] for v in cap["verdicts"] for s in v["sessions"] for f in s["files"]]


@pytest.mark.smoke
def test_busy_window_is_ok_with_the_real_file_names(live: dict[str, Any], sidecar: Any, dialect: VllmDialect) -> None:
    cap = _capture(sidecar, live["server"].url)
    assert cap["state"] == "completed", cap
    (verdict,) = cap["verdicts"]
    assert verdict["verdict"] == "ok", verdict
    names = _files(cap)
    assert any(dialect.trace_pattern().match(n) for n in names), names
    assert any(FRONTEND_TRACE.match(n) for n in names), names
    assert any(dialect.table_pattern().match(n) for n in names), names
    if dialect.per_capture_prefix:  # every file of the window named by the capture
        assert all(n.startswith(profile_prefix(cap["id"]) + "_") for n in names), names
    assert cap["server"]["vllm"].startswith(f"{dialect.line[0]}.{dialect.line[1]}."), cap["server"]


@pytest.mark.smoke
def test_idle_window_is_empty_with_a_reason(live: dict[str, Any], sidecar: Any) -> None:
    cap = _capture(sidecar, None)
    (verdict,) = cap["verdicts"]
    assert verdict["verdict"] == "empty", verdict
    assert "no request ran in the window" in verdict["reason"]
    assert cap["state"] == "degraded"
    # Still listed (and downloadable): the user can open it and see for themselves.
    assert any(WORKER_TRACE.match(n) for n in _files(cap))


@pytest.mark.smoke
def test_rewritten_table_download_returns_what_this_capture_saw(live: dict[str, Any], sidecar: Any,
                                                               dialect: VllmDialect) -> None:
    first = _capture(sidecar, live["server"].url)
    second = _capture(sidecar, live["server"].url)
    with httpx.Client(base_url=sidecar.url, timeout=60) as client:
        def table(cap: dict[str, Any]) -> tuple[str, bytes]:
            (session,) = cap["verdicts"][0]["sessions"]
            folder = Path(session["local_path"] or session["path"]).name
            # the worker's table: profiler_out_0.txt (0.30, 0.31) or <worker>.profiler_out.txt (0.32 on)
            (name,) = [f["name"] for f in session["files"] if dialect.table_pattern().match(f["name"])
                       and "async_llm" not in f["name"]]
            r = client.get(f"/v1/captures/{cap['id']}/files/{folder}/{name}")
            assert r.status_code == 200, r.text
            return name, r.content

        (first_name, first_table), (second_name, second_table) = table(first), table(second)
    assert first_table != second_table
    if dialect.per_capture_prefix:  # each window's table is its own file: nothing rewrote the first
        assert (first_name != second_name, (live["dir"] / first_name).read_bytes()) == (True, first_table)
    else:  # vLLM rewrote profiler_out_0.txt at the second stop; the first capture keeps its own copy
        assert (first_name, (live["dir"] / first_name).read_bytes()) == (second_name, second_table)


def test_kill_9_of_the_sidecar_is_recovered_and_the_server_stops_recording(
    live: dict[str, Any], sidecar_factory: Any, tmp_path: Path
) -> None:
    args = dict(flavor="vllm", extra_args=["--profiler-config", json.dumps(live["profiler_config"])],
                state_dir=tmp_path / "state")
    first = sidecar_factory(live["server"].url, None, **args)
    with httpx.Client(base_url=first.url, timeout=300) as client:
        r = client.post("/v1/captures", json={"label": "crash"})
        assert r.status_code == 201, r.text
        cid = r.json()["id"]
    complete(live["server"].url, n=1)
    first.kill()
    second = sidecar_factory(live["server"].url, None, **args)
    with httpx.Client(base_url=second.url, timeout=300) as client:
        cap = _wait_terminal(client, cid)
    assert cap["stop_reason"] == "stopped_on_recovery"
    assert cap["verdicts"][0]["verdict"] == "ok", cap
    assert any(WORKER_TRACE.match(n) for n in _files(cap))


def test_verified_stop_decides_from_the_files_not_a_bound(live: dict[str, Any], sidecar_factory: Any,
                                                          tmp_path: Path) -> None:
    # Plain vLLM's files are complete when its stop answers: the check must end from what the
    # files show (its first look, milliseconds), not by running into its bound (300 s here, far
    # beyond any real collect). A tenth of the bound leaves a loaded machine room and still fails
    # if anything waited out a fixed settle time or the bound.
    bound_s = 300
    sidecar = sidecar_factory(
        live["server"].url, None, flavor="vllm", state_dir=tmp_path / "state",
        extra_args=["--profiler-config", json.dumps(live["profiler_config"])],
        env={"OMNI_SIDECAR_COLLECT_TIMEOUT_S": str(bound_s)},
    )  # fmt: skip
    cap = _capture(sidecar, live["server"].url)
    assert cap["state"] == "completed", cap
    (verdict,) = cap["verdicts"]
    assert verdict["verdict"] == "ok" and not verdict["reason"], verdict  # no "still changing after 300s"
    from datetime import datetime

    checked = datetime.fromisoformat(cap["finished_at"]) - datetime.fromisoformat(cap["stopped_at"])
    assert checked.total_seconds() < bound_s / 10, checked  # the bound was not what ended the check


def _sidecar_for(sidecar_factory: Any, server: Any, pc: dict[str, Any], state: Path) -> Any:
    return sidecar_factory(server.url, None, flavor="vllm", extra_args=["--profiler-config", json.dumps(pc)],
                           state_dir=state)


def test_two_servers_sharing_a_folder_have_their_captures_told_apart_by_name(
    live: dict[str, Any], vllm_factory: Any, sidecar_factory: Any, tmp_path: Path
) -> None:
    # A second server writing into the first one's folder, each with its own sidecar, both windows
    # open at once: each capture lists only the files its start named with its prefix.
    other = vllm_factory(live["profiler_config"])
    sidecars = [_sidecar_for(sidecar_factory, server, live["profiler_config"], tmp_path / f"state{i}")
                for i, server in enumerate((live["server"], other))]
    clients = [httpx.Client(base_url=s.url, timeout=300) for s in sidecars]
    try:
        ids = []
        for client in clients:
            r = client.post("/v1/captures", json={"label": "shared"})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        complete(live["server"].url)
        complete(other.url)
        for client, cid in zip(clients, ids):
            assert client.post(f"/v1/captures/{cid}/stop").status_code in (200, 202)
        caps = [_wait_terminal(client, cid) for client, cid in zip(clients, ids)]
    finally:
        for client in clients:
            client.close()
    for cap in caps:
        names = _files(cap)
        assert (cap["state"], cap["verdicts"][0]["verdict"]) == ("completed", "ok"), cap
        assert names and all(n.startswith(profile_prefix(cap["id"]) + "_") for n in names), names
    assert not set(_files(caps[0])) & set(_files(caps[1]))


def test_a_session_opened_by_someone_else_is_refused_with_the_servers_409_and_left_open(
    live: dict[str, Any], sidecar: Any
) -> None:
    url = live["server"].url
    httpx.post(f"{url}/start_profile", timeout=300).raise_for_status()  # a window opened by hand
    try:
        with httpx.Client(base_url=sidecar.url, timeout=300) as client:
            r = client.post("/v1/captures", json={"label": "while someone profiles"})
            err = r.json()["error"]
            assert (r.status_code, err["code"], err["details"]["open_session"]) == (
                409, "upstream_session_active", "not this sidecar's"), r.text
            # still open: the sidecar stopped nothing of theirs
            again = httpx.post(f"{url}/start_profile", timeout=300)
            assert again.status_code == 409, again.text
    finally:
        httpx.post(f"{url}/stop_profile", timeout=600).raise_for_status()
