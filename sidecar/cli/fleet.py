"""CLI: ``omni-sidecar fleet start|stop|capture --targets T,T,...`` — the same fan-out as the
rollout hook, by hand. A target is ``sidecar=URL`` (a bare URL is a sidecar) or ``upstream=URL``
(driven in-process; needs ``--deploy-config``). Exit code: the one rule of
sidecar/control/outcome.py over every target: 0 when every target's traces were checked ok, 1 when
any failed, 3 when none failed but some are not checked yet (still collecting at ``--timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path
from collections.abc import Iterator
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from sidecar.cli._app import EXIT_ERROR, app, cli_errors, console, err_console, finite, parse_stage_list
from sidecar.cli._app import StagesOpt, TimeoutOpt, WaitOpt, WindowOpt  # shared options
from sidecar.cli.slim import size_cap
from sidecar.cli._layout import Column, print_table, print_text
from sidecar.cli._render import STATE_STYLES, VERDICT_STYLES, print_verdicts, styled, styled_cell
from sidecar.control.models import CaptureState, Verdict
from sidecar.control.outcome import Outcome, exit_code
from sidecar.errors import FleetDurationInvalid, TargetInvalid
from sidecar.fleet import START_TIMEOUT_S

fleet_app = typer.Typer(
    name="fleet",
    help="Start, stop or run one capture on many replicas at once (sidecars or upstream servers).",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(fleet_app, name="fleet")

def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "omni-sidecar" / "fleet"


TargetsOpt = Annotated[
    str,
    typer.Option(
        "--targets",
        envvar="OMNI_SIDECAR_TARGETS",
        help="comma-separated: sidecar=http://h:8092 (or a bare URL) and/or upstream=http://h:8091",
    ),
]
DeployOpt = Annotated[
    Optional[Path], typer.Option("--deploy-config", help="deploy YAML of the upstream targets (upstream=URL only)")
]
FlavorOpt = Annotated[str, typer.Option("--flavor", help="upstream targets: omni or vllm (plain vLLM, no stages)")]
TokenFileOpt = Annotated[
    Optional[Path],
    typer.Option("--token-file", envvar="OMNI_SIDECAR_TOKEN_FILE", help="bearer token for the sidecar targets"),
]
StateDirOpt = Annotated[
    Optional[Path],
    typer.Option("--state-dir", help="journal of upstream targets' captures, so `fleet stop` can find them "
                 f"(default: `{_default_state_dir()}`, under $XDG_STATE_HOME when set, else ~/.local/state)"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON (every target in full) instead of a table")]
LabelOpt = Annotated[Optional[str], typer.Option("--label", help="a name for the captures, shown in lists")]
WideOpt = Annotated[bool, typer.Option("--wide", help="one table row per target and stage, as wide as its values")]
SharedOpt = Annotated[bool, typer.Option(
    "--allow-shared-dirs", help="run even where targets share a torch_profiler_dir (their verdicts are then ambiguous)")]
HostLocalOpt = Annotated[bool, typer.Option(
    "--dirs-host-local", help="the same dir path on different hosts is a different (host-local) folder")]
BudgetOpt = Annotated[float, typer.Option("--stop-budget", min=0.001, callback=finite, help="seconds each target's stop may take (s)")]
StartTimeoutOpt = Annotated[float, typer.Option(
    "--start-timeout", min=0.001, callback=finite, help="seconds a target may take to answer an open, a start, a read or a heartbeat")]
KindOpt = Annotated[str, typer.Option("--kind", help="torch (trace files) or nsys (profiler: cuda stages)")]
StartAtOpt = Annotated[Optional[str], typer.Option(
    "--start-at", help="start every target at this wall-clock time: +S (seconds from now), epoch seconds, "
    "or ISO with zone (2026-12-01T14:05:00Z); each sidecar is told it ahead, on its own clock")]
# Up to this many targets the table has a row per target; beyond it, one roll-up table.
ROWS_MAX = 16


def _fleet(targets: str | list[Any], stages: str | None, deploy_config: Path | None, flavor: str,
           token_file: Path | None, state_dir: Path | None, allow_shared_dirs: bool = False,
           dirs_host_local: bool = False, stop_budget_s: float = 1800.0,
           start_timeout_s: float = START_TIMEOUT_S) -> Any:
    from sidecar.fleet import Fleet

    token = None
    if token_file is not None:
        from sidecar.config.settings import SidecarSettings

        token = SidecarSettings(token_file=token_file).read_token()
    if flavor not in ("omni", "vllm"):
        raise TargetInvalid(f"--flavor must be omni or vllm, got {flavor!r}")
    fleet = Fleet(targets, stages=parse_stage_list(stages), deploy_config=deploy_config, flavor=flavor,  # type: ignore[arg-type]
                  token=token, state_dir=state_dir or _default_state_dir(),
                  allow_shared_dirs=allow_shared_dirs, dirs_host_local=dirs_host_local, stop_budget_s=stop_budget_s,
                  start_timeout_s=start_timeout_s)
    return fleet


@contextlib.contextmanager
def _owning_state_dir(fleet: Any) -> Iterator[None]:
    """With upstream targets, this command's controllers journal them in the fleet's state dir:
    one command at a time there (a second would recover, and so stop, the first's captures)."""
    if not any(t.kind.value == "upstream" for t in fleet.targets):
        yield
        return
    from sidecar.control.journal import StateDirLock

    lock = StateDirLock(Path(fleet.state_dir))
    lock.acquire(command="omni-sidecar fleet")
    if lock.swept_note():
        err_console.print(f"omni-sidecar: {lock.swept_note()}", highlight=False, markup=False)
    try:
        yield
    finally:
        lock.release()


def _start_at(text: str | None) -> float | None:
    from sidecar.fleet import check_start_at, parse_start_at

    # Read once, when the command starts: "+2" means two seconds from now, not from the fan-out.
    return None if text is None else check_start_at(parse_start_at(text))


def _print(fc: Any, as_json: bool, wide: bool = False, *, nothing_recording: list[str] | None = None,
           not_this_fleets: dict[str, str] | None = None) -> None:
    if as_json:  # `fleet archive` / `fleet timeline` / `fleet skew` read this back
        console.print_json(json.dumps({
            "label": fc.label, "ok": fc.ok, "outcome": fc.traces.value, "stages": fc.stages, "start_at": fc.start_at,
            "released_at": fc.released_at, "key": fc.key, "lease_s": fc.lease_s,
            "targets": [{**r.model_dump(mode="json"), "folders": r.folders, "outcome_of_traces": r.traces.value}
                        for r in fc.targets.values()],
            **({"nothing_recording": nothing_recording} if nothing_recording is not None else {}),
            **({"not_this_fleets": not_this_fleets} if not_this_fleets is not None else {}),
        }))
        return
    if len(fc.targets) > ROWS_MAX:
        _print_rollup(fc)
        return
    ok = sum(r.ok for r in fc.targets.values())
    unchecked = sum(r.traces is Outcome.unchecked for r in fc.targets.values())
    title = f"fleet {fc.label or ''}".rstrip() + f": {ok} of {len(fc.targets)} ok"
    if unchecked:
        title += f", {unchecked} not checked yet"
    if wide:
        _print_wide(title, fc)
        return
    # A target URL, a capture id and a folder are never cut: each on its own line.
    print_text(console, title, markup=False)
    for r in fc.targets.values():
        state = r.state.value if r.state else "-"
        print_text(console, f"{escape(r.target)}  {escape(r.outcome.value)}  {styled(state, STATE_STYLES)}")
        if r.capture_id:
            print_text(console, f"capture {r.capture_id}", indent="  ", markup=False)
        if r.error:
            print_text(console, f"[red]{escape(r.error.code)}[/]: {escape(r.error.message)}", indent="  ", hang="    ")
        _print_sweep(r)
        print_verdicts(console, r.verdicts, indent="  ")


def _print_sweep(r: Any) -> None:
    """What the end-of-call sweep found on this target, or why it could not look."""
    if r.sweep is None:
        return
    if r.sweep.stopped:
        print_text(console, f"[yellow]swept[/]: stopped {escape(', '.join(r.sweep.stopped))} (carried this fleet's "
                   "key and was still live: a start that landed late)", indent="  ", hang="    ")
    if r.sweep.error:
        print_text(console, f"[red]not swept[/]: {escape(r.sweep.error.message)}; "
                   f"{escape(r.sweep.ends_by or '')}", indent="  ", hang="    ")


def _print_wide(title: str, fc: Any) -> None:
    """``--wide``: a row per target and stage, at the table's natural width."""
    columns = [Column("target"), Column("outcome"), Column("capture"), Column("state"), Column("stage"),
               Column("verdict"), Column("reason", prose=True), Column("session folders")]
    rows: list[list[str | Text]] = []
    for r in fc.targets.values():
        state = styled_cell(r.state.value if r.state else "-", STATE_STYLES)
        head = [r.target, r.outcome.value, r.capture_id or "-", state]
        error = f"{r.error.code}: {r.error.message}" if r.error else ""
        if not r.verdicts:
            rows.append([*head, "-", "-", error, "-"])
        for v in r.verdicts:
            verdict = styled_cell(v.verdict.value if v.verdict else "-", VERDICT_STYLES)
            reason = error or (v.reason if v.verdict is not Verdict.ok else "") or ""
            folders = "\n".join(s.local_path or s.path for s in v.sessions) or "-"
            rows.append([*head, str(v.stage_id), verdict, reason, folders])
    print_table(console, title, columns, rows, wide=True)


def _print_rollup(fc: Any) -> None:
    """Counts and the worst few, a line each: a target URL is never cut."""
    roll = fc.rollup()

    def line(text: str) -> None:
        print_text(console, text, hang="    ")

    unchecked = f", {roll['unchecked']} not checked yet" if roll["unchecked"] else ""
    line(f"fleet {escape(fc.label or '')}".rstrip()
         + f": {roll['ok']} of {roll['targets']} ok{unchecked} (--json for every target)")
    for group in ("outcomes", "states", "verdicts"):
        for name, count in roll[group].items():
            line(f"  {group[:-1]} {escape(str(name))}: {count}")
    for what in ("slowest_start", "slowest_stop"):
        for x in roll[what] or []:
            line(f"  {what.replace('_', ' ')}: {x['seconds']:.3f}s {escape(x['target'])}")
    for f in roll["failures"]:
        line(f"  [red]{escape(f['outcome'])}[/]: {escape(f['target'])}: {escape(f['reason'])}")
    if roll["failures_total"] > len(roll["failures"]):
        line(f"  ... and {roll['failures_total'] - len(roll['failures'])} more failures")


def _exit(fc: Any, as_json: bool = False) -> None:
    """Exit by the one rule over every target (sidecar/control/outcome.py), saying why where it is not plain."""
    outcome = fc.traces
    if not as_json and outcome is Outcome.ok and any(r.state is not CaptureState.completed for r in fc.targets.values()):
        print_text(console, "note: nsys writes its reports itself, so the sidecar cannot check them (unverified, "
                   "as expected); exit 0. Look for the .nsys-rep files where each `nsys profile -o` points.",
                   markup=False)
    elif not as_json and outcome is Outcome.unchecked:
        print_text(console, "note: some targets' traces are not checked yet (still being checked when --timeout ran "
                   f"out); exit {exit_code(outcome)}, not 0: nothing says they are ok.", markup=False)
    raise typer.Exit(exit_code(outcome))


@fleet_app.command("start")
def start(
    targets: TargetsOpt,
    stages: StagesOpt = None,
    duration: Annotated[
        Optional[float],
        typer.Option("--duration", callback=finite, help="sidecar targets stop by themselves after N s (default: at `fleet stop`)"),
    ] = None,
    label: LabelOpt = None,
    deploy_config: DeployOpt = None,
    flavor: FlavorOpt = "omni",
    token_file: TokenFileOpt = None,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
    allow_shared_dirs: SharedOpt = False,
    dirs_host_local: HostLocalOpt = False,
    kind: KindOpt = "torch",
    start_at: StartAtOpt = None,
    start_timeout: StartTimeoutOpt = START_TIMEOUT_S,
    wide: WideOpt = False,
) -> None:
    """Start on every target at once; all or nothing (a failure stops the ones that started)."""
    with cli_errors():
        at = _start_at(start_at)
        if duration is not None and not duration > 0:
            raise FleetDurationInvalid(f"--duration must be > 0 seconds, got {duration}; leave it out to end the "
                                       "window with `omni-sidecar fleet stop`")
        fleet = _fleet(targets, stages, deploy_config, flavor, token_file, state_dir, allow_shared_dirs,
                       dirs_host_local, start_timeout_s=start_timeout)
        upstream = [t.name for t in fleet.targets if t.kind.value == "upstream"]
        if duration is not None and upstream:
            raise FleetDurationInvalid(
                f"--duration needs a process that stays to stop upstream targets ({', '.join(upstream)}); "
                "use `omni-sidecar fleet capture --duration S`, or put sidecars in front of them",
            )

        async def run() -> Any:
            await fleet.open()
            try:
                # handed over to `fleet stop`: no lease (nothing renews it once this command exits)
                return await fleet.start(label=label, duration_s=duration, kind=kind, start_at=at,  # type: ignore[arg-type]
                                         lease_s=None)
            finally:
                await fleet.close(keep_live=True)  # `fleet stop` stops them (journal in --state-dir)

        with _owning_state_dir(fleet):
            fc = asyncio.run(run())
        _print(fc, as_json, wide)
        if not as_json and fc.key:
            print_text(console, f"fleet key {fc.key}: `omni-sidecar fleet stop --targets ... --key {fc.key}` stops "
                       "this window and no other client's", hang="    ", markup=False)


@fleet_app.command("stop")
def stop(
    targets: TargetsOpt,
    wait: WaitOpt = True,
    timeout: TimeoutOpt = None,
    deploy_config: DeployOpt = None,
    flavor: FlavorOpt = "omni",
    token_file: TokenFileOpt = None,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
    stop_budget: BudgetOpt = 1800.0,
    start_timeout: StartTimeoutOpt = START_TIMEOUT_S,
    wide: WideOpt = False,
    key: Annotated[Optional[str], typer.Option(
        "--key", help="stop only the captures of the fleet with this key (`fleet start` prints it); "
                      "another client's capture is left recording")] = None,
) -> None:
    """Stop the live capture on every target at once, each within its own budget."""
    with cli_errors():
        def make(which: str | list[Any]) -> Any:
            return _fleet(which, None, deploy_config, flavor, token_file, state_dir, stop_budget_s=stop_budget,
                          start_timeout_s=start_timeout)

        if key is not None:
            from sidecar.fleet._leases import key_problem

            why = key_problem(key)
            if why is not None:
                raise typer.BadParameter(why, param_hint="'--key'")
        fleet = make(targets)
        others: dict[str, str] = {}  # target -> the live capture left alone (not this fleet's)

        async def run() -> tuple[Any, list[str]]:
            # A target that cannot be opened holds no other's stop back: the others are stopped
            # (a `fleet start` window has no lease: left alone it records until its --duration, or on).
            reachable, down = fleet, await _open_reachable(fleet)
            if down:
                reachable = make([t for t in fleet.targets if t.name not in down])
                await reachable.open()
            try:
                fc = await reachable.live(key=key)
                # a target with nothing recording has nothing to stop: a no-op, as vLLM's
                # /stop_profile without a session; a target that could not be asked stays a failure.
                # With --key, another's live capture is left recording, and said.
                idle = [n for n, r in fc.targets.items() if _nothing_recording(r)]
                others.update({n: r.error.message for n, r in fc.targets.items()
                               if r.error is not None and r.error.code == "capture_not_this_fleets"})
                fc = fc.model_copy(update={"targets": {n: r for n, r in fc.targets.items()
                                                       if n not in idle and n not in others}})
                if fc.targets:
                    fc = await reachable.stop(fc, wait_artifacts=wait, artifact_timeout_s=timeout)
                if down:
                    every = {**fc.targets, **down}
                    fc = fc.model_copy(update={"targets": {t.name: every[t.name] for t in fleet.targets
                                                           if t.name in every}})
                return fc, idle
            finally:
                await reachable.close()

        with _owning_state_dir(fleet):
            fc, idle = asyncio.run(run())
        if as_json or fc.targets:
            _print(fc, as_json, wide, nothing_recording=idle, not_this_fleets=others if key is not None else None)
        if idle and not as_json:
            print_text(console, f"nothing was recording on {len(idle)} target(s), nothing to stop there: "
                       f"{escape(', '.join(idle))}", hang="    ")
        if others and not as_json:
            print_text(console, f"left recording on {len(others)} target(s), not fleet {key}'s: " + "; ".join(
                f"{name}: {why}" for name, why in others.items()), hang="    ", markup=False)
        _exit(fc, as_json)


async def _open_reachable(fleet: Any) -> dict[str, Any]:
    """Open ``fleet``; where some targets cannot be opened (down, not a sidecar, no answer), each
    of them as a ``stop_not_sent`` result saying that nothing was stopped there and how to stop it
    later, and the fleet left closed (reopen it over the others). Raised as it is when none opens."""
    from sidecar.errors import FleetError
    from sidecar.fleet import TargetError, TargetOutcome, TargetResult

    try:
        await fleet.open()
    except FleetError as err:
        failed = {t["target"]: t["error"] for t in err.details.get("targets", []) if isinstance(t, dict)}
        if not failed or len(failed) >= len(fleet.targets):
            raise
        kinds = {t.name: t.kind for t in fleet.targets}
        return {name: TargetResult(target=name, kind=kinds[name], outcome=TargetOutcome.stop_not_sent, error=TargetError(
            code=e["code"], message=f"{e['message']}; nothing was stopped there (the other targets were): once it "
                                    f"answers, `omni-sidecar fleet stop --targets {name}`"))
                for name, e in failed.items() if name in kinds}
    return {}


def _nothing_recording(r: Any) -> bool:
    """``Fleet.live`` found no live capture on this target (it answered: not an error reading it)."""
    return r.capture_id is None and r.error is not None and r.error.code == "capture_not_found"


@fleet_app.command("capture")
def capture(
    targets: TargetsOpt,
    duration: WindowOpt = None,
    stages: StagesOpt = None,
    label: LabelOpt = None,
    timeout: TimeoutOpt = None,
    deploy_config: DeployOpt = None,
    flavor: FlavorOpt = "omni",
    token_file: TokenFileOpt = None,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
    allow_shared_dirs: SharedOpt = False,
    dirs_host_local: HostLocalOpt = False,
    kind: KindOpt = "torch",
    stop_budget: BudgetOpt = 1800.0,
    start_at: StartAtOpt = None,
    start_timeout: StartTimeoutOpt = START_TIMEOUT_S,
    wide: WideOpt = False,
) -> None:
    """Start everywhere, keep the window open --duration seconds (or until Ctrl-C), stop
    everywhere, check the traces and print where they are. On a terminal a progress line follows
    the start (and its --start-at wait), the window, the stops and the traces collected."""
    with cli_errors():
        at = _start_at(start_at)
        if duration is not None and not duration > 0:
            raise FleetDurationInvalid(f"--duration must be > 0 seconds, got {duration}")
        fleet = _fleet(targets, stages, deploy_config, flavor, token_file, state_dir, allow_shared_dirs,
                       dirs_host_local, stop_budget, start_timeout)

        async def run() -> Any:
            async with fleet:
                with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                              console=err_console, transient=True, disable=as_json) as progress:
                    return await _capture_with_progress(fleet, progress, duration, label=label, timeout=timeout,
                                                        kind=kind, start_at=at)

        with _owning_state_dir(fleet):
            fc = asyncio.run(run())
        _print(fc, as_json, wide)
        _exit(fc, as_json)


async def _capture_with_progress(fleet: Any, progress: Progress, duration: float | None, *, label: str | None,
                                 timeout: float | None, kind: str, start_at: float | None) -> Any:
    """``Fleet.capture`` in its public steps (start, window, stop, then the artifact checks read
    until done), so each can show on the progress line. Each target is told the window's duration
    and ends it itself. Ctrl-C (SIGINT, also to the whole process group) during the start or the
    window ends the window: a start in flight lands first, then every target is stopped, swept and
    its traces checked; during the checks it ends the wait for them. A second Ctrl-C abandons the
    clean-up (what is left ends by its lease)."""
    import time

    from sidecar.fleet import TargetOutcome

    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    checking = False  # the window is over: a Ctrl-C now ends the wait for the checks

    def interrupted() -> None:
        ended.set()
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C: KeyboardInterrupt, the clean-up abandoned
        err_console.print("not waiting for the checks" if checking else
                          "stopping every target (Ctrl-C again to abandon it; the leases end what is left)")

    loop.add_signal_handler(signal.SIGINT, interrupted)
    try:
        n = len(fleet.targets)
        when = f" at {time.strftime('%H:%M:%S', time.localtime(start_at))}" if start_at is not None else ""
        task = progress.add_task(f"starting {n} target(s){when}", total=None)
        fc = await fleet.start(label=label, kind=kind, start_at=start_at, duration_s=duration)
        started = sum(r.outcome is TargetOutcome.started for r in fc.targets.values())
        span = f"{duration:g}s" if duration is not None else "until Ctrl-C"
        progress.update(task, description=f"window: {started} of {n} started, {span}", total=duration, completed=0)
        t0 = time.monotonic()
        while not ended.is_set() and (duration is None or time.monotonic() - t0 < duration):
            left = 0.2 if duration is None else min(0.2, duration - (time.monotonic() - t0))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ended.wait(), max(left, 0.0))
            progress.update(task, completed=time.monotonic() - t0)
        progress.update(task, description=f"stopping {started} target(s) (the servers write traces now)", total=None)
        fc = await fleet.stop(fc, wait_artifacts=False)  # every stop sent, even if cancelled meanwhile
        if ended.is_set():  # the window was ended by Ctrl-C: a new one may end the wait for the checks
            ended.clear()
            loop.add_signal_handler(signal.SIGINT, interrupted)
        checking = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            waiting = [r for r in fc.targets.values()
                       if r.capture_id and not r.done and r.outcome is TargetOutcome.stopped]
            progress.update(task, description=f"collected {started - len(waiting)} of {started} target(s)' traces")
            if not waiting or ended.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return await fleet.clocks(fc)  # the offsets exchanged after the stops, for `fleet archive`
            await asyncio.sleep(0.5)
            fc = await fleet.refresh(fc)
    finally:
        loop.remove_signal_handler(signal.SIGINT)


ResultArg = Annotated[Path, typer.Argument(help="a fleet result: the output of `fleet capture ... --json`")]


def _print_alignment(al: Any) -> None:
    """Per trace: host, clock offset ± error, profiling start and first work against the requested
    start; then the spread within each stage, the hand-overs and the common window."""
    from sidecar.analysis.findings import handover_finding

    def ms(v: float | None, fmt: str = "{:+.3f}") -> str:
        return "-" if v is None else fmt.format(v)

    def work(sp: Any) -> float | None:
        return None if sp.first_ns is None or al.requested_ns is None else (sp.first_ns - al.requested_ns) / 1e6

    columns = [Column("replica"), Column("stage"), Column("rank"), Column("machine"), Column("offset ms", "right"),
               Column("± ms", "right"), Column("start ms", "right"), Column("first work ms", "right"), Column("trace")]
    rows = [[str(sp.replica), str(sp.stage_id), str(sp.rank), sp.host, ms(sp.offset_ns / 1e6),
             ms(None if sp.error_ns is None else sp.error_ns / 1e6, "{:.3f}"), ms(sp.start_skew_ms), ms(work(sp)), sp.file]
            for sp in al.spans]
    print_table(console, "start skew on the fleet's clock", columns, rows, keys=3, empty="no traces")
    spreads = ", ".join(f"stage {st.stage_id} {st.spread_us / 1000:.3f} ms" for st in al.stages)
    line = f"spread of profiling starts within each stage: {spreads or '-'}"
    if al.skew_p50_ms is not None:
        line += f"; against the requested start: p50 {al.skew_p50_ms:+.3f} ms, worst {al.skew_max_ms:+.3f} ms"
    print_text(console, line, markup=False)
    for h in al.handovers:
        print_text(console, f"{h.pipeline}: {handover_finding(h).message}", markup=False)
    if al.window_ns is not None:
        print_text(console, f"common window: {al.window_ms:.3f} ms (latest profiling start → earliest profiling end)",
                   markup=False)
    elif al.window_empty:
        print_text(console, "[yellow]no common window[/]: one trace's profiling ended before another's began")


def _exit_on_trace_errors(errors: list[str]) -> None:
    """Each trace that could not be read, on stderr; exit 1 if any (the others were used)."""
    for msg in errors:
        err_console.print(f"[bold red]error[/]{escape('[trace_invalid]')}: {escape(msg)}", highlight=False)
    if errors:
        raise typer.Exit(EXIT_ERROR)


def _output(out: Path, result: Path) -> Path:
    """``-o``: a file to write, never a folder nor the fleet result it is made from (that would
    overwrite the only record of which trace is whose)."""
    from sidecar.analysis.writer import output_path

    return output_path(out, [result])


def _alignment_json(al: Any) -> dict[str, Any]:
    from pydantic import TypeAdapter

    return {**TypeAdapter(type(al)).dump_python(al, mode="json"), "window_ms": al.window_ms}


@fleet_app.command("skew")
def skew(result: ResultArg, as_json: JsonOpt = False) -> None:
    """Each trace's profiling start (Kineto's profiler span) and first work against the requested
    start, on the fleet's clock (each host's clock offset applied); their spread within each stage,
    each stage's hand-over latency, and the window every trace was recording."""
    from sidecar.fleet import align_fleet, load_fleet_result

    with cli_errors():
        al = align_fleet(load_fleet_result(result))
    if as_json:
        console.print_json(json.dumps(_alignment_json(al)))
    else:
        _print_alignment(al)
    _exit_on_trace_errors(al.errors)


@fleet_app.command("timeline")
def fleet_timeline_cmd(
    result: ResultArg,
    out: Annotated[Path, typer.Option("-o", "--out", help="the merged trace (.json or .json.gz)")],
    common_window: Annotated[bool, typer.Option(
        "--common-window", help="trim every trace to the window all of them cover")] = False,
    as_json: JsonOpt = False,
) -> None:
    """One merged Perfetto trace of a fleet capture, every host's events on the fleet's clock."""
    from sidecar.fleet import fleet_timeline, load_fleet_result

    with cli_errors():
        fc = load_fleet_result(result)
        report, al = fleet_timeline(fc, _output(out, result), common_window=common_window)
    if as_json:
        from dataclasses import asdict

        console.print_json(json.dumps({**asdict(report), "alignment": None if al is None else _alignment_json(al)}))
    else:
        if al is not None:
            print_text(console, f"common window: {al.window_ms:.3f} ms; {report.trimmed:,} events outside it left out",
                       markup=False)
        print_text(console, f"wrote {out}: {len(report.processes)} processes, {report.events:,} events; "
                   "open it in https://ui.perfetto.dev", markup=False)
    _exit_on_trace_errors(report.errors)


@fleet_app.command("archive")
def archive(
    result: ResultArg,
    out: Annotated[Path, typer.Option("-o", "--out", help="the archive to write (.tar)")],
    mode: Annotated[str, typer.Option(
        "--mode", help="named (each trace's process named stage · replica · rank), raw (files unchanged) "
        "or slim (Python stacks dropped, --max-mb per trace)")] = "named",
    max_mb: Annotated[Optional[float], typer.Option("--max-mb", callback=size_cap, help="slim: at most this many MB per trace")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Every trace of a fleet capture in one TAR with a perfetto_manifest.json: open it in
    https://ui.perfetto.dev and the hosts' traces are merged, one machine per host, aligned."""
    from sidecar.fleet import fleet_archive, load_fleet_result

    with cli_errors():
        fc = load_fleet_result(result)
        report = fleet_archive(fc, _output(out, result), mode=mode, max_mb=max_mb)  # type: ignore[arg-type]
    if as_json:
        from dataclasses import asdict

        console.print_json(json.dumps(asdict(report)))
    else:
        for name, off in report.machines.items():
            print_text(console, f"machine {name}: clock {off / 1e6:+.3f} ms", markup=False)
        print_text(console, f"wrote {out}: {len(report.members)} traces + perfetto_manifest.json "
                   f"({report.mode}); open it in https://ui.perfetto.dev", markup=False)
    _exit_on_trace_errors(report.errors)


@fleet_app.command("stragglers")
def stragglers_cmd(
    result: ResultArg,
    k: Annotated[int, typer.Option("-k", min=0, help="how many of the slowest replicas")] = 3,
    top: Annotated[int, typer.Option("--top", min=0, help="ops per diff")] = 10,
    as_json: JsonOpt = False,
) -> None:
    """The slowest replicas of one step against the median replica: wall time on the fleet's
    clock, the stage where each loses it, and how their top ops differ."""
    from sidecar.fleet import fleet_stragglers, load_fleet_result

    with cli_errors():
        st = fleet_stragglers(load_fleet_result(result), k=k, top=top)
    if as_json:
        from dataclasses import asdict

        body = asdict(st)
        for row, s in zip(body["slowest"], st.slowest):
            row["diff"] = None if s.diff is None else s.diff.model_dump(mode="json")
        console.print_json(json.dumps(body))
        _exit_on_trace_errors(st.errors)
        return
    print_text(console, f"median replica {st.median_replica}: {st.median_wall_ms:.3f} ms of {st.replicas} replicas",
               markup=False)
    for line in st.left_out:
        print_text(console, f"not ranked: {line}", hang="  ", markup=False)
    for s in st.slowest:
        print_text(console, f"replica {s.replica} ({s.target}): {s.wall_ms:.3f} ms, {s.excess_ms:+.3f} ms; "
                   f"most in stage {s.stage_id} ({s.stage_excess_ms:+.3f} ms)", hang="  ", markup=False)
        stage = next((d for d in (s.diff.stages if s.diff else []) if d.stage_id == s.stage_id), None)
        for op in (stage.ops_by_self_cpu if stage else [])[:top]:
            print_text(console, f"{op.name}: {op.delta_self_us:+,.1f} µs self CPU ({op.count_a} → {op.count_b} calls)",
                       indent="  ", hang="    ", markup=False)
    _exit_on_trace_errors(st.errors)
