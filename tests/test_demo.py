"""``omni-sidecar demo`` — the README's main-job command — run as users run it: a subprocess. One
full run serves the checks on its exit code, journal and files; a second run is interrupted
(Ctrl-C) as soon as its capture is active, and must leave nothing running and nothing on disk.
"""

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

from sidecar.analysis import summarize_paths
from tests.fixtures.terminal import ctrl_c_as_in_a_terminal
from tests.test_cli_narrow import NO_FAULTS, layout_faults, shown_values

pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[1]
# the console script imports `sidecar` from the checkout under test, not from wherever it is installed;
# piped, on an 80-column terminal (the run's output is checked against that width)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
       "COLUMNS": "80"}


def demo_command() -> list[str]:
    exe = shutil.which("omni-sidecar")
    return [exe, "demo"] if exe else [sys.executable, "-m", "sidecar", "demo"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("demo") / "out"
    proc = subprocess.run([*demo_command(), "--out", str(out)], capture_output=True, text=True, timeout=300, env=ENV)
    return proc, out


def test_demo_exits_0_with_ok_traces_for_stages_0_and_2(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = demo_run
    journal = [json.loads(p.read_text()) for p in (out / "state" / "captures").glob("*.json")]
    verdicts = {v["stage_id"]: v["verdict"] for cap in journal for v in cap["verdicts"]}
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ([c["state"] for c in journal], verdicts) == (["completed"], {0: "ok", 2: "ok"})


def test_demo_keeps_traces_of_the_captured_stages_in_out(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = demo_run
    traces = {p.parent.parent.name for p in (out / "traces").glob("stage*/*/trace_rank0.json*")}
    assert (traces, (out / "deploy.yaml").is_file(), f"kept {out.resolve()}" in proc.stdout) == (
        {"stage0", "stage2"}, True, True)  # fmt: skip


def test_demo_out_keeps_both_logs_and_prints_no_numpy_warning(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = demo_run
    logs = [(out / name).is_file() and (out / name).stat().st_size > 0 for name in ("sidecar.log", "emulator.log")]
    assert (logs, "Failed to initialize NumPy" in proc.stdout + proc.stderr) == ([True, True], False)


def test_demo_shows_every_figure_id_and_path_of_its_capture_whole_in_80_columns(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, out = demo_run
    (cap,) = [json.loads(p.read_text()) for p in (out / "state" / "captures").glob("*.json")]
    values = shown_values(cap)
    # the top-ops tables: each row's op is one the traces hold, whole
    traced = {o.name for st in summarize_paths([out / "traces"], top=10_000).stages for o in st.cpu_ops}
    shown_ops = re.findall(r"^(\S+) +\d+ +[\d.]+ *$", proc.stdout, re.M)
    assert (len(values) > 10, len(shown_ops) >= 2, set(shown_ops) - traced, layout_faults(proc.stdout, values, 80)) == (
        True, True, set(), NO_FAULTS), proc.stdout


def test_ctrl_c_mid_capture_shuts_everything_down_and_cleans_up(tmp_path: Path) -> None:
    # Without --out the demo works in a temporary folder it deletes on the way out, Ctrl-C included.
    proc = subprocess.Popen(
        demo_command(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**ENV, "TMPDIR": str(tmp_path)},
        preexec_fn=ctrl_c_as_in_a_terminal,  # a shell's & would ignore it
    )  # fmt: skip
    try:
        seen = ""
        while "4/5" not in seen:  # the capture is active: emulator and sidecar both up
            line = proc.stdout.readline() if proc.stdout else ""
            assert line, f"demo ended early:\n{seen}"
            seen += line
        started = [p.name for p in tmp_path.glob("omni-sidecar-demo-*")]
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
    left = [p.name for p in tmp_path.glob("omni-sidecar-demo-*")]
    assert (proc.returncode, len(urls), still_up, len(started), left) == (130, 2, [], 1, []), seen


@pytest.mark.parametrize("case", ["a_file", "foreign_folder", "cannot_create"])
def test_an_out_the_demo_would_clobber_or_cannot_write_is_refused_before_anything_starts(tmp_path: Path, case: str) -> None:
    # the demo writes deploy.yaml, traces/, state/ and two logs into --out: a user's own deploy.yaml
    # there was replaced, and a file or an unwritable path ended in a traceback
    out = tmp_path / "out"
    if case == "a_file":
        out.write_text("mine")
    elif case == "foreign_folder":
        out.mkdir()
        (out / "deploy.yaml").write_text("mine")
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        out = tmp_path / "ro" / "out" if os.geteuid() != 0 else tmp_path / "afile" / "out"
        (tmp_path / "afile").write_text("")
    proc = subprocess.run([*demo_command(), "--out", str(out)], capture_output=True, text=True, timeout=120, env=ENV)
    said = " ".join(proc.stderr.split())
    assert (proc.returncode, "Traceback" in said, "--out" in said) == (2, False, True), proc.stdout + proc.stderr
    assert "starting the emulated" not in proc.stdout, proc.stdout
    if case == "foreign_folder":
        assert (sorted(p.name for p in out.iterdir()), (out / "deploy.yaml").read_text()) == (["deploy.yaml"], "mine")
    elif case == "a_file":
        assert out.read_text() == "mine"


def test_an_out_an_earlier_demo_wrote_is_taken_again(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    from sidecar.cli.demo import MARKER, out_folder

    _, out = demo_run
    assert (out / MARKER).is_file()
    assert out_folder(out) == out  # the rule --out is checked with: an earlier demo's folder passes
