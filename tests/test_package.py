"""The core package imports without torch, vllm or vllm-omni (they live in extras), and
FastAPI stays in the HTTP surface: checked in a fresh interpreter where those imports fail."""

import subprocess
import sys

import pytest

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError(f'blocked import of {{name}}')
sys.meta_path.insert(0, Block())
"""


def _run(blocked: set[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK.format(blocked=blocked) + code], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "module",
    [
        "sidecar",
        "sidecar.cli",
        "sidecar.config.deploy",
        "sidecar.config.rules",
        "sidecar.analysis",
        "sidecar.control.controller",
        "sidecar.api.app",
        "sidecar.client",
        "sidecar.fleet",
        "sidecar.rollout",
        "sidecar.integrations.verl",
        "sidecar.emulator.launcher",
    ],
)
def test_core_imports_without_torch_or_vllm(module: str) -> None:
    proc = _run({"torch", "vllm", "vllm_omni"}, f"import {module}")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "module",
    ["sidecar.config.deploy", "sidecar.config.rules", "sidecar.config.verl", "sidecar.analysis",
     "sidecar.upstream.server", "sidecar.control.controller"],
)
def test_lower_layers_do_not_need_fastapi(module: str) -> None:
    proc = _run({"fastapi", "starlette", "typer"}, f"import {module}")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_cli_answers_help_without_torch() -> None:
    proc = _run({"torch", "vllm", "vllm_omni"}, "import sys; sys.argv=['omni-sidecar', '--help']\nfrom sidecar.cli import main\nmain()")
    assert proc.returncode == 0 and "validate" in proc.stdout, proc.stderr[-2000:]
