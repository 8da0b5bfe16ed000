"""What a user profiling a plain ``vllm serve`` met (an exploratory pass on the real CPU server):
the window's latency quantiles never beyond what the window's sum allows (vLLM's first bucket is
0.3 s: microsecond queue times read p50 0.15 s), a file where the trace folder should be named as
such (`missing`, not "mount the folder"), a server gone forgotten until one answers again, and one
restarted on the same port without ``--profiler-config`` told to add that flag. One server, killed
and restarted last.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.client import SidecarClient
from tests.live.conftest import VllmServer, complete


@pytest.fixture(scope="module")
def live(vllm_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    trace_dir = tmp_path_factory.mktemp("vllm-explore-traces")
    pc = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False}
    # stat loggers on: the window's latency histograms come from its /metrics
    return {"server": vllm_factory(pc, log_stats=True), "dir": trace_dir, "profiler_config": pc}


@pytest.fixture
def sidecar(live: dict[str, Any], sidecar_factory: Any, tmp_path: Path) -> Any:
    return sidecar_factory(live["server"].url, None, flavor="vllm", state_dir=tmp_path / "state",
                           extra_args=["--profiler-config", json.dumps(live["profiler_config"])])  # fmt: skip


def _capture(sidecar: Any, busy_url: str | None, during: Callable[[], None] | None = None) -> dict[str, Any]:
    with SidecarClient(sidecar.url, timeout=300) as client:
        cid = client.start_capture(label="explore").id
        if busy_url:
            complete(busy_url, n=2)
        if during is not None:
            during()
        return client.stop_capture(cid, wait=True, timeout=300).model_dump(mode="json")


def test_window_latency_quantiles_never_exceed_what_the_window_sum_allows(live: dict[str, Any], sidecar: Any) -> None:
    # The k-th smallest of n non-negative durations is at most sum / (n - k + 1): a quantile above it
    # is no observation's (queue p50 0.15 s beside a 20 us mean, interpolated in the 0-0.3 s bucket).
    cap = _capture(sidecar, live["server"].url)
    engines = cap["window_metrics"]["engines"]
    assert engines and all(e["latency"] for e in engines), cap["window_metrics"]
    over = []
    for e in engines:
        for name, h in e["latency"].items():
            for q, key in ((0.5, "p50_s"), (0.95, "p95_s")):
                if h["count"] and h[key] is not None:
                    k = max(1, math.ceil(q * h["count"]))
                    if h[key] > h["sum_s"] / (h["count"] - k + 1) * (1 + 1e-9):
                        over.append((name, key, h))
    assert not over, over


def test_a_file_where_the_trace_folder_should_be_leaves_the_stage_missing(live: dict[str, Any], sidecar: Any) -> None:
    # vLLM cannot make its folder (it warns "Can't create directory" and answers 200): the sidecar
    # sees the path, so the stage wrote nothing; it is not a folder it cannot see (`unverified`).
    folder: Path = live["dir"]

    def block() -> None:
        shutil.rmtree(folder)
        folder.write_text("not a folder")

    try:
        cap = _capture(sidecar, live["server"].url, during=block)
    finally:
        if folder.is_file():
            folder.unlink()
        folder.mkdir(exist_ok=True)
    (verdict,) = cap["verdicts"]
    assert (cap["state"], verdict["verdict"]) == ("degraded", "missing"), verdict


def test_a_counted_steps_window_on_a_server_that_bounds_its_own_says_to_leave_the_count_out(
        live: dict[str, Any], sidecar: Any) -> None:
    # vLLM >= 0.32 ends a steps window itself, per capture: the advice for exactly N was to restart
    # the server with a rendered profiler config, which it does not need
    from sidecar.control.notes import word

    with SidecarClient(sidecar.url, timeout=300) as client:
        cid = client.start_capture(steps=4, steps_bound="count").id
        complete(live["server"].url, n=2)
        cap = client.wait_capture(cid, timeout=300)
    (ended,) = cap.fact("steps_ended")
    assert (cap.steps_ended_by.value, ended.figures["per_capture"]) == ("steps", True), cap.facts
    said = word(ended)
    assert "leave steps_bound out" in said and "restart it" not in said, said


def test_a_server_gone_is_forgotten_once_a_probe_finds_it_unreachable(live: dict[str, Any], sidecar: Any) -> None:
    # What answers on that port next may be another vLLM (an upgrade): its version is asked again.
    with httpx.Client(base_url=sidecar.url, timeout=60) as client:
        assert client.get("/v1/stages").json()["server"]["vllm"], "identified at connect"
        live["server"].kill()
        assert client.get("/readyz").status_code == 503
        assert client.get("/v1/stages").json()["server"] is None


class _RestartedVllm(VllmServer):
    """``vllm serve`` started again on the port another one had, without ``--profiler-config``."""

    def argv(self) -> list[str]:
        argv = super().argv()
        at = argv.index("--profiler-config")
        return argv[:at] + argv[at + 2:]


def test_a_server_restarted_without_a_profiler_is_told_to_add_profiler_config(
    live: dict[str, Any], sidecar: Any, live_python: str, tiny_model: Path, tmp_path: Path
) -> None:
    live["server"].kill()  # (the test before killed it already, when it ran)
    again = _RestartedVllm(live_python, tiny_model, {}, cwd=tmp_path, log_path=tmp_path / "vllm.log", log_stats=True)
    again.stop()  # releases the port it picked: it binds the old one
    again.port = live["server"].port
    try:
        again.start()
        with httpx.Client(base_url=sidecar.url, timeout=120) as client:
            ready = client.get("/readyz")
            start = client.post("/v1/captures", json={"label": "after the restart"})
            stages = client.get("/v1/stages").json()
    finally:
        again.stop(grace=30)
    assert (ready.status_code, ready.json()["error"]["details"]["profiler_mounted"]) == (503, False), ready.text
    assert start.status_code == 502, start.text
    # the fix a plain `vllm serve` takes (the flag), not a deploy YAML's key
    assert "--profiler-config" in ready.json()["error"]["message"], ready.text
    assert "--profiler-config" in start.json()["error"]["message"], start.text
    assert stages["server"]["vllm"], "the new server identified at the start"
