"""An exploratory pass of the product against the real vLLM-Omni 0.32.0rc1 server on CPU, as a
user drives it: ``capture`` (a duration, ``--steps`` on the capped server, ``--count-steps``),
``start`` / ``stop`` / ``status`` / ``list``, a second start, an unknown stage, a stop while a
request was still running, the server killed mid-capture, ``plan`` against a capture of the planned
size, ``validate --server``, ``render`` of every preset and ``--steps`` on every deploy YAML the
release ships read back by vLLM-Omni's own loader (``load_deploy_config`` and its platform
overlay: the same stages, profiler, dir and ``max_iterations``), and ``summarize`` of the real
traces (stage names, engine steps and idle iterations counted as in the trace).

What it found, tested here: ``summarize`` (and a capture's summary) of CPU traces said nothing of
when each stage started or worked, so the pipeline's hand-over from stage 0 to stage 1 was never
reported: only GPU devices were put on the hosts' clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from sidecar.api.launcher import SidecarProcess
from sidecar.client import SidecarClient
from tests.omni.conftest import ROOT, Setup, complete, end_open_captures, module_sidecar


@pytest.fixture(scope="module")
def sidecar(two_stage: Setup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    with module_sidecar(two_stage, tmp_path_factory) as proc:
        yield proc
        end_open_captures(proc.url)


def test_summary_of_a_real_cpu_capture_gives_the_hand_over_from_stage_0_to_stage_1(
        two_stage: Setup, sidecar: SidecarProcess) -> None:  # fmt: skip
    """One request through both stages in an otherwise idle window: stage 1 works only once stage 0
    hands its output over, so its first work comes after stage 0's. Both the CLI's ``summarize`` of
    the session folders and the capture's own summary say so (a hand-over, never a start skew)."""
    with SidecarClient(sidecar.url, timeout=600) as client:
        cap = client.start_capture(stages=[0, 1], label="handover")
        complete(two_stage.url, n=1)
        cap = client.stop_capture(cap.id, wait=True, timeout=600)
        assert {v.stage_id: v.verdict.value for v in cap.verdicts} == {0: "ok", 1: "ok"}, cap
        served = client.summary(cap.id)
    folders = [s.path for v in cap.verdicts for s in v.sessions]
    r = subprocess.run([sys.executable, "-m", "sidecar", "summarize", *folders, "--json"], capture_output=True,
                       text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    for handovers, findings, window in ((summary["handovers"], summary["findings"], summary["common_window"]),
                                        ([h.model_dump() for h in served.handovers],
                                         [f.model_dump() for f in served.findings],
                                         served.common_window)):  # fmt: skip
        assert [(h["stage_id"], h["upstream_stage_id"]) for h in handovers] == [(1, 0)], handovers
        assert 0 < handovers[0]["latency_us"] < 60e6, handovers  # stage 0's steps, then the hand-over
        assert handovers[0]["first_work_epoch_us"] > handovers[0]["upstream_first_work_epoch_us"]
        assert window is not None  # both stages on the hosts' clock
        assert "start_skew" not in {f["rule"] for f in findings}, findings
