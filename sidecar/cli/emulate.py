"""CLI: ``omni-sidecar emulate``, a stand-in vLLM-Omni 0.30 server that profiles for real on CPU
(thin: parse options, call ``sidecar.emulator.server.serve``). Needs the ``emulator`` extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from pydantic import ValidationError

from sidecar.cli._app import EXIT_ERROR, app, err_console, finite, parse_stage_list, print_error
from sidecar.errors import SidecarError


def emulate(
    deploy_config: Path = typer.Option(..., "--deploy-config", help="vLLM-Omni deploy YAML (stages, profiler_config)."),
    host: str = typer.Option("127.0.0.1", "--host", help="bind address"),
    port: int = typer.Option(8091, "--port", help="port (the sidecar's --upstream is then http://127.0.0.1:8091)"),
    fd: Optional[int] = typer.Option(None, "--fd", hidden=True, help="serve on this listening socket (a launcher's)"),
    flavor: str = typer.Option("omni", "--flavor", help="omni: vLLM-Omni 0.30 semantics; vllm: plain vLLM 0.30."),
    diffusion_stages: Optional[str] = typer.Option(
        None, "--diffusion-stages", help="Stage ids to run as diffusion stages, e.g. 1,2."
    ),
    model: str = typer.Option("omni-emulator", "--model", help="Model name served by /v1/models."),
    step_ms: float = typer.Option(5.0, "--step-ms", min=0, callback=finite, help="Minimum wall time of one engine step (ms)."),
    idle_after_request: Optional[str] = typer.Option(
        None, "--idle-after-request", metavar="STAGE=N,...",
        help="Idle iterations a stage's engine runs after each request (nothing scheduled; max_iterations counts them), e.g. 2=1.",
    ),
    gzip_delay: float = typer.Option(
        0.5, "--gzip-delay", min=0, callback=finite, help="Seconds a trace's background gzip waits after the export (models big traces)."
    ),
    fault_stop_delay: float = typer.Option(
        0.0, "--fault-stop-delay", min=0, callback=finite, help="Test aid: extra seconds inside stop before replying."
    ),
    fault_stop_travel: float = typer.Option(
        0.0, "--fault-stop-travel", min=0, callback=finite, help="Test aid: seconds a stop takes to reach the workers, which record meanwhile."
    ),
    fault_start_travel: float = typer.Option(
        0.0, "--fault-start-travel", min=0, callback=finite, help="Test aid: seconds a start takes to reach the workers, which step meanwhile unrecorded."
    ),
    fault_start_delay: float = typer.Option(
        0.0, "--fault-start-delay", min=0, callback=finite, help="Test aid: extra seconds inside start before replying (the workers record)."
    ),
    fault_metrics_delay: float = typer.Option(
        0.0, "--fault-metrics-delay", min=0, callback=finite, help="Test aid: seconds each /metrics read is held (see --fault-metrics-delay-after)."
    ),
    fault_metrics_delay_after: int = typer.Option(
        0, "--fault-metrics-delay-after", help="Test aid: /metrics reads since the last start answered at once before the delay."
    ),
    fault_metrics_delay_count: int = typer.Option(
        0, "--fault-metrics-delay-count", help="Test aid: how many /metrics reads are held (0: every one after those answered)."
    ),
    fault_dead_stage: Optional[int] = typer.Option(
        None,
        "--fault-dead-stage",
        help="Test aid: this stage's workers die after start-up (start/stop still answer SUCCESS, no trace; /health 503).",
    ),
    fault_die_after_start: Optional[int] = typer.Option(
        None,
        "--fault-die-after-start",
        help="Test aid: this stage's workers acknowledge a profiler start, then exit (no trace is written).",
    ),
    fault_hang_stop: bool = typer.Option(False, "--fault-hang-stop", help="Test aid: stop never replies."),
    fault_start_500: bool = typer.Option(False, "--fault-start-500", help="Test aid: start answers 500."),
    fault_stop_500: bool = typer.Option(
        False, "--fault-stop-500", help="Test aid: stop answers 500 and reaches no worker."
    ),
    workers: str = typer.Option(
        "process",
        "--workers",
        help="process: a process per stage replica with real torch traces; "
        "thread: in the server process, torch-free synthetic traces (fast start, for tests).",
    ),
    worker_start: str = typer.Option(
        "forkserver", "--worker-start", help="How process workers start: forkserver (torch preloaded once) or spawn."
    ),
    platform: str = typer.Option(
        "cuda", "--platform", help="cuda: the files a GPU server writes; cpu: those of vLLM-Omni on vLLM's CPU platform "
        "(no `profiler_out_<N>.txt` for LLM stages, no stacks_cuda)."
    ),
    stage_overrides: Optional[str] = typer.Option(
        None, "--stage-overrides", help="Per-stage JSON merged over the deploy file, as `vllm serve --omni` does."
    ),
    profiler_config: Optional[str] = typer.Option(
        None, "--profiler-config", help="Server-wide ProfilerConfig JSON reaching every stage, as `vllm serve` takes it."
    ),
) -> None:
    """Run a stand-in vLLM-Omni 0.30 server: one CPU worker per stage, real torch profiler traces."""
    if flavor not in ("omni", "vllm"):
        raise typer.BadParameter(f"--flavor must be omni or vllm (got {flavor!r})")
    try:
        from sidecar.config.deploy import load_deploy_config
        from sidecar.emulator.options import EmulatorOptions
        from sidecar.emulator.server import serve

        server_args = {"stage_overrides": stage_overrides, "profiler_config": profiler_config}
        given = {k: v for k, v in server_args.items() if v is not None}
        if given:
            # Refuse bad JSON / keys / stage ids here, with the key named, before any worker starts.
            load_deploy_config(deploy_config, platform="cuda", **given)

        serve(
            EmulatorOptions(
                deploy_config=deploy_config,
                host=host,
                port=port,
                fd=fd,
                flavor=flavor,  # type: ignore[arg-type]
                diffusion_stages=parse_stage_list(diffusion_stages, "--diffusion-stages") or [],
                model=model,
                step_ms=step_ms,
                idle_after_request=_stage_counts(idle_after_request),
                gzip_delay_s=gzip_delay,
                fault_stop_delay_s=fault_stop_delay,
                fault_stop_travel_s=fault_stop_travel,
                fault_start_travel_s=fault_start_travel,
                fault_start_delay_s=fault_start_delay,
                fault_metrics_delay_s=fault_metrics_delay,
                fault_metrics_delay_after=fault_metrics_delay_after,
                fault_metrics_delay_count=fault_metrics_delay_count,
                fault_dead_stage=fault_dead_stage,
                fault_die_after_start=fault_die_after_start,
                fault_hang_stop=fault_hang_stop,
                fault_start_500=fault_start_500,
                fault_stop_500=fault_stop_500,
                workers=workers,  # type: ignore[arg-type]
                worker_start=worker_start,  # type: ignore[arg-type]
                platform=platform,  # type: ignore[arg-type]
                **given,
            )
        )
    except ValidationError as err:  # an out-of-range option value
        for e in err.errors():
            field = "_".join(map(str, e["loc"]))  # the option's name without its unit: gzip_delay_s is --gzip-delay
            option = "--" + (field[:-2] if field.endswith("_s") else field).replace("_", "-")
            detail = escape(f"[invalid_option]: {option}: {e['msg']}")
            err_console.print(f"[bold red]error[/]{detail}", highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    except SidecarError as err:
        # The real server exits 1 for any refused deploy file, unreadable ones included.
        print_error(err)
        raise typer.Exit(EXIT_ERROR) from None


app.command("emulate")(emulate)


def _stage_counts(value: str | None) -> dict[int, int]:
    """``"2=1,1=2"`` → ``{2: 1, 1: 2}``; a bad item is a usage error naming the form."""
    out: dict[int, int] = {}
    for item in filter(None, (v.strip() for v in (value or "").split(","))):
        stage, _, n = item.partition("=")
        try:
            out[int(stage)] = int(n)
        except ValueError:
            raise typer.BadParameter(f"--idle-after-request takes STAGE=N,..., e.g. 2=1 (got {value!r})") from None
    return out


def run_standalone() -> None:
    """Entry point of ``python -m sidecar.emulator`` (no subcommand name)."""
    typer.run(emulate)
