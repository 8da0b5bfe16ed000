"""Start skew means what it says: profiling starts (Kineto's own profiler span) compared among the
ranks and replicas of one stage only; a downstream stage's late first work is the pipeline's
hand-over latency, its own field and finding (docs/summaries.md, "When each device started").

Built from the committed H200 fixture: a two-stage pipeline whose stage 1 is the same trace with
its events 400 ms later and its profiler span where it was (the profiler started with stage 0's,
the work came when stage 0 handed it over); and two ranks of one stage whose recordings really
started 400 ms apart. Summaries and fleet alignments through the CLI, as a user runs them.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sidecar.analysis import summarize_paths
from tests.fixtures.analysis import TRACE_DATA, load_trace

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = TRACE_DATA / "busy_gemm.json.gz"  # 2048² matmuls: a busy GPU, no finding of its own
SHIFT_US = 400_000.0


def handed_over_copy(src: Path, dst: Path, shift_us: float) -> Path:
    """``src`` with every event ``shift_us`` later but Kineto's profiler span and markers (the span
    starts where it did and ends after the moved events): a stage that started profiling with the
    others and got its first work ``shift_us`` later."""
    doc = load_trace(src)
    for e in doc["traceEvents"]:
        if not isinstance(e.get("ts"), (int, float)) or e.get("ph") in ("M", "i", "I"):
            continue
        if e.get("cat") == "Trace":
            e["dur"] = e.get("dur", 0) + shift_us
        else:
            e["ts"] += shift_us
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return dst


def later_rank_copy(src: Path, dst: Path, rank: int, later_ns: int) -> Path:
    """``src`` as rank ``rank`` of its job, its whole recording (profiler span and work) ``later_ns``
    later: its clock base moved, its ``ts`` unchanged."""
    doc = load_trace(src)
    doc["baseTimeNanoseconds"] += later_ns
    doc["distributedInfo"] = {**doc.get("distributedInfo", {}), "rank": rank}
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return dst


def _trace(root: Path, stage: int, rank: int) -> Path:
    """Where vLLM-Omni writes the trace of ``stage``'s ``rank`` (its session folder)."""
    return root / f"20261201-100000_stage{stage}_rank{rank}_1764500000" / f"trace_rank{rank}.json.gz"


def _with_stage0(root: Path) -> Path:
    """``root`` holding the fixture as stage 0, rank 0."""
    dst = _trace(root, 0, 0)
    dst.parent.mkdir(parents=True)
    dst.write_bytes(FIXTURE.read_bytes())
    return root


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 0: the fixture; stage 1: its work 400 ms later, its profiler span unmoved."""
    root = _with_stage0(tmp_path_factory.mktemp("pipeline"))
    handed_over_copy(FIXTURE, _trace(root, 1, 0), SHIFT_US)
    return root


@pytest.fixture(scope="module")
def late_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 0, ranks 0 and 1: the same recording, rank 1's whole trace (span and work) 400 ms later."""
    root = _with_stage0(tmp_path_factory.mktemp("late_rank"))
    later_rank_copy(FIXTURE, _trace(root, 0, 1), 1, int(SHIFT_US * 1000))
    return root


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    env.pop("OMNI_SIDECAR_URL", None)
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT, check=False)


def cli_json(*args: str) -> dict[str, Any]:
    out = cli(*args, "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    return json.loads(out.stdout)


def _by_rule(findings: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in findings:
        out.setdefault(f["rule"], []).append(f)
    return out


# --- the capture summary --------------------------------------------------------------------


def test_a_downstream_stage_s_late_first_work_is_no_skew(pipeline: Path) -> None:
    doc = cli_json("summarize", str(pipeline))
    assert [f["rule"] for f in doc["findings"]] == ["handover_latency"]  # was: start_skew, high, score 1.00
    assert [(s["stage_id"], s["members"], s["spread_us"]) for s in doc["stage_starts"]] == [(0, 1, 0.0), (1, 1, 0.0)]
    assert [d["start_skew_us"] for d in doc["devices"]] == [0.0, 0.0]


def test_the_pipeline_states_its_hand_over_latency(pipeline: Path) -> None:
    doc = cli_json("summarize", str(pipeline))
    (h,) = doc["handovers"]
    assert (h["stage_id"], h["upstream_stage_id"]) == (1, 0)
    assert h["latency_us"] == pytest.approx(SHIFT_US, abs=1.0)
    assert h["waited_us"] == pytest.approx(SHIFT_US + 409.4, abs=1.0)  # + the fixture's own first-op delay
    (f,) = _by_rule(doc["findings"])["handover_latency"]
    assert (f["stage_id"], f["severity"], f["figures"]["upstream_stage_id"]) == (1, "info", 0)
    assert f["figures"]["latency_us"] == pytest.approx(SHIFT_US, abs=1.0)
    assert doc["findings"][-1]["rule"] == "handover_latency"  # a figure, not a problem: ranked last


def test_the_common_window_is_the_span_every_device_was_recording(pipeline: Path) -> None:
    cap = summarize_paths([pipeline])
    span = next(e for e in load_trace(FIXTURE)["traceEvents"] if e.get("cat") == "Trace")
    assert cap.common_window is not None
    assert cap.common_window.span_us == pytest.approx(span["dur"], abs=1.0)  # stage 0's span, inside stage 1's


def test_two_ranks_of_one_stage_started_apart_are_a_start_skew(late_rank: Path) -> None:
    doc = cli_json("summarize", str(late_rank))
    rules = _by_rule(doc["findings"])
    (f,) = rules["start_skew"]
    assert (f["stage_id"], f["rank"]) == (0, 1)
    assert f["figures"]["spread_us"] == pytest.approx(SHIFT_US, abs=1.0) and f["figures"]["common_us"] == 0.0
    assert "handover_latency" not in rules and doc["handovers"] == []
    assert sorted(d["start_skew_us"] for d in doc["devices"]) == [0.0, pytest.approx(SHIFT_US, abs=1.0)]


def test_a_late_stage_started_with_its_ranks_apart_is_both(late_rank: Path, pipeline: Path, tmp_path: Path) -> None:
    # stage 0 has the late rank; stage 1 is the handed-over copy: the skew stays within stage 0
    for folder in [*late_rank.iterdir(), *pipeline.glob("*_stage1_*")]:
        dst = tmp_path / folder.name
        dst.mkdir()
        for f in folder.iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
    cap = summarize_paths([tmp_path])
    assert [(f.rule, f.stage_id) for f in cap.findings if f.rule in ("start_skew", "handover_latency")] == [
        ("start_skew", 0), ("handover_latency", 1)]
    assert [(h.stage_id, round(h.latency_us)) for h in cap.handovers] == [(1, round(SHIFT_US))]


def test_a_stage_that_worked_before_its_upstream_shows_no_hand_over(tmp_path: Path) -> None:
    # stage 0 is the handed-over copy, stage 1 the fixture: stage 1 had work when the window opened
    dst = _trace(tmp_path, 1, 0)
    dst.parent.mkdir(parents=True)
    dst.write_bytes(FIXTURE.read_bytes())
    handed_over_copy(FIXTURE, _trace(tmp_path, 0, 0), SHIFT_US)
    cap = summarize_paths([tmp_path])
    assert (cap.handovers, cap.findings) == ([], [])


def test_a_trace_without_the_profiler_s_span_starts_at_its_first_event(write_trace, x_event, tmp_path: Path) -> None:
    # a Chrome trace written by something other than Kineto: no ``PyTorch Profiler`` span
    for rank, at in ((0, 1_000.0), (1, 1_000.0 + SHIFT_US)):
        kernel = x_event("gemm", at + 10, 50, cat="kernel", pid=0, tid=7, device=0, stream=7)
        write_trace([x_event("aten::mm", at, 20), kernel],
                    f"20261201-100000_stage0_rank{rank}_1764500000/trace_rank{rank}.json",
                    header={"baseTimeNanoseconds": 1_790_000_000_000_000_000})
    cap = summarize_paths([tmp_path])
    assert [d.profiling_start_epoch_us for d in cap.devices] == [None, None]
    assert [d.start_skew_us for d in cap.devices] == [0.0, SHIFT_US]
    (f,) = cap.findings
    assert (f.rule, f.stage_id, f.rank, f.figures["spread_us"]) == ("start_skew", 0, 1, SHIFT_US)


# --- the fleet's alignment -------------------------------------------------------------------


def fleet_result(path: Path, targets: dict[str, list[Path]]) -> Path:
    """A fleet result as `fleet capture --json` writes it: per target, its stages' session folders."""
    doc = {"targets": [
        {"target": name, "kind": "upstream", "outcome": "stopped",
         "verdicts": [{"stage_id": int(f.name.split("_stage")[1].split("_")[0]), "sessions": [{"path": str(f)}]}
                      for f in folders]}
        for name, folders in targets.items()]}
    path.write_text(json.dumps(doc))
    return path


def test_fleet_skew_compares_stages_apart_and_names_the_hand_over(pipeline: Path, tmp_path: Path) -> None:
    result = fleet_result(tmp_path / "result.json", {"upstream=http://127.0.0.1:1": sorted(pipeline.iterdir())})
    doc = cli_json("fleet", "skew", str(result))
    assert doc["spread_ms"] == 0.0
    assert [(s["stage_id"], s["spread_us"]) for s in doc["stages"]] == [(0, 0.0), (1, 0.0)]
    (h,) = doc["handovers"]
    assert (h["pipeline"], h["stage_id"], h["upstream_stage_id"]) == ("upstream=http://127.0.0.1:1", 1, 0)
    assert h["latency_us"] == pytest.approx(SHIFT_US, abs=1.0)
    # every stage was recording over the same span: the common window is stage 0's whole span
    span = next(e for e in load_trace(FIXTURE)["traceEvents"] if e.get("cat") == "Trace")
    assert doc["window_ms"] == pytest.approx(span["dur"] / 1000, abs=0.01)
    text = cli("fleet", "skew", str(result))
    assert text.returncode == 0, text.stderr + text.stdout


def test_fleet_skew_finds_replicas_of_one_stage_started_apart(late_rank: Path, tmp_path: Path) -> None:
    a, b = sorted(late_rank.iterdir())
    result = fleet_result(tmp_path / "result.json", {"upstream=http://127.0.0.1:1": [a], "upstream=http://127.0.0.1:2": [b]})
    doc = cli_json("fleet", "skew", str(result))
    assert doc["spread_ms"] == pytest.approx(SHIFT_US / 1000, abs=0.01)
    (s,) = doc["stages"]
    assert (s["stage_id"], s["members"], s["latest_replica"]) == (0, 2, 1)
    assert doc["handovers"] == [] and doc["window_ns"] is None and doc["window_empty"] is True
    starts = sorted(sp["profiling_start_ns"] for sp in doc["spans"])
    assert starts[1] - starts[0] == pytest.approx(SHIFT_US * 1000, abs=1000)


def test_fleet_timeline_trims_to_the_window_every_stage_was_recording(pipeline: Path, tmp_path: Path) -> None:
    result = fleet_result(tmp_path / "result.json", {"upstream=http://127.0.0.1:1": sorted(pipeline.iterdir())})
    out = tmp_path / "t.json.gz"
    doc = cli_json("fleet", "timeline", str(result), "-o", str(out), "--common-window")
    assert doc["alignment"]["window_ms"] > 0 and doc["trimmed"] > 0
    kernels = [e for e in load_trace(out)["traceEvents"] if e.get("cat") == "kernel"]
    assert {e["pid"] for e in kernels} == {1}  # stage 1's work came after stage 0's span ended
