"""The sidecar's omni flavour against a real two-stage ``vllm serve --omni``: per-stage verdicts
with the real folder and file names, idle windows, stage subsets, refused stage lists, a double
start and a partial stop made on the server behind the sidecar's back, and kill -9 recovery.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.api.launcher import SidecarProcess
from sidecar.client import SidecarClient
from sidecar.control.models import Capture
from sidecar.errors import SidecarError
from tests.fixtures.waits import poll
from tests.omni.conftest import Setup, complete, end_open_captures, start_sidecar

# <dir>/<YYYYmmdd-HHMMSS>_stage<sid>_rank0_<epoch>/ (vLLM-Omni's OmniTorchProfilerWrapper)
SESSION = re.compile(r"^\d{8}-\d{6}_stage(?P<sid>\d+)_rank0_\d+$")
AR_FILES = {"trace_rank0.json.gz", "ops_rank0.xlsx"}



def tree(dirs: dict[int, Path]) -> set[str]:
    """Every file and folder under the stages' trace dirs."""
    return {str(p) for d in dirs.values() if d.exists() for p in d.rglob("*")}


def capture(client: SidecarClient, busy_url: str | None, stages: list[int] | None = None) -> Capture:
    cap = client.start_capture(stages=stages, label="omni")
    if busy_url:
        complete(busy_url)
    return client.stop_capture(cap.id, wait=True, timeout=600)


def by_stage(cap: Capture) -> dict[int, Any]:
    return {v.stage_id: v for v in cap.verdicts}


def assert_not_recording(setup: Setup) -> None:
    """A stop sent straight to the server writes a trace for every stage still recording (it
    answers after the worker wrote it): nothing new may appear."""
    before = tree(setup.dirs)
    r = httpx.post(f"{setup.url}/stop_profile", timeout=600, trust_env=False)
    assert r.status_code == 200, r.text
    assert tree(setup.dirs) == before


@pytest.mark.smoke
def test_busy_window_on_both_stages_is_ok_with_the_real_names(two_stage: Setup, client: SidecarClient) -> None:
    cap = capture(client, two_stage.url)
    assert cap.state.value == "completed", cap
    verdicts = by_stage(cap)
    assert set(verdicts) == {0, 1}
    for sid, verdict in verdicts.items():
        assert verdict.verdict.value == "ok", verdict
        (session,) = verdict.sessions
        folder = Path(session.path)
        assert folder.parent == two_stage.dirs[sid]
        m = SESSION.match(folder.name)
        assert m and int(m["sid"]) == sid, folder.name
        names = {f.name for f in session.files}
        assert AR_FILES <= names, names
        assert not any(n.startswith("profiler_out_") for n in names), names  # no CUDA table on CPU
    assert_not_recording(two_stage)


@pytest.mark.smoke
def test_idle_window_is_empty_on_both_stages(two_stage: Setup, client: SidecarClient) -> None:
    cap = capture(client, None)
    assert cap.state.value == "degraded", cap
    assert {sid: v.verdict.value for sid, v in by_stage(cap).items()} == {0: "empty", 1: "empty"}


@pytest.mark.smoke
def test_one_stage_of_two_records_only_that_stage(two_stage: Setup, client: SidecarClient) -> None:
    stage0_before = tree({0: two_stage.dirs[0]})
    cap = capture(client, two_stage.url, stages=[1])
    assert cap.stages == [1]
    assert {sid: v.verdict.value for sid, v in by_stage(cap).items()} == {1: "ok"}
    assert tree({0: two_stage.dirs[0]}) == stage0_before  # stage 0 was never started
    assert_not_recording(two_stage)


@pytest.mark.parametrize(("stages", "code"), [([], "stages_empty"), ([7], "stage_unknown"),
                                              ([0, 0], "stage_duplicate")])  # fmt: skip
def test_bad_stage_lists_are_refused_before_the_server_is_called(
    two_stage: Setup, client: SidecarClient, stages: list[int], code: str
) -> None:
    before, known = tree(two_stage.dirs), len(client.list_captures())
    with pytest.raises(SidecarError) as err:
        client.start_capture(stages=stages)
    assert err.value.code == code, err.value
    assert tree(two_stage.dirs) == before  # no session folder: the server never got a start
    assert len(client.list_captures()) == known


def test_a_double_start_on_the_server_during_a_capture_is_still_ok(two_stage: Setup, client: SidecarClient) -> None:
    before = tree(two_stage.dirs)
    cap = client.start_capture(label="double")
    # A folder is named by the second of its start: a restart within the same second reuses it.
    first = [Path(p).name for p in tree(two_stage.dirs) - before if SESSION.match(Path(p).name)]
    started = max(int(name.rsplit("_", 1)[1]) for name in first)
    assert poll(lambda: time.time() >= started + 1, timeout=5)
    r = httpx.post(f"{two_stage.url}/start_profile", timeout=120, trust_env=False)  # behind the sidecar's back
    assert r.status_code == 200, r.text
    complete(two_stage.url)
    cap = client.stop_capture(cap.id, wait=True, timeout=600)
    verdicts = by_stage(cap)
    for sid in (0, 1):
        # The real server: an empty first folder, the artifacts in the second; both are this capture's.
        folders = sorted(s.path for s in verdicts[sid].sessions)
        new = sorted(p for p in tree({sid: two_stage.dirs[sid]}) - before if SESSION.match(Path(p).name))
        assert folders == new and len(new) == 2, (folders, new)
        assert verdicts[sid].verdict.value == "ok", verdicts[sid]
    assert_not_recording(two_stage)


def test_a_partial_stop_on_the_server_leaves_the_other_stage_recording(two_stage: Setup,
                                                                     client: SidecarClient) -> None:
    cap = client.start_capture(label="partial")
    complete(two_stage.url)
    r = httpx.post(f"{two_stage.url}/stop_profile", json={"stages": [0]}, timeout=600, trust_env=False)
    assert r.status_code == 200, r.text
    stage1_files = {p for p in tree({1: two_stage.dirs[1]}) if Path(p).is_file()}
    cap = client.stop_capture(cap.id, wait=True, timeout=600)
    assert {sid: v.verdict.value for sid, v in by_stage(cap).items()} == {0: "ok", 1: "ok"}, cap
    (stage1,) = by_stage(cap)[1].sessions
    # Stage 1 was still recording after the partial stop: its trace came with the sidecar's stop.
    assert not any(p.startswith(stage1.path) for p in stage1_files)
    assert_not_recording(two_stage)


@pytest.mark.smoke
def test_kill_9_of_the_sidecar_mid_capture_is_recovered_and_the_server_stops_recording(
    two_stage: Setup, sidecar: SidecarProcess, tmp_path: Path
) -> None:
    end_open_captures(sidecar.url)  # the module's sidecar holds nothing open: the server is free
    first = start_sidecar(two_stage, tmp_path / "state")
    try:
        with SidecarClient(first.url, timeout=120) as c:
            cid = c.start_capture(label="crash").id
        complete(two_stage.url, n=1)
        first.kill()
        second = start_sidecar(two_stage, tmp_path / "state")
        try:
            with SidecarClient(second.url, timeout=120) as c:
                cap = c.wait_capture(cid, timeout=600)
        finally:
            second.stop(grace=30)
    finally:
        first.stop(grace=5)
    assert cap.stop_reason is not None and cap.stop_reason.value == "stopped_on_recovery", cap
    assert {sid: v.verdict.value for sid, v in by_stage(cap).items()} == {0: "ok", 1: "ok"}, cap
    assert_not_recording(two_stage)


@pytest.mark.smoke
def test_the_sidecar_knows_its_server_by_version(two_stage: Setup, sidecar: SidecarProcess) -> None:
    # vLLM-Omni answers GET /version with its vLLM's version; it is told apart by a route only it serves
    from typer.testing import CliRunner

    from sidecar.cli import app
    from tests.omni.conftest import PAIRED_VLLM, VERSION

    with httpx.Client(base_url=sidecar.url, timeout=60) as http:
        assert poll(lambda: http.get("/v1/stages").json()["server"], timeout=60)
        server = http.get("/v1/stages").json()["server"]
    line = f"{PAIRED_VLLM.line[0]}.{PAIRED_VLLM.line[1]}."
    assert (server["kind"], server["omni"], server["vllm"].startswith(line), server["warnings"]) == (
        "omni", VERSION, True, []), server
    said = CliRunner().invoke(app, ["validate", "--server", two_stage.url])
    assert (said.exit_code, " ".join(said.output.split())) == (0, f"server: vLLM-Omni {VERSION} on vLLM {server['vllm']}: "
            "per-capture bounds not available over HTTP; the deploy's max_iterations caps bound a steps window vLLM-Omni serves its own version nowhere: "
            f"{VERSION} is the release made for vLLM {server['vllm']} (--omni-version to name another)"), said.output
