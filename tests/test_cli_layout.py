"""``sidecar.cli._layout``: every table and line of the CLI fits the terminal's width without cutting
a figure, id or path. A table that fits stays one; a narrower terminal gets tables of fewer columns
that repeat the key column, then one block of ``header: value`` lines per row; prose wraps between
words; a value wider than the terminal gets a line of its own, whole. (The commands themselves at
60, 80 and 120 columns: tests/test_cli_narrow.py.)"""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from rich.console import Console

from sidecar.cli._layout import Column, print_table, print_text

ENGINES = [Column("engine"), *(Column(h, "right", group="counts") for h in ("steps", "requests", "prompt tok", "gen tok")),
           *(Column(f"{h} p50/p95 ms", "right", group="latency") for h in ("ttft", "itl", "e2e", "queue"))]
ROWS = [["stage 0", "12", "4", "120", "64", "12.3/45.6", "1.2/3.4", "200.1/300.2", "0.1/0.3"],
        ["stage 2 rep 1", "1200", "40", "12000", "640", "112.3/145.6", "11.2/13.4", "1200.1/1300.2", "10.1/10.3"]]
VALUES = sorted({v for row in ROWS for v in row})


def _shown(width: int, *args: Any, **kwargs: Any) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    print_table(console, *args, **kwargs)
    return console.file.getvalue()  # type: ignore[attr-defined]


def _whole(out: str, values: list[str]) -> list[str]:
    """The values ``out`` does not show whole (between blanks)."""
    return [v for v in values if not re.search(rf"(?<!\S){re.escape(v)}(?!\S)", out)]


def _widest(out: str) -> int:
    return max(len(line) for line in out.splitlines())


def test_a_table_that_fits_is_one_table_on_one_header_line():
    out = _shown(120, "server metrics", ENGINES, ROWS)
    assert (out.count("engine"), out.splitlines()[1].split()[:3], _whole(out, VALUES), _widest(out) <= 120) == (
        1, ["engine", "steps", "requests"], [], True), out


@pytest.mark.parametrize("width", [80, 60])
def test_a_narrower_terminal_gets_two_tables_that_repeat_the_key_column(width):
    out = _shown(width, "server metrics", ENGINES, ROWS)
    assert (out.count("engine"), out.count("stage 2 rep 1"), _whole(out, VALUES), _widest(out) <= width, "…" in out) == (
        2, 2, [], True, False), out


def test_a_split_keeps_the_columns_of_a_group_together():
    out = _shown(80, None, ENGINES, ROWS)
    tables = out.split("\n\n")
    assert (len(tables), ["ttft" in tables[0], "steps" in tables[0]], ["ttft" in tables[1], "steps" in tables[1]]) == (
        2, [False, True], [True, False]), out


def test_a_terminal_too_narrow_for_two_tables_gets_one_block_per_row():
    out = _shown(40, "server metrics", ENGINES, ROWS)
    lines = out.splitlines()
    assert (lines[1], "  steps: 12  requests: 4" in lines, _whole(out, VALUES), _widest(out) <= 40) == (
        "engine: stage 0", True, [], True), out


def test_a_value_wider_than_the_terminal_gets_a_line_of_its_own_whole():
    path = "/data/perf/" + "a-long-trace-directory-name-" * 4 + "stage0/20261201-000000_stage0_rank0_123"
    out = _shown(60, "captures", [Column("id"), Column("folder")], [["20261201-000000-abcdef", path]])
    assert ([line for line in out.splitlines() if len(line) > 60], _whole(out, ["20261201-000000-abcdef"])) == (
        [path], []), out


def test_prose_wraps_between_words_and_never_inside_one():
    reason = "no trace arrived in /data/perf/stage0/20261201-000000_stage0_rank0_123 within 120 s; check the dir"
    out = _shown(50, None, [Column("stage"), Column("reason", prose=True)], [["0", reason]])
    assert (" ".join(out.split()).endswith(reason), _widest(out) <= 50, "/data/perf/stage0/20261201-000000_stage0_rank0_123"
            in out.split()) == (True, True, True), out


def test_a_value_is_shown_as_text_never_as_markup():
    out = _shown(80, "[bold]title[/]", [Column("label")], [["[red]mine[/]"]])
    assert ("[bold]title[/]" in out, "[red]mine[/]" in out) == (True, True), out


def test_no_rows_say_so():
    assert _shown(80, "captures", [Column("id")], [], empty="no captures yet").splitlines() == [
        "captures", "  no captures yet"]


def test_wide_prints_one_table_at_its_natural_width(capsys):
    print_table(Console(width=40), "metrics", ENGINES, ROWS, wide=True)
    out = capsys.readouterr().out
    assert (out.count("engine"), _whole(out, VALUES), _widest(out) > 100) == (1, [], True), out


def test_a_line_of_prose_hangs_under_its_first_line_and_keeps_each_word_whole():
    console = Console(width=30, file=io.StringIO(), color_system=None)
    print_text(console, "note: a window of 20 steps at /data/perf/stage0/session-folder-name", indent="  - ",
               hang="    ", markup=False)
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert lines == ["  - note: a window of 20 steps", "    at", "/data/perf/stage0/session-folder-name"], lines
