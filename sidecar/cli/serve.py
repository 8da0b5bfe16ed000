"""CLI: ``omni-sidecar serve`` — validate the deploy YAML (refuse errors, print warnings), take
the state dir (one live sidecar per dir), then run the HTTP API under uvicorn. Flags override
``OMNI_SIDECAR_*`` environment settings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from sidecar.cli._app import app, cli_errors, err_console, finite
from sidecar.config.settings import SidecarSettings, default_state_dir

# The defaults the help gives are the settings' own (a flag left out takes the OMNI_SIDECAR_* variable,
# else these), and the state dir's root is the one this environment gives.
_DEFAULTS = {name: field.default for name, field in SidecarSettings.model_fields.items()}
STATE_DIR_HELP = (
    "journal of captures, owned by this sidecar while it runs (default: "
    f"`{default_state_dir()}/<upstream host>_<upstream port>-<sidecar port>`, under $XDG_STATE_HOME when set, "
    "else ~/.local/state)"
)


# uvicorn's own names (uvicorn.config.LOG_LEVELS; tests/test_cli_help.py keeps them equal), not
# imported: the CLI starts without uvicorn until a server runs
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _log_level(value: str) -> str:
    if value.lower() not in LOG_LEVELS:
        raise typer.BadParameter(f"{value!r} is not a log level; one of {', '.join(LOG_LEVELS)}")
    return value.lower()


@app.command()
def serve(
    upstream: Annotated[
        Optional[str],
        typer.Option(
            "--upstream",
            help="URL of `vllm serve <model> --omni`, e.g. http://127.0.0.1:8000 (required, or "
            "OMNI_SIDECAR_UPSTREAM_URL; `omni-sidecar emulate` listens on http://127.0.0.1:8091)",
        ),
    ] = None,
    deploy_config: Annotated[
        Optional[Path], typer.Option("--deploy-config", help="the deploy YAML the server was started with")
    ] = None,
    host: Annotated[Optional[str], typer.Option("--host", help=f"bind address (default {_DEFAULTS['host']})")] = None,
    port: Annotated[Optional[int], typer.Option("--port", help=f"port (default {_DEFAULTS['port']})")] = None,
    fd: Annotated[Optional[int], typer.Option("--fd", hidden=True, min=0,
                                              help="serve on this listening socket (a launcher's, or systemd's)")] = None,
    state_dir: Annotated[
        Optional[Path],
        typer.Option("--state-dir", help=STATE_DIR_HELP),
    ] = None,
    token_file: Annotated[
        Optional[Path], typer.Option("--token-file", help="bearer token required on mutating routes")
    ] = None,
    flavor: Annotated[Optional[str], typer.Option(
        "--flavor", help=f"omni (stage lists) or vllm (no body) (default {_DEFAULTS['flavor']})")] = None,
    platform: Annotated[Optional[str], typer.Option(
        "--platform", help=f"the deploy YAML's `platforms.<name>` overlay to apply (default {_DEFAULTS['platform']})")] = None,
    artifact_root: Annotated[
        Optional[list[str]],
        typer.Option("--artifact-root", help="SERVER_PATH=LOCAL_PATH where the server's trace dirs are mounted here"),
    ] = None,
    stage_overrides: Annotated[
        Optional[str], typer.Option("--stage-overrides", help="the --stage-overrides JSON the server was started with")
    ] = None,
    profiler_config: Annotated[
        Optional[str],
        typer.Option(
            "--profiler-config",
            help="the --profiler-config JSON the server was started with (no --deploy-config needed with --flavor vllm, or with --stages for `vllm serve --omni`)",
        ),
    ] = None,
    stages: Annotated[
        Optional[str],
        typer.Option("--stages", help="with --profiler-config and no --deploy-config: the `vllm serve --omni` "
                     "pipeline's stage ids, e.g. 0,1"),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", callback=_log_level,
                                           help=f"uvicorn log level: {', '.join(LOG_LEVELS)}")] = "info",
    keep: Annotated[Optional[int], typer.Option(
        "--keep", help=f"finished captures kept in history (default {_DEFAULTS['keep']})")] = None,
    keep_days: Annotated[
        Optional[float], typer.Option("--keep-days", callback=finite, help="drop finished captures older than this many days "
                                      "(default: kept whatever their age)")
    ] = None,
    allowed_host: Annotated[
        Optional[list[str]],
        typer.Option("--allowed-host", help="Host/Origin name accepted besides loopback names (repeatable; '*' = any)"),
    ] = None,
) -> None:
    """Run the sidecar's HTTP API beside a vLLM-Omni server (OpenAPI at /docs).

    A setting left out takes its `OMNI_SIDECAR_*` environment variable (e.g. `OMNI_SIDECAR_PORT`),
    else the default shown."""
    with cli_errors():
        from sidecar.config.deploy import load_server_config
        from sidecar.config.rules import validate_deploy
        from sidecar.config.settings import SidecarSettings
        from pydantic import ValidationError

        from sidecar.control.journal import CaptureJournal, StateDirLock
        from sidecar.errors import SettingInvalid, ValidationFailed
        from sidecar.scrub import scrub_secrets

        if upstream is None and not os.environ.get("OMNI_SIDECAR_UPSTREAM_URL"):
            raise SettingInvalid(
                "no upstream: pass --upstream URL of the server, e.g. --upstream http://127.0.0.1:8000 for "
                "`vllm serve` or --upstream http://127.0.0.1:8091 for `omni-sidecar emulate` (or set "
                "OMNI_SIDECAR_UPSTREAM_URL)",
                key="upstream_url",
            )
        given: dict[str, Any] = {
            "upstream_url": upstream,
            "deploy_config": deploy_config,
            "host": host,
            "port": port,
            "state_dir": state_dir,
            "token_file": token_file,
            "flavor": flavor,
            "platform": platform,
            "artifact_roots": artifact_root or None,
            "stage_overrides": stage_overrides,
            "profiler_config": profiler_config,
            "stages": stages,
            "keep": keep,
            "keep_days": keep_days,
            "allowed_hosts": allowed_host or None,
        }
        try:
            settings = SidecarSettings(**{k: v for k, v in given.items() if v is not None})
        except ValidationError as err:  # a flag or env value out of range or malformed
            first = err.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "settings"
            raise SettingInvalid(
                scrub_secrets(f"invalid setting {where}: {first.get('msg', err)}"), key=where
            ) from None
        token = settings.read_token()  # an unreadable token file must stop start-up, not open the routes
        settings.check_exposure(token)  # beyond loopback, mutating routes need a token
        state = Path(settings.state_dir or ".")  # never None: the settings fill it in per sidecar
        CaptureJournal(state).check_writable()  # no journal = no history and no recovery
        # A legacy `stage_args:` file is refused: a 0.30 server cannot have started with it.
        deploy = load_server_config(
            settings.deploy_config,
            flavor=settings.flavor,
            platform=settings.platform,
            stage_overrides=settings.stage_overrides,
            profiler_config=settings.profiler_config,
            stages=settings.stages,
        )
        findings = validate_deploy(deploy)  # includes the loader's own findings
        errors = [f for f in findings if f.is_error]
        if errors:
            raise ValidationFailed(
                f"{settings.deploy_config or 'the server config'} is not a valid deploy for profiling; fix the errors "
                "below (`omni-sidecar validate` with the same --deploy-config / --stage-overrides / "
                "--profiler-config checks it)",
                findings=errors,
            )
        for finding in findings:
            err_console.print(f"[yellow]{escape(str(finding))}[/]", highlight=False)

        # Held while this sidecar runs (the kernel drops it even on kill -9): a second sidecar on
        # this dir would recover, and so stop, the captures this one runs.
        lock = StateDirLock(state)
        lock.acquire(upstream=scrub_secrets(settings.upstream_url), port=settings.port)
        try:
            from sidecar._process import serve_uvicorn
            from sidecar.api.app import build_app

            fastapi_app = build_app(settings, deploy)
            err_console.print(
                f"omni-sidecar: upstream {scrub_secrets(settings.upstream_url)}, deploy {settings.deploy_config or '(--profiler-config)'}, "
                f"http://{settings.host}:{settings.port} (docs at /docs), state {settings.state_dir}",
                highlight=False,
            )
            # a short graceful window: a client blocked on ?wait=true must not delay the shutdown
            # stop of the active capture (lifespan shutdown runs after connections close)
            serve_uvicorn(fastapi_app, host=settings.host, port=settings.port, fd=fd, log_level=log_level,
                          timeout_graceful_shutdown=5)
        finally:
            lock.release()
