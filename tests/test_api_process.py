"""The sidecar as users run it: ``omni-sidecar serve`` under uvicorn on a free port, in front of
the emulated vLLM-Omni server, driven over real sockets (curl-level). Only what a process shows:
its command-line flags reaching the running server (token file, artifact roots, an upstream URL
with credentials), real-socket paths and concurrency, its log file, SIGTERM; and the start-up
refusals of the serve command (in process: it refuses before it binds). The rules behind the
routes are tested in process (tests/test_api.py, tests/test_controller.py), the faults of real
processes in the fault matrix (tests/test_faults.py).

The sidecar tests share one (``served``: started once per module, every capture ended between
tests, SIGTERM last); the emulator is the session pool's, with thread workers (synthetic traces:
the same files and names, made-up ops).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.emulator import EmulatorPool, emulator_state, make_deploy
from tests.fixtures.sidecar import ModuleSidecar

pytestmark = pytest.mark.slow

FAST = {  # small bounds so a failing test ends quickly; the defaults are minutes
    "OMNI_SIDECAR_COLLECT_TIMEOUT_S": "5",
    "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "20",
}
STAGES = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}  # like Qwen2.5-Omni
THREAD = ["--workers", "thread"]
TOKEN = "tok-0123456789"
PASSWORD = "pw-0123456789"
HTTP_TIMEOUT = 120  # explicit and generous: a start waits for the upstream's start
WAIT = 90
SESSION = re.compile(r"^\d{8}-\d{6}_stage(\d+)_rank0_\d+$")


def upstream_calls(emu: Any, path: str) -> list[dict[str, Any]]:
    return [c for c in emulator_state(emu)["calls"] if c["method"] == "POST" and c["path"] == path]


def profiling(emu: Any) -> dict[str, bool]:
    return {sid: st["profiling"] for sid, st in emulator_state(emu)["stages"].items()}


def busy(emu: Any) -> int:
    """One chat request through every stage, so the window records work (an idle one is ``empty``)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{emu.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT).status_code


# --- one sidecar for the tests that read what it serves ----------------------------------------


class Served(ModuleSidecar):
    """``omni-sidecar serve --token-file ... --artifact-root TRACES=MOUNT`` with an upstream URL
    that carries credentials; ``mount`` is a link to the server's trace dirs (as a container
    mount would show them)."""

    @property
    def root(self) -> Path:
        return self.deploy.parent

    @property
    def mount(self) -> Path:
        return self.root / "mnt"

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return httpx.post(f"{self.url}{path}", headers=headers, timeout=HTTP_TIMEOUT, **kwargs)


@pytest.fixture(scope="module")
def _served(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served")
    deploy = make_deploy(root, STAGES)
    (root / "mnt").symlink_to(root / "traces", target_is_directory=True)
    (root / "token").write_text(TOKEN + "\n")
    yield from Served.for_module(
        emulator_pool, deploy, emulator_args=THREAD, token=TOKEN, timeout=HTTP_TIMEOUT,
        upstream=lambda url: url.replace("http://", f"http://admin:{PASSWORD}@"),
        state_dir=root / "state", token_file=root / "token", env=FAST, log_path=root / "sidecar.log",
        artifact_roots={str(root / "traces"): str(root / "mnt")},
    )  # fmt: skip


@pytest.fixture
def served(_served: Served) -> Iterator[Served]:
    """The module's sidecar, ready for this test; every capture ended afterwards."""
    yield from _served.each_test(settle_timeout=WAIT)


def test_a_capture_over_real_sockets_completes_with_a_trace_per_stage(served: Served) -> None:
    first = served.post("/v1/captures", json={"stages": [0, 2]})
    assert busy(served.emulator) == 200
    done = served.post(f"/v1/captures/{first.json()['id']}/stop", params={"wait": "true"}).json()
    names = {
        v["stage_id"]: (v["verdict"], Path(s["path"]).name, sorted(f["name"] for f in s["files"]))
        for v in done["verdicts"]
        for s in v["sessions"]
    }
    assert (first.status_code, done["state"], sorted(names)) == (201, "completed", [0, 2])
    for sid, (verdict, folder, files) in names.items():
        assert verdict == "ok" and SESSION.match(folder) and SESSION.match(folder).group(1) == str(sid)
        assert "trace_rank0.json.gz" in files


def test_artifact_root_maps_server_paths_to_local_ones(served: Served) -> None:
    # the server's trace dirs as the sidecar sees them: under the mount given by --artifact-root
    with served.client() as client:
        cap = client.start_capture([0, 2])
        assert busy(served.emulator) == 200
        final = client.stop_capture(cap.id, wait=True, timeout=WAIT)
    seen = {v.stage_id: (v.verdict.value, [s.local_path.startswith(f"{served.mount}/") for s in v.sessions])
            for v in final.verdicts}  # fmt: skip
    assert (final.state.value, seen) == ("completed", {0: ("ok", [True]), 2: ("ok", [True])})


def test_token_required_on_mutating_routes(served: Served) -> None:
    without = httpx.post(f"{served.url}/v1/captures", json={"stages": [0]}, timeout=HTTP_TIMEOUT)
    wrong = httpx.post(f"{served.url}/v1/captures", json={"stages": [0]}, timeout=HTTP_TIMEOUT,
                       headers={"Authorization": "Bearer tok-wrong"})  # fmt: skip
    with served.client() as client:
        cap = client.start_capture([0])
    assert (without.status_code, without.json()["error"]["code"], wrong.status_code) == (401, "unauthorized", 401)
    assert cap.state.value == "active"  # the token file's value, its newline stripped


def test_file_download_is_confined_to_the_capture(served: Served) -> None:
    (served.root / "secret.txt").write_text("not yours")
    with served.client() as client:
        cap = client.start_capture([0])
        assert busy(served.emulator) == 200
        done = client.stop_capture(cap.id, wait=True, timeout=WAIT)
    folder = Path(done.verdicts[0].sessions[0].path).name
    files = f"{served.url}/v1/captures/{cap.id}/files"
    token = {"Authorization": f"Bearer {TOKEN}"}  # trace content needs the token (--token-file)
    ok = httpx.get(f"{files}/{folder}/trace_rank0.json.gz", headers=token, timeout=HTTP_TIMEOUT)
    escapes = [
        httpx.get(f"{files}/{folder}/../../../secret.txt", headers=token, timeout=HTTP_TIMEOUT),
        httpx.get(f"{files}/{folder}/..%2F..%2F..%2Fsecret.txt", headers=token, timeout=HTTP_TIMEOUT),
    ]
    assert (ok.status_code, ok.content[:2]) == (200, b"\x1f\x8b")
    assert [r.status_code for r in escapes] == [404, 404]


def test_reads_of_trace_content_need_the_token(served: Served) -> None:
    # --token-file: a summary, a timeline, a diff and a download each run an analysis or return
    # trace content, so each is 401 without the token and answers with it
    with served.client() as client:
        cap = client.start_capture([0])
        assert busy(served.emulator) == 200
        done = client.stop_capture(cap.id, wait=True, timeout=WAIT)
    folder = Path(done.verdicts[0].sessions[0].path).name
    reads = [f"/v1/captures/{cap.id}/summary?top=3", f"/v1/captures/{cap.id}/timeline",
             f"/v1/captures/{cap.id}/diff/{cap.id}", f"/v1/captures/{cap.id}/files/{folder}/trace_rank0.json.gz"]
    without = [httpx.get(f"{served.url}{path}", timeout=HTTP_TIMEOUT) for path in reads]
    wrong = [httpx.get(f"{served.url}{path}", headers={"Authorization": "Bearer tok-wrong"}, timeout=HTTP_TIMEOUT)
             for path in reads]  # fmt: skip
    right = [httpx.get(f"{served.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=HTTP_TIMEOUT)
             for path in reads]  # fmt: skip
    assert [(r.status_code, r.json()["error"]["code"], r.headers["www-authenticate"]) for r in without] == [
        (401, "unauthorized", "Bearer")] * 4
    assert [r.status_code for r in wrong] == [401] * 4
    assert [r.status_code for r in right] == [200] * 4, [r.text[:300] for r in right]
    assert (right[0].json()["stages"][0]["stage_id"], right[3].content[:2]) == (0, b"\x1f\x8b")


def test_a_json_null_body_starts_a_capture_of_every_profiled_stage(served: Served) -> None:
    # over a real socket: `null` is the body the OpenAPI document allows beside none, read as none
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    reply = httpx.post(f"{served.url}/v1/captures", content=b"null", headers=headers, timeout=HTTP_TIMEOUT)
    assert (reply.status_code, reply.json().get("stages")) == (201, [0, 2]), reply.text
    assert [c["stages"] for c in upstream_calls(served.emulator, "/start_profile")][-1:] == [[0, 2]]


def test_upstream_credentials_are_never_shown(served: Served) -> None:
    created = served.post("/v1/captures", json={"stages": [0]})
    ready = httpx.get(f"{served.url}/readyz", timeout=HTTP_TIMEOUT)
    with served.client() as client:
        client.stop_capture(created.json()["id"], wait=True, timeout=WAIT)
    listed = httpx.get(f"{served.url}/v1/captures", timeout=HTTP_TIMEOUT).text
    log = served.sidecar.log_path.read_text()
    assert (created.status_code, ready.status_code) == (201, 200)
    assert PASSWORD not in created.text + ready.text + listed + log
    assert "***@" in created.text  # the URL is shown, its user-info part replaced


def test_fifty_concurrent_starts_make_one_capture(served: Served) -> None:
    # over real sockets, through uvicorn's loop: the controller's one-at-a-time rule holds
    async def burst() -> list[int]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=served.url, headers=headers, timeout=HTTP_TIMEOUT) as http:
            replies = await asyncio.gather(*(http.post("/v1/captures", json={"stages": [0]}) for _ in range(50)))
        return [r.status_code for r in replies]

    codes = asyncio.run(burst())
    assert (codes.count(201), codes.count(409), len(upstream_calls(served.emulator, "/start_profile"))) == (1, 49, 1)


def test_sigterm_stops_the_active_capture_before_exit(served: Served) -> None:
    # last of the module's tests on purpose: the next user of ``served`` would start a new one
    with served.client() as client:
        client.start_capture([0, 2])
    assert profiling(served.emulator) == {"0": True, "1": False, "2": True}
    served.sidecar.stop(grace=30)  # uvicorn re-raises SIGTERM after its shutdown, so the exit code is -15
    assert (profiling(served.emulator), len(upstream_calls(served.emulator, "/stop_profile"))) == (
        {"0": False, "1": False, "2": False}, 1)


# --- start-up refusals: exit 1 naming the fix (the serve command in process: it refuses before
# it binds a port, and a process adds nothing to that) ----------------------------------------


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    return make_deploy(tmp_path, STAGES)


def _serve_refused(deploy: Path, *args: str) -> str:
    """``omni-sidecar serve`` with ``args``: asserts it exits 1 before serving; its stderr."""
    from typer.testing import CliRunner

    from sidecar.cli import app

    # --upstream is required; a test's own --upstream comes later and wins
    result = CliRunner().invoke(app, ["serve", "--upstream", "http://127.0.0.1:9", "--deploy-config", str(deploy), *args])
    assert result.exit_code == 1, result.output
    return result.stderr


def test_an_unwritable_state_dir_stops_start_up(deploy: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = _serve_refused(deploy, "--port", "0", "--state-dir", str(blocker / "state"))
    assert str(blocker / "state") in err.replace("\n", "") and "state_dir_unusable" in err


def test_an_upstream_without_scheme_stops_start_up(deploy: Path, tmp_path: Path) -> None:
    err = _serve_refused(deploy, "--upstream", "127.0.0.1:8000", "--state-dir", str(tmp_path / "s"))
    assert "http://127.0.0.1:8000" in err


def test_listening_beyond_loopback_needs_a_token(deploy: Path, tmp_path: Path) -> None:
    err = _serve_refused(deploy, "--host", "0.0.0.0", "--state-dir", str(tmp_path / "s"))
    assert "--token-file" in err
