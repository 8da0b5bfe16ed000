"""``omni-sidecar demo`` — the README's main-job command — run as users run it: a subprocess,
exit 0, and a completed capture with ``ok`` traces for stages 0 and 2 in its journal."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
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
    return dict(os.environ)


def test_ctrl_c_mid_capture_shuts_everything_down(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*demo_command(), "--out", str(tmp_path / "demo")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a shell's & would ignore it
    )  # fmt: skip
    try:
        seen = ""
        while "4/5" not in seen:  # the capture is active: emulator and sidecar both up
            line = proc.stdout.readline() if proc.stdout else ""
            assert line, f"demo ended early:\n{seen}"
            seen += line
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        seen += proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    urls = re.findall(r"(?:server|sidecar) at (http://127\.0\.0\.1:\d+)", seen)
    still_up = []
    for url in urls:
        try:
            httpx.get(f"{url}/health", timeout=2)
            still_up.append(url)
        except httpx.TransportError:
            pass
    assert (proc.returncode, len(urls), still_up) == (130, 2, [])
