"""The CLI on an 80-column terminal, through the real command line (``python -m sidecar`` with
COLUMNS=80) against a real sidecar and emulator: capture ids, URLs and session-folder paths are
never cut, ids may be given by a unique prefix, every non-``ok`` verdict shows its reason, and
``fleet capture`` shows progress on a terminal and stays quiet when piped. Piped at 60, 80 and 120
columns, ``status``, ``list``, ``summarize`` and ``fleet capture`` show every figure, id and path
of the capture's JSON whole, no ellipsis, and no line wider than the terminal but a path that is
wider by itself (alone on its line)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.api.launcher import SidecarProcess
from sidecar.client import SidecarClient
from tests.fixtures.emulator import EmulatorPool, make_deploy
from tests.fixtures.load import steady_load
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[tuple[Any, Any]]:
    root = tmp_path_factory.mktemp("narrow")
    # a long trace dir: its session-folder paths are longer than the terminal is wide
    deep = root / ("a-long-trace-directory-name-" * 2) / "traces"
    deploy = make_deploy(root, {0: {"profiler": "torch", "torch_profiler_dir": str(deep / "stage0")}, 1: None,
                                2: {"profiler": "torch", "torch_profiler_dir": str(deep / "stage2")}})
    emu = emulator_pool.get(deploy, extra_args=["--workers", "thread"], startup_timeout=120)
    with SidecarProcess(emu.url, deploy, state_dir=root / "state") as sc:
        yield sc, emu


def _env(terminal: bool, columns: int = 80) -> dict[str, str]:
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(ROOT)}
    env.pop("OMNI_SIDECAR_URL", None)
    if terminal:  # rich treats the pipe as an interactive terminal
        env.update(TTY_COMPATIBLE="1", TTY_INTERACTIVE="1")
    return env


def cli(*args: str, terminal: bool = False, columns: int = 80) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True,
                          env=_env(terminal, columns), timeout=300, cwd=ROOT)


def shown_values(cap: dict[str, Any], metrics: bool = True) -> list[str]:
    """Every figure, id and path of a capture's JSON that the CLI prints, as it prints them: the id,
    each session folder and trace file, and (``metrics``) the server's counters and p50/p95
    latencies in ms."""
    values = [cap["id"]]
    for v in cap["verdicts"]:
        for s in v["sessions"]:
            values.append(s.get("local_path") or s["path"])
            values += [f["name"] for f in s["files"] if ".json" in f["name"]]
    for e in (cap.get("window_metrics") or {}).get("engines", []) if metrics else []:
        values += [str(e[k]) for k in ("engine_steps", "requests_finished", "prompt_tokens", "generation_tokens")
                   if e.get(k) is not None]
        values += [f"{h['p50_s'] * 1000:.1f}/{h['p95_s'] * 1000:.1f}" for h in e.get("latency", {}).values()
                   if h.get("count")]
    return values


def layout_faults(out: str, values: list[str], columns: int) -> dict[str, list[str]]:
    """What breaks the terminal rule in ``out``: values not shown whole (between blanks), an
    ellipsis, and lines wider than ``columns`` other than a value too long for any line, alone and
    unindented on its own."""
    return {
        "not whole": [v for v in values if not re.search(rf"(?<!\S){re.escape(v)}(?!\S)", out)],
        "ellipsis": [ln for ln in out.splitlines() if "…" in ln],
        "too wide": [ln for ln in out.splitlines() if len(ln) > columns and ln not in values],
    }


NO_FAULTS: dict[str, list[str]] = {"not whole": [], "ellipsis": [], "too wide": []}


def _captured(sc: Any, emu: Any, traffic: bool = True) -> Any:
    with SidecarClient(sc.url, timeout=120) as client:
        cap = client.start_capture([0, 2])
        if traffic:
            emu.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2}).raise_for_status()
        return client.stop_capture(cap.id, wait=True, timeout=120)


def test_list_shows_every_capture_id_whole_and_the_upstream(setup):
    sc, emu = setup
    ids = [_captured(sc, emu).id for _ in range(2)]
    out = cli("list", "--sidecar", sc.url).stdout
    assert ([cid in out for cid in ids], emu.url in out, max(map(len, out.splitlines())) <= 80) == (
        [True, True], True, True), out


def test_status_prints_whole_session_folder_paths_and_takes_an_id_prefix(setup):
    sc, emu = setup
    cap = _captured(sc, emu)
    done = cli("status", cap.id[:-2], "--sidecar", sc.url)
    folders = [s.local_path or s.path for v in cap.verdicts for s in v.sessions]
    lines = [ln.strip() for ln in done.stdout.splitlines()]
    assert (done.returncode, len(folders), all(f in lines for f in folders), cap.id in done.stdout) == (
        0, 2, True, True), done.stdout


def test_an_ambiguous_id_prefix_lists_the_candidates(setup):
    sc, emu = setup
    ids = [_captured(sc, emu).id for _ in range(2)]
    common = os.path.commonprefix(ids)
    done = cli("status", common, "--sidecar", sc.url)
    err = " ".join(done.stderr.split())
    assert (done.returncode, "capture_id_ambiguous" in err, all(i in err for i in ids)) == (1, True, True), err


def test_a_non_ok_verdict_shows_its_reason(setup):
    sc, emu = setup
    cap = _captured(sc, emu, traffic=False)  # an idle window: every stage is empty
    done = cli("status", cap.id, "--sidecar", sc.url)
    reasons = [v.reason for v in cap.verdicts]
    assert (done.returncode, [v.verdict.value for v in cap.verdicts], all(r and r in " ".join(done.stdout.split())
                                                                          for r in reasons)) == (
        1, ["empty", "empty"], True), done.stdout


def test_wide_keeps_each_session_folder_on_one_table_row(setup):
    sc, emu = setup
    cap = _captured(sc, emu)
    done = cli("status", cap.id, "--sidecar", sc.url, "--wide")
    folders = [s.local_path or s.path for v in cap.verdicts for s in v.sessions]
    assert (done.returncode, all(f in done.stdout for f in folders)) == (0, True), done.stdout


def test_fleet_capture_names_targets_ids_and_reasons_whole_and_is_quiet_when_piped(setup):
    sc, _ = setup
    done = cli("fleet", "capture", "--targets", f"sidecar={sc.url}", "--stages", "0,2", "--duration", "0.5")
    with SidecarClient(sc.url) as client:
        cap = client.list_captures()[0]
    text = " ".join(done.stdout.split())
    assert (done.returncode, f"sidecar={sc.url}" in done.stdout, cap.id in done.stdout,
            all(v.reason and v.reason in text for v in cap.verdicts), "window" in done.stderr) == (
        1, True, True, True, False), done.stdout + done.stderr


def test_fleet_capture_shows_progress_on_a_terminal(setup):
    sc, _ = setup
    done = cli("fleet", "capture", "--targets", f"sidecar={sc.url}", "--stages", "0,2", "--duration", "1",
               terminal=True)
    assert ("window: 1 of 1 started" in done.stderr, "collected" in done.stderr) == (True, True), done.stderr


def test_plan_shows_which_probe_runs_on_a_terminal_and_prints_the_plan(setup):
    # A plan waits for each probe's steps (a minute or more on a slow server): on a terminal the
    # CLI says which probe runs, its steps and state, while it waits; then the plan. Piped, the plan alone.
    sc, emu = setup
    args = [sys.executable, "-m", "sidecar", "plan", "--sidecar", sc.url, "--stages", "0,2", "--budget-mb", "500",
            "--no-refine"]
    with steady_load(emu.url, max_tokens=1, chat=True):
        waiting = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(True), cwd=ROOT)
        shown = _Reader(waiting)
        assert waiting.wait(timeout=300) == 0, shown.text()
        piped = subprocess.run(args, capture_output=True, text=True, env=_env(False), timeout=300, cwd=ROOT)
    shown.join()
    text = shown.text()
    line = re.search(r"planning: probe \d+ \((\d+) steps, (\w+)\)", text)
    assert (line is not None, "plan for stages [0, 2]" in text, "fits: --steps" in text) == (True, True, True), text
    assert (piped.returncode, "planning" in piped.stdout + piped.stderr, "fits: --steps" in piped.stdout) == (
        0, False, True), piped.stdout + piped.stderr


def test_stop_wait_timeout_reports_the_time_it_waited(setup):
    sc, emu = setup
    emu.set_faults(hang_stop=True)  # the stop is held until the CLI has given up waiting
    try:
        with SidecarClient(sc.url) as client:
            cid = client.start_capture([0]).id
        done = cli("stop", cid, "--sidecar", sc.url, "--wait", "--timeout", "1")
    finally:
        emu.set_faults(hang_stop=False)
        with SidecarClient(sc.url, timeout=120) as client:
            client.wait_capture(cid, timeout=120)
    err = " ".join(done.stderr.split())
    waited = re.search(r"after (\d+\.\d)s", err)
    assert (done.returncode, "wait_timeout" in err, waited is not None and float(waited.group(1)) >= 1.0) == (
        1, True, True), err


def _stops(emu: Any) -> int:
    return sum(c["path"] == "/stop_profile" for c in emu.state()["calls"])


def test_a_stop_the_server_holds_answers_at_once_and_the_cli_waits_with_its_state(setup):
    # The server holds its stop reply (vLLM-Omni does while it builds the op tables and stacks of a
    # long window): the API's stop answers at once, a second stop through the CLI answers and sends
    # nothing more upstream, and the waiting CLI shows the state on a terminal until the reply comes.
    # The real server's stop is sometimes done before a CLI has started (CI at 85cfd57), so holding
    # it is what makes "while it is still stopping" a condition here, not a hope.
    sc, emu = setup
    emu.set_faults(hang_stop=True)
    cid = None
    try:
        with SidecarClient(sc.url, timeout=120) as client:
            cid = client.start_capture([0]).id
            emu.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2}).raise_for_status()
            sent = _stops(emu)
            first = client.stop_capture(cid).state.value
            assert poll(lambda: _stops(emu) == sent + 1)  # the sidecar's one stop is held by the server
            again = cli("stop", cid, "--no-wait", "--sidecar", sc.url)
            held = (client.get_capture(cid).state.value, _stops(emu) - sent)
        waiting = subprocess.Popen([sys.executable, "-m", "sidecar", "stop", cid, "--sidecar", sc.url, "--timeout",
                                    "120"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(True), cwd=ROOT)
        shown = _Reader(waiting)
        assert poll(lambda: f"capture {cid}: stopping" in shown.text(), timeout=120), shown.text()
        still = (waiting.poll(), _stops(emu) - sent)
    finally:
        emu.set_faults(hang_stop=False)
        if cid is not None:  # the module's sidecar holds nothing open for the next test
            with SidecarClient(sc.url, timeout=120) as client:
                client.wait_capture(cid, timeout=120)
    assert waiting.wait(timeout=120) == 0, shown.text()
    shown.join()
    assert (first, again.returncode, f"capture {cid} stopping" in " ".join(again.stdout.split()), held, still) == (
        "stopping", 0, True, ("stopping", 1), (None, 1)), again.stdout + again.stderr
    assert f"capture {cid} — completed" in shown.text() and "ok" in shown.text(), shown.text()


class _Reader:
    """Everything a child process writes, read as it comes (a terminal's progress line is redrawn
    in place and never ends a line, so it is read in chunks)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._chunks: list[bytes] = []
        assert proc.stdout is not None
        self._out = proc.stdout
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while chunk := self._out.read1(4096):
            self._chunks.append(chunk)

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(self._chunks).decode(errors="replace"))

    def join(self) -> None:
        self._thread.join(timeout=120)


def test_diff_takes_capture_id_prefixes(setup):
    sc, emu = setup
    a, b = (_captured(sc, emu).id for _ in range(2))
    done = cli("diff", a[:-1], b[:-1], "--sidecar", sc.url, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["a"] == a, done.stdout


def test_diff_of_ids_says_on_a_terminal_what_it_waits_for(setup):
    # the sidecar analyses each capture once, up to minutes for a large one: the terminal is told
    sc, emu = setup
    a, b = (_captured(sc, emu).id for _ in range(2))
    done = cli("diff", a, b, "--sidecar", sc.url, terminal=True, columns=200)
    assert (done.returncode, f"comparing {a} and {b} on the sidecar" in done.stdout) == (0, True), (done.stdout, done.stderr)


def test_diff_of_ids_says_the_sidecars_row_limit_before_sending(setup):
    """More rows than the sidecar serves: a usage error that names the limit and the way round it
    (the folders), not the route's 422 relayed; the most it serves works."""
    sc, emu = setup
    a, b = (_captured(sc, emu).id for _ in range(2))
    over = cli("diff", a, b, "--sidecar", sc.url, "--top", "501")
    most = cli("diff", a, b, "--sidecar", sc.url, "--top", "500", "--json")
    said = " ".join(over.stderr.split())
    assert (over.returncode, "--top" in said, "at most 500" in said, "capture folders" in said, "422" in said,
            "Traceback" in over.stderr, most.returncode) == (2, True, True, True, False, False, 0), over.stderr + most.stderr


@pytest.fixture(scope="module")
def busy_capture(setup: tuple[Any, Any]) -> dict[str, Any]:
    """A capture whose window holds a request: ok verdicts, trace files and the server's metrics."""
    sc, emu = setup
    cap = _captured(sc, emu)
    return json.loads(cli("status", cap.id, "--sidecar", sc.url, "--json").stdout)


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_status_shows_every_figure_id_and_path_whole_within_the_width(setup, busy_capture, columns):
    sc, _ = setup
    done = cli("status", busy_capture["id"], "--sidecar", sc.url, columns=columns)
    values = shown_values(busy_capture)
    assert (done.returncode, bool(busy_capture["window_metrics"]["engines"]), layout_faults(done.stdout, values, columns)) == (
        0, True, NO_FAULTS), done.stdout


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_list_shows_every_capture_whole_within_the_width(setup, busy_capture, columns):
    sc, emu = setup
    done = cli("list", "--sidecar", sc.url, columns=columns)
    ids = [c["id"] for c in json.loads(cli("list", "--sidecar", sc.url, "--json").stdout)]
    assert (busy_capture["id"] in ids, layout_faults(done.stdout, [*ids, sc.url, emu.url], columns)) == (
        True, NO_FAULTS), done.stdout


@pytest.mark.parametrize("columns", [60, 80])
def test_summarize_shows_every_op_name_whole_within_the_width(busy_capture, columns):
    folders = [s.get("local_path") or s["path"] for v in busy_capture["verdicts"] for s in v["sessions"]]
    summary = json.loads(cli("summarize", *folders, "--json").stdout)
    done = cli("summarize", *folders, columns=columns)
    ops = [o["name"] for st in summary["stages"] for o in st["cpu_ops"]]
    assert (done.returncode, bool(ops), layout_faults(done.stdout, ops, columns)) == (0, True, NO_FAULTS), done.stdout


def test_fleet_capture_shows_its_target_ids_and_paths_whole_in_60_columns(setup):
    sc, _ = setup
    done = cli("fleet", "capture", "--targets", f"sidecar={sc.url}", "--stages", "0,2", "--duration", "0.5",
               columns=60)
    with SidecarClient(sc.url) as client:
        cap = json.loads(client.list_captures()[0].model_dump_json())
    values = [f"sidecar={sc.url}", *shown_values(cap, metrics=False)]
    assert (cap["id"] in done.stdout, layout_faults(done.stdout, values, 60)) == (True, NO_FAULTS), done.stdout


def test_a_piped_stop_prints_the_verdicts_and_no_blank_line_before_them(setup):
    # rich's progress line, started and stopped where nothing is drawn, still printed a newline
    sc, emu = setup
    with SidecarClient(sc.url, timeout=120) as client:
        cid = client.start_capture([0]).id
        emu.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2}).raise_for_status()
    done = cli("stop", cid, "--sidecar", sc.url, "--wait", "--timeout", "120")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"capture {cid}"), repr(done.stdout[:120])
