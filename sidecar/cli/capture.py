"""CLI: ``omni-sidecar start|stop|status|capture|list`` — talk to a running sidecar through
``SidecarClient``; show a spinner while a stop flushes and a verdict table at the end.
Exit code: the one rule of sidecar/control/outcome.py: 0 once the traces were checked ok, 1 for
degraded/failed or any error, 3 for traces not checked yet (still collecting at ``--timeout``).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.markup import escape

from sidecar.cli._app import app, cli_errors, console, ctrl_c_held, finite, not_blank, parse_stage_list, waiting_line
from sidecar.cli._app import StagesOpt, TimeoutOpt, WaitOpt, WindowOpt  # shared options
from sidecar.cli._layout import Column, print_table, print_text
from sidecar.cli._render import STATE_STYLES, print_plan, print_steps, print_verdict_table, print_verdicts
from sidecar.cli._render import print_window_metrics, styled, styled_cell
from sidecar.client import DEFAULT_URL, SidecarClient
from sidecar.control.budget import PROBE_LABEL, Plan
from sidecar.control.models import Capture, CaptureState, Verdict
from sidecar.control.budget import MIN_BUDGET_MB, MIN_STOP_S
from sidecar.control.outcome import Outcome, outcome_of
from sidecar.control.outcome import exit_code as outcome_exit_code
from sidecar.errors import SidecarError

T = TypeVar("T")

SidecarOpt = Annotated[
    str, typer.Option("--sidecar", envvar="OMNI_SIDECAR_URL", help="URL of a running `omni-sidecar serve`")
]
TokenFileOpt = Annotated[
    Optional[Path],
    typer.Option("--token-file", envvar="OMNI_SIDECAR_TOKEN_FILE", help="file holding the bearer token"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]
WideOpt = Annotated[bool, typer.Option("--wide", help="one table row per session folder, as wide as its values")]
IdArg = Annotated[
    Optional[str], typer.Argument(callback=not_blank, help="capture id or a unique start of it (default: the active capture)")
]
# the lease `capture` asks for and heartbeats: a killed CLI leaves a capture recording at most this long
MAX_CLI_LEASE_S = 60.0
LabelOpt = Annotated[Optional[str], typer.Option("--label", help="a name for the capture, shown in lists")]
StepsOpt = Annotated[
    Optional[int],
    typer.Option("--steps", min=1, help="a window of N engine steps, ended by the server's own max_iterations cap "
                 "(omni-sidecar render --steps N writes it; refused where there is none, see --count-steps)"),
]
CountStepsOpt = Annotated[bool, typer.Option(
    "--count-steps", help="with --steps: let the sidecar count the server's /metrics and stop at N (best effort: "
    "the engines step on while the stop travels; the result says how many steps each trace holds)")]
DelayStepsOpt = Annotated[
    Optional[int], typer.Option("--delay-steps", min=0, help="start once the server has run N engine steps")
]
ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", help="record this capture with a stage preset's torch options (memory, shapes, stacks, ops, light), "
    "sent as the start's profiler_kwargs: plain vLLM 0.33 or newer; other servers need `omni-sidecar render "
    "--profile NAME` and a restart")]
StartAtOpt = Annotated[Optional[str], typer.Option(
    "--start-at", help="send the start at this time: +S (seconds from now on the sidecar's clock), epoch seconds "
    "or ISO with zone (2026-12-01T14:05:00Z); answered at once, state starting")]


def _client(sidecar: str, token_file: Path | None) -> SidecarClient:
    from sidecar.config.settings import SidecarSettings

    token = SidecarSettings(token_file=token_file).read_token() if token_file else None
    return SidecarClient(sidecar, token=token)


def print_capture(cap: Capture, as_json: bool, wide: bool = False) -> None:
    if as_json:
        console.print_json(cap.model_dump_json())
        return
    title = f"capture {cap.id} — {styled(cap.state.value, STATE_STYLES)}"
    if wide:
        print_verdict_table(console, title, cap.verdicts,
                            "; ".join(e.message for e in cap.errors) or "no verdicts yet")
    else:
        print_text(console, title)
        print_verdicts(console, cap.verdicts, indent="  ")
    if cap.stop_reason:
        print_text(console, f"stop reason: {cap.stop_reason.value}", markup=False)
    print_steps(console, cap)
    print_window_metrics(console, cap.window_metrics)
    if cap.notes:  # what the window did and the way to what was asked (the web page's "Notes")
        print_text(console, "notes:")
        for note in cap.notes:
            print_text(console, note, indent="  - ", hang="    ", markup=False)
    if only_expected_unverified(cap):
        print_text(console, "note: nsys writes its report itself, so the sidecar cannot check it (unverified, as "
                   "expected); exit 0. Look for the .nsys-rep where `nsys profile -o` points.", markup=False)
    elif outcome_of(cap) is Outcome.unchecked:
        print_text(console, f"note: the traces are not checked yet (the capture is {cap.state.value}); exit "
                   f"{exit_code(cap)}. `omni-sidecar status {cap.id}` says how they ended.", markup=False)
    for err in cap.errors:
        print_text(console, f"[red]{escape(err.code)}[/]: {escape(err.message)}", hang="  ")


def print_capture_findings(client: SidecarClient, cap: Capture) -> None:
    """After the verdicts: the findings of the capture's summary (the server computes it when the
    capture ends). A capture without a readable trace, or a sidecar without the summarizer, has none."""
    if not cap.terminal or not any(v.verdict is Verdict.ok for v in cap.verdicts):
        return
    from sidecar.cli.summarize import print_findings, print_memory

    try:
        with waiting_line(f"capture {cap.id}: the findings (the sidecar analyses a capture's traces once)"):
            summary = client.summary(cap.id)
    except SidecarError:
        return
    print_findings(summary.findings)
    print_memory(summary.memory, summary.snapshots, summary.memory_ops[:5])  # a memory profile's figures, per device


def only_expected_unverified(cap: Capture) -> bool:
    """Ok without being completed: an nsys capture whose stages are ``unverified`` as expected
    (nsys writes the report itself; the rule is sidecar/control/outcome.py's)."""
    return outcome_of(cap) is Outcome.ok and cap.state is not CaptureState.completed


def exit_code(cap: Capture) -> int:
    """The one rule's exit code (sidecar/control/outcome.py): 0 ok, 1 failed, 3 not checked yet."""
    return outcome_exit_code(outcome_of(cap))


def wait_with_progress(client: SidecarClient, capture_id: str, timeout: float | None, quiet: bool) -> Capture:
    """Poll until terminal, showing a spinner with elapsed time and the current state (on a
    terminal; rich shows nothing when the output is piped)."""
    if quiet:
        return client.wait_capture(capture_id, timeout=timeout)
    with waiting_line(f"capture {capture_id}: stopping") as say:
        return client.wait_capture(capture_id, timeout=timeout, poll_s=0.25,
                                   on_poll=lambda cap: say(f"capture {capture_id}: {cap.state.value}"))


DELAY_POLL_S = 0.5  # how often a delayed start's waiting line asks for its capture


def start_with_progress(client: SidecarClient, watcher: SidecarClient, stages: list[int] | None, *,
                        delay_steps: int | None, quiet: bool, interrupted: Callable[[], bool] = lambda: False,
                        **opts: Any) -> Capture:
    """``client.start_capture``; with ``delay_steps``, showing on a terminal what it waits for and the
    time: the start is answered once the server has run them (minutes on an idle server, up to the
    sidecar's ``steps_wait_s``). ``watcher`` (a second client) finds the capture meanwhile; once
    ``interrupted()`` (a held Ctrl-C), it stops that capture, which cancels the start (nothing was
    sent upstream): the start then raises ``start_cancelled``."""
    if not delay_steps:
        return client.start_capture(stages, delay_steps=delay_steps, **opts)
    # polled with --json too (no line then): a held Ctrl-C must still cancel the wait
    waiting = f"waiting for {delay_steps} engine steps before the start"
    cancelled: list[str] = []

    def progress() -> str:
        cid = _delayed_capture(watcher, delay_steps)
        if cid is None:
            return waiting
        if interrupted() and not cancelled:
            with contextlib.suppress(SidecarError):  # already started or ended: the caller stops it then
                watcher.stop_capture(cid)
                cancelled.append(cid)
        return f"capture {cid}: " + ("Ctrl-C: cancelling the start" if cancelled else waiting)

    return _while_saying(lambda: client.start_capture(stages, delay_steps=delay_steps, **opts), waiting,
                         progress, DELAY_POLL_S, name="start", quiet=quiet)


def _start_or_cancel(client: SidecarClient, watcher: SidecarClient, stages: list[int] | None, *, quiet: bool,
                     interrupted: Callable[[], bool], **opts: Any) -> Capture:
    """``start_with_progress``; a delayed start that Ctrl-C cancelled (nothing was sent upstream) is
    said and ends the command as Ctrl-C does."""
    try:
        return start_with_progress(client, watcher, stages, quiet=quiet, interrupted=interrupted, **opts)
    except SidecarError as err:
        if err.code == "start_cancelled" and interrupted():
            if not quiet:
                print_text(console, f"capture {err.details.get('capture_id', '')}: start cancelled by Ctrl-C while it "
                                    "waited for its steps; nothing was sent upstream", markup=False)
            raise KeyboardInterrupt from None
        raise


def _delayed_capture(watcher: SidecarClient, delay_steps: int) -> str | None:
    """The capture whose start waits for its delay (one capture at a time: the newest, state
    ``starting``), or None. The record says which capture waits, not how many steps ran so far."""
    try:
        newest = watcher.list_captures(2)
    except SidecarError:  # a progress line never fails the start
        return None
    ours = [c for c in newest if c.state is CaptureState.starting and c.delay_steps == delay_steps]
    return ours[0].id if ours else None


@app.command()
def start(
    sidecar: SidecarOpt = DEFAULT_URL,
    stages: StagesOpt = None,
    duration: Annotated[
        Optional[float], typer.Option("--duration", callback=finite, help="the server stops it after N s (default: at `omni-sidecar "
                                      "stop`, or after the sidecar's `OMNI_SIDECAR_MAX_DURATION_S` where it sets one)")
    ] = None,
    lease: Annotated[
        Optional[float],
        typer.Option("--lease", min=1, callback=finite, help="the server stops it after N s without a heartbeat (default: the "
                     "sidecar's `OMNI_SIDECAR_DEFAULT_LEASE_S`, no lease unless it sets one)"),
    ] = None,
    label: LabelOpt = None,
    steps: StepsOpt = None,
    delay_steps: DelayStepsOpt = None,
    count_steps: CountStepsOpt = False,
    profile: ProfileOpt = None,
    start_at: StartAtOpt = None,
    token_file: TokenFileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Start a capture on the sidecar (one at a time; the stage set is fixed now)."""
    with cli_errors(), _client(sidecar, token_file) as client, _client(sidecar, token_file) as watcher:
        at = None if start_at is None else _on_sidecar_clock(client, start_at)
        with ctrl_c_held() as interrupted:  # held: a capture started is never left unknown (its id is printed)
            cap = _start_or_cancel(client, watcher, parse_stage_list(stages), delay_steps=delay_steps, quiet=as_json,
                                   interrupted=interrupted, label=label, duration_s=duration, lease_s=lease,
                                   steps=steps, start_at=at, steps_bound="count" if count_steps else None,
                                   profile=profile)
        if interrupted() and not as_json:
            print_text(console, f"Ctrl-C came as the start was answered: capture {cap.id} is {cap.state.value}; "
                                f"`omni-sidecar stop {cap.id}` ends it", markup=False)
        if as_json:
            console.print_json(cap.model_dump_json())
        elif cap.start_at is not None and cap.state.value == "starting":
            when = cap.start_at.astimezone().strftime("%H:%M:%S.%f")[:-3]
            print_text(console, f"capture [bold]{cap.id}[/] starting: stages {escape(str(cap.stages))}, sent at {when} (the "
                       "sidecar's clock); `omni-sidecar stop` before then cancels it")
        else:
            print_text(console, f"capture [bold]{cap.id}[/] {cap.state.value}: stages {escape(str(cap.stages))}")


def _on_sidecar_clock(client: SidecarClient, text: str) -> float:
    """``--start-at`` as epoch seconds on the sidecar's clock: ``+S`` from its now, else as written."""
    from sidecar.control.schedule import parse_start_at

    now = int(client.clock()["realtime_ns"]) / 1e9 if text.strip().startswith("+") else None
    return parse_start_at(text, now=now)


@app.command()
def stop(
    capture_id: IdArg = None,
    sidecar: SidecarOpt = DEFAULT_URL,
    wait: WaitOpt = True,
    timeout: TimeoutOpt = None,
    token_file: TokenFileOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Stop a capture; show progress while the server flushes, then the verdicts (--no-wait: return at once)."""
    with cli_errors(), _client(sidecar, token_file) as client:
        capture_id = client.resolve_id(capture_id) if capture_id else _active_id(client)
        cap = client.stop_capture(capture_id)
        if wait:
            cap = wait_with_progress(client, capture_id, timeout, quiet=as_json)
            print_capture(cap, as_json, wide)
            if not as_json:
                print_capture_findings(client, cap)
            raise typer.Exit(exit_code(cap))
        if as_json:
            console.print_json(cap.model_dump_json())
        else:
            print_text(console, f"capture [bold]{cap.id}[/] {cap.state.value}; `omni-sidecar status {cap.id}` to follow")


def _active_id(client: SidecarClient) -> str:
    from sidecar.errors import CaptureNotFound

    for cap in client.list_captures():
        if not cap.terminal:
            return cap.id
    raise CaptureNotFound("no active capture on this sidecar; pass a capture id (see `omni-sidecar list`)")


@app.command()
def status(
    capture_id: Annotated[
        Optional[str], typer.Argument(callback=not_blank, help="capture id or a unique start of it (default: the newest)")
    ] = None,
    sidecar: SidecarOpt = DEFAULT_URL,
    token_file: TokenFileOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Show one capture: state, verdicts, session folders and trace files."""
    with cli_errors(), _client(sidecar, token_file) as client:
        if capture_id is None:
            captures = client.list_captures()
            if not captures:
                from sidecar.errors import CaptureNotFound

                raise CaptureNotFound("no captures yet; start one with `omni-sidecar capture`")
            cap = captures[0]
        else:
            cap = client.get_capture(client.resolve_id(capture_id))
        print_capture(cap, as_json, wide)
        raise typer.Exit(exit_code(cap))


@app.command("list")
def list_(
    sidecar: SidecarOpt = DEFAULT_URL,
    token_file: TokenFileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List captures, newest first (history survives sidecar restarts)."""
    with cli_errors(), _client(sidecar, token_file) as client:
        captures = client.list_captures()
        if as_json:
            console.print_json(json.dumps([c.model_dump(mode="json") for c in captures]))
            return
        upstreams = sorted({c.upstream for c in captures})
        where = f" · upstream {upstreams[0]}" if len(upstreams) == 1 else ""
        columns = [Column("id"), Column("state"), Column("stages"), Column("label"), Column("created"),
                   Column("stop reason"), *([Column("upstream")] if len(upstreams) > 1 else [])]
        rows = [[
            c.id,
            styled_cell(c.state.value, STATE_STYLES),
            ",".join(map(str, c.stages)),
            c.label or "",
            c.created_at.astimezone().strftime("%m-%d %H:%M:%S"),  # the id has the year (UTC)
            c.stop_reason.value if c.stop_reason else "",
            *([c.upstream] if len(upstreams) > 1 else []),
        ] for c in captures]
        print_table(console, f"captures on {sidecar}{where}", columns, rows, empty="no captures yet")


@app.command()
def capture(
    sidecar: SidecarOpt = DEFAULT_URL,
    stages: StagesOpt = None,
    duration: WindowOpt = None,
    label: LabelOpt = None,
    timeout: TimeoutOpt = None,
    lease: Annotated[
        float,
        typer.Option("--lease", min=1, max=MAX_CLI_LEASE_S, callback=finite,
                     help="the server stops it after N s without a heartbeat (this command sends them)"),
    ] = MAX_CLI_LEASE_S,
    steps: StepsOpt = None,
    delay_steps: DelayStepsOpt = None,
    count_steps: CountStepsOpt = False,
    profile: ProfileOpt = None,
    token_file: TokenFileOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Start, wait DURATION or STEPS (or until Ctrl-C), stop, wait for the traces, print the verdicts.

    The window is the server's: it gets the duration and a lease this command heartbeats, so a
    killed CLI leaves nothing recording (the lease runs out within --lease seconds)."""
    with cli_errors(), _client(sidecar, token_file) as client, _client(sidecar, token_file) as watcher:
        cap = None
        try:
            with ctrl_c_held() as interrupted:  # Ctrl-C during the start stops the capture once it has one
                cap = _start_or_cancel(client, watcher, parse_stage_list(stages), delay_steps=delay_steps,
                                       quiet=as_json, interrupted=interrupted, label=label, duration_s=duration,
                                       lease_s=lease, steps=steps, steps_bound="count" if count_steps else None,
                                       profile=profile)
            if not as_json:
                print_text(console, f"capture [bold]{cap.id}[/] {cap.state.value}: stages {escape(str(cap.stages))}")
            if interrupted():
                raise KeyboardInterrupt
            if steps is not None and not as_json:
                console.print(f"profiling until the server has run {steps} engine steps; press Ctrl-C to stop")
            elif duration is None and not as_json:
                console.print("profiling; press Ctrl-C to stop")
            _hold(client, cap.id, duration, lease, quiet=as_json, steps=steps)
        except KeyboardInterrupt:
            if cap is None:  # before the start was sent: nothing to stop
                raise
            if not as_json:
                console.print("stopping")
        # stop even when interrupted: never leave a profiler running upstream
        client.stop_capture(cap.id)
        cap = wait_with_progress(client, cap.id, timeout, quiet=as_json)
        print_capture(cap, as_json, wide)
        if not as_json:
            print_capture_findings(client, cap)
        raise typer.Exit(exit_code(cap))


END_POLL_S = 0.5  # how often a held window looks whether the server ended it


def _heartbeat_until(client: SidecarClient, capture_id: str, seconds: float | None, lease: float) -> None:
    """Heartbeat every third of the lease until ``seconds`` pass (None: forever) or the capture is
    no longer active (the server's duration or a ``steps`` window ended it, or someone stopped it),
    looked at every ``END_POLL_S``: a window the server ended is said then, not at the next heartbeat."""
    from sidecar.errors import CaptureStateError

    now = time.monotonic()
    end = None if seconds is None else now + seconds
    beat = now + lease / 3
    while end is None or time.monotonic() < end:
        left = math.inf if end is None else end - time.monotonic()
        time.sleep(max(0.0, min(END_POLL_S, left, beat - time.monotonic())))
        try:
            if time.monotonic() >= beat:
                client.heartbeat(capture_id)
                beat = time.monotonic() + lease / 3
            elif client.get_capture(capture_id).state is not CaptureState.active:
                return
        except CaptureStateError:
            return


def _hold(client: SidecarClient, capture_id: str, seconds: float | None, lease: float, quiet: bool,
          steps: int | None = None) -> None:
    """Heartbeat the window until it ends, on a terminal with a line saying what it waits for and
    for how long (a steps window on an idle server may wait minutes)."""
    if quiet:
        _heartbeat_until(client, capture_id, seconds, lease)
        return
    what = (f"profiling for {seconds:g}s" if seconds is not None else
            f"profiling until the server has run {steps} engine steps" if steps is not None else "profiling")
    with waiting_line(f"capture {capture_id}: {what}"):
        _heartbeat_until(client, capture_id, seconds, lease)


PLAN_POLL_S = 1.0  # how often a plan's progress line asks for its probes
PLAN_SEEN = 16  # the newest captures it asks for: well above the probes of one plan (sidecar/control/budget.py)


def plan_with_progress(client: SidecarClient, watcher: SidecarClient, stages: list[int] | None, *, quiet: bool,
                       interrupted: Callable[[], bool] = lambda: False, stopped: list[str] | None = None,
                       **opts: Any) -> Plan:
    """``client.plan``, showing on a terminal which probe runs (its steps and state) and the time:
    a plan waits for each probe's steps, a minute or more on a slow or idle server. ``watcher`` (a
    second client) lists the captures the plan starts meanwhile; once ``interrupted()`` (a held
    Ctrl-C) it stops the plan's running probe (kept in ``stopped``), which ends the plan on the
    sidecar (a plan whose probe someone stopped is cancelled): before, the CLI exited and the plan
    went on probing, holding the capture slot."""
    stopped = [] if stopped is None else stopped
    try:
        before = {c.id for c in watcher.list_captures(PLAN_SEEN)}
    except SidecarError:
        before = set()

    def progress() -> str:
        if interrupted():
            _stop_probes(watcher, before, stopped)
            return "planning: Ctrl-C: stopping the plan's probe (Ctrl-C again: leave it to the sidecar)"
        return _plan_progress(watcher, before)

    return _while_saying(lambda: client.plan(stages, **opts), "planning: the first probe", progress,
                         PLAN_POLL_S, name="plan", quiet=quiet, wake=interrupted)


def _stop_probes(watcher: SidecarClient, before: set[str], stopped: list[str]) -> None:
    """Stop every probe capture the plan started (those not in ``before``) that is still live."""
    try:
        live = [c for c in watcher.list_captures(PLAN_SEEN)
                if c.id not in before and (c.label or "").startswith(PROBE_LABEL) and not c.terminal]
    except SidecarError:
        return
    for cap in live:
        with contextlib.suppress(SidecarError):  # ended meanwhile
            watcher.stop_capture(cap.id)
            if cap.id not in stopped:
                stopped.append(cap.id)


def _while_saying(call: Callable[[], T], first: str, progress: Callable[[], str], poll_s: float, *, name: str,
                  quiet: bool = False, wake: Callable[[], bool] | None = None) -> T:
    """``call()`` in a thread while the waiting line says ``first``, then ``progress()`` every
    ``poll_s`` (``quiet``: called, no line shown; ``wake()`` true: at once, not after ``poll_s``);
    its result, or what it raised, raised here in the caller's thread."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # raised in the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    with (contextlib.nullcontext(lambda _what: None) if quiet else waiting_line(first)) as say:
        thread.start()
        while thread.is_alive():
            if wake is None:
                thread.join(poll_s)
            else:  # in short waits, so a held Ctrl-C is acted on at once
                until = time.monotonic() + poll_s
                while thread.is_alive() and time.monotonic() < until and not wake():
                    thread.join(min(0.05, max(until - time.monotonic(), 0.0)))
            if thread.is_alive():
                say(progress())
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


def _plan_progress(watcher: SidecarClient, before: set[str]) -> str:
    try:
        probes = [c for c in watcher.list_captures(PLAN_SEEN)
                  if c.id not in before and (c.label or "").startswith(PROBE_LABEL)]
    except SidecarError:  # a progress line never fails the plan
        return "planning"
    if not probes:
        return "planning: the first probe"
    last = max(probes, key=lambda c: c.id)
    return f"planning: probe {len(probes)} ({last.steps} steps, {last.state.value})"


@app.command()
def plan(
    sidecar: SidecarOpt = DEFAULT_URL,
    stages: StagesOpt = None,
    budget_mb: Annotated[Optional[float], typer.Option("--budget-mb", min=MIN_BUDGET_MB, callback=finite, help="trace size on disk to fit")] = None,
    max_stop_s: Annotated[
        Optional[float], typer.Option("--max-stop-s", min=MIN_STOP_S, callback=finite, help="how long the server's stop may take")
    ] = None,
    refine: Annotated[bool, typer.Option(
        "--refine/--no-refine",
        help="a plan 8x or more beyond its longest probe probes once more at half its steps (at most 5 s of them)",
    )] = True,
    token_file: TokenFileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Probe captures of 1 and 2 engine steps (longer ones when those give no line), then the steps that fit.

    The server must be serving (a probe waits for its steps). The profiler flags are the
    server's, fixed at its start: the plan measures those it runs with."""
    with cli_errors(), _client(sidecar, token_file) as client, _client(sidecar, token_file) as watcher:
        stopped: list[str] = []
        with ctrl_c_held(again_leaves=True) as interrupted:  # Ctrl-C stops the probe the plan runs: the plan ends on the sidecar
            try:
                result = plan_with_progress(client, watcher, parse_stage_list(stages), quiet=as_json,
                                            interrupted=interrupted, stopped=stopped, budget_mb=budget_mb,
                                            max_stop_s=max_stop_s, refine=refine)
            except SidecarError:
                if not interrupted():
                    raise
                if not as_json:
                    print_text(console, "plan cancelled by Ctrl-C: " + (
                        f"its probe {', '.join(stopped)} was stopped; " if stopped else "") + "nothing was planned",
                        markup=False)
                raise KeyboardInterrupt from None
    if as_json:
        console.print_json(result.model_dump_json())
        return
    print_plan(console, result)
