"""A `memory`-profile capture against a real vLLM 0.30 CPU server (`pytest -m live`): the server
runs with the `memory` stage profile's profiler config (``torch_profiler_with_memory`` on), the
capture is taken around real requests, and its summary holds the memory of the worker's process
(torch's CPU allocator: ``[memory]`` events, no snapshot on CPU) with figures torch itself wrote.
No stand-ins here.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.config.profiles import load_profile
from tests.live.conftest import complete
from tests.live.test_live_vllm import WORKER_TRACE, _capture


@pytest.fixture(scope="module")
def live_memory(vllm_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    trace_dir = tmp_path_factory.mktemp("vllm-memory-traces")
    pc = {**load_profile("memory").profiler_config, "torch_profiler_dir": str(trace_dir)}
    server = vllm_factory(pc)
    return {"server": server, "dir": trace_dir, "profiler_config": pc}


@pytest.fixture
def memory_sidecar(live_memory: dict[str, Any], sidecar_factory: Any, tmp_path: Path) -> Any:
    return sidecar_factory(
        live_memory["server"].url, None, flavor="vllm",
        extra_args=["--profiler-config", json.dumps(live_memory["profiler_config"])],
        state_dir=tmp_path / "state",
    )  # fmt: skip


def test_a_memory_capture_of_the_real_server_has_memory_per_stage(live_memory: dict[str, Any],
                                                                 memory_sidecar: Any) -> None:
    complete(live_memory["server"].url, n=1)  # warm: the window's allocations are the requests'
    cap = _capture(memory_sidecar, live_memory["server"].url)
    assert cap["state"] == "completed", cap
    with httpx.Client(base_url=memory_sidecar.url, timeout=600) as client:
        summary = client.get(f"/v1/captures/{cap['id']}/summary").json()
    memory = [m for st in summary["stages"] for m in st["memory"]]
    assert memory, summary["stages"]
    cpu = next(m for m in memory if m["device_type"] == "cpu")
    assert cpu["events"] > 0 and cpu["peak_allocated_bytes"] > 0 and cpu["live_at_peak"], cpu
    assert cpu["alloc_bytes_per_step"] is not None and cpu["steps"] > 0, cpu
    assert any(o["device_type"] == "cpu" and o["alloc_bytes"] > 0 for st in summary["stages"] for o in st["memory_ops"])
    # the worker trace's own Total Allocated at its peak, within 2 %
    (session,) = cap["verdicts"][0]["sessions"]
    names = [f["name"] for f in session["files"]]
    workers = [Path(session["local_path"] or session["path"]) / n for n in names if WORKER_TRACE.match(n)]
    assert len(workers) == 1, names
    (trace,) = workers
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    torch_peak = max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")
    assert abs(cpu["peak_allocated_bytes"] - torch_peak) <= 0.02 * torch_peak, (cpu["peak_allocated_bytes"], torch_peak)
    # a CPU worker keeps no allocator history: no snapshot, and no reason asking for one
    assert not summary["snapshots"] and "memory_snapshot" not in (cap["verdicts"][0]["reason"] or "")
    assert not [e for e in summary["errors"] if re.search(r"memory_snapshot", e)]
