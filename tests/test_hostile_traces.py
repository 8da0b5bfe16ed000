"""Hostile trace files through the reader and the CLI (issue 20, items 9-11): a gzip bomb, leading
whitespace, a numbers-only array, a run of ``}``, a huge header, JSON nested 1,000 deep, a FIFO,
and cut-off input to ``slim``. Each ends in one error family (``trace_too_large`` /
``trace_invalid``): CLI exit 1 with the message, never a traceback. The server side (a worker
process, 422, its RSS) is tests/test_hostile_server.py; peak RSS per input is bench/hostile.py."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from sidecar.analysis import summarize_trace
from sidecar.analysis.reader import TraceReader
from sidecar.cli import app
from sidecar.errors import SidecarClosing, SidecarError, TraceError, TraceTooLarge
from tests.fixtures.analysis import AnalysisGate, held_analysis
from tests.fixtures.hostile import write_hostile
from tests.fixtures.waits import poll

TOO_LARGE = ["bomb", "whitespace", "numbers", "braces", "header"]


def _cli(*args: str) -> tuple[int, str, BaseException | None]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output, result.exception


@pytest.mark.parametrize("kind", TOO_LARGE)
def test_a_1_gib_hostile_body_is_trace_too_large_after_a_bounded_read(hostile_dir: Path, kind: str) -> None:
    reader = TraceReader(hostile_dir / f"{kind}.json.gz")
    with pytest.raises(TraceTooLarge) as err:
        for _ in reader.batches():
            pass
    assert (err.value.code, err.value.http_status) == ("trace_too_large", 422)
    # stopped at the limit, not at the end of the gigabyte
    assert reader.raw_bytes < 4 * (reader.chunk_size + reader.max_event_bytes) < (1 << 30) // 8


@pytest.mark.parametrize("kind", TOO_LARGE + ["deep"])
def test_summarize_cli_exits_1_with_the_message_and_no_traceback(hostile_dir: Path, kind: str) -> None:
    path = hostile_dir / f"{kind}.json.gz"
    code, out, exc = _cli("summarize", str(path))
    want = "trace_invalid" if kind == "deep" else "trace_too_large"
    assert (code, type(exc)) == (1, SystemExit), out
    assert f"[{want}]" in out and path.name in out and "Traceback" not in out


def test_json_nested_1000_deep_is_trace_invalid_not_a_recursion_error(hostile_dir: Path) -> None:
    path = hostile_dir / "deep.json.gz"
    assert len(gzip.decompress(path.read_bytes())) < 3000
    with pytest.raises(TraceError) as err:
        summarize_trace(path)
    assert type(err.value) is TraceError and "nests JSON deeper" in err.value.message


@pytest.mark.parametrize("command", ["timeline", "slim"])
def test_timeline_and_slim_refuse_deep_json_and_a_bomb_with_exit_1(hostile_dir: Path, tmp_path: Path, command: str) -> None:
    for kind in ("deep", "bomb"):
        code, out, exc = _cli(command, str(hostile_dir / f"{kind}.json.gz"), "-o", str(tmp_path / f"{kind}.out.json.gz"))
        assert (code, type(exc)) == (1, SystemExit), out
        assert "Traceback" not in out and ("trace_invalid" in out or "trace_too_large" in out), out


def test_diff_cli_refuses_deep_json_and_a_bomb_with_exit_1(hostile_dir: Path) -> None:
    code, out, exc = _cli("diff", str(hostile_dir / "deep.json.gz"), str(hostile_dir / "bomb.json.gz"))
    assert (code, type(exc)) == (1, SystemExit), out
    assert "[trace_invalid]" in out and "Traceback" not in out


def test_identical_nested_events_keep_the_open_op_stack_bounded(tmp_path: Path) -> None:
    # every event inside the one before (same ts, same dur): the stack of open ops grew per event
    path = write_hostile(tmp_path, "identical", 8 << 20)
    summary = summarize_trace(path)
    assert summary.totals.cpu_ops > 50_000
    assert any("open ops on one thread" in w for w in summary.warnings), summary.warnings


def test_unique_names_past_the_cap_are_counted_in_one_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.analysis import summary as summary_mod

    monkeypatch.setattr(summary_mod, "_MAX_ROWS", 100)
    events = ",".join(f'{{"ph":"X","cat":"cpu_op","name":"op{i}","pid":1,"tid":1,"ts":{i * 10},"dur":5}}' for i in range(500))
    path = tmp_path / "names.json"
    path.write_text('{"traceEvents": [' + events + "]}")
    s = summarize_trace(path, top=1000)
    names = {o.name for o in s.cpu_ops}
    assert len(names) == 101 and summary_mod.OTHER_NAMES in names
    assert sum(o.count for o in s.cpu_ops) == 500  # nothing lost: counted under the overflow row


def test_a_fifo_is_refused_without_being_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "trace_rank0.json"
    os.mkfifo(fifo)
    # a child process, so a reader that opened the FIFO would block there and time out, not here
    code = "from sidecar.analysis import summarize_trace\nsummarize_trace(%r)" % str(fifo)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == 1 and "is a FIFO, not a trace file: not read" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("body", [b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1', b"not json at all", b'{"traceEvents": ['])
def test_slim_of_unparseable_or_truncated_input_exits_1_with_the_reason(tmp_path: Path, body: bytes) -> None:
    src = tmp_path / "in.json"
    src.write_bytes(body)
    out = tmp_path / "out.json"
    code, text, exc = _cli("slim", str(src), "-o", str(out))
    assert (code, type(exc)) == (1, SystemExit), text
    assert "0 of 0 events" not in text and "trace_invalid" in text and not out.exists()


def test_an_analysis_worker_past_its_memory_cap_is_trace_too_large_and_the_caller_lives() -> None:
    from sidecar.analysis.isolated import run_isolated

    with pytest.raises(TraceTooLarge) as err:
        run_isolated(bytearray, 2 << 30, memory_bytes=512 << 20)  # 2 GiB asked under a 512 MB cap
    assert "memory limit" in err.value.message
    assert len(run_isolated(bytearray, 1 << 20)) == 1 << 20  # the next analysis runs as usual


@pytest.fixture
def no_kept_child() -> Iterator[None]:
    """No analysis child kept from an earlier test, and none left for the next."""
    from sidecar.analysis import isolated

    isolated.stop_all()
    yield
    isolated.stop_all()


def _gone(pid: int) -> bool:
    import psutil

    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_worker_that_answered_serves_the_next_analysis(no_kept_child: None) -> None:
    # a fresh interpreter costs 0.35 s of CPU before any work (bench/isolated.py): the one that
    # answered is kept for the next analysis, which then starts at once
    from sidecar.analysis.isolated import run_isolated
    from tests.fixtures.analysis import pid_after_holding

    first = run_isolated(pid_after_holding, 1 << 20)
    assert first != os.getpid() and run_isolated(pid_after_holding, 1 << 20) == first


@pytest.mark.parametrize("failure", ["memory", "error", "bug"])
def test_a_worker_whose_analysis_failed_is_never_reused(no_kept_child: None, hostile_dir: Path, failure: str) -> None:
    from sidecar.analysis.isolated import run_isolated
    from tests.fixtures.analysis import pid_after_holding, summarizer_bug

    first = run_isolated(pid_after_holding, 1 << 20)  # kept
    with pytest.raises(SidecarError if failure != "bug" else RuntimeError):
        if failure == "memory":
            run_isolated(bytearray, 2 << 30, memory_bytes=512 << 20)  # another cap: a child of its own
        elif failure == "error":
            run_isolated(summarize_trace, hostile_dir / "deep.json.gz")  # ran in the kept one
        else:
            run_isolated(summarizer_bug, ["a.json"])
    after = run_isolated(pid_after_holding, 1 << 20)
    if failure == "memory":  # the kept child was not the one that failed: it still serves
        assert after == first
    else:
        assert after != first and poll(lambda: _gone(first), 30)


def test_a_worker_whose_memory_peaked_high_is_not_kept(no_kept_child: None) -> None:
    from sidecar.analysis import isolated
    from tests.fixtures.analysis import pid_after_holding

    big = isolated.run_isolated(pid_after_holding, isolated.REUSE_MAX_RSS + (64 << 20))
    assert poll(lambda: _gone(big), 30) and not isolated._idle
    small = isolated.run_isolated(pid_after_holding, 1 << 20)
    assert small != big and isolated.run_isolated(pid_after_holding, 1 << 20) == small


def test_a_kept_worker_ends_after_its_idle_time_and_at_stop_all(no_kept_child: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.analysis import isolated
    from tests.fixtures.analysis import pid_after_holding

    monkeypatch.setattr(isolated, "IDLE_S", 0.5)
    idle = isolated.run_isolated(pid_after_holding, 1 << 20)
    assert poll(lambda: _gone(idle) and not isolated._idle, 30)
    monkeypatch.setattr(isolated, "IDLE_S", 600.0)
    kept = isolated.run_isolated(pid_after_holding, 1 << 20)
    assert kept != idle and not _gone(kept)
    isolated.stop_all()  # the sidecar's shutdown: nothing of it stays
    assert poll(lambda: _gone(kept), 30) and not isolated._idle


def test_concurrent_analyses_keep_one_worker_and_close_the_others(no_kept_child: None, analysis_gate: AnalysisGate) -> None:
    from sidecar.analysis import isolated

    n = isolated.MAX_WORKERS
    threads, outcomes = _analyses(n, held_analysis, analysis_gate.port)
    assert analysis_gate.wait_started(n)
    analysis_gate.release()
    assert _joined(threads) and outcomes == ["released"] * n
    assert len(isolated._idle) == isolated.KEEP_IDLE


def test_an_error_in_the_worker_keeps_its_class(hostile_dir: Path) -> None:
    from sidecar.analysis.isolated import run_isolated

    with pytest.raises(TraceTooLarge):
        run_isolated(summarize_trace, hostile_dir / "bomb.json.gz")
    with pytest.raises(TraceError) as err:
        run_isolated(summarize_trace, hostile_dir / "deep.json.gz")
    assert type(err.value) is TraceError


def test_a_bug_in_the_worker_is_raised_as_it_was_or_as_internal_error_where_it_cannot_cross() -> None:
    from sidecar.analysis.isolated import run_isolated
    from tests.fixtures.analysis import summarizer_bug, summarizer_bug_built_otherwise

    with pytest.raises(RuntimeError, match=r"summarizer bug \(1 trace\(s\)\)"):
        run_isolated(summarizer_bug, ["a.json"])
    with pytest.raises(SidecarError) as err:
        run_isolated(summarizer_bug_built_otherwise, ["a.json"])
    assert (err.value.code, err.value.message) == ("internal_error", "BugBuiltOtherwise: summarizer bug: 1 trace(s)")



def test_the_servers_summary_of_several_large_files_runs_in_its_worker(tmp_path: Path) -> None:
    # The server summarises a capture in a memory-capped worker, which aggregates its files one
    # after another; files above the parallel threshold made summarize_paths open a process pool
    # there (the worker was then a daemonic multiprocessing child: "daemonic processes are not
    # allowed to have children"): the summary, and a steps window's trace count, failed on a real
    # vLLM capture of 37 MB (bench/steps.py, stacks flags).
    import gzip
    import json

    from sidecar.analysis import summarize_paths
    from sidecar.analysis.capture import PARALLEL_MIN_BYTES
    from sidecar.analysis.isolated import run_isolated

    doc = json.load(gzip.open(Path(__file__).parent / "data" / "traces" / "cuda_small_stack.json.gz"))
    text = json.dumps(doc)
    copies = PARALLEL_MIN_BYTES // 2 // len(text) + 1
    doc["traceEvents"] = doc["traceEvents"] * copies
    paths = []
    for rank in (0, 1):
        path = tmp_path / f"trace_rank{rank}.json"
        path.write_text(json.dumps(doc))
        paths.append(path)
    assert sum(p.stat().st_size for p in paths) >= PARALLEL_MIN_BYTES
    summary = run_isolated(summarize_paths, paths)
    assert [f.totals.events for f in summary.files] == [len(doc["traceEvents"])] * 2

_OWNER = """
import os, sys, threading
import psutil
from sidecar.analysis.isolated import run_isolated
from tests.fixtures.analysis import AnalysisGate, held_analysis

if __name__ == "__main__":
    gate = AnalysisGate()
    threading.Thread(target=run_isolated, args=(held_analysis, gate.port), daemon=True).start()
    assert gate.wait_started(1)  # the analysis child runs it
    print(" ".join(str(c.pid) for c in psutil.Process().children(recursive=True)), flush=True)
    os.kill(os.getpid(), 9)
"""


def test_an_analysis_child_never_outlives_a_killed_sidecar(tmp_path: Path) -> None:
    # a sidecar killed mid-summary left its analysis worker (and the forkserver it came from)
    # running, holding its stdout (the docs walkthrough's pipe never closed); now it goes with it
    import psutil

    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == -9, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) >= 1, proc.stdout  # the analysis child
    assert poll(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids), 60)


_NO_MAIN_GUARD = """
import sys, threading
from sidecar.analysis import summarize_paths, summarize_trace
from sidecar.analysis.isolated import run_isolated

with open(sys.argv[1], "a") as fh:
    fh.write("top level\\n")
threading.Thread(target=threading.Event().wait, daemon=True).start()  # a program with threads (a trainer)
if sys.argv[2] == "worker":
    print(run_isolated(summarize_trace, sys.argv[3]).totals.events)
else:
    print(len(summarize_paths(sys.argv[3:], workers=2).files))
"""


@pytest.mark.parametrize("how", ["worker", "pool"])
def test_a_script_without_a_main_guard_runs_its_top_level_once(tmp_path: Path, how: str) -> None:
    # multiprocessing imported the caller's main script as __mp_main__ in each child (forkserver,
    # spawn): a script without a main guard that summarised in process ran its top level again
    # there (and, doing so, failed the summary as trace_too_large)
    traces = Path(__file__).parent / "data" / "traces"
    script, lines = tmp_path / "no_guard.py", tmp_path / "lines.txt"
    script.write_text(_NO_MAIN_GUARD)
    files = [traces / "cuda_small.json.gz"] if how == "worker" else [traces / "comm_rank0.json.gz", traces / "comm_rank1.json.gz"]
    proc = subprocess.run([sys.executable, str(script), str(lines), how, *map(str, files)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == 0 and int(proc.stdout) > 0, proc.stderr[-2000:]
    assert lines.read_text().splitlines() == ["top level"]


def _analyses(count: int, fn: Any, *args: Any) -> tuple[list[threading.Thread], list[object]]:
    """``count`` callers of ``run_isolated(fn, *args)``, each in its own thread; each one's value
    or exception lands in the list."""
    from sidecar.analysis.isolated import run_isolated

    outcomes: list[object] = []

    def run() -> None:
        try:
            outcomes.append(run_isolated(fn, *args))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcomes.append(exc)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, outcomes


def _joined(threads: list[threading.Thread]) -> bool:
    for thread in threads:
        thread.join(60)
    return not any(t.is_alive() for t in threads)


def test_at_most_max_workers_analyses_run_at_once_and_the_next_starts_as_one_ends(analysis_gate: AnalysisGate) -> None:
    from sidecar.analysis import isolated

    n = isolated.MAX_WORKERS
    threads, outcomes = _analyses(n + 1, held_analysis, analysis_gate.port)
    assert analysis_gate.wait_started(n)
    assert poll(lambda: isolated._queued == 1, 60)  # the last one waits for a slot...
    assert analysis_gate.started() == n  # ...without a child
    analysis_gate.release()
    assert analysis_gate.wait_started(n + 1)  # a slot freed: it starts
    analysis_gate.release()
    assert _joined(threads) and outcomes == ["released"] * (n + 1)


def test_stop_all_ends_an_analysis_in_flight_with_sidecar_closing(analysis_gate: AnalysisGate) -> None:
    from sidecar.analysis import isolated

    threads, outcomes = _analyses(1, held_analysis, analysis_gate.port)
    assert analysis_gate.wait_started(1)
    isolated.stop_all()
    assert _joined(threads) and len(outcomes) == 1 and isinstance(outcomes[0], SidecarClosing), outcomes
    assert len(isolated.run_isolated(bytearray, 10)) == 10  # one asked for after it runs as usual


def test_an_analysis_queued_behind_the_slots_is_refused_once_stop_all_has_begun(analysis_gate: AnalysisGate) -> None:
    # A shutdown killed the analyses in flight, and the one queued behind them then took the freed
    # slot and ran its full 9.7 s, holding the sidecar's exit.
    from sidecar.analysis import isolated

    n = isolated.MAX_WORKERS
    threads, outcomes = _analyses(n + 1, held_analysis, analysis_gate.port)
    assert analysis_gate.wait_started(n)
    assert poll(lambda: isolated._queued == 1, 60)
    isolated.stop_all()
    assert _joined(threads), "an analysis still runs after stop_all()"
    assert [type(o) for o in outcomes] == [SidecarClosing] * (n + 1), outcomes
    assert analysis_gate.started() == n  # the queued one never started


# --- numbers no profiler writes ----------------------------------------------------------------
_BAD = 123456789.25  # where a case writes its number, as text


def _numbers_trace(bad: dict | None) -> dict:
    """A step, ops, memory events, kernels and their API calls; ``bad``: one more event in the
    middle, holding a number no profiler writes."""
    ev: list[dict] = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": 400.0}]
    for i in range(8):
        t = 10.0 + 40 * i
        ev.append({"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 3}", "pid": 1, "tid": 1, "ts": t, "dur": 20.0,
                   "args": {"External id": i + 1}})
        ev.append({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": t + 1,
                   "args": {"Total Reserved": 1 << 21, "Total Allocated": 512 * (i + 1), "Bytes": 512, "Device Id": 0,
                            "Device Type": 1, "Addr": 4096 * (i + 1)}})
    if bad is not None:
        ev.append(bad)
    for i in range(8):
        t = 12.0 + 40 * i
        ev.append({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": t + 5, "dur": 9.0,
                   "args": {"External id": i + 1, "correlation": 100 + i, "device": 0, "stream": 7}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t, "dur": 3.0,
                   "args": {"External id": i + 1, "correlation": 100 + i}})
    return {"schemaVersion": 1, "traceEvents": ev}


NUMBERS = {
    "float_past_float64": ({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": _BAD, "dur": 9.0,
                            "args": {"correlation": 999, "device": 0, "stream": 7}}, "1e400"),
    "times_past_2_53_us": ({"ph": "X", "cat": "cpu_op", "name": "aten::late", "pid": 1, "tid": 1, "ts": _BAD, "dur": _BAD}, "1e308"),
    "memory_event_time_past_2_53_us": ({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1,
                                        "tid": 1, "ts": _BAD, "args": {"Bytes": 8, "Addr": 1, "Device Id": 0,
                                                                       "Device Type": 1}}, "1e308"),
    "complete_event_of_negative_duration": ({"ph": "X", "cat": "cpu_op", "name": "aten::neg", "pid": 1, "tid": 1,
                                             "ts": 200.0, "dur": _BAD}, "-0.005"),
    "allocator_figure_past_64_bits": ({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1,
                                       "ts": 200.0, "args": {"Bytes": _BAD, "Addr": 1, "Device Id": 0, "Device Type": 1}},
                                      str(10**23)),
}


def _strict(text: str) -> Any:
    """The first JSON document in ``text`` (the CLI's output: warnings follow it), as RFC 8259 has
    it: no Infinity, no NaN."""
    import json

    def refuse(c: str) -> None:
        raise ValueError(f"{c} is not JSON")

    return json.JSONDecoder(parse_constant=refuse).raw_decode(text, text.index("{"))[0]


@pytest.mark.parametrize("case", sorted(NUMBERS))
def test_an_event_with_a_number_no_profiler_writes_is_left_out_and_said_and_nothing_else_is_lost(tmp_path: Path, case: str) -> None:
    import json

    bad, number = NUMBERS[case]
    path = tmp_path / f"{case}.json"
    path.write_text(json.dumps(_numbers_trace(bad)).replace(repr(_BAD), number))
    clean = tmp_path / "clean.json"
    clean.write_text(json.dumps(_numbers_trace(None)))
    code, out, exc = _cli("summarize", str(path), "--json")
    assert code == 0 and "Traceback" not in out, out
    got = _strict(out)
    want = _strict(_cli("summarize", str(clean), "--json")[1])
    assert got["warnings"] == [f"{path}: 1 event left out: a timestamp or duration past ±2^53 µs, a negative duration, "
                               "or an allocator figure past 64 bits (not a number a profiler writes)"]
    assert not got["truncated"] and got["errors"] == []
    for key in ("window", "cpu_ops", "kernels", "devices", "memory"):  # the rest, as if the event were not there
        assert json.dumps(got[key]).replace(str(path), "") == json.dumps(want[key]).replace(str(clean), ""), key
    # slim and timeline copy events as they are, in strict JSON: all but one past a float64 (no
    # JSON number holds it), which they leave out and say so
    left = case == "float_past_float64"
    code, out, _ = _cli("slim", str(path), "-o", str(tmp_path / "slim.json"))
    assert code == 0 and f"{34 - left} of 34 events" in out, out
    assert len(_strict((tmp_path / "slim.json").read_text())["traceEvents"]) == 34 - left
    code, out, _ = _cli("timeline", str(path), "-o", str(tmp_path / "timeline.json"))
    assert code == 0 and ("1 event left out" in out) == left, out
    _strict((tmp_path / "timeline.json").read_text())


# --- values of a type no profiler writes -------------------------------------------------------
# Found by a seeded fuzz of field values over the committed H100 memory trace (150 files: 21
# tracebacks in slim and timeline, one in the summary).
MEMORY_TRACE = Path(__file__).parent / "data" / "cuda_memory" / "cuda_memory_rank0.json.gz"
ODD_VALUES = {
    "category_an_object": lambda e: e.update(cat={"a": 1}),
    "category_an_array": lambda e: e.update(cat=[1, 2]),
    "pid_an_object": lambda e: e.update(pid={"a": 1}),
    "tid_an_array": lambda e: e.update(tid=[1, 2]),
    "phase_an_object": lambda e: e.update(ph={"a": 1}),
    "memory_event_as_a_complete_event": lambda e: e.update(ph="X", dur=1.0) if e.get("name") == "[memory]" else None,
}


@pytest.mark.parametrize("case", sorted(ODD_VALUES))
def test_a_value_of_a_type_no_profiler_writes_is_no_traceback_in_summarize_slim_or_timeline(tmp_path: Path, case: str) -> None:
    import json

    doc = json.loads(gzip.decompress(MEMORY_TRACE.read_bytes()))
    events = doc["traceEvents"]
    for e in events[len(events) // 3 :: 97]:  # every 97th event from a third of the way in: ops, memory, kernels
        ODD_VALUES[case](e)
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(doc))
    code, out, exc = _cli("summarize", str(path), "--json")
    assert code == 0 and exc is None, out
    assert _strict(out)["totals"]["events"] == len(events)
    for command in ("slim", "timeline"):
        code, out, exc = _cli(command, str(path), "-o", str(tmp_path / f"{command}.json"))
        assert code == 0 and exc is None, out
        _strict((tmp_path / f"{command}.json").read_text())
