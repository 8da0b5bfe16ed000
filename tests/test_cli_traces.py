"""``summarize`` and ``timeline`` of a stage dir that holds several captures: the summary says
what it merged, and the timeline names every process distinctly."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from sidecar.cli import app

TRACE = Path(__file__).parent / "data" / "traces" / "fleet_rank0.json.gz"


def _stage_dir(tmp_path: Path) -> Path:
    """stage0/ with the session folders of two captures, a minute apart."""
    stage = tmp_path / "stage0"
    for folder in ("20261201-100000_stage0_rank0_1764583200", "20261201-100100_stage0_rank0_1764583260"):
        (stage / folder).mkdir(parents=True)
        shutil.copy(TRACE, stage / folder / "trace_rank0.json.gz")
    return stage


def test_summarize_of_a_stage_dir_says_it_merged_several_captures(tmp_path):
    result = CliRunner().invoke(app, ["summarize", str(_stage_dir(tmp_path))], env={"COLUMNS": "200"})
    err = " ".join(result.stderr.split())
    assert (result.exit_code, "2 session folders" in err, "20261201-100000 to 20261201-100100" in err) == (
        0, True, True), err


def test_summarize_of_one_session_folder_has_no_note(tmp_path):
    one = next(_stage_dir(tmp_path).iterdir())
    result = CliRunner().invoke(app, ["summarize", str(one)])
    assert (result.exit_code, "note" in result.stderr) == (0, False)


def test_timeline_of_a_stage_dir_names_each_capture_s_process_distinctly(tmp_path):
    out = tmp_path / "t.json.gz"
    result = CliRunner().invoke(app, ["timeline", str(_stage_dir(tmp_path)), "-o", str(out)])
    names = [p["name"] for p in json.loads(gzip.decompress(out.read_bytes()))["otherData"]["omni_sidecar_timeline"]]
    assert (result.exit_code, len(names), len(set(names))) == (0, 2, 2), names
