"""What ``summarize``, ``slim``, ``timeline`` and ``diff`` do with the paths they are given, through
the real CLI (``python -m sidecar`` in a subprocess): an output that is an input, a folder, empty
or a symlink loop is refused before anything is read, and nothing half-written stays; each file is
read once however often it is named; a trace-named entry that cannot be read is said, never lost;
a cut-off file says how many events it kept, the same number the totals count."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.analysis.writer import TraceWriter
from sidecar.errors import TraceError

TRACE = Path(__file__).parent / "data" / "traces" / "cuda_small.json.gz"
SESSION = "20261201-100000_stage0_rank0_1764583200"


def _cli(*args: str | Path, cwd: Path) -> tuple[int, str, str]:
    r = subprocess.run([sys.executable, "-m", "sidecar", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "300"}, timeout=120)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture
def work(tmp_path: Path) -> Path:
    shutil.copy(TRACE, tmp_path / "good.json.gz")
    return tmp_path


def _events(out: str) -> int:
    return json.loads(out)["totals"]["events"]


# --- the output ---------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dot_slash", "link"])
def test_a_timeline_onto_its_input_trace_by_another_name_is_refused_and_the_input_kept(work: Path, how: str) -> None:
    # slim's rule (one place: sidecar.analysis.writer.output_path), now the timeline's too
    out = "./good.json.gz"
    if how == "link":
        (work / "link.json.gz").symlink_to("good.json.gz")
        out = "link.json.gz"
    code, _, err = _cli("timeline", "good.json.gz", "-o", out, cwd=work)
    assert (code, "error[trace_invalid]" in err, "must not be the input trace" in err, "Traceback" in err) == (1, True, True, False), err
    assert (work / "good.json.gz").read_bytes() == TRACE.read_bytes()


@pytest.mark.parametrize("command", ["slim", "timeline"])
def test_an_output_that_is_a_folder_is_refused_and_nothing_is_left_behind(work: Path, command: str) -> None:
    (work / "o").mkdir()
    code, _, err = _cli(command, "good.json.gz", "-o", "o", cwd=work)
    assert (code, "is a folder; give a file path" in err, "Traceback" in err) == (1, True, False), err
    assert sorted(p.name for p in work.iterdir()) == ["good.json.gz", "o"]


@pytest.mark.parametrize("command", ["slim", "timeline"])
def test_an_empty_output_is_a_clear_error(work: Path, command: str) -> None:
    code, _, err = _cli(command, "good.json.gz", "-o", "", cwd=work)
    assert (code, "names no file; give a file path" in err, "Traceback" in err) == (1, True, False), err


def test_a_writer_that_fails_at_its_end_leaves_no_temporary_file(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    with pytest.raises(TraceError, match="cannot be written"):
        with TraceWriter(out, {}) as w:
            w.write([{"ph": "X", "ts": 1}])
            out.mkdir()  # the rename at the end now fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.json"]


@pytest.mark.parametrize("command", ["slim", "timeline"])
def test_the_gzip_header_names_the_written_file_not_its_temporary_name(work: Path, command: str) -> None:
    code, _, err = _cli(command, "good.json.gz", "-o", "small.json.gz", cwd=work)
    data = (work / "small.json.gz").read_bytes()
    assert (code, data[3] & 0x08) == (0, 0x08), err  # FNAME set
    assert data[10:data.index(b"\0", 10)] == b"small.json"


@pytest.mark.parametrize("command", ["slim", "timeline"])
def test_an_output_named_gz_in_capitals_is_gzip(work: Path, command: str) -> None:
    # OUT.JSON.GZ held plain JSON under a gzip name: what reads it by its name (gzip -d, zcat) fails
    code, _, err = _cli(command, "good.json.gz", "-o", "SMALL.JSON.GZ", cwd=work)
    assert (code, (work / "SMALL.JSON.GZ").read_bytes()[:2]) == (0, b"\x1f\x8b"), err


# --- symlink loops, --max-mb ----------------------------------------------------------------------


@pytest.mark.parametrize("args", [("slim", "loop1.json", "-o", "x.json"), ("slim", "good.json.gz", "-o", "loop1.json"),
                                  ("timeline", "good.json.gz", "-o", "loop1.json"), ("summarize", "loop1.json"),
                                  ("diff", "loop1.json", "good.json.gz")], ids=lambda a: "_".join(a))
def test_a_symlink_loop_is_said_to_be_one(work: Path, args: tuple[str, ...]) -> None:
    (work / "loop1.json").symlink_to("loop2.json")
    (work / "loop2.json").symlink_to("loop1.json")
    code, _, err = _cli(*args, cwd=work)
    assert (code, "loop1.json" in err, "is a symlink loop" in err, "Traceback" in err) == (1, True, True, False), err
    assert not (work / "x.json").exists()


@pytest.mark.parametrize("size", ["inf", "1e308"])  # NaN, 0 and below were refused already, by the same rule now
def test_max_mb_past_any_size_is_a_usage_error(work: Path, size: str) -> None:
    code, _, err = _cli("slim", "good.json.gz", "-o", "x.json", "--max-mb", size, cwd=work)
    assert (code, "--max-mb" in err, "Traceback" in err, (work / "x.json").exists()) == (2, True, False, False), err


# --- a cut-off file -------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [3000, 20000])
def test_a_cut_off_gzip_says_the_events_it_kept_as_the_totals_count_them(work: Path, cut: int) -> None:
    (work / "trunc.json.gz").write_bytes(TRACE.read_bytes()[:cut])
    code, out, err = _cli("summarize", "trunc.json.gz", "--json", cwd=work)
    events = _events(out)
    said = f"summary covers the {events:,} events read before it"
    assert (code, events > 0, json.loads(out)["errors"][0].endswith(said)) == (1, True, True), (out, err)
    for args in (("slim", "trunc.json.gz", "-o", "s.json"), ("timeline", "trunc.json.gz", "-o", "t.json"),
                 ("diff", "trunc.json.gz", "good.json.gz")):
        code, _, err = _cli(*args, cwd=work)
        assert (code, said in " ".join(err.split())) == (1, True), (args, err)


# --- each file once ---------------------------------------------------------------------------------


def test_a_file_named_three_times_is_read_once_and_said(work: Path) -> None:
    alone = _events(_cli("summarize", "good.json.gz", "--json", cwd=work)[1])
    code, out, err = _cli("summarize", "good.json.gz", "good.json.gz", "./good.json.gz", "--json", cwd=work)
    assert (code, _events(out), json.loads(out)["warnings"]) == (
        0, alone, ["good.json.gz given 3 times: read once"]), err


def test_a_folder_and_a_folder_inside_it_read_each_file_once(work: Path) -> None:
    session = work / "cap" / "stage0" / SESSION
    session.mkdir(parents=True)
    shutil.copy(TRACE, session / "trace_rank0.json.gz")
    alone = _events(_cli("summarize", "good.json.gz", "--json", cwd=work)[1])
    code, out, err = _cli("summarize", "cap", f"cap/stage0/{SESSION}", "--json", cwd=work)
    assert (code, _events(out), "given 2 times" in json.loads(out)["warnings"][0]) == (0, alone, True), err
    code, _, err = _cli("timeline", "cap", f"cap/stage0/{SESSION}", "-o", "t.json", cwd=work)
    names = json.loads((work / "t.json").read_text())["otherData"]["omni_sidecar_timeline"]
    assert (code, len(names), "given 2 times" in err) == (0, 1, True), err


# --- trace-named entries that cannot be read ----------------------------------------------------------


def _bad_entries(session: Path) -> dict[str, str]:
    """Trace-named entries that are no readable file, and the words that must name each."""
    (session / "trace_rank1.json.gz").mkdir()
    (session / "trace_rank2.json.gz").symlink_to("trace_rank2.json.gz")
    (session / "trace_rank3.json.gz").symlink_to("/dev/zero")
    (session / "trace_rank4.json.gz").symlink_to("gone.json.gz")
    return {"trace_rank1.json.gz": "is a folder", "trace_rank2.json.gz": "is a symlink loop",
            "trace_rank3.json.gz": "is a character device", "trace_rank4.json.gz": "is a broken symlink"}


def test_trace_named_entries_that_cannot_be_read_are_named_beside_the_readable_rank(work: Path) -> None:
    session = work / "cap" / SESSION
    session.mkdir(parents=True)
    shutil.copy(TRACE, session / "trace_rank0.json.gz")
    bad = _bad_entries(session)
    code, out, err = _cli("summarize", "cap", "--json", cwd=work)
    errors = json.loads(out)["errors"]
    assert (code, len(errors)) == (1, 4), errors
    for name, why in bad.items():
        assert any(name in e and why in e for e in errors), (name, errors)
    code, _, err = _cli("timeline", "cap", "-o", "t.json", cwd=work)
    assert (code, all(f"{n} {w}" in err for n, w in bad.items())) == (1, True), err


def test_a_folder_whose_only_trace_is_a_link_to_a_device_names_it(work: Path) -> None:
    session = work / "cap" / SESSION
    session.mkdir(parents=True)
    (session / "trace_rank0.json.gz").symlink_to("/dev/zero")
    code, _, err = _cli("summarize", "cap", cwd=work)
    assert (code, "trace_rank0.json.gz is a character device" in err, "Traceback" in err) == (1, True, False), err


# --- what a file that is no trace is ------------------------------------------------------------------


@pytest.mark.parametrize(("body", "said"), [
    ('{"traceEvents": "x"}', "traceEvents is not an array (it is a string)"),
    ("null", "is JSON but not a Chrome trace (a null"),
    ('"hi"', "is JSON but not a Chrome trace (a string"),
])
def test_json_that_is_no_trace_says_what_it_is(work: Path, body: str, said: str) -> None:
    (work / "j.json").write_text(body)
    code, _, err = _cli("summarize", "j.json", cwd=work)
    assert (code, said in err) == (1, True), err


@pytest.mark.parametrize("command", [["summarize", ""], ["timeline", "", "-o", "OUT"], ["slim", "", "-o", "OUT"],
                                     ["diff", "", "GOOD"], ["diff", "GOOD", " "]])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(work: Path, command: list[str]) -> None:
    """``summarize "$DIR"`` with DIR unset read the whole current folder (here: good.json.gz)."""
    args = [work / "out.json" if a == "OUT" else work / "good.json.gz" if a == "GOOD" else a for a in command]
    rc, _, err = _cli(*args, cwd=work)
    assert (rc, "an empty path" in err, "Traceback" in err, (work / "out.json").exists()) == (1, True, False, False), err
