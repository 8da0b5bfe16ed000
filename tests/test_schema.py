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

# Where the time goes (measured, thread-worker emulator): the coverage phase (deterministic, a
# case per boundary and per invalid form of every parameter, independent of this number) is over
# half, fuzzing (this many examples per operation) about a quarter at 15, and the server answers
# in a fifth of it: the client's generation and checks dominate, so running the app in process
# would save little. 6 fuzzed examples per operation on top of the full coverage phase.
MAX_EXAMPLES = 6
# The default run is the same cases every time (a fixed seed, deterministic generation, which also
# means no example database carried between runs): it cannot flake by drawing a new case. `make test-schema-fuzz`
# runs a longer random search (OMNI_SIDECAR_SCHEMA_EXAMPLES examples, a fresh seed) on purpose.
FUZZ_EXAMPLES = os.environ.get("OMNI_SIDECAR_SCHEMA_EXAMPLES")


def _st() -> list[str]:
    exe = shutil.which("st") or shutil.which("schemathesis")
    return [exe] if exe else [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()"]


def test_the_api_conforms_to_its_openapi_document(
    tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]
) -> None:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})
    # thread workers: the API's shapes and statuses, not real torch ops, are under test
    emu = shared_emulator_factory(deploy, extra_args=["--workers", "thread"], startup_timeout=120)
    # a scheduled capture's held GET (?until=started) answers within 1 s here, not 30: the shapes
    # are under test, and the stateful phase holds several
    # a steps window or a plan's probe on the idle emulator ends once its counter stood still 1 s
    env = {"OMNI_SIDECAR_COLLECT_TIMEOUT_S": "3", "OMNI_SIDECAR_HOLD_MAX_S": "1", "OMNI_SIDECAR_STEPS_STALL_S": "1"}
    sc = sidecar_factory(emu.url, deploy, env=env)
    generation = (["--max-examples", FUZZ_EXAMPLES] if FUZZ_EXAMPLES else
                  ["--max-examples", str(MAX_EXAMPLES), "--seed", "1", "--generation-deterministic"])
    proc = subprocess.run(
        [*_st(), "run", f"{sc.url}/openapi.json", "--url", sc.url, "--checks", "all", *generation,
         "--request-timeout", "60", "--max-response-time", "120", "--no-color"],
        capture_output=True, text=True, timeout=540, env={**os.environ, "NO_COLOR": "1"},
        cwd=tmp_path,  # schemathesis writes its .schemathesis/ cache in the working directory
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "failure" not in out.split("SUMMARY")[-1].lower(), out[-3000:]
