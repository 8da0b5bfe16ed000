"""Edges of the fleet surface found by an exploratory hunt, each through the real surface: a
`fleet stop` with one target down still stops the others; bad windows and labels are refused
before anything is sent; the analyses of a fleet result (`skew`, `stragglers`, `archive`,
`timeline`) name every replica or trace they leave out and exit 1, refuse a result that lists a
target twice, and never write over the result or into a folder."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from sidecar._process import free_port
from sidecar.cli import app
from sidecar.client import SidecarClient
from sidecar.control.controller import ControlSettings
from sidecar.control.models import CaptureState
from sidecar.errors import FleetInvalid
from sidecar.fleet import Fleet, Target

FAST = ControlSettings(collect_timeout_s=30, close_timeout_s=3, summarize=False)
ANALYSES = (["skew"], ["stragglers"], ["archive", "-o", "{tmp}/out.tar"], ["timeline", "-o", "{tmp}/out.json"])


def _dead_url() -> str:
    """A 127.0.0.1 URL nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


# --- `fleet stop` with one target down --------------------------------------------------------------


@pytest.mark.slow
def test_fleet_stop_with_one_target_down_still_stops_the_others(replica_factory, sidecar_factory, tmp_path):
    (replica,) = replica_factory(1, stages=(0, 1))
    side = sidecar_factory(replica.url, replica.deploy)
    runner, state = CliRunner(), ["--state-dir", str(tmp_path / "st")]
    started = runner.invoke(app, ["fleet", "start", "--targets", side.url, "--stages", "0", *state])
    assert started.exit_code == 0, started.output
    dead = _dead_url()
    stopped = runner.invoke(app, ["fleet", "stop", "--targets", f"{side.url},{dead}", "--json", *state])
    with SidecarClient(side.url, timeout=30) as client:
        caps = client.list_captures()
    # before: the open refused the whole fleet and the live sidecar window (no lease) recorded on
    assert [c.state in (CaptureState.starting, CaptureState.active) for c in caps] == [False], caps
    assert replica.profiling() == {0: False, 1: False}
    result = json.loads(stopped.stdout)
    outcomes = {t["target"]: (t["outcome"], (t["error"] or {}).get("code")) for t in result["targets"]}
    assert outcomes == {f"sidecar={side.url}": ("stopped", None),
                        f"sidecar={dead}": ("stop_not_sent", "sidecar_unreachable")}, stopped.output
    assert stopped.exit_code == 1  # a target could not be stopped: never 0


@pytest.mark.slow
def test_fleet_stop_with_its_key_leaves_another_clients_capture_recording(replica_factory, sidecar_factory, tmp_path):
    # `fleet stop` stopped whatever was live on each target, another client's capture too; with
    # the key `fleet start` prints, it stops that window only and says what it left
    r1, r2 = replica_factory(2, stages=(0, 1))
    ours, theirs = sidecar_factory(r1.url, r1.deploy), sidecar_factory(r2.url, r2.deploy)
    runner, state = CliRunner(), ["--state-dir", str(tmp_path / "st")]
    started = runner.invoke(app, ["fleet", "start", "--targets", ours.url, "--stages", "0", *state])
    assert started.exit_code == 0 and "fleet key " in started.stdout, started.output
    key = started.stdout.split("fleet key ", 1)[1].split(":", 1)[0]
    with SidecarClient(theirs.url, timeout=30) as client:
        other = client.start_capture([0], label="someone else's")
        httpx.post(f"{r1.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2}, timeout=60).raise_for_status()
        stopped = runner.invoke(app, ["fleet", "stop", "--targets", f"{ours.url},{theirs.url}", "--key", key,
                                      "--json", *state])
        still = client.get_capture(other.id)
        client.stop_capture(other.id, wait=True, timeout=60)
    result = json.loads(stopped.stdout)
    assert (stopped.exit_code, [t["target"] for t in result["targets"]], list(result["not_this_fleets"]),
            still.state) == (0, [f"sidecar={ours.url}"], [f"sidecar={theirs.url}"], CaptureState.active), stopped.output
    assert result["targets"][0]["outcome"] == "stopped" and r1.profiling() == {0: False, 1: False}
    bad = runner.invoke(app, ["fleet", "stop", "--targets", ours.url, "--key", "no key!", *state])
    assert (bad.exit_code, "--key" in bad.output) == (2, True), bad.output


# --- input refused before anything is sent ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("start", "code"), [
    ({"duration_s": 0}, "duration_invalid"),
    ({"duration_s": -5}, "duration_invalid"),
    ({"duration_s": float("nan")}, "duration_invalid"),
    ({"label": "step 3\n[red]"}, "label_invalid"),
])
async def test_a_bad_window_or_label_is_refused_before_any_target_is_sent_a_start(
        replica_factory, sidecar_factory, start, code):
    (replica,) = replica_factory(1, stages=(0, 1))
    side = await asyncio.to_thread(sidecar_factory, replica.url, replica.deploy)
    async with Fleet([Target.sidecar(side.url)], stages=[0]) as fleet:
        with pytest.raises(FleetInvalid) as info:
            await fleet.start(**start)
    assert info.value.code == code, info.value
    with SidecarClient(side.url, timeout=30) as client:
        assert client.list_captures() == []  # before: sent, each target answered a bare request_invalid


def test_cli_fleet_start_refuses_a_duration_of_0_naming_the_option(tmp_path):
    out = CliRunner().invoke(app, ["fleet", "start", "--targets", _dead_url(), "--duration", "0",
                                   "--state-dir", str(tmp_path / "st")])
    said = " ".join(out.output.split())
    assert (out.exit_code, "duration_invalid" in said, "--duration" in said) == (1, True, True), out.output


# --- the analyses of a fleet result -------------------------------------------------------------------


@pytest.fixture
def fleet_result(replica_factory, tmp_path) -> Path:
    """A fleet result (a ``FleetCapture`` as JSON) of two replicas that did work in the window."""
    replicas = replica_factory(2, stages=(0, 1))

    async def run() -> str:
        async with Fleet([Target.upstream(r.url, r.deploy) for r in replicas], control_settings=FAST) as fleet:
            fc = await fleet.start(label="edges")
            for r in replicas:
                await asyncio.to_thread(r.generate)
            fc = await fleet.stop(fc)
        assert fc.ok, fc.rollup()
        return fc.model_dump_json()

    path = tmp_path / "result.json"
    path.write_text(asyncio.run(run()))
    return path


def _analyse(result: Path, command: list[str], tmp_path: Path):
    args = [a.format(tmp=tmp_path) for a in command]
    return CliRunner().invoke(app, ["fleet", args[0], str(result), *args[1:]])


def _second(result: Path) -> tuple[dict, dict]:
    doc = json.loads(result.read_text())
    return doc, list(doc["targets"].values())[1]


@pytest.mark.slow
@pytest.mark.parametrize("command", ANALYSES, ids=lambda c: c[0])
def test_an_analysis_names_a_replica_whose_traces_are_gone_and_exits_1(fleet_result, tmp_path, command):
    doc, second = _second(fleet_result)
    for folder in {s["path"] for v in second["verdicts"] for s in v["sessions"]}:
        shutil.rmtree(folder)
    out = _analyse(fleet_result, command, tmp_path)
    said = " ".join(out.output.split())
    # before: replica 1 was dropped in silence, the rest reported as the whole run, exit 0
    assert (out.exit_code, f"{second['target']} (replica 1)" in said) == (1, True), out.output


@pytest.mark.slow
@pytest.mark.parametrize("command", ANALYSES, ids=lambda c: c[0])
def test_an_analysis_names_a_replica_whose_start_failed_and_exits_1(fleet_result, tmp_path, command):
    doc, second = _second(fleet_result)
    second.update(outcome="start_failed", verdicts=[], error={"code": "capture_active", "message": "busy"})
    fleet_result.write_text(json.dumps(doc))
    out = _analyse(fleet_result, command, tmp_path)
    said = " ".join(out.output.split())
    assert (out.exit_code, f"{second['target']} (replica 1)" in said, "start_failed" in said) == (1, True, True), \
        out.output


@pytest.mark.slow
def test_stragglers_names_an_unreadable_trace_and_exits_1(fleet_result, tmp_path):
    doc, second = _second(fleet_result)
    folder = Path(second["verdicts"][0]["sessions"][0]["path"])
    broken = next(p for p in folder.rglob("trace_rank*.json*") if p.is_file())
    broken.write_bytes(b"not a trace")
    out = _analyse(fleet_result, ["stragglers", "--json"], tmp_path)
    # before: the replica with a stage missing was diffed as if that stage had done nothing, exit 0
    assert out.exit_code == 1 and str(broken) in " ".join(out.output.split()), out.output


@pytest.mark.slow
@pytest.mark.parametrize("command", ANALYSES, ids=lambda c: c[0])
def test_a_result_listing_a_target_twice_is_refused(fleet_result, tmp_path, command):
    doc = json.loads(fleet_result.read_text())
    first, second = doc["targets"].values()
    second["target"] = first["target"]
    listed = tmp_path / "listed.json"  # the `fleet capture --json` form: targets as a list
    listed.write_text(json.dumps({**doc, "targets": [first, second]}))
    out = _analyse(listed, command, tmp_path)
    said = " ".join(out.output.split())
    assert (out.exit_code, "fleet_result_invalid" in said, "more than once" in said) == (1, True, True), out.output


@pytest.mark.slow
@pytest.mark.parametrize("command", ["archive", "timeline"])
def test_archive_and_timeline_never_write_over_the_result_or_into_a_folder(fleet_result, tmp_path, command):
    before = fleet_result.read_bytes()
    over = CliRunner().invoke(app, ["fleet", command, str(fleet_result), "-o", str(fleet_result)])
    (tmp_path / "a-folder").mkdir()
    into = CliRunner().invoke(app, ["fleet", command, str(fleet_result), "-o", str(tmp_path / "a-folder")])
    assert fleet_result.read_bytes() == before  # before: `archive -o RESULT` wrote the TAR over it
    assert (over.exit_code, into.exit_code) == (1, 1), over.output + into.output
    assert into.exception is None or isinstance(into.exception, SystemExit), into.exception  # no traceback
    assert "trace_invalid" in over.output and "folder" in into.output


@pytest.mark.slow
def test_stragglers_does_not_rank_a_replica_missing_a_stage(fleet_result, tmp_path):
    # replica 1's stage 1 traces gone: its wall spans stage 0 alone and read short, so it was ranked
    # (and could be the median) against replicas whose wall spans both stages
    doc, second = _second(fleet_result)
    for v in second["verdicts"]:
        if v["stage_id"] == 1:
            for s in v["sessions"]:
                shutil.rmtree(s["path"])
    out = _analyse(fleet_result, ["stragglers", "--json"], tmp_path)
    body = json.loads(out.stdout)
    assert (body["replicas"], body["median_replica"], [line.split(":")[0] for line in body["left_out"]]) == (
        1, 0, ["replica 1"]), out.output
    text = " ".join(_analyse(fleet_result, ["stragglers"], tmp_path).output.split())
    assert "not ranked: replica 1: no trace of stage 1" in text, text
