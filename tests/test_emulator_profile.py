"""The emulator's profiler endpoints over HTTP: every trap row of docs/design.md §3, folder and file
names, gzip after the reply, and real torch artifacts. A pooled emulator with real torch workers
(``omni_emulator``: stage 0 LLM + torch, stage 1 LLM without profiler, stage 2 diffusion + torch)
is reset before each test and writes into that test's own trace dirs, so every session folder a
test sees is its own.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.emulator.launcher import EmulatorProcess
from tests.fixtures.emulator import emulator_state, log_offset, log_since, make_deploy
from tests.fixtures.waits import poll

TIMEOUT = 60
LLM_FOLDER = re.compile(r"^(\d{8}-\d{6})_stage0_rank0_(\d+)$")
DIFFUSION_FOLDER = re.compile(r"^(\d{8}-\d{6})_stage_2_rep_0_diffusion_(\d+)$")
THREAD = ["--workers", "thread", "--gzip-delay", "1", "--step-ms", "1"]


@pytest.fixture
def emu(omni_emulator: EmulatorProcess) -> EmulatorProcess:
    return omni_emulator


def post(emu: EmulatorProcess, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    if body is not None:
        kw["json"] = body
    return emu.http.post(path, timeout=TIMEOUT, **kw)


def get(emu: EmulatorProcess, path: str) -> httpx.Response:
    return emu.http.get(path, timeout=TIMEOUT)


def chat(emu: EmulatorProcess, max_tokens: int = 3) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return post(emu, "/v1/chat/completions", body)


def stages(emu: EmulatorProcess) -> dict[str, dict[str, Any]]:
    return emulator_state(emu)["stages"]


def sessions(emu: EmulatorProcess) -> dict[str, list[Path]]:
    return {sid: [Path(p) for p in s["sessions"]] for sid, s in stages(emu).items()}


def profiling(emu: EmulatorProcess) -> dict[str, bool]:
    return {sid: s["profiling"] for sid, s in stages(emu).items()}


def next_second() -> None:
    """Session folders are named to the second: wait until the clock has moved to a new one."""
    now = int(time.time())
    assert poll(lambda: int(time.time()) > now, timeout=5)


def read_trace(session: Path) -> dict[str, Any]:
    """The trace as written at stop: ``trace_rank0.json`` until the background gzip replaced it
    (it is complete from the stop reply on; the .gz is complete once the .json is gone)."""
    try:
        with open(session / "trace_rank0.json", "rb") as f:
            return json.loads(f.read())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return json.loads(gzip.decompress((session / "trace_rank0.json.gz").read_bytes()))  # type: ignore[no-any-return]


def one_capture(emu: EmulatorProcess, stage_ids: list[int]) -> tuple[float, float, dict[str, list[Path]]]:
    t0 = time.time()
    post(emu, "/start_profile", {"stages": stage_ids})
    t1 = time.time()
    chat(emu)
    post(emu, "/stop_profile", {"stages": stage_ids})
    return t0, t1, sessions(emu)


# --- mounting, body, reply ---------------------------------------------------------------------


def test_get_on_mounted_endpoint_is_405(emu: EmulatorProcess) -> None:
    assert get(emu, "/start_profile").status_code == 405


def test_start_reply_is_success_json(emu: EmulatorProcess) -> None:
    r = post(emu, "/start_profile", {"stages": [0]})
    assert (r.status_code, r.json()) == (200, {"status": "SUCCESS"})


def test_missing_body_means_all_profiled_stages(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile")
    assert profiling(emu) == {"0": True, "1": False, "2": True}


def test_null_body_means_all_stages(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0, 2]})
    post(emu, "/stop_profile", content=b"null", headers={"content-type": "application/json"})
    assert profiling(emu) == {"0": False, "1": False, "2": False}


@pytest.mark.parametrize(
    "content",
    [b'{"stages": "0"}', b'{"stages": [0, "x"]}', b"[0, 2]", b"{not json"],
    ids=["string", "bad-item", "list-body", "not-json"],
)
def test_bad_body_is_400_and_profiles_nothing(emu: EmulatorProcess, content: bytes) -> None:
    r = post(emu, "/start_profile", content=content, headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["code"], any(profiling(emu).values())) == (400, 400, False)


# --- traps ---------------------------------------------------------------------------------


def test_empty_list_profiles_nothing_but_succeeds(emu: EmulatorProcess) -> None:
    r = post(emu, "/start_profile", {"stages": []})
    assert (r.json(), profiling(emu), sessions(emu)) == (
        {"status": "SUCCESS"},
        {"0": False, "1": False, "2": False},
        {"0": [], "1": [], "2": []},
    )


def test_unknown_stage_id_is_skipped_with_warning(emu: EmulatorProcess) -> None:
    offset = log_offset(emu)
    r = post(emu, "/start_profile", {"stages": [0, 7]})
    assert r.json() == {"status": "SUCCESS"}
    assert profiling(emu)["0"] is True
    assert "collective_rpc: ignoring invalid stage_id 7" in log_since(emu, offset)


def test_unprofiled_llm_stage_fails_in_worker_but_succeeds(emu: EmulatorProcess) -> None:
    offset = log_offset(emu)
    r = post(emu, "/start_profile", {"stages": [1]})
    assert (r.status_code, r.json(), profiling(emu)["1"]) == (200, {"status": "SUCCESS"}, False)
    assert "stage=1 replica=0 method=profile: RuntimeError: Profiling is not enabled" in log_since(emu, offset)


def test_double_start_makes_a_fresh_empty_folder_and_records_into_the_latest(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    next_second()  # folder names have one-second resolution: a start in the same second reuses one
    post(emu, "/start_profile", {"stages": [0]})
    at_second_start = sessions(emu)["0"]
    empty_then = [p.is_dir() and not any(p.iterdir()) for p in at_second_start]
    chat(emu)
    post(emu, "/stop_profile", {"stages": [0]})
    first, second = sessions(emu)["0"]
    assert (empty_then, list(first.iterdir()), (second / "profiler_out_0.txt").exists()) == ([True, True], [], True)


def test_stop_without_start_is_a_noop_success(emu: EmulatorProcess, tmp_path: Path) -> None:
    r = post(emu, "/stop_profile", {"stages": [0, 2]})
    traces = tmp_path / "traces"
    assert (r.json(), sessions(emu), list(traces.rglob("*"))) == ({"status": "SUCCESS"}, {"0": [], "1": [], "2": []}, [])


def test_stop_of_a_subset_leaves_the_others_recording(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0, 2]})
    post(emu, "/stop_profile", {"stages": [0]})
    assert profiling(emu) == {"0": False, "1": False, "2": True}


def test_stop_returns_after_trace_and_table_are_written(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0]})
    chat(emu)
    post(emu, "/stop_profile", {"stages": [0]})
    (session,) = sessions(emu)["0"]
    # the trace may already be gzipped under load; either name proves it was written
    assert sorted(f.name.removesuffix(".gz") for f in session.iterdir()) == ["profiler_out_0.txt", "trace_rank0.json"]


def test_gzip_replaces_the_trace_only_after_the_stop_reply(emu: EmulatorProcess, tmp_path: Path) -> None:
    stage_dir = tmp_path / "traces" / "stage2"  # make_deploy's default
    post(emu, "/start_profile", {"stages": [2]})
    post(emu, "/stop_profile", {"stages": [2]})
    (session,) = stage_dir.iterdir()  # the disk first, before any other round trip
    at_reply = sorted(p.name for p in session.iterdir())
    later = poll(lambda: not (session / "trace_rank0.json").exists() and (session / "trace_rank0.json.gz").exists())
    assert ("trace_rank0.json" in at_reply, "trace_rank0.json.gz" in at_reply, later) == (True, False, True)


def test_calls_are_recorded_with_stages_and_status(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [2]})
    post(emu, "/stop_profile", {"stages": [2]})
    calls = emulator_state(emu)["calls"]
    assert [(c["path"], c["stages"], c["status"]) for c in calls] == [
        ("/start_profile", [2], 200),
        ("/stop_profile", [2], 200),
    ]


# --- artifacts (real torch) --------------------------------------------------------------------


def test_llm_session_folder_name_and_place(emu: EmulatorProcess) -> None:
    t0, t1, new = one_capture(emu, [0])
    (folder,) = new["0"]
    m = LLM_FOLDER.match(folder.name)
    assert m and int(t0) <= int(m.group(2)) <= int(t1) and folder.parent.name == "stage0"


def test_diffusion_session_folder_name_and_place(emu: EmulatorProcess) -> None:
    t0, t1, new = one_capture(emu, [2])
    (folder,) = new["2"]
    m = DIFFUSION_FOLDER.match(folder.name)
    assert m and int(t0) <= int(m.group(2)) <= int(t1) and folder.parent.name == "stage2"


def test_trace_is_chrome_json_with_cpu_ops_of_the_workload(emu: EmulatorProcess) -> None:
    _, _, new = one_capture(emu, [0])
    events = read_trace(new["0"][0])["traceEvents"]
    cpu_ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    annotations = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert {"aten::linear", "aten::embedding"} <= cpu_ops and "execute_model" in annotations


def test_diffusion_trace_has_conv_ops_and_step_annotation(emu: EmulatorProcess) -> None:
    _, _, new = one_capture(emu, [2])
    events = read_trace(new["2"][0])["traceEvents"]
    assert "aten::conv2d" in {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert "diffusion_forward" in {e["name"] for e in events if e.get("cat") == "user_annotation"}


def test_idle_window_writes_a_valid_trace_with_zero_ops(emu: EmulatorProcess) -> None:
    post(emu, "/start_profile", {"stages": [0, 2]})
    post(emu, "/stop_profile", {"stages": [0, 2]})
    new = [p for sid in ("0", "2") for p in sessions(emu)[sid]]
    events = [read_trace(folder)["traceEvents"] for folder in new]
    assert len(new) == 2 and [sum(e.get("cat") == "cpu_op" for e in ev) for ev in events] == [0, 0]


# The header of torch's ``key_averages().table()`` with CPU activity only (torch 2.13), as the
# real worker writes it to profiler_out_<rank>.txt; checked here without importing torch.
KEY_AVERAGES_HEADER = ["Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "# of Calls"]


def test_profiler_out_is_a_key_averages_table(emu: EmulatorProcess) -> None:
    _, _, new = one_capture(emu, [0])
    ours = (new["0"][0] / "profiler_out_0.txt").read_text().splitlines()
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in ours[3:] if ln.strip() and not ln.startswith("-")]
    assert re.split(r"\s{2,}", ours[1].strip()) == KEY_AVERAGES_HEADER
    assert "aten::linear" in {r[0] for r in rows}
    assert re.fullmatch(r"Self CPU time total: [\d.]+(us|ms|s)", ours[-2 if ours[-1] == "" else -1])


# --- requests --------------------------------------------------------------------------------


def test_chat_completion_steps_every_stage(emu: EmulatorProcess) -> None:
    r = chat(emu, max_tokens=5)
    assert r.json()["usage"]["completion_tokens"] == 5
    assert {sid: s["iterations"] for sid, s in stages(emu).items()} == {"0": 5, "1": 5, "2": 4}


def test_models_and_health(emu: EmulatorProcess) -> None:
    models = get(emu, "/v1/models").json()
    assert (get(emu, "/health").status_code, models["data"][0]["id"]) == (200, "omni-emulator")


def test_chat_without_messages_is_400(emu: EmulatorProcess) -> None:
    assert post(emu, "/v1/chat/completions", {"max_tokens": 2}).status_code == 400


# --- separate servers -------------------------------------------------------------------------


def test_endpoints_are_404_when_no_stage_has_a_profiler(tmp_path: Path, shared_emulator_factory: Any) -> None:
    e = shared_emulator_factory(make_deploy(tmp_path, {0: None, 1: None}), extra_args=THREAD)
    assert (get(e, "/start_profile").status_code, post(e, "/stop_profile").status_code) == (404, 404)


def test_legacy_schema_is_refused_at_start_up(tmp_path: Path) -> None:
    bad = tmp_path / "legacy.yaml"
    bad.write_text("stage_args:\n  - stage_id: 0\n    engine_args: {}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.emulator", "--deploy-config", str(bad), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert (proc.returncode, "stage_args" in out, "Traceback" in out) == (1, True, False)


# --- an LLM stage with num_replicas > 1 ------------------------------------------------------------


def test_llm_replicas_write_one_folder_and_the_last_trace_wins(tmp_path: Path, shared_emulator_factory: Any) -> None:
    """0.30: every replica is rank 0 of its own engine, called one after another within ms: the
    same folder name, the same trace_rank0.json; replica 1 (stopped last) overwrites replica 0.
    Thread workers: the naming is the profiler's, whichever backend records."""
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}}, extra={0: {"num_replicas": 2}})
    e = shared_emulator_factory(deploy, extra_args=THREAD)
    post(e, "/start_profile", {"stages": [0]})
    chat(e, max_tokens=2)  # round robin: replica 0
    chat(e, max_tokens=5)  # replica 1
    post(e, "/stop_profile", {"stages": [0]})
    listed = sessions(e)["0"]
    on_disk = list((tmp_path / "traces" / "stage0").iterdir())
    assert poll(lambda: (on_disk[0] / "trace_rank0.json.gz").exists() and not (on_disk[0] / "trace_rank0.json").exists())
    steps = [ev for ev in read_trace(on_disk[0])["traceEvents"] if ev.get("name") == "execute_model"]
    assert (len(listed), len(on_disk), sorted(p.name for p in on_disk[0].iterdir()), len(steps)) == (
        1, 1, ["profiler_out_0.txt", "trace_rank0.json.gz"], 5)  # fmt: skip
