"""Per-GPU truth, insight, timeline, slim and diff: against torch's key_averages on real H200
traces (committed), hand-built traces, the CLI and the HTTP routes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.analysis import summarize_paths, summarize_trace
from sidecar.analysis.diff import diff_paths
from sidecar.analysis.slim import slim_trace
from sidecar.analysis.timeline import write_timeline
from sidecar.errors import SlimWindowInvalid
from tests.fixtures.analysis import load_trace, rebased_copy

COMMITTED = ["cuda_small", "cuda_small_stack", "fleet_rank0", "fleet_rank1", "comm_rank0", "comm_rank1"]
_STEP = re.compile(r"^ProfilerStep#\d+$")


def _ref_rows(trace_data: Path, name: str) -> list[dict]:
    data = json.loads((trace_data / f"{name}.key_averages.json").read_text())
    if isinstance(data, dict) and "rows" in data:
        return data["rows"]
    return [{"key": k, **v} for k, v in data.items()]


def _device_rows(summary) -> dict[str, float]:
    """Self device time per op and per annotation, ``ProfilerStep#N`` pooled as key_averages does."""
    rows = {o.name: o.self_device_us for o in summary.cpu_ops}
    for o in summary.annotations:
        key = "ProfilerStep*" if _STEP.match(o.name) else o.name
        rows[key] = rows.get(key, 0.0) + o.self_device_us
    return rows


@pytest.mark.parametrize("name", COMMITTED)
def test_top10_self_device_time_equals_key_averages(trace_data, name):
    s = summarize_trace(trace_data / f"{name}.json.gz", top=100_000)
    ours = _device_rows(s)
    annotations = {"ProfilerStep*" if _STEP.match(o.name) else o.name for o in s.annotations}
    # CUPTI's own "Activity Buffer Request" is profiler overhead, reported in totals, not an op
    ref = [r for r in _ref_rows(trace_data, name) if r["self_device_us"] > 0 and r["key"] != "Activity Buffer Request"
           and (r["device_type"] == "DeviceType.CPU" or r["key"] in annotations)]
    top10 = sorted(ref, key=lambda r: -r["self_device_us"])[:10]
    off = {r["key"][:60]: (ours.get(r["key"]), r["self_device_us"]) for r in top10
           if ours.get(r["key"]) is None or abs(ours[r["key"]] - r["self_device_us"]) > 0.02 * r["self_device_us"]}
    # the communication job launches few kinds of work: every row of it is compared
    assert (len(top10), off) == (6 if name.startswith("comm_") else 10, {})


def test_user_annotations_get_their_gpu_span_as_self_device_time(trace_data):
    rows = {o.name: o for o in summarize_trace(trace_data / "fleet_rank0.json.gz", top=1000).annotations}
    ref = {r["key"]: r for r in _ref_rows(trace_data, "fleet_rank0") if r["device_type"] == "DeviceType.CUDA"}
    assert rows["Optimizer.step#AdamW.step"].self_device_us == pytest.approx(ref["Optimizer.step#AdamW.step"]["self_device_us"], rel=1e-4)


def test_devices_of_different_stages_are_not_added_together(write_trace, x_event, tmp_path):
    # two stage processes, each sees its GPU as cuda:0 and itself as rank 0: 90 µs busy of 100 each
    for sid in (0, 1):
        write_trace([x_event("op", 0, 100, External_id=1),
                     x_event("k", 5, 90, cat="kernel", pid=0, tid=7, External_id=1, device=0, stream=7)],
                    f"20261201-100000_stage{sid}_rank0_1764500000/trace_rank0.json")
    s = summarize_paths([tmp_path])
    got = [(d.stage_id, d.rank, d.device, d.busy_us, round(d.idle_share, 3)) for d in s.devices]
    assert got == [(0, 0, 0, 90.0, 0.1), (1, 0, 0, 90.0, 0.1)]


def test_overhead_is_charged_out_of_every_op_even_past_4096(write_trace, x_event):
    # each op: 100 µs, an API call at +50 (5 µs) preceded by a 10 µs CUPTI buffer request at +38
    n = 5000
    events = [x_event("op", i * 1000, 100, tid=1, pid=1, External_id=i + 1) for i in range(n)]
    events += [x_event("Activity Buffer Request", i * 1000 + 38, 10, cat="overhead", pid=1, tid=0) for i in range(n)]
    events += [x_event("cudaLaunchKernel", i * 1000 + 50, 5, cat="cuda_runtime", pid=1, tid=1, External_id=i + 1, correlation=i + 1)
               for i in range(n)]
    s = summarize_trace(write_trace(events), top=10)
    op = next(o for o in s.cpu_ops if o.name == "op")
    assert (op.self_us, s.totals.profiler_overhead_us) == (pytest.approx(n * (100 - 5 - 10)), pytest.approx(n * 10))


def test_engine_step_kinds_and_gpu_split(write_trace, x_event):
    events = [
        x_event("execute_context_1(17)_generation_0(0)", 0, 30, cat="user_annotation"),
        x_event("execute_context_0(0)_generation_2(2)", 40, 10, cat="user_annotation"),
        x_event("execute_context_0(0)_generation_2(2)", 60, 10, cat="user_annotation"),
        x_event("execute_context_1(5)_generation_1(1)", 80, 20, cat="user_annotation"),
        x_event("k", 0, 30, cat="kernel", pid=0, tid=7, device=0, stream=7),
        x_event("m", 40, 10, cat="gpu_memcpy", pid=0, tid=7, device=0, stream=7),
    ]
    s = summarize_trace(write_trace(events))
    kinds = {k.kind: (k.count, k.total_us, k.mean_us) for k in s.engine_step_kinds}
    assert (kinds, s.gpu_split.kernel_share) == ({"prefill": (1, 30.0, 30.0), "decode": (2, 20.0, 10.0), "mixed": (1, 20.0, 20.0)}, 0.75)


def test_straggler_is_the_slowest_replica_against_the_median(write_trace, x_event, tmp_path):
    for rep, step in enumerate((10.0, 10.0, 30.0)):
        write_trace([x_event("ProfilerStep#1", 0, step, cat="user_annotation")],
                    f"replica_{rep}/20261201-100000_stage0_rank0_1764500000/trace_rank0.json")
    g = summarize_paths([tmp_path]).stragglers
    assert [(x.stage_id, x.slowest_replica, x.metric, x.ratio, x.members) for x in g] == [(0, 2, "step_mean", 3.0, 3)]


def test_files_summarised_in_parallel_equal_one_by_one(trace_data, tmp_path):
    for i, name in enumerate(COMMITTED):
        d = tmp_path / f"20261201-10000{i}_stage{i}_rank0_1764500000"
        d.mkdir()
        shutil.copy(trace_data / f"{name}.json.gz", d / "trace_rank0.json.gz")
    one = summarize_paths([tmp_path], workers=1).model_dump()
    two = summarize_paths([tmp_path], workers=2).model_dump()
    assert one == two


def test_a_trace_too_big_to_open_is_flagged_with_the_slim_command(trace_data, monkeypatch):
    import sidecar.analysis.report as report

    monkeypatch.setattr(report, "TOO_BIG_BYTES", 1000)
    s = summarize_paths([trace_data / "cuda_small.json.gz"])
    assert (s.files[0].too_big, "omni-sidecar slim" in s.warnings[0]) == (True, True)


# --- timeline ------------------------------------------------------------------------------


@pytest.fixture
def three_stage_capture(trace_data, tmp_path) -> Path:
    """Stages 0, 1 (LLM) and 2 (diffusion) from the committed H200 traces; stage 1's clock base
    is 5 s later than the others'."""
    root = tmp_path / "capture"
    for sid, name in ((0, "fleet_rank0"), (1, "fleet_rank1"), (2, "cuda_small")):
        folder = (f"20261201-100000_stage{sid}_rank0_1764500000" if sid < 2
                  else f"20261201-100000_stage_{sid}_rep_0_diffusion_1764500000")
        dst = root / folder / "trace_rank0.json.gz"
        if sid == 1:
            rebased_copy(trace_data / f"{name}.json.gz", dst, 5_000_000_000)
        else:
            dst.parent.mkdir(parents=True)
            shutil.copy(trace_data / f"{name}.json.gz", dst)
    return root


def _kernels(events, pid=None):
    return sorted((e["name"], e["ts"]) for e in events if e.get("cat") == "kernel" and (pid is None or e["pid"] == pid))


def test_timeline_names_one_process_per_stage(three_stage_capture, tmp_path):
    write_timeline([three_stage_capture], tmp_path / "t.json.gz")
    doc = load_trace(tmp_path / "t.json.gz")
    names = sorted(e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name")
    assert names == ["stage 0 · replica 0 · rank 0 (llm)", "stage 1 · replica 0 · rank 1 (llm)",
                     "stage 2 · replica 0 · rank 0 (diffusion)"]


def test_timeline_keeps_every_kernel_on_each_trace_s_own_clock(three_stage_capture, tmp_path):
    report = write_timeline([three_stage_capture], tmp_path / "t.json.gz")
    out = load_trace(tmp_path / "t.json.gz")["traceEvents"]
    off = {}
    for p in report.processes:
        src = _kernels(load_trace(Path(p.file))["traceEvents"])
        got = _kernels(out, p.pid)
        assert [n for n, _ in got] == [n for n, _ in src]
        shift = {round(g - s - p.offset_us, 3) for (_, g), (_, s) in zip(got, src)}
        assert max(abs(x) for x in shift) < 1000.0  # within 1 ms of its own trace's timestamps
        off[p.stage_id] = p.offset_us
    assert off == {0: 0.0, 1: 5_000_000.0, 2: 0.0}


def test_timeline_keeps_flows_with_ids_unique_per_source(three_stage_capture, tmp_path):
    write_timeline([three_stage_capture], tmp_path / "t.json.gz")
    out = load_trace(tmp_path / "t.json.gz")["traceEvents"]
    src_flows = sum(1 for f in three_stage_capture.rglob("*.json.gz") for e in load_trace(f)["traceEvents"] if e.get("ph") in ("s", "f"))
    ids = {(e["pid"], e["id"]) for e in out if e.get("ph") == "s"}
    assert (sum(1 for e in out if e.get("ph") in ("s", "f")), len(ids) == len({i for _, i in ids})) == (src_flows, True)


# --- slim ----------------------------------------------------------------------------------


def test_slim_to_one_step_keeps_that_step_s_events_only(trace_data, tmp_path):
    src = trace_data / "cuda_small.json.gz"
    r = slim_trace(src, tmp_path / "s.json.gz", window="step:2")
    events = load_trace(tmp_path / "s.json.gz")["traceEvents"]
    step = next(e for e in events if e.get("name") == "ProfilerStep#2")
    lo, hi = step["ts"], step["ts"] + step["dur"]
    outside = [e for e in events if e.get("ph") == "X" and (e["ts"] + e.get("dur", 0) < lo or e["ts"] > hi)]
    assert (outside, 0 < r.events_out < r.events_in, any(e.get("name") == "ProfilerStep#1" for e in events)) == ([], True, False)


def test_slim_fits_max_mb_and_stays_valid(trace_data, tmp_path):
    r = slim_trace(trace_data / "cuda_small_stack.json.gz", tmp_path / "s.json", max_mb=0.2)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert (r.fits, r.raw_bytes_out <= 200_000, len(doc["traceEvents"]) > 0, "python_function" in r.dropped_categories) == (True, True, True, True)


def test_slim_rejects_a_missing_step(trace_data, tmp_path):
    with pytest.raises(SlimWindowInvalid) as info:
        slim_trace(trace_data / "cuda_small.json.gz", tmp_path / "s.json", window="step:9")
    assert "ProfilerStep#9" in str(info.value)


# --- diff ----------------------------------------------------------------------------------


def test_diff_of_a_capture_with_itself_is_zero(trace_data):
    d = diff_paths([trace_data / "fleet_rank0.json.gz"], [trace_data / "fleet_rank0.json.gz"])
    assert {o.delta_self_us for o in d.total.ops_by_self_cpu} | {k.delta_us for k in d.total.kernels} == {0.0}


def test_diff_ranks_by_change_with_both_counts(trace_data):
    a, b = trace_data / "fleet_rank0.json.gz", trace_data / "fleet_rank1.json.gz"
    d = diff_paths([a], [b], top=1000)
    sa = {o.name: o for o in summarize_trace(a, top=1000).annotations}
    sb = {o.name: o for o in summarize_trace(b, top=1000).annotations}
    row = next(o for o in d.total.ops_by_self_device if o.name == "gloo:all_reduce")
    deltas = [abs(o.delta_self_device_us) for o in d.total.ops_by_self_device]
    assert ((row.count_a, row.count_b), row.delta_self_device_us, deltas == sorted(deltas, reverse=True)) == (
        (12, 12), pytest.approx(sb["gloo:all_reduce"].self_device_us - sa["gloo:all_reduce"].self_device_us), True)


# --- CLI -----------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=300)


def test_cli_timeline_writes_a_trace(three_stage_capture, tmp_path):
    r = _cli("timeline", str(three_stage_capture), "-o", str(tmp_path / "t.json.gz"))
    assert (r.returncode, "stage 2 · replica 0 · rank 0 (diffusion)" in r.stdout, (tmp_path / "t.json.gz").is_file()) == (0, True, True)


def test_cli_slim_and_diff(trace_data, tmp_path):
    r = _cli("slim", str(trace_data / "cuda_small.json.gz"), "-o", str(tmp_path / "s.json.gz"), "--drop", "python_function,ac2g", "--window", "step:1")
    d = _cli("diff", str(trace_data / "fleet_rank0.json.gz"), str(trace_data / "fleet_rank1.json.gz"), "--json", "--top", "3")
    assert (r.returncode, d.returncode, len(json.loads(d.stdout)["total"]["kernels"])) == (0, 0, 3)


def test_cli_diff_totals_the_annotations_its_rows_hold(trace_data):
    # the self CPU rows hold annotations (gloo:all_reduce) beside the ops: the header totals both,
    # each apart; it gave the ops' total alone above rows larger than it
    a, b = trace_data / "fleet_rank0.json.gz", trace_data / "fleet_rank1.json.gz"
    d = json.loads(_cli("diff", str(a), str(b), "--json").stdout)["total"]["totals"]
    want = [sum(o.self_us for o in summarize_trace(p, top=1000).annotations) for p in (a, b)]
    text = " ".join(_cli("diff", str(a), str(b)).stdout.split())  # as one line, however the terminal wraps it
    assert ([d["annotation_self_us_a"], d["annotation_self_us_b"]], "of annotations" in text) == (
        [pytest.approx(w) for w in want], True), text[:400]
    assert want[0] > 0


def test_cli_slim_bad_window_exits_1(trace_data, tmp_path):
    r = _cli("slim", str(trace_data / "cuda_small.json.gz"), "-o", str(tmp_path / "s.json"), "--window", "soon")
    assert (r.returncode, "slim_window_invalid" in r.stderr, "Traceback" in r.stderr) == (1, True, False)


@pytest.mark.parametrize("chunk", [4096, 65536, 4 << 20])
@pytest.mark.parametrize("trace", ["traces/cuda_small_stack.json.gz", "cuda_memory/cuda_memory_rank0.json.gz"])
def test_python_stack_events_are_counted_without_decoding_and_nothing_else_is_lost(trace_data, chunk, trace):
    """Real traces with stacks: the ops' and GPU's (H200), and one with memory on (H100), where
    Kineto writes the Python run between the memory events and the GPU events, inside a slice."""
    from sidecar.analysis.reader import TraceReader

    path = trace_data.parent / trace
    every = [e for b in TraceReader(path, chunk_size=chunk).batches() for e in b]
    fast = TraceReader(path, chunk_size=chunk, skip_python=True)
    kept = [e for b in fast.batches() for e in b]
    others = [e for e in every if e.cat != "python_function"]
    python = len(every) - len(others)
    assert (len(kept) + fast.skipped, [(e.ph, e.name, e.ts) for e in kept if e.cat != "python_function"],
            fast.skipped > python * 0.9) == (len(every), [(e.ph, e.name, e.ts) for e in others], True)


def _op(i: int) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 7}", "pid": 1, "tid": 1, "ts": float(i), "dur": 0.5,
            "args": {"External id": i + 1}}


def _py(i: int) -> dict:
    return {"ph": "X", "cat": "python_function", "name": f"f.py({i}): g", "pid": 1, "tid": 1, "ts": float(i), "dur": 0.1,
            "args": {"Python id": i}}


def _read_fast(path, chunk: int = 256 << 10):
    from sidecar.analysis.reader import TraceReader

    fast = TraceReader(path, chunk_size=chunk, skip_python=True, read_ahead=False)
    return [e for b in fast.batches() for e in b], fast


def test_python_runs_are_skipped_wherever_they_start_and_short_ones_are_decoded(tmp_path):
    """A long run of Python events that starts in the middle of a slice, with ops after it in the
    same slice (the layout of a trace with memory on), is skipped; a short run is decoded like any
    other event. Either way every other event is kept, in order, and every event is counted once."""
    events = [_op(i) for i in range(300)] + [_py(i) for i in range(3)] + [_op(i) for i in range(300, 600)]
    events += [_py(i) for i in range(1500)] + [_op(i) for i in range(600, 700)]
    events = events * 3
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"traceEvents": events}, indent=1))
    kept, fast = _read_fast(path, chunk=2 << 20)  # the whole file is one slice
    ops = [(e.name, e.ts) for e in kept if e.cat == "cpu_op"]
    decoded_python = sum(e.cat == "python_function" for e in kept)
    assert (ops, len(kept) + fast.skipped, decoded_python, fast.skipped) == (
        [(f"aten::op{i % 7}", float(i)) for i in range(700)] * 3, len(events), 9, 4500)


def test_an_event_of_another_category_inside_a_python_run_is_kept(tmp_path):
    """The run's end is found by probing; an event between two probes is caught by the count, and
    the slice is then decoded as it is: nothing is lost, whatever its category or layout."""
    run = [_py(i) for i in range(2000)]
    odd = [{"ph": "X", "cat": "kernel", "name": "odd_kernel", "pid": 0, "tid": 7, "ts": 5.0, "dur": 1.0},
           {"ph": "i", "name": "[memory]", "pid": 1, "tid": 1, "ts": 6.0, "s": "t",
            "args": {"Bytes": 512, "Addr": 1, "Device Type": 0, "Device Id": -1}}]
    events = [_op(0), *run[:700], odd[0], *run[700:1400], odd[1], *run[1400:], _op(1)]
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"traceEvents": events}, indent=1))
    kept, fast = _read_fast(path, chunk=2 << 20)
    assert ([e.name for e in kept if e.cat != "python_function"], len(kept) + fast.skipped) == (
        ["aten::op0", "odd_kernel", "[memory]", "aten::op1"], len(events))


@pytest.mark.parametrize("chunk", [4096, 65536, 4 << 20])
def test_a_python_run_that_ends_the_events_array_stops_before_the_keys_after_it(tmp_path, chunk):
    """Keys after ``traceEvents`` may hold ``},{`` (a list of objects): a skip never reaches past
    the array's end, so no such object is read as an event and the keys are kept."""
    events = [_op(i) for i in range(500)] + [_py(i) for i in range(3000)]
    path = tmp_path / "tail.json"
    path.write_text(json.dumps({"traceEvents": events, "extra": [{"a": 1}, {"b": 2}], "traceName": "x"}, indent=1))
    kept, fast = _read_fast(path, chunk=chunk)
    assert ([e.name for e in kept if e.cat != "python_function"], len(kept) + fast.skipped, fast.skipped >= 2900,
            fast.truncated, fast.meta.get("extra")) == (
        [f"aten::op{i % 7}" for i in range(500)], len(events), True, False, [{"a": 1}, {"b": 2}])


@pytest.mark.parametrize("seed", range(12))
def test_python_skipping_keeps_every_other_event_whatever_the_layout(tmp_path, seed):
    """Random runs of ops and Python events (1 to 3,000 long; now and then an event of another
    category, or one without a category, inside a Python run), random slice sizes and two JSON
    layouts: the reader that skips Python runs keeps every other event, in order, and counts all."""
    import random

    rnd = random.Random(seed)
    events: list[dict] = []
    i = 0
    while len(events) < 12000:
        n = rnd.choice([1, 2, 5, 40, 300, 3000]) if events else 3000  # one long run at least
        events.extend(_py(j) for j in range(i, i + n))
        i += n
        if rnd.random() < 0.3:  # an odd event inside the run
            events.insert(len(events) - rnd.randrange(n), rnd.choice([_op(i), {"ph": "M", "name": "thread_name", "pid": 1}]))
        events.extend(_op(j) for j in range(i, i + rnd.choice([1, 3, 50, 400])))
        i += 400
    doc: dict = {"traceEvents": events}
    if rnd.random() < 0.5:  # keys after the array, one holding "},{"
        doc.update(extra=[{"a": 1}, {"b": 2}], traceName="t")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc, indent=rnd.choice([None, 1])))
    kept, fast = _read_fast(path, chunk=rnd.choice([4096, 20000, 65536, 300000]))
    want = [(e.get("name"), e.get("ts")) for e in events if e.get("cat") != "python_function"]
    assert ([(e.name, e.ts if e.ph != "M" else None) for e in kept if e.cat != "python_function"],
            len(kept) + fast.skipped, fast.skipped >= 1500, fast.truncated, fast.meta.get("extra")) == (
        want, len(events), True, False, doc.get("extra"))


def _event_ends(raw: bytes) -> list[int]:
    """Where each event of a trace's ``traceEvents`` ends (byte offsets), by the standard library's
    own JSON decoder: the reference for what a cut-off file still holds whole."""
    import re

    s = raw.decode("latin-1")  # one character a byte: offsets in it are the file's
    i = s.index("[", s.index('"traceEvents"')) + 1
    dec, sep, out = json.JSONDecoder(), re.compile(r"[\s,]*"), []
    while True:
        i = sep.match(s, i).end()
        if s[i] == "]":
            return out
        _, i = dec.raw_decode(s, i)
        out.append(i)


@pytest.mark.parametrize("trace", ["traces/cuda_small_stack.json.gz", "cuda_memory/cuda_memory_rank0.json.gz"])
def test_a_trace_cut_off_anywhere_keeps_every_whole_event(trace_data, tmp_path, trace):
    """A file cut off (a copy or a write stopped) is read as truncated with every event written
    whole before the cut, with Python runs skipped or not; the cut lands inside events, right
    after one's ``}`` and after its ``,``, where the last whole event was once dropped."""
    import gzip
    import random

    from sidecar.analysis.reader import TraceReader

    raw = gzip.decompress((trace_data.parent / trace).read_bytes())
    ends = _event_ends(raw)
    rnd = random.Random(5)
    cuts = [rnd.randrange(ends[0], ends[-1]) for _ in range(6)]
    cuts += [ends[i] + d for i in rnd.sample(range(len(ends) - 1), 4) for d in (0, 1, 3)]
    got, want = [], []
    for cut in cuts:
        path = tmp_path / "cut.json"
        path.write_bytes(raw[:cut])
        for skip in (False, True):
            for chunk in (4096, 1 << 20):
                r = TraceReader(path, chunk_size=chunk, skip_python=skip, read_ahead=False)
                n = sum(len(b) for b in r.batches()) + r.skipped
                got.append((cut, skip, chunk, n, r.truncated))
                want.append((cut, skip, chunk, sum(e <= cut for e in ends), True))
    assert got == want


@pytest.mark.parametrize("chunk", [65536, 4 << 20])
def test_a_damaged_byte_keeps_every_event_before_it_and_says_where(trace_data, tmp_path, chunk):
    """One malformed byte inside the events array (a disk or copy fault): every event before the
    damaged one is read, the summary is truncated and its error names the byte. It once failed the
    whole file as "no event boundary within 4 MB" (trace_too_large), with nothing read."""
    import gzip

    from sidecar.analysis.reader import TraceReader

    raw = bytearray(gzip.decompress((trace_data.parent / "cuda_memory/cuda_memory_rank0.json.gz").read_bytes()))
    ends = _event_ends(bytes(raw))
    at = raw.index(b'"cat": "cpu_op", "name": "', len(raw) // 4) + 24  # an op's: the space after "name": becomes an X
    raw[at] = ord("X")
    path = tmp_path / "damaged.json"
    path.write_bytes(raw)
    got = []
    for skip in (False, True):
        r = TraceReader(path, chunk_size=chunk, skip_python=skip, read_ahead=False)
        got.append((sum(len(b) for b in r.batches()) + r.skipped, r.truncated,
                    f"invalid JSON at byte {at:,} of the decompressed trace" in (r.error or "")))
    assert got == [(sum(e < at for e in ends), True, True)] * 2


def test_cli_summarize_of_a_damaged_trace_shows_the_events_before_the_damage(trace_data, tmp_path):
    """Exit 1, as for a cut-off file, with the summary of what was read."""
    import gzip

    raw = bytearray(gzip.decompress((trace_data / "cuda_small.json.gz").read_bytes()))
    at = raw.index(b'"name": "', len(raw) // 2) + 7
    raw[at] = ord("X")
    (tmp_path / "trace_rank0.json").write_bytes(raw)
    r = _cli("summarize", str(tmp_path / "trace_rank0.json"), "--json")
    doc = json.loads(r.stdout)
    assert (r.returncode, doc["truncated"], f"invalid JSON at byte {at:,}" in doc["errors"][0], doc["totals"]["events"] > 1000,
            "Traceback" in r.stderr) == (1, True, True, True, False), r.stderr


def _in_a_terminal(*args: str) -> tuple[int, str]:
    """``python -m sidecar ARGS`` with a terminal (a pty) as its stdout and stderr: what it drew."""
    import os
    import pty

    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "sidecar", *args], stdin=sub, stdout=sub, stderr=sub, close_fds=True,
                            env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
    os.close(sub)
    out = b""
    try:
        while chunk := os.read(main, 65536):
            out += chunk
    except OSError:  # the pty's end once the child closed it
        pass
    finally:
        os.close(main)
    return proc.wait(timeout=300), out.decode(errors="replace")


def test_summarize_diff_timeline_and_slim_say_what_they_are_reading_on_a_terminal(trace_data, tmp_path):
    files = [str(trace_data / f"{n}.json.gz") for n in ("cuda_small", "host_bound", "cuda_graph")]
    rc, drawn = _in_a_terminal("summarize", *files, "--top", "2")
    assert rc == 0 and "summarising 3 trace files: 3 done" in drawn and "Findings" in drawn
    rc, drawn = _in_a_terminal("diff", files[0], files[1], "--top", "2")
    assert rc == 0 and "comparing 1 trace file: 1 done" in drawn
    rc, drawn = _in_a_terminal("timeline", *files, "-o", str(tmp_path / "t.json.gz"))
    assert rc == 0 and "merging 3 trace files: 3 done" in drawn and "wrote " in drawn
    rc, drawn = _in_a_terminal("slim", str(trace_data / "host_bound.json.gz"), "-o", str(tmp_path / "s.json.gz"),
                               "--max-mb", "1")  # the line's last words are always drawn (rich refreshes at its end)
    assert rc == 0 and "slim: pass 6: 1.7 MB is over 1 MB, writing it again with the first 37.2 ms" in drawn
    assert "wrote " in drawn
    piped = _cli("summarize", *files, "--top", "2")  # piped: the tables only, not even a blank line before them
    assert piped.returncode == 0 and "summarising" not in piped.stdout + piped.stderr
    assert piped.stdout.startswith("stage ")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_summary_reports_each_file_read_as_it_ends(trace_data, workers):
    import threading

    from sidecar.analysis import summarize_paths

    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def on_file(done: int, total: int) -> None:
        with lock:
            seen.append((done, total))

    files = [trace_data / f"{n}.json.gz" for n in ("cuda_small", "host_bound", "cuda_graph")]
    s = summarize_paths(files, workers=workers, on_file=on_file)
    assert len(s.files) == 3 and seen == [(0, 3), (1, 3), (2, 3), (3, 3)]
