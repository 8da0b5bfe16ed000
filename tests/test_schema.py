"""The API against its own OpenAPI document: schemathesis (``--checks all``, bounded examples)
against a live ``omni-sidecar serve`` over the emulator, 0 failures. It generates valid and invalid
requests per operation plus stateful sequences, and checks statuses, the error shape, content
types, ``Allow``, and that invalid input is refused and valid input accepted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.emulator import make_deploy

pytestmark = pytest.mark.slow
pytest.importorskip("schemathesis")

MAX_EXAMPLES = 15  # ~30-60 s on a loaded 2-core machine


def _st() -> list[str]:
    exe = shutil.which("st") or shutil.which("schemathesis")
    return [exe] if exe else [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()"]


def test_the_api_conforms_to_its_openapi_document(
    tmp_path: Path, emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]
) -> None:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})
    emu = emulator_factory(deploy)
    env = {"OMNI_SIDECAR_SETTLE_S": "0.3", "OMNI_SIDECAR_COLLECT_TIMEOUT_S": "3"}
    sc = sidecar_factory(emu.url, deploy, env=env)
    proc = subprocess.run(
        [*_st(), "run", f"{sc.url}/openapi.json", "--url", sc.url, "--checks", "all",
         "--max-examples", str(MAX_EXAMPLES), "--seed", "1", "--request-timeout", "60",
         "--max-response-time", "120", "--no-color"],
        capture_output=True, text=True, timeout=540, env={**os.environ, "NO_COLOR": "1"},
        cwd=tmp_path,  # schemathesis writes its .schemathesis/ cache in the working directory
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "failure" not in out.split("SUMMARY")[-1].lower(), out[-3000:]
