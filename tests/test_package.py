"""The core package imports without torch, vllm or vllm-omni (they live in extras), and
FastAPI stays in the HTTP surface: checked in a fresh interpreter where those imports fail.
One interpreter per blocked set imports every module in turn (a blocked module never enters
``sys.modules``, so an earlier import cannot hide a later module's need for it)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

BLOCK = """
import importlib, importlib.abc, json, sys, traceback
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError(f'blocked import of {{name}}')
sys.meta_path.insert(0, Block())
errors = {{}}
for module in {modules!r}:
    try:
        importlib.import_module(module)
    except BaseException:
        errors[module] = traceback.format_exc()[-2000:]
print('IMPORTS:' + json.dumps(errors), flush=True)
"""

NO_TORCH = {"torch", "vllm", "vllm_omni"}
NO_FASTAPI = {"fastapi", "starlette", "typer"}
CORE = [
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
]
LOWER = [
    "sidecar.config.deploy",
    "sidecar.config.rules",
    "sidecar.config.verl",
    "sidecar.analysis",
    "sidecar.upstream.server",
    "sidecar.control.controller",
]
# run after the imports, in the same torch-less interpreter
CLI_HELP = "sys.argv = ['omni-sidecar', '--help']\nfrom sidecar.cli import main\nmain()\n"


def _run(blocked: set[str], modules: list[str], then: str = "") -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK.format(blocked=sorted(blocked), modules=modules) + then],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    marker = [ln for ln in lines if ln.startswith("IMPORTS:")]
    assert marker, f"the import check did not run:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    after = "\n".join(lines[lines.index(marker[0]) + 1 :])
    return {"errors": json.loads(marker[0].removeprefix("IMPORTS:")), "rc": proc.returncode, "after": after,
            "stderr": proc.stderr[-2000:]}  # fmt: skip


@pytest.fixture(scope="module")
def without_torch() -> dict[str, Any]:
    return _run(NO_TORCH, CORE, then=CLI_HELP)


@pytest.fixture(scope="module")
def without_fastapi() -> dict[str, Any]:
    return _run(NO_FASTAPI, LOWER)


@pytest.mark.parametrize("module", CORE)
def test_core_imports_without_torch_or_vllm(module: str, without_torch: dict[str, Any]) -> None:
    assert module not in without_torch["errors"], without_torch["errors"].get(module)


@pytest.mark.parametrize("module", LOWER)
def test_lower_layers_do_not_need_fastapi(module: str, without_fastapi: dict[str, Any]) -> None:
    assert module not in without_fastapi["errors"], without_fastapi["errors"].get(module)


def test_the_blocker_refuses_what_it_blocks() -> None:
    # the checks above can fail: a module that needs a blocked one is reported
    got = _run(NO_TORCH, ["torch.nn", "sidecar.emulator._torch_backend"])
    assert sorted(got["errors"]) == ["sidecar.emulator._torch_backend", "torch.nn"]


def test_the_cli_answers_help_without_torch(without_torch: dict[str, Any]) -> None:
    assert without_torch["rc"] == 0 and "validate" in without_torch["after"], without_torch["stderr"]


# what `omni-sidecar status` (or any client command) never needs, and so never pays for at start-up
NOT_AT_CLI_START = ["sidecar.control.controller", "sidecar.api.app", "sidecar.fleet._fleet", "fastapi", "ray", "torch"]


def test_the_cli_starts_without_the_controller_the_app_or_the_fleet() -> None:
    # the packages' exports are lazy (sidecar/_lazy.py): a light submodule does not pull its package's rest
    code = (f"import json, sys, sidecar.cli, sidecar.control.models\n"
            f"print(json.dumps([m for m in {NOT_AT_CLI_START!r} if m in sys.modules]))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, json.loads(done.stdout or "null")) == (0, []), done.stderr[-2000:]


def test_lazy_exports_resolve_and_unknown_names_raise_attribute_error() -> None:
    import sidecar.control as control

    assert control.CaptureController.__module__ == "sidecar.control.controller"
    assert set(control.__all__) >= {"Capture", "CaptureController", "Verdict"}
    with pytest.raises(AttributeError, match="module 'sidecar.control' has no attribute 'nope'"):
        control.nope  # noqa: B018
