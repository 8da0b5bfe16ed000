"""What a vLLM worker says at start of its profiler_config on its device, against vLLM's own check:
``validate_worker_profiler_config`` and its tables from ``vllm/profiler/wrapper.py`` (the 0.33 copy
in tests/data/vllm_profile_api/; byte-identical in 0.31, 0.32 and 0.34), run here on each device
type. ``validate --device`` and ``GET /v1/stages`` word the same refusals (sidecar/versions.py's
``worker_refusal``) and must agree with it on every row, word for word."""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from sidecar.versions import NEWEST_VLLM, WORKER_PROFILERS, vllm_dialect, Release, worker_refusal

pytestmark = pytest.mark.contract

WRAPPER = Path(__file__).resolve().parents[1] / "data" / "vllm_profile_api" / "wrapper-0.33.py"
NAMES = ("_DEFAULT_TORCH_PROFILER_ACTIVITIES", "_SUPPORTED_TORCH_PROFILER_ACTIVITIES", "_SUPPORTED_PROFILER_KINDS")


def _vllm_check(device: str) -> Callable[[Any], None]:
    """vLLM's ``validate_worker_profiler_config`` with ``current_platform.device_type == device``."""
    source = WRAPPER.read_text()
    nodes = [n for n in ast.parse(source).body
             if (isinstance(n, (ast.Assign, ast.AnnAssign))
                 and getattr(n.targets[0] if isinstance(n, ast.Assign) else n.target, "id", "") in NAMES)
             or (isinstance(n, ast.FunctionDef) and n.name == "validate_worker_profiler_config")]
    assert len(nodes) == 4
    ns: dict[str, Any] = {"current_platform": SimpleNamespace(device_type=device), "TorchProfilerActivity": str,
                          "ProfilerKind": str, "ProfilerConfig": object}
    exec(compile(ast.Module(nodes, []), "vllm/profiler/wrapper.py", "exec"), ns)  # noqa: S102
    return ns["validate_worker_profiler_config"]


ROWS = list(itertools.product(
    ("cpu", "cuda", "xpu"), ("torch", "cuda", "proton", None),
    (None, ["CPU"], ["CUDA"], ["CPU", "CUDA"], ["XPU"], ["CPU", "XPU"], ["PrivateUse1"])))


@pytest.mark.parametrize(("device", "profiler", "activities"), ROWS)
def test_the_workers_refusal_is_vllms_own_word_for_word(device: str, profiler: str | None,
                                                        activities: list[str] | None) -> None:
    try:
        _vllm_check(device)(SimpleNamespace(profiler=profiler, torch_profiler_activities=activities))
        theirs = None
    except ValueError as err:
        theirs = str(err)
    ours = worker_refusal(NEWEST_VLLM, profiler, activities, device)
    assert (ours[1] if ours else None) == theirs
    assert set(WORKER_PROFILERS) == set(_vllm_check(device).__globals__["_SUPPORTED_PROFILER_KINDS"])


def test_0_30_workers_check_nothing_and_an_unknown_device_is_left_to_its_workers() -> None:
    assert worker_refusal(vllm_dialect(Release.parse("0.30.0")), "cuda", None, "cpu") is None
    assert worker_refusal(NEWEST_VLLM, "cuda", None, None) is None
    assert worker_refusal(NEWEST_VLLM, "cuda", None, "npu") is None


def test_validate_refuses_a_cuda_profiler_on_cpu_workers_in_vllms_words(tmp_path: Path) -> None:
    def run(*args: str) -> tuple[int, dict[str, Any]]:
        p = subprocess.run([sys.executable, "-m", "sidecar", "validate", "--json", *args], capture_output=True,
                           text=True, timeout=120)
        return p.returncode, json.loads(p.stdout)

    code, report = run("--profiler-config", '{"profiler": "cuda"}', "--device", "cpu", "--vllm-version", "0.31.0")
    [finding] = [f for f in report["findings"] if f["severity"] == "error"]
    assert (code, finding["code"], finding["key"]) == (1, "profiler_config_device", "profiler_config.profiler")
    assert finding["message"].startswith(
        "profiler_config: Unsupported profiler type for cpu: cuda. Supported profiler types: torch.")
    # the same config on CUDA workers, or on 0.30 (whose workers check nothing), passes
    assert run("--profiler-config", '{"profiler": "cuda"}', "--vllm-version", "0.31.0")[0] == 0
    assert run("--profiler-config", '{"profiler": "cuda"}', "--device", "cpu", "--vllm-version", "0.30.0")[0] == 0
    bad = subprocess.run([sys.executable, "-m", "sidecar", "validate", "--profiler-config", '{"profiler": "torch"}',
                          "--device", "tpu"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--device must be one of cpu, cuda, xpu" in bad.stderr and "Traceback" not in bad.stderr
