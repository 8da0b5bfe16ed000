"""Found by an exploratory pass over the analysis commands, through the real CLI (``python -m
sidecar`` in a subprocess): a timeline of traces that share a folder or a folder name names every
process distinctly; ``diff`` with a sidecar URL in the environment reads a mistyped path as a
missing file, not as a capture id; a diff whose sides share no stage says so and compares the
totals."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TRACES = Path(__file__).parent / "data" / "traces"
SESSION = "20261201-100000_stage0_rank0_1764583200"


def _cli(*args: str | Path, cwd: Path, env: dict[str, str] | None = None, columns: int = 200) -> tuple[int, str, str]:
    r = subprocess.run([sys.executable, "-m", "sidecar", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": str(columns), **(env or {})}, timeout=120)
    return r.returncode, r.stdout, r.stderr


def _process_names(out: Path) -> list[str]:
    doc = json.loads(gzip.decompress(out.read_bytes()))
    return [e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"]


@pytest.mark.parametrize("layout", ["one_folder", "same_folder_name"])
def test_timeline_names_each_process_distinctly_when_their_folders_do_not_tell_them_apart(tmp_path: Path, layout: str) -> None:
    # two traces with no stage or rank to tell them apart were both named
    # "stage ? · replica 0 · rank 0 · traces": their shared folder's name did not separate them
    if layout == "one_folder":
        files = [tmp_path / "traces" / "cuda_small.json.gz", tmp_path / "traces" / "host_bound.json.gz"]
    else:
        files = [tmp_path / "a" / "run" / "trace.json.gz", tmp_path / "b" / "run" / "trace.json.gz"]
    for src, dst in zip(("cuda_small", "host_bound"), files):
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TRACES / f"{src}.json.gz", dst)
    out = tmp_path / "t.json.gz"
    code, stdout, stderr = _cli("timeline", *files, "-o", out, cwd=tmp_path)
    names = _process_names(out)
    assert (code, len(names), len(set(names))) == (0, 2, 2), (names, stderr)
    report = json.loads(_cli("timeline", *files, "-o", tmp_path / "t2.json", "--json", cwd=tmp_path)[1])
    assert sorted(p["name"] for p in report["processes"]) == sorted(names)


def test_timeline_of_one_stage_dir_still_names_processes_by_session_folder(tmp_path: Path) -> None:
    stage = tmp_path / "stage0"
    folders = ("20261201-100000_stage0_rank0_1764583200", "20261201-100100_stage0_rank0_1764583260")
    for folder in folders:
        (stage / folder).mkdir(parents=True)
        shutil.copy(TRACES / "fleet_rank0.json.gz", stage / folder / "trace_rank0.json.gz")
    out = tmp_path / "t.json.gz"
    code, _, stderr = _cli("timeline", stage, "-o", out, cwd=tmp_path)
    assert (code, sorted(_process_names(out))) == (0, [f"stage 0 · replica 0 · rank 0 (llm) · {f}" for f in folders]), stderr


@pytest.mark.parametrize("columns", [80, 200])
def test_diff_with_a_sidecar_url_exported_says_a_mistyped_path_is_missing(tmp_path: Path, columns: int) -> None:
    # with OMNI_SIDECAR_URL set, one real file and one mistyped path were both taken for capture ids
    # and the error was about the sidecar (unreachable, or no such capture), not the missing file
    shutil.copy(TRACES / "cuda_small.json.gz", tmp_path / "a.json.gz")
    typo = tmp_path / "runs" / "b.json.gz"
    code, stdout, stderr = _cli("diff", tmp_path / "a.json.gz", typo, cwd=tmp_path, columns=columns,
                                env={"OMNI_SIDECAR_URL": "http://127.0.0.1:9"})
    err = " ".join(stderr.split())
    assert (code, "[trace_invalid]" in err, f"{typo}: no such file or folder" in err, "sidecar_unreachable" in err) == (
        1, True, True, False), stderr
    assert "Traceback" not in stderr


def test_diff_with_sidecar_url_exported_still_sends_capture_ids(tmp_path: Path) -> None:
    code, _, stderr = _cli("diff", "20261201-100000-abc123", "20261201-100100-def456", cwd=tmp_path,
                           env={"OMNI_SIDECAR_URL": "http://127.0.0.1:9"})
    assert (code, "[sidecar_unreachable]" in stderr) == (1, True), stderr


def test_diff_of_sides_with_no_stage_in_common_says_so_and_compares_the_totals(tmp_path: Path) -> None:
    # a capture's session folder (stage 0) against a bare trace file (no stage): every stage was
    # compared with an empty side, each figure of the other side read 0, and nothing said why
    (tmp_path / "a" / SESSION).mkdir(parents=True)
    shutil.copy(TRACES / "cuda_small.json.gz", tmp_path / "a" / SESSION / "trace_rank0.json.gz")
    (tmp_path / "a" / "20261201-100000_stage_1_rep_0_diffusion_1764583200").mkdir()
    shutil.copy(TRACES / "host_bound.json.gz", tmp_path / "a" / "20261201-100000_stage_1_rep_0_diffusion_1764583200" / "trace_rank0.json.gz")
    shutil.copy(TRACES / "cuda_small_stack.json.gz", tmp_path / "b.json.gz")
    code, stdout, stderr = _cli("diff", tmp_path / "a", tmp_path / "b.json.gz", "--top", "3", cwd=tmp_path)
    err = " ".join(stderr.split())
    assert (code, "no stage is on both sides (A: stage 0, 1; B: stage ?)" in err) == (0, True), stderr
    assert "\nall: window" in "\n" + stdout, stdout  # A against B as a whole, after the one-sided stages
    body = json.loads(_cli("diff", tmp_path / "a", tmp_path / "b.json.gz", "--json", cwd=tmp_path)[1])
    assert any(w.startswith("no stage is on both sides") for w in body["warnings"])
    assert body["total"]["totals"]["kernels_a"] > 0 and body["total"]["totals"]["kernels_b"] > 0


def test_diff_of_sides_sharing_a_stage_has_no_such_warning(tmp_path: Path) -> None:
    for side, name in (("a", "cuda_small"), ("b", "cuda_small_stack")):
        (tmp_path / side / SESSION).mkdir(parents=True)
        shutil.copy(TRACES / f"{name}.json.gz", tmp_path / side / SESSION / "trace_rank0.json.gz")
    code, _, stderr = _cli("diff", tmp_path / "a", tmp_path / "b", cwd=tmp_path)
    assert (code, "no stage is on both sides" in stderr) == (0, False), stderr
