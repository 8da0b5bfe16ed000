"""The CI gate (tests/fixtures/ci_gate.py) on a tiny test file, in a real pytest subprocess: under
CI a skip or an empty selection fails the run and names the reason; without CI it does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
import pytest

def test_runs():
    assert True

def test_skips():
    pytest.skip("no chromium here")

@pytest.mark.xfail(reason="known upstream bug", strict=True)
def test_xfails():
    assert False
'''


def run_pytest(tmp_path: Path, ci: str | None, *args: str) -> tuple[int, str, dict]:
    (tmp_path / "test_tiny.py").write_text(TESTS)
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "OMNI_CI_REPORT", "PYTEST_ADDOPTS")}
    # the installed plugins (xdist, playwright, hypothesis...) are not what is tested: not loaded, ~3 s a run saved
    env.update(PYTHONPATH=str(ROOT), OMNI_CI_REPORT=str(report), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    if ci is not None:
        env["CI"] = ci
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.fixtures.ci_gate",
         "--rootdir", str(tmp_path), "test_tiny.py", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr, json.loads(report.read_text())


def test_a_skip_fails_the_run_under_ci_and_names_its_reason(tmp_path: Path) -> None:
    rc, out, report = run_pytest(tmp_path, "true")
    assert (rc, "CI gate: FAILED" in out, "no chromium here" in out) == (1, True, True), out
    assert (report["passed"], report["skipped"], report["failed"], report["exitstatus"]) == (1, 1, 0, 1)


def test_a_skip_passes_without_ci_with_its_reason_printed(tmp_path: Path) -> None:
    rc, out, report = run_pytest(tmp_path, None)
    assert (rc, "would fail under CI=true" in out, "no chromium here" in out) == (0, True, True), out
    assert report["gate"] == [f"skipped: {tmp_path / 'test_tiny.py'}:8: no chromium here"]


@pytest.mark.parametrize("ci", ["true", "1"])
def test_an_empty_selection_fails_under_ci(tmp_path: Path, ci: str) -> None:
    rc, out, report = run_pytest(tmp_path, ci, "-k", "nothing_matches_this")
    assert (rc != 0, "no test was selected" in out, report["passed"]) == (True, True, 0), out


def test_a_run_without_skips_passes_under_ci(tmp_path: Path) -> None:
    rc, out, report = run_pytest(tmp_path, "true", "-k", "runs or xfails")
    assert (rc, "CI gate" in out, report["passed"], report["skipped"]) == (0, False, 1, 0), out


def test_ci_false_is_not_ci(tmp_path: Path) -> None:
    rc, out, _ = run_pytest(tmp_path, "false")
    assert rc == 0, out
