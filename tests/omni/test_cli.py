"""The CLI against a real ``vllm serve --omni`` behind a real sidecar: ``capture`` (Ctrl-C ends
the window), and ``summarize`` / ``timeline`` / ``diff`` of the real omni traces it wrote.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.api.launcher import SidecarProcess
from sidecar.client import SidecarClient
from tests.fixtures.terminal import ctrl_c_as_in_a_terminal
from tests.fixtures.waits import poll
from tests.omni.conftest import ROOT, Setup, complete, end_open_captures, module_sidecar


@pytest.fixture(scope="module")
def sidecar(two_stage: Setup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    with module_sidecar(two_stage, tmp_path_factory) as proc:
        yield proc
        end_open_captures(proc.url)


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def cli_capture(sidecar: SidecarProcess, busy_url: str) -> dict[str, Any]:
    """``omni-sidecar capture --json`` until Ctrl-C, with one request in the window."""
    with SidecarClient(sidecar.url) as client:
        known = {c.id for c in client.list_captures()}
        proc = subprocess.Popen([sys.executable, "-m", "sidecar", "capture", "--sidecar", sidecar.url, "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                preexec_fn=ctrl_c_as_in_a_terminal)  # fmt: skip
        try:
            assert poll(lambda: any(c.id not in known and c.state.value == "active" for c in client.list_captures()),
                        timeout=120)  # fmt: skip
            complete(busy_url, n=1)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, (out, err)
    return json.loads(out)


@pytest.fixture(scope="module")
def two_captures(two_stage: Setup, sidecar: SidecarProcess) -> list[dict[str, Any]]:
    return [cli_capture(sidecar, two_stage.url) for _ in range(2)]


def sessions(cap: dict[str, Any]) -> dict[int, Path]:
    return {v["stage_id"]: Path(s["path"]) for v in cap["verdicts"] for s in v["sessions"]}


def test_cli_capture_until_ctrl_c_is_ok_on_both_stages(two_captures: list[dict[str, Any]]) -> None:
    for cap in two_captures:
        assert cap["state"] == "completed", cap
        assert {v["stage_id"]: v["verdict"] for v in cap["verdicts"]} == {0: "ok", 1: "ok"}


def test_summarize_reads_both_stages_of_a_real_capture(two_captures: list[dict[str, Any]]) -> None:
    folders = sessions(two_captures[0])
    r = cli("summarize", *map(str, folders.values()), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert not summary["errors"], summary["errors"]
    stages = {s["stage_id"]: s for s in summary["stages"]}
    assert set(stages) == {0, 1}  # the stage read from vLLM-Omni's folder names
    for stage in stages.values():
        assert stage["totals"]["cpu_ops"] > 0 and stage["totals"]["kernels"] == 0  # CPU activity only
        assert stage["window"]["engine_steps"] > 0  # the request's engine steps are in the window
        assert any(op["name"].startswith("aten::") for op in stage["cpu_ops"])


def test_timeline_merges_both_stages(two_captures: list[dict[str, Any]], tmp_path: Path) -> None:
    out = tmp_path / "merged.json.gz"
    r = cli("timeline", *map(str, sessions(two_captures[0]).values()), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert not report["errors"], report["errors"]
    assert sorted(p["stage_id"] for p in report["processes"]) == [0, 1]
    assert all(p["events"] > 0 for p in report["processes"])
    assert out.stat().st_size > 0


def test_diff_of_two_real_captures_by_id(two_captures: list[dict[str, Any]], sidecar: SidecarProcess) -> None:
    a, b = (c["id"] for c in two_captures)
    r = cli("diff", a, b, "--sidecar", sidecar.url, "--json", "--top", "500")
    assert r.returncode == 0, r.stderr
    diff = json.loads(r.stdout)
    assert not diff["errors"], diff["errors"]
    stages = {s["stage_id"]: s for s in diff["stages"]}
    assert set(stages) == {0, 1}
    for stage in stages.values():
        totals = stage["totals"]
        assert totals["cpu_ops_a"] > 0 and totals["cpu_ops_b"] > 0
        attention = [op for op in stage["ops_by_self_cpu"] if "unified_attention" in op["name"]]
        assert attention and all(op["count_a"] > 0 and op["count_b"] > 0 for op in attention), stage
