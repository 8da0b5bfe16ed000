"""``omni-sidecar start|stop|status|capture|list`` against a real sidecar and emulator (``serve``
refusing an invalid deploy is tests/test_config_cli.py's). Exit codes: 0 completed, 1 degraded/failed/error."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from sidecar.api.launcher import SidecarProcess, free_port
from sidecar.cli import app
from sidecar.client import SidecarClient
from sidecar.errors import CaptureStateError
from tests.fixtures.emulator import EmulatorPool, make_deploy
from tests.fixtures.terminal import ctrl_c_as_in_a_terminal
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[tuple[str, str]]:
    """(sidecar url, emulator url). Thread workers: the CLI prints verdicts and file names, the ops
    in the traces do not matter."""
    root = tmp_path_factory.mktemp("cli")
    deploy = make_deploy(root, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})
    emu = emulator_pool.get(deploy, extra_args=["--workers", "thread"], startup_timeout=120)
    with SidecarProcess(emu.url, deploy, state_dir=root / "state", env={}) as sc:
        yield sc.url, emu.url


@pytest.fixture(scope="module")
def url(urls: tuple[str, str]) -> str:
    return urls[0]


@pytest.fixture(scope="module")
def emu_url(urls: tuple[str, str]) -> str:
    return urls[1]


def _request(emu_url: str) -> None:
    """One chat request through every stage: the window records work (an idle one is ``empty``)."""
    reply = httpx.post(
        f"{emu_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
        trust_env=False,
    )
    reply.raise_for_status()


@contextlib.contextmanager
def _in_background(work: Callable[[threading.Event], None], what: str) -> Iterator[None]:
    """``work(done)`` in a thread while the block runs; ``done`` is set when the block ends. What it
    raised fails the test, not swallowed."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work(done)
        except Exception as err:
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=60)
    assert not errors, f"{what} failed: {errors[0]!r}"


def _traffic(emu_url: str) -> contextlib.AbstractContextManager[None]:
    """Requests back to back while the block runs, as on a busy server."""

    def loop(done: threading.Event) -> None:
        while not done.is_set():
            _request(emu_url)

    return _in_background(loop, "traffic")


def _one_request_then_stop(sidecar: str, emu_url: str) -> contextlib.AbstractContextManager[None]:
    """While the block runs a ``capture`` whose window the CLI holds open (a long ``--duration``): once
    the capture is active, one request goes through every stage and then the capture is stopped.
    The window so ends on a condition, a whole request inside it, not on a time that a loaded host
    can outrun (a 0.5 s window against back-to-back traffic was `empty` on stage 2, exit 1, in 1
    of 2 loaded runs of the default group)."""

    def once(done: threading.Event) -> None:
        with SidecarClient(sidecar) as client:
            while not done.is_set():
                active = [c for c in client.list_captures() if c.state.value == "active"]
                if active:
                    _request(emu_url)
                    client.stop_capture(active[0].id)
                    return
                done.wait(0.02)

    return _in_background(once, "the request or the stop")


@pytest.fixture
def sidecar(url: str) -> Iterator[str]:
    yield url
    with SidecarClient(url) as client:
        for cap in client.list_captures():
            if not cap.terminal:
                client.stop_capture(cap.id, wait=True, timeout=60)


def test_capture_prints_json_and_exits_0(sidecar: str, emu_url: str) -> None:
    with _one_request_then_stop(sidecar, emu_url):
        result = runner.invoke(app, ["capture", "--sidecar", sidecar, "--stages", "0,2", "--duration", "120",
                                     "--lease", "3", "--json"])  # fmt: skip
    cap = json.loads(result.stdout)
    got = (result.exit_code, cap["state"], sorted(v["stage_id"] for v in cap["verdicts"]))
    assert got == (0, "completed", [0, 2]), result.output


def test_capture_prints_the_verdict_table(sidecar: str, emu_url: str) -> None:
    with _one_request_then_stop(sidecar, emu_url):
        result = runner.invoke(app, ["capture", "--sidecar", sidecar, "--stages", "2", "--duration", "120",
                                     "--lease", "3"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "completed" in result.stdout and "trace_rank0.json.gz" in result.stdout and "stage 2  ok" in result.stdout


def test_start_then_stop_wait(sidecar: str, emu_url: str) -> None:
    started = runner.invoke(app, ["start", "--sidecar", sidecar, "--stages", "0", "--json"])
    cap_id = json.loads(started.stdout)["id"]
    _request(emu_url)
    stopped = runner.invoke(app, ["stop", cap_id, "--sidecar", sidecar, "--wait", "--json"])
    assert (started.exit_code, stopped.exit_code, json.loads(stopped.stdout)["state"]) == (0, 0, "completed")


def test_status_and_list_show_history(sidecar: str, emu_url: str) -> None:
    with _traffic(emu_url):
        done = runner.invoke(app, ["capture", "--sidecar", sidecar, "--stages", "0", "--duration", "0.2", "--json"])
    listed = json.loads(runner.invoke(app, ["list", "--sidecar", sidecar, "--json"]).stdout)
    status = runner.invoke(app, ["status", listed[0]["id"], "--sidecar", sidecar, "--json"])
    # the newest first, and status exits as the capture did (0 for ok; on a loaded machine the 0.2 s
    # window may miss the traffic and be `empty`, exit 1, for both)
    assert (status.exit_code, json.loads(status.stdout)["id"]) == (done.exit_code, json.loads(done.stdout)["id"])


def test_unprofiled_stage_is_an_error_not_a_traceback(sidecar: str) -> None:
    result = runner.invoke(app, ["start", "--sidecar", sidecar, "--stages", "1"])
    assert result.exit_code == 1
    assert "stage_not_profiled" in result.stderr and "Traceback" not in result.output


def test_unknown_capture_status_exits_1(sidecar: str) -> None:
    result = runner.invoke(app, ["status", "nope", "--sidecar", sidecar])
    assert (result.exit_code, "capture_not_found" in result.stderr) == (1, True)


def test_bad_stage_list_is_a_usage_error() -> None:
    result = runner.invoke(app, ["start", "--stages", "a,b"])
    assert result.exit_code == 2


def test_unreachable_sidecar_exits_1() -> None:
    result = runner.invoke(app, ["list", "--sidecar", f"http://127.0.0.1:{free_port()}"])
    assert (result.exit_code, "sidecar_unreachable" in result.stderr) == (1, True)


def _capture_until_ctrl_c(sidecar: str) -> subprocess.Popen[str]:
    """``omni-sidecar capture`` on stage 0 with no window: it runs until SIGINT, as from a terminal."""
    return subprocess.Popen(
        [sys.executable, "-m", "sidecar", "capture", "--sidecar", sidecar, "--stages", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=ctrl_c_as_in_a_terminal,  # a shell's & would ignore it
    )  # fmt: skip


def test_capture_until_ctrl_c_still_stops_and_reports(sidecar: str, emu_url: str) -> None:
    proc = _capture_until_ctrl_c(sidecar)
    try:
        seen = ""
        while "Ctrl-C" not in seen:
            line = proc.stdout.readline() if proc.stdout else ""
            assert line, f"capture ended early:\n{seen}"
            seen += line
        _request(emu_url)  # the capture is active: the window records work
        proc.send_signal(signal.SIGINT)
        seen += proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, seen
    assert "completed" in seen and "trace_rank0.json.gz" in seen



def _faults(emu_url: str, **knobs: Any) -> None:
    httpx.post(f"{emu_url}/emulator/faults", json=knobs, timeout=30, trust_env=False).raise_for_status()


def test_ctrl_c_while_the_start_is_in_flight_stops_the_capture_it_started(sidecar: str, emu_url: str) -> None:
    # Ctrl-C is held while the start request is out: raised inside it, the CLI would never learn the
    # id of the capture the sidecar started, and that capture would record until its lease ran out
    _faults(emu_url, start_delay_s=4.0)
    proc = _capture_until_ctrl_c(sidecar)
    try:
        with SidecarClient(sidecar, timeout=30) as client:
            known = {c.id for c in client.list_captures()}

            def starting() -> list[Any]:
                return [c for c in client.list_captures() if c.id not in known and c.state.value == "starting"]

            deadline = time.monotonic() + 60
            while not starting() and time.monotonic() < deadline:
                time.sleep(0.05)
            (cap,) = starting()
            proc.send_signal(signal.SIGINT)
            assert client.get_capture(cap.id).state.value == "starting"  # the signal came inside the start
            seen = proc.communicate(timeout=120)[0]
            final = client.get_capture(cap.id)
    finally:
        if proc.poll() is None:
            proc.kill()
        _faults(emu_url, start_delay_s=0.0)
    assert ("stopping" in seen, "interrupted" in seen, final.terminal) == (True, False, True), seen
    assert final.stop_reason is not None and final.stop_reason.value != "lease_expired", final

def _past_the_lease(cap: Any) -> bool:
    """Still active, with a heartbeat more than one lease after the start."""
    beat, started = cap.last_heartbeat_at, cap.started_at
    return cap.state.value == "active" and beat is not None and (beat - started).total_seconds() > cap.lease_s


def test_a_killed_capture_cli_leaves_nothing_recording(sidecar: str) -> None:
    # the window is the server's: duration_s and a lease the CLI heartbeats, so kill -9 of the CLI
    # ends the capture when the lease runs out, not never
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "capture", "--sidecar", sidecar, "--stages", "0", "--duration", "600",
         "--lease", "3", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        with SidecarClient(sidecar, timeout=30) as client:
            deadline = time.monotonic() + 60
            live = []
            while not live and time.monotonic() < deadline:
                live = [c for c in client.list_captures() if not c.terminal]
                time.sleep(0.2)
            assert live, "the CLI never started a capture"
            cap = live[0]
            # heartbeats keep it active past one lease
            still = client.get_capture(cap.id)
            while not _past_the_lease(still) and time.monotonic() < deadline + 60:
                time.sleep(0.2)
                still = client.get_capture(cap.id)
            assert _past_the_lease(still), still
            proc.kill()
            proc.wait(timeout=30)
            final = client.wait_capture(cap.id, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (cap.duration_s, cap.lease_s) == (600, 3)
    assert (final.terminal, final.stop_reason.value if final.stop_reason else None) == (True, "lease_expired")


def test_capture_duration_is_sent_to_the_server(sidecar: str, emu_url: str) -> None:
    with _traffic(emu_url):
        result = runner.invoke(app, ["capture", "--sidecar", sidecar, "--stages", "2", "--duration", "1", "--json"])
    cap = json.loads(result.stdout[result.stdout.index("{"):])
    # the server ended it after the duration; the exit follows the verdict (a loaded host's 1 s window
    # can miss the traffic: `empty`, exit 1 — the table tests above hold a request in their window)
    ok = all(v["verdict"] == "ok" for v in cap["verdicts"])
    got = (cap["duration_s"], cap["stop_reason"], cap["lease_s"] <= 60, result.exit_code)
    assert got == (1.0, "duration", True, 0 if ok else 1), result.output


class _Output:
    """Everything a child writes, read as it comes: a terminal's progress line is redrawn in place
    and never ends a line, so it is read in chunks (terminal escapes dropped)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._out = proc.stdout
        self._chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while chunk := self._out.read1(4096):  # type: ignore[attr-defined]
            self._chunks.append(chunk)

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(self._chunks).decode(errors="replace"))


@contextlib.contextmanager
def _delayed_capture(sidecar: str, steps: int, command: str = "capture", *extra: str,
                     ) -> Iterator[tuple[subprocess.Popen[bytes], _Output, SidecarClient, Any]]:
    """``COMMAND --delay-steps STEPS`` (capture or start) on a terminal (rich told so), on an emulator with no load: its
    start waits (state ``starting``) until the test ends it; the process, its output, a client, the
    capture. The process is killed if the test leaves it running."""
    env = {**os.environ, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", command, "--sidecar", sidecar, "--stages", "0", "--delay-steps", str(steps),
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        preexec_fn=ctrl_c_as_in_a_terminal,  # a shell's & (CI) would leave it ignoring the test's Ctrl-C
    )  # fmt: skip
    shown = _Output(proc)
    try:
        with SidecarClient(sidecar, timeout=30) as client:
            def waiting() -> list[Any]:
                return [c for c in client.list_captures(2) if c.state.value == "starting" and c.delay_steps == steps]

            assert poll(waiting), shown.text()
            yield proc, shown, client, waiting()[0]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_capture_shows_its_wait_for_delay_steps_on_a_terminal(sidecar: str) -> None:
    # The terminal is told what the command waits for and since when; before, nothing at all.
    with _delayed_capture(sidecar, 5) as (proc, shown, client, cap):
        line = f"capture {cap.id}: waiting for 5 engine steps before the start"
        said = poll(lambda: line in shown.text(), timeout=30)
        client.stop_capture(cap.id)  # ends the wait at once: nothing was sent upstream
        proc.wait(timeout=60)
    assert said, shown.text()


def test_capture_shows_its_steps_window_and_the_time_so_far_on_a_terminal(sidecar: str) -> None:
    # A steps window on an idle server waits for load; before, its terminal showed no line and no
    # time (only a window of seconds had one), so a wait of minutes looked like a hang.
    env = {**os.environ, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "capture", "--sidecar", sidecar, "--stages", "0", "--steps", "40",
         "--count-steps"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        preexec_fn=ctrl_c_as_in_a_terminal)  # fmt: skip
    shown = _Output(proc)
    try:
        line = re.compile(r"capture (\S+): profiling until the server has run 40 engine steps\s+\d+:\d\d:\d\d")
        assert poll(lambda: line.search(shown.text()) is not None, timeout=60), shown.text()
        with SidecarClient(sidecar, timeout=30) as client, contextlib.suppress(CaptureStateError):
            client.stop_capture(line.search(shown.text()).group(1))  # (or the idle window ended itself)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (rc in (0, 1), "Traceback" in shown.text()) == (True, False), shown.text()


@pytest.mark.parametrize(("command", "steps"), [("capture", 7), ("start", 9)])
def test_ctrl_c_while_a_delayed_start_waits_cancels_it_at_once(sidecar: str, command: str, steps: int) -> None:
    # Ctrl-C is held while a start is in flight (so no capture is left unknown); for a start that
    # waits for its steps that was minutes of a dead key (capture), or it left a capture that would
    # start later unknown to anyone (start). Now it stops the waiting capture: the start is
    # cancelled, nothing was sent upstream, and the command ends.
    with _delayed_capture(sidecar, steps, command) as (proc, shown, client, cap):
        assert poll(lambda: f"capture {cap.id}: waiting" in shown.text(), timeout=30), shown.text()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
        cap = client.get_capture(cap.id)
    assert (rc != 0, cap.state.value, [e.code for e in cap.errors], cap.started_at) == (
        True, "failed", ["start_cancelled"], None), shown.text()
    assert "start cancelled by Ctrl-C" in shown.text() and "Traceback" not in shown.text(), shown.text()


def test_ctrl_c_cancels_a_delayed_start_with_json_output_too(sidecar: str) -> None:
    # --json shows no waiting line; the wait was not polled then, and a held Ctrl-C did nothing
    with _delayed_capture(sidecar, 11, "capture", "--json") as (proc, shown, client, cap):
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
        cap = client.get_capture(cap.id)
    assert (rc != 0, cap.state.value, [e.code for e in cap.errors]) == (True, "failed", ["start_cancelled"]), \
        shown.text()


def test_every_verdict_has_a_colour_in_the_table() -> None:
    from sidecar.cli._render import VERDICT_STYLES
    from sidecar.control.models import Verdict

    assert {v.value: bool(VERDICT_STYLES.get(v.value)) for v in Verdict} == {v.value: True for v in Verdict}


@pytest.mark.parametrize(("kind", "verdicts", "code"), [
    ("nsys", ["unverified"], 0),            # nsys writes the report itself: unverified is the expected outcome
    ("nsys", ["unverified", "missing"], 1),
    ("torch", ["unverified"], 1),           # a torch stage the sidecar cannot see is a real gap
])
def test_only_nsys_captures_whose_stages_are_unverified_exit_0(kind, verdicts, code):
    from datetime import datetime, timezone

    from sidecar.cli.capture import exit_code
    from sidecar.control.models import Capture, StageVerdict

    cap = Capture(id="20261201-000000-abcdef", upstream="http://127.0.0.1:8091", stages=list(range(len(verdicts))),
                  kind=kind, state="degraded", created_at=datetime.now(timezone.utc),
                  verdicts=[StageVerdict(stage_id=i, verdict=v) for i, v in enumerate(verdicts)])
    assert exit_code(cap) == code
