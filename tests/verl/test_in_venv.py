"""Run the ``-m verl`` group where verl is installed: build (or reuse) its venv with
``tools/verl-env.sh`` and run ``tests/verl`` there. Skipped only when that venv cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.verl.conftest import ROOT

pytestmark = pytest.mark.verl


def test_the_verl_group_passes_in_its_venv() -> None:
    build = subprocess.run(["bash", str(ROOT / "tools" / "verl-env.sh")], capture_output=True, text=True,
                           timeout=3600, env={**os.environ, "PY": sys.executable})
    if build.returncode != 0:
        pytest.skip(f"the verl venv cannot be built (tools/verl-env.sh exit {build.returncode}): "
                    f"{build.stderr[-2000:]}")
    python = build.stdout.strip().splitlines()[-1]
    run = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "verl", "tests/verl"],
        cwd=ROOT, capture_output=True, text=True, timeout=3000, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
