"""CLI: ``omni-sidecar demo`` — the whole product in one command, no GPU needed: an emulated
3-stage Qwen2.5-Omni server and a sidecar on free ports, a capture of stages 0 and 2 around a few
chat requests, the verdict table, where the traces are, and a short summary. Exits 0 when both
stages produced a trace; everything is shut down on the way out (Ctrl-C included).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape

from sidecar.cli._app import EXIT_ERROR, EXIT_OK, app, cli_errors, console
from sidecar.cli._layout import Column, print_table, print_text

if TYPE_CHECKING:
    from sidecar.analysis.models import CaptureSummary

DEMO_STAGES = [0, 2]
DEMO_REQUESTS = 4
BASE_DEPLOY = "qwen2_5_omni.yaml"
DEMO_PROFILE = "light"  # stacks off, gzip on, bounded window: small traces, a fast stop
MARKER = ".omni-sidecar-demo"  # in an --out folder: a demo wrote it, and may write it again


def find_base_deploy() -> Path:
    """The example deploy: bundled in the package, or in ``configs/`` of a source checkout."""
    import sidecar

    pkg = Path(sidecar.__file__).resolve().parent
    for candidate in (pkg / "_data" / "configs" / BASE_DEPLOY, pkg.parent / "configs" / BASE_DEPLOY):
        if candidate.is_file():
            return candidate
    from sidecar.errors import ConfigUnreadable

    raise ConfigUnreadable(
        f"example deploy {BASE_DEPLOY} not found (looked in {pkg / '_data' / 'configs'} and {pkg.parent / 'configs'}); "
        "run the demo from a source checkout or reinstall omni-sidecar"
    )


def write_overlay(base: Path, out: Path) -> Path:
    """The example deploy with the ``light`` stage profile on every stage and traces under
    ``out/traces/stage<N>``: the same overlay ``omni-sidecar render`` writes (``base_config:``), so
    the demo runs the real render and loader paths."""
    from sidecar.config.deploy import load_deploy_config
    from sidecar.config.profiles import render_overlay

    overlay = out / "deploy.yaml"
    stages = load_deploy_config(base).stage_ids
    overlay.write_text(
        render_overlay(base, DEMO_PROFILE, stages, out_path=overlay, out_dir=out / "traces"), encoding="utf-8"
    )
    return overlay


def send_chat_requests(url: str, n: int) -> int:
    import httpx

    done = 0
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as http:
        for i in range(n):
            reply = http.post(
                "/v1/chat/completions",
                json={
                    "model": "Qwen/Qwen2.5-Omni-7B",
                    "messages": [{"role": "user", "content": f"Say hello in {i + 3} words."}],
                    "max_tokens": 16,
                },
            )
            reply.raise_for_status()
            done += 1
    return done


def step(n: int | None, text: str) -> None:
    """A step of the demo, ``N/5 text`` (``n`` None: more about the step before), wrapped under it."""
    print_text(console, f"[bold]{n}/5[/] {text}" if n else f"      {text}", hang="      ")


def print_summary(summary: CaptureSummary, top: int = 5) -> None:
    """Top CPU ops per stage of a capture's summary (``GET /v1/captures/{id}/summary``)."""
    for stage in summary.stages:
        print_table(console, f"stage {stage.stage_id}: top ops by self CPU time",
                    [Column("op"), Column("calls", "right"), Column("self (ms)", "right")],
                    [[op.name, str(op.count), f"{op.self_us / 1000:.2f}"] for op in stage.cpu_ops[:top]])


def out_folder(value: Path | None) -> Path | None:
    """``--out``: a folder to create, an empty one, or one an earlier demo wrote (its marker). Any
    other is refused before anything starts: the demo writes ``deploy.yaml``, ``traces/``,
    ``state/`` and two logs there and would replace a file of the user's by those names."""
    if value is None:
        return None
    if value.exists() and not value.is_dir():
        raise typer.BadParameter(f"{value} is a file, not a folder; give a new or empty folder (or one an earlier "
                                 "demo wrote)")
    try:
        value.mkdir(parents=True, exist_ok=True)
        entries = sorted(e.name for e in value.iterdir())
    except OSError as err:
        raise typer.BadParameter(f"{value} cannot be used ({err.strerror or err}); give a folder this user can write")
    if entries and MARKER not in entries:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise typer.BadParameter(f"{value} holds files of its own ({shown}); the demo writes deploy.yaml, traces/, "
                                 "state/ and logs there: give a new or empty folder")
    return value


@app.command()
def demo(
    out: Annotated[
        Optional[Path], typer.Option("--out", callback=out_folder, help="keep everything (deploy, traces, state, "
                                     "logs) in this folder: a new or empty one, or an earlier demo's")
    ] = None,
    keep: Annotated[bool, typer.Option("--keep", help="keep the temporary folder instead of deleting it")] = False,
) -> None:
    """Run an emulated 3-stage Qwen2.5-Omni server and a sidecar, capture stages 0 and 2, show the result."""
    with cli_errors():
        from sidecar.api.launcher import SidecarProcess
        from sidecar.cli.capture import print_capture, wait_with_progress
        from sidecar.client import SidecarClient
        from sidecar.control.models import CaptureState, Verdict
        from sidecar.emulator.launcher import EmulatorProcess

        workdir = Path(out).resolve() if out else Path(tempfile.mkdtemp(prefix="omni-sidecar-demo-"))
        (workdir / MARKER).touch()
        keep = keep or out is not None
        ok = False
        try:
            base = find_base_deploy()
            overlay = write_overlay(base, workdir)
            step(1, f"deploy: {escape(str(overlay))} (base_config {escape(base.name)} + stage profile "
                    f"{DEMO_PROFILE!r}, traces under {escape(str(workdir / 'traces'))})")
            step(2, "starting the emulated vLLM-Omni server (3 stages, CPU torch profiler)")
            with EmulatorProcess(overlay, flavor="omni", log_path=workdir / "emulator.log") as emulator:
                step(None, f"server at {emulator.url}")
                step(3, "starting the sidecar")
                with SidecarProcess(
                    emulator.url, overlay, state_dir=workdir / "state", log_path=workdir / "sidecar.log"
                ) as sc, SidecarClient(sc.url, timeout=60) as client:
                    step(None, f"sidecar at {sc.url} (API docs at {sc.url}/docs)")
                    cap = client.start_capture(DEMO_STAGES, label="demo")
                    step(4, f"capture {cap.id} active on stages {escape(str(cap.stages))}; sending {DEMO_REQUESTS} "
                            "chat requests")
                    sent = send_chat_requests(emulator.url, DEMO_REQUESTS)
                    step(None, f"{sent} requests answered; stopping (the server flushes traces now)")
                    client.stop_capture(cap.id)
                    cap = wait_with_progress(client, cap.id, timeout=300, quiet=False)
                    step(5, "result")
                    print_capture(cap, as_json=False)
                    ok = cap.state is CaptureState.completed and all(
                        (v := cap.verdict(s)) is not None and v.verdict is Verdict.ok for s in DEMO_STAGES
                    )
                    if cap.state.terminal and any(v.verdict is Verdict.ok for v in cap.verdicts):
                        try:
                            print_summary(client.summary(cap.id))
                        except Exception as err:  # a summary is a bonus; it never fails the demo
                            print_text(console, f"(no summary: {err})", markup=False)
                    where = "" if keep else " (deleted on exit; pass --keep or --out DIR to keep them)"
                    print_text(console, f"traces: {workdir / 'traces'}{where}", hang="  ", markup=False)
                    print_text(console, f"journal: {workdir / 'state'}; logs: {workdir / 'sidecar.log'}, "
                               f"{workdir / 'emulator.log'}{where}", hang="  ", markup=False)
                    print_text(console, "shutting down")
        finally:
            if not keep:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                print_text(console, f"kept {workdir}", markup=False)
        print_text(console, "[green]demo ok[/]" if ok else "[red]demo: capture not completed[/]")
        raise typer.Exit(EXIT_OK if ok else EXIT_ERROR)
