"""Clock offsets, start skew, the common window and the Perfetto archive of a fleet capture
(docs/fleet-clocks.md). The clock endpoint and the exchange run over the real app; the skewed
replicas run under libfaketime (real emulator + sidecar processes at known offsets)."""

from __future__ import annotations

import time

from sidecar.fleet._clocks import ClockOffset, exchange
from tests.fixtures.sidecar import AppClient


async def test_the_clock_route_answers_both_clocks_and_the_exchange_bounds_its_error(api: AppClient) -> None:
    client = await api(token=True)  # read-only: no token needed

    async def read() -> tuple[int, int]:
        body = (await client.get("/v1/clock")).json()
        return body["realtime_ns"], body["monotonic_ns"]

    before = time.time_ns()
    clock = await exchange(read, samples=4, more=0)
    after = time.time_ns()
    assert clock.method == "exchange" and clock.samples == 4
    # the app runs in this process: the true offset is 0, so the bound must hold it
    assert abs(clock.offset_ns) <= clock.error_ns and clock.error_ns * 2 >= clock.rtt_ns
    assert before <= clock.at_ns <= after and clock.target_monotonic_ns is not None
    assert ClockOffset.in_process().method == "in_process" and ClockOffset.in_process().offset_ns == 0


async def test_a_capture_keeps_a_clock_record_and_refuses_a_malformed_one(api: AppClient) -> None:
    from tests.fixtures.sidecar import TOKEN, error_of

    client = await api(token=True)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cid = (await client.post("/v1/captures", json={}, headers=auth)).json()["id"]
    record = {"phase": "start", "offset_ns": -1_200_000_000, "error_ns": 350_000, "at_ns": time.time_ns()}
    assert (await client.post(f"/v1/captures/{cid}/clock", json=record)).status_code == 401  # mutating: token
    reply = await client.post(f"/v1/captures/{cid}/clock", json=record, headers=auth)
    assert reply.status_code == 200 and reply.json()["clocks"] == [{**record, "reference": "fleet"}]
    for bad in ({**record, "phase": "middle"}, {**record, "error_ns": -1}, {"offset_ns": 1}, {**record, "extra": 1}):
        reply = await client.post(f"/v1/captures/{cid}/clock", json=bad, headers=auth)
        assert reply.status_code == 422 and error_of(reply)["code"] == "request_invalid", bad
    assert (await client.post("/v1/captures/nope/clock", json=record, headers=auth)).status_code == 404
    assert len((await client.get(f"/v1/captures/{cid}")).json()["clocks"]) == 1


# --- two replicas whose hosts' clocks are off by known amounts (libfaketime) ----------------------

import asyncio  # noqa: E402
import json  # noqa: E402
import tarfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from sidecar.api.launcher import SidecarProcess  # noqa: E402
from sidecar.emulator.launcher import EmulatorProcess  # noqa: E402
from sidecar.fleet import Fleet, FleetCapture, Target, align_fleet, fleet_archive, fleet_timeline  # noqa: E402
from sidecar.fleet._view import load_fleet_result  # noqa: E402
from tests.fixtures.analysis import load_trace  # noqa: E402
from tests.fixtures.emulator import make_deploy  # noqa: E402
from tests.fixtures.fleet import EMULATOR_ARGS  # noqa: E402

FAKETIME = next((p for p in (Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
                              Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"),
                              Path("/usr/lib/faketime/libfaketime.so.1")) if p.exists()),
                Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"))
OFFSETS_NS = (250_000_000, -1_200_000_000)  # +250 ms and -1.2 s, as the issue asks
TOLERANCE_NS = 2_000_000
MAPPED_NS = 50_000_000  # a schedule mapped through one exchange: its error, far below either offset


@dataclass
class Skewed:
    offset_ns: int  # the truth: this replica's realtime clock minus ours
    emulator: EmulatorProcess
    sidecar: SidecarProcess

    def request(self) -> tuple[int, int]:
        """One chat request; our realtime clock just before it is sent and just after its reply."""
        t0 = time.time_ns()
        httpx.post(f"{self.emulator.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).raise_for_status()
        return t0, time.time_ns()


@dataclass
class Run:
    replicas: list[Skewed]
    fc: FleetCapture
    requests: list[list[tuple[int, int]]]  # per replica, each request's bracket on our clock
    tmp: Path


@pytest.fixture(scope="module")
def skewed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Two emulator + sidecar pairs, each under libfaketime at its offset,
    one fleet capture over both sidecars with start_at; requests r0, r1, r0, r1 in turn, so the
    traces overlap from r1's first request to r0's last."""
    if not FAKETIME.exists():
        pytest.skip("libfaketime is absent: apt-get install faketime (make install-test installs it)")
    tmp = tmp_path_factory.mktemp("skewed")
    started: list[EmulatorProcess | SidecarProcess] = []
    try:
        replicas = []
        for i, offset in enumerate(OFFSETS_NS):
            root = tmp / f"replica{i}"
            root.mkdir()
            deploy = make_deploy(root, {0: {"profiler": "torch"}})
            # libfaketime 0.9.10 shifts CLOCK_MONOTONIC too; FAKETIME_DONT_FAKE_MONOTONIC=1 would keep it
            # true but breaks clock_nanosleep (Python's time.sleep: EINVAL). Fractional seconds work.
            env = {"LD_PRELOAD": str(FAKETIME), "FAKETIME": f"{offset / 1e9:+.3f}"}
            emu = EmulatorProcess(deploy, extra_args=[*EMULATOR_ARGS, "--model", f"skewed{i}"], env=env)
            started.append(emu)
            emu.start()
            side = SidecarProcess(emu.url, deploy, state_dir=root / "state", env=env)
            started.append(side)
            side.start()
            replicas.append(Skewed(offset, emu, side))

        async def capture() -> tuple[FleetCapture, list[list[tuple[int, int]]]]:
            async with Fleet([Target.sidecar(r.sidecar.url) for r in replicas], stages=[0]) as fleet:
                fc = await fleet.start(label="skewed", start_at=time.time() + 0.5)
                brackets: list[list[tuple[int, int]]] = [[], []]
                for i in (0, 1, 0, 1):
                    brackets[i].append(await asyncio.to_thread(replicas[i].request))
                return await fleet.stop(fc, artifact_timeout_s=60), brackets

        fc, brackets = asyncio.run(capture())
        assert fc.ok, fc.rollup()
        yield Run(replicas, fc, brackets, tmp)
    finally:
        for proc in reversed(started):
            proc.stop()


def _steps(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e.get("name") == "execute_model" and e.get("ph") == "X"]


def _within(start_ns: float, end_ns: float, brackets: list[tuple[int, int]]) -> bool:
    return any(t0 - TOLERANCE_NS <= start_ns and end_ns <= t1 + TOLERANCE_NS for t0, t1 in brackets)


def test_recovered_offsets_are_within_2ms_of_the_truth_and_within_their_own_bounds(skewed_run: Run) -> None:
    for r in skewed_run.replicas:
        res = skewed_run.fc.targets[Target.sidecar(r.sidecar.url).name]
        for clock in (res.clock_start, res.clock_stop):  # each exchange: its error bound holds
            assert clock is not None and clock.method == "exchange"
            assert abs(clock.offset_ns - r.offset_ns) <= clock.error_ns, (clock, r.offset_ns)
        # the offset its traces are mapped through (the tighter exchange)
        assert res.clock is not None and abs(res.clock.offset_ns - r.offset_ns) <= TOLERANCE_NS, (res.clock, r.offset_ns)


def test_each_sidecars_capture_keeps_the_fleets_offsets_of_its_clock(skewed_run: Run) -> None:
    from sidecar.client import SidecarClient

    for r in skewed_run.replicas:
        res = skewed_run.fc.targets[Target.sidecar(r.sidecar.url).name]
        with SidecarClient(r.sidecar.url) as client:
            cap = client.get_capture(res.capture_id)  # read back from the sidecar (journaled there)
        kept = {c.phase: c for c in cap.clocks}
        assert set(kept) == {"start", "stop"}
        for phase, clock in (("start", res.clock_start), ("stop", res.clock_stop)):
            assert (kept[phase].offset_ns, kept[phase].error_ns, kept[phase].at_ns) == (clock.offset_ns, clock.error_ns, clock.at_ns)


def test_each_skewed_sidecar_sends_its_start_at_the_fleets_start_at_on_its_own_clock(skewed_run: Run) -> None:
    from sidecar.client import SidecarClient

    for r in skewed_run.replicas:
        res = skewed_run.fc.targets[Target.sidecar(r.sidecar.url).name]
        with SidecarClient(r.sidecar.url) as client:
            cap = client.get_capture(res.capture_id)
        # told the fleet's start_at plus its offset as the fleet measured it just before (within
        # that exchange's error: 2 ms or less idle, more on a loaded host; unmapped, it would be off
        # by the whole +250 ms or -1.2 s)...
        assert cap.start_at is not None
        told_ns = round(cap.start_at.timestamp() * 1e9) - r.offset_ns
        assert abs(told_ns - round(skewed_run.fc.start_at * 1e9)) <= MAPPED_NS, (told_ns, skewed_run.fc.start_at)
        # ...and its server received the start then, not before (its log is on the skewed clock)
        (sent,) = [c["t"] for c in r.emulator.state()["calls"] if c["path"] == "/start_profile"]
        assert round(sent * 1e9) - r.offset_ns >= round(skewed_run.fc.start_at * 1e9) - MAPPED_NS, (
            sent, r.offset_ns, skewed_run.fc.start_at)


def test_the_merged_timeline_puts_each_request_where_it_happened_and_trims_to_the_common_window(skewed_run: Run) -> None:
    out = skewed_run.tmp / "timeline.json"
    report, _ = fleet_timeline(skewed_run.fc, out)
    doc = load_trace(out)
    base = doc.get("baseTimeNanoseconds", 0)  # the emulator's ts are absolute: none here
    by_pid = {p.pid: p.replica for p in report.processes}
    steps = _steps(doc)
    assert {by_pid[e["pid"]] for e in steps} == {0, 1}
    for e in steps:  # on the fleet's clock, inside the request that made it (±2 ms)
        at = base + e["ts"] * 1000
        assert _within(at, at + e["dur"] * 1000, skewed_run.requests[by_pid[e["pid"]]]), e

    trimmed = skewed_run.tmp / "window.json"
    report, al = fleet_timeline(skewed_run.fc, trimmed, common_window=True)
    # the window both replicas were recording (from start_at to the first stop): trimming to it is
    # shown on a pipeline whose stage 1 works past it in tests/test_skew.py
    assert al is not None and al.window_ns is not None
    lo, hi = al.window_ns
    kept = _steps(load_trace(trimmed))
    assert kept and all(lo <= base + (e["ts"] + e["dur"]) * 1000 and base + e["ts"] * 1000 <= hi for e in kept)


def test_the_start_skew_and_the_common_window_match_the_traces_read_with_the_true_offsets(skewed_run: Run) -> None:
    al = align_fleet(skewed_run.fc)
    assert al.requested_ns == round(skewed_run.fc.start_at * 1e9)
    spans = {}  # the profiler's own span, the first request's step
    for span in al.spans:
        offset = skewed_run.replicas[span.replica].offset_ns
        doc = load_trace(Path(span.file))  # the emulator's ts are its (faked) epoch µs
        steps = _steps(doc)
        (profiler,) = [e for e in doc["traceEvents"] if e.get("cat") == "Trace"]
        spans[span.replica] = (profiler["ts"] * 1000 - offset, (profiler["ts"] + profiler["dur"]) * 1000 - offset)
        assert abs(span.first_ns - (min(e["ts"] for e in steps) * 1000 - offset)) <= TOLERANCE_NS
        assert abs(span.profiling_start_ns - spans[span.replica][0]) <= TOLERANCE_NS
        assert span.start_skew_ms == pytest.approx((span.profiling_start_ns - al.requested_ns) / 1e6, abs=0.001)
    # both replicas of stage 0 started profiling at start_at: the window is the span both were recording
    assert al.window_ns is not None
    assert abs(al.window_ns[0] - max(a for a, _ in spans.values())) <= TOLERANCE_NS
    assert abs(al.window_ns[1] - min(b for _, b in spans.values())) <= TOLERANCE_NS
    starts = [sp.profiling_start_ns for sp in al.spans]
    assert [(st.stage_id, st.members) for st in al.stages] == [(0, 2)] and al.handovers == []
    assert al.spread_ms == pytest.approx(abs(starts[0] - starts[1]) / 1e6, abs=0.001)


def _result_file(run: Run, path: Path) -> Path:
    """The capture as `fleet capture --json` writes it (targets as a list), for the CLI to read."""
    path.write_text(json.dumps({"label": "skewed", "start_at": run.fc.start_at,
                                "targets": [r.model_dump(mode="json") for r in run.fc.targets.values()]}))
    return path


def test_the_cli_reports_skew_and_writes_the_trimmed_timeline_and_the_archive(skewed_run: Run, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sidecar.cli import app

    result = str(_result_file(skewed_run, tmp_path / "result.json"))
    runner = CliRunner()
    skew = runner.invoke(app, ["fleet", "skew", result, "--json"])
    assert skew.exit_code == 0, skew.output
    body = json.loads(skew.output)
    assert len(body["spans"]) == 2 and body["window_ms"] > 0 and body["requested_ns"] == round(skewed_run.fc.start_at * 1e9)
    out = tmp_path / "t.json.gz"
    timeline = runner.invoke(app, ["fleet", "timeline", result, "-o", str(out), "--common-window"])
    assert timeline.exit_code == 0 and out.exists() and "common window" in timeline.output, timeline.output
    tar = tmp_path / "run.tar"
    archive = runner.invoke(app, ["fleet", "archive", result, "-o", str(tar), "--mode", "raw"])
    assert archive.exit_code == 0 and "2 traces" in archive.output, archive.output
    with tarfile.open(tar) as t:  # raw: the files byte for byte
        for m in json.load(t.extractfile(".omni-sidecar/index.json"))["members"]:  # type: ignore[arg-type]
            assert t.extractfile(m["name"]).read() == Path(m["file"]).read_bytes()  # type: ignore[union-attr]
    bad = runner.invoke(app, ["fleet", "archive", str(tmp_path / "t.json.gz"), "-o", str(tar)])
    assert bad.exit_code != 0 and "fleet_result_invalid" in bad.output and "Traceback" not in bad.output


def test_the_archive_manifest_names_each_host_with_its_offset_and_places_every_trace(skewed_run: Run, tmp_path: Path) -> None:
    result = _result_file(skewed_run, tmp_path / "result.json")
    out = tmp_path / "run.tar"
    report = fleet_archive(load_fleet_result(result), out)
    with tarfile.open(out) as tar:
        names = tar.getnames()
        manifest = json.load(tar.extractfile("perfetto_manifest.json"))["perfetto_manifest"]  # type: ignore[arg-type]
        index = json.load(tar.extractfile(".omni-sidecar/index.json"))  # type: ignore[arg-type]
        members = {m["name"]: (m, json.loads(gzip_read(tar, m["name"]))) for m in index["members"]}
    assert manifest["version"] == 1 and len(manifest["files"]) == 2 == len(members)
    ref = manifest["files"][0]["path"]
    assert "clocks" not in manifest["files"][0]
    for f in manifest["files"]:
        assert f["path"] in names and f["machine"]["name"]
        if f["path"] != ref:
            assert f["clocks"]["sync_to"] == {"file": ref} and isinstance(f["clocks"]["offset_ns"], int)
    # one machine per clock: both replicas run on 127.0.0.1 but on clocks 1.45 s apart
    assert len({f["machine"]["name"] for f in manifest["files"]}) == 2
    offsets = {k: v for k, v in manifest["attributes"].items() if k.endswith(".offset_ns")}
    assert sorted(offsets.values()) == sorted(report.machines.values())
    assert all(abs(a - b) <= TOLERANCE_NS for a, b in zip(sorted(offsets.values()), sorted(OFFSETS_NS)))
    # Perfetto places a clockless file at its own ts + offset_ns; mapped back through the
    # reference's own shift, every request lands where it happened on our clock
    ref_member, _ = members[ref]
    shift = -ref_member["offset_ns"]  # the emulator writes absolute ts (epoch µs on its own clock)
    placed = {f["path"]: f.get("clocks", {}).get("offset_ns", 0) for f in manifest["files"]}
    for name, (m, doc) in members.items():
        procs = [e for e in doc["traceEvents"] if e.get("name") == "process_name"]
        assert [p["args"]["name"] for p in procs] == [m["process"]] and m["process"].startswith("stage 0 · replica")
        replica = int(m["process"].split("replica ")[1].split(" ")[0])
        for e in _steps(doc):
            at = e["ts"] * 1000 + placed[name] + shift
            assert _within(at, at + e["dur"] * 1000, skewed_run.requests[replica]), (name, e)


def gzip_read(tar: tarfile.TarFile, name: str) -> bytes:
    import gzip

    return gzip.decompress(tar.extractfile(name).read())  # type: ignore[union-attr]


def test_stragglers_name_the_slowest_replica_its_stage_and_diff_its_ops_against_the_median(skewed_run: Run) -> None:
    from sidecar.fleet import fleet_stragglers

    st = fleet_stragglers(skewed_run.fc, k=1)
    walls = {}
    for i, r in enumerate(skewed_run.replicas):  # truth: each replica's steps read with its true offset
        target = skewed_run.fc.targets[Target.sidecar(r.sidecar.url).name]
        steps = [e for f in target.folders for p in Path(f).glob("trace_rank*.json*") for e in _steps(load_trace(p))]
        walls[i] = (max(e["ts"] + e["dur"] for e in steps) - min(e["ts"] for e in steps)) / 1e3
    slow = max(walls, key=walls.get)  # type: ignore[arg-type]
    assert st.replicas == 2 and st.median_replica == 1 - slow and len(st.slowest) == 1
    row = st.slowest[0]
    assert row.replica == slow and row.stage_id == 0
    assert row.wall_ms == pytest.approx(walls[slow], abs=0.01) and row.median_wall_ms == pytest.approx(walls[1 - slow], abs=0.01)
    assert row.diff is not None and [d.stage_id for d in row.diff.stages] == [0]
    ops = {o.name: o for o in row.diff.stages[0].ops_by_self_cpu}
    assert "aten::linear" in ops and ops["aten::linear"].count_a > 0 and ops["aten::linear"].count_b > 0


def test_fleet_capture_json_carries_both_clock_exchanges(skewed_run: Run, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sidecar.cli import app

    urls = ",".join(f"sidecar={r.sidecar.url}" for r in skewed_run.replicas)
    out = CliRunner().invoke(app, ["fleet", "capture", "--targets", urls, "--stages", "0", "--duration", "0.2",
                                   "--json", "--state-dir", str(tmp_path / "state")])
    body = json.loads(out.output)  # an idle window: degraded (exit 1), its clocks measured all the same
    for t, r in zip(body["targets"], skewed_run.replicas):
        for phase in ("clock_start", "clock_stop"):
            clock = t[phase]
            assert clock["method"] == "exchange" and abs(clock["offset_ns"] - r.offset_ns) <= clock["error_ns"], t
