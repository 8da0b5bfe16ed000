"""Findings: each rule fires where the trace shows it and stays quiet where it does not.

Real H200 fixtures where they exist (host_bound: tiny kernels at batch 1; busy_gemm: 2048²
matmuls, a busy GPU; the 2-rank fleet job; the 2-rank NCCL job, comm_rank), devices built from the
fixtures' own figures where no real trace on one GPU shows it (memcpy-bound, idle on another stream).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.analysis import summarize_paths
from sidecar.analysis.findings import DEVICE_RULES, capture_findings
from sidecar.analysis.models import Straggler

TRACES = Path(__file__).parent / "data" / "traces"


@pytest.fixture(scope="module")
def caps() -> dict:
    out = {n: summarize_paths([TRACES / f"{n}.json.gz"]) for n in ("host_bound", "busy_gemm")}
    out["fleet"] = summarize_paths([TRACES / "fleet_rank0.json.gz", TRACES / "fleet_rank1.json.gz"])
    out["comm"] = summarize_paths([TRACES / "comm_rank0.json.gz", TRACES / "comm_rank1.json.gz"])
    return out


def _rules(cap) -> set[str]:
    return {f.rule for f in cap.findings}


def test_host_bound_trace_is_host_and_launch_bound(caps: dict) -> None:
    fs = {f.rule: f for f in caps["host_bound"].findings}
    assert {"host_bound", "launch_bound"} <= set(fs)
    hb = fs["host_bound"]
    assert hb.severity == "high" and hb.figures["idle_share"] > 0.9 and hb.figures["host_wait_share"] > 0.9
    assert "GPU idle 97% of the window, 100% of it waiting on the host" in hb.message
    assert "launch-bound" in fs["launch_bound"].message and fs["launch_bound"].figures["short_share"] == 1.0


def test_busy_gpu_has_no_finding(caps: dict) -> None:
    d = caps["busy_gemm"].devices[0]
    assert d.temporal.idle_share < 0.2 and not d.launch.cpu_bound
    assert caps["busy_gemm"].findings == []


def test_findings_are_ranked_and_name_where(caps: dict) -> None:
    fs = caps["fleet"].findings
    assert [f.score for f in fs] == sorted((f.score for f in fs), reverse=True)
    assert {f.rank for f in fs} == {0, 1} and all(f.message.startswith(f"rank {f.rank}: ") for f in fs)


def test_exposed_communication_of_the_nccl_job(caps: dict) -> None:
    fs = [f for f in caps["comm"].findings if f.rule == "communication_exposed"]
    assert sorted(f.rank for f in fs) == [0, 1]
    for f in fs:
        assert f.severity == "high" and f.figures["communication_share"] > 0.5 and f.figures["overlap_share"] < 0.5
        assert f.message.startswith(f"rank {f.rank}: communication takes 6") and "overlapped by compute" in f.message
    assert "communication_exposed" not in _rules(caps["fleet"]) | _rules(caps["busy_gemm"])


def _device(cap, **temporal):
    d = cap.devices[0].model_copy(deep=True)
    for k, v in temporal.items():
        obj, _, field = k.partition("__")
        setattr(getattr(d, obj), field, v)
    return d


@pytest.mark.parametrize(("rule", "fire", "quiet"), [
    ("communication_exposed", dict(temporal__communication_share=0.3, overlap__share=0.1), dict(temporal__communication_share=0.3, overlap__share=0.8)),
    ("memory_bound", dict(temporal__memory_share=0.25), dict(temporal__memory_share=0.02)),
    ("idle_other", dict(temporal__idle_share=0.7, idle_breakdown__other_share=0.8), dict(temporal__idle_share=0.7, idle_breakdown__other_share=0.1)),
])
def test_rules_on_a_device_with_one_figure_changed(caps: dict, rule: str, fire: dict, quiet: dict) -> None:
    busy = caps["busy_gemm"]
    assert DEVICE_RULES[rule](_device(busy, **fire)) is not None
    assert DEVICE_RULES[rule](_device(busy, **quiet)) is None
    assert DEVICE_RULES[rule](busy.devices[0]) is None


def test_straggler_fires_past_the_ratio(caps: dict) -> None:
    real = caps["fleet"]
    assert real.stragglers == [] or real.stragglers[0].ratio < 1.2
    assert "straggler" not in _rules(real)
    slow = Straggler(stage_id=0, metric="step_mean", slowest_replica=1, slowest_rank=1, slowest_us=30_000,
                     median_us=20_000, ratio=1.5, members=2)
    (f,) = capture_findings([], [slow])
    assert f.rule == "straggler" and f.message == "stage 0 · replica 1 · rank 1: 1.50× the median of its stage (30.0 vs 20.0 ms)"


def test_start_skew_against_the_requested_start() -> None:
    paths = [TRACES / "fleet_rank0.json.gz", TRACES / "host_bound.json.gz"]  # recorded 13 h apart
    cap = summarize_paths(paths)
    assert cap.common_window.reference == "earliest_rank" and cap.common_window.span_us == 0.0
    skews = sorted(d.start_skew_us for d in cap.devices)
    assert skews[0] == 0.0 and skews[1] > 3.6e9
    assert "start_skew" in _rules(cap)
    first = min(d.profiling_start_epoch_us for d in cap.devices)  # Kineto's span, before the first event
    assert first < min(d.first_event_epoch_us for d in cap.devices)
    cap2 = summarize_paths(paths, requested_start=first / 1e6 - 2.0)
    assert cap2.common_window.reference == "requested_start"
    assert min(d.start_skew_us for d in cap2.devices) == pytest.approx(2e6, abs=1)
    one = summarize_paths([TRACES / "fleet_rank0.json.gz", TRACES / "fleet_rank1.json.gz"])
    assert "start_skew" not in _rules(one) and one.common_window.span_us > 30_000


def test_cli_prints_the_why_table_and_findings_after_the_tables() -> None:
    import json

    from typer.testing import CliRunner

    from sidecar.cli import app

    out = CliRunner().invoke(app, ["summarize", str(TRACES / "host_bound.json.gz")], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    text = out.output
    assert text.index("Why, per stage·replica·rank·GPU") < text.index("Findings")
    assert "high   the trace: GPU idle 97% of the window, 100% of it waiting on the host" in text
    as_json = CliRunner().invoke(app, ["summarize", str(TRACES / "host_bound.json.gz"), "--json"])
    doc = json.loads(as_json.stdout)
    assert {"host_bound", "launch_bound"} <= {f["rule"] for f in doc["findings"]}
    assert doc["devices"][0]["temporal"]["idle_share"] > 0.9 and doc["devices"][0]["launch"]["cpu_bound"] is True


def test_a_summary_written_before_these_fields_still_loads(caps: dict) -> None:
    from sidecar.analysis.models import CaptureSummary

    old = caps["host_bound"].model_dump(mode="json")
    for key in ("findings", "common_window"):
        old.pop(key)
    for body in [old, *old["stages"], *old["files"]]:
        for d in body["devices"]:
            for key in ("temporal", "idle_breakdown", "kernel_categories", "overlap", "launch", "steady",
                        "first_event_epoch_us", "start_skew_us"):
                d.pop(key)
    back = CaptureSummary.model_validate(old)
    assert back.findings == [] and back.devices[0].temporal is None and back.devices[0].busy_us > 0
