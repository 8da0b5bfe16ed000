"""``omni-sidecar demo`` — the README's main-job command — run as users run it: a subprocess,
exit 0, and a completed capture with ``ok`` traces for stages 0 and 2 in its journal."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def demo_command() -> list[str]:
    exe = shutil.which("omni-sidecar")
    return [exe, "demo"] if exe else [sys.executable, "-m", "sidecar", "demo"]


def test_demo_exits_0_with_ok_traces_for_stages_0_and_2(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run([*demo_command(), "--out", str(out)], capture_output=True, text=True, timeout=300)
    journal = [json.loads(p.read_text()) for p in (out / "state" / "captures").glob("*.json")]
    verdicts = {v["stage_id"]: v["verdict"] for cap in journal for v in cap["verdicts"]}
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ([c["state"] for c in journal], verdicts) == (["completed"], {0: "ok", 2: "ok"})


def test_demo_cleans_up_without_keep(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*demo_command()], capture_output=True, text=True, timeout=300, env={**_env(), "TMPDIR": str(tmp_path)}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in tmp_path.glob("omni-sidecar-demo-*")] == []


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
