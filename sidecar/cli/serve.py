"""CLI: ``omni-sidecar serve`` — validate the settings and the deploy YAML (refuse errors, print
warnings), bind the port, take the state dir (one live sidecar per dir), then run the HTTP API under
uvicorn until SIGINT, SIGTERM or SIGHUP (the active capture's stop begins at once). Flags override
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
    log_level: Annotated[str, typer.Option("--log-level", callback=_log_level, envvar="OMNI_SIDECAR_LOG_LEVEL",
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
        from pydantic import ValidationError

        from sidecar.errors import SettingInvalid
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

        def settings_of(values: dict[str, Any]) -> SidecarSettings:
            try:
                return SidecarSettings(**{k: v for k, v in values.items() if v is not None})
            except ValidationError as err:  # a flag or env value out of range or malformed
                first = err.errors()[0]
                where = ".".join(str(p) for p in first.get("loc", ())) or "settings"
                raise SettingInvalid(
                    scrub_secrets(f"invalid setting {where}{_named(where, given)}: {first.get('msg', err)}"), key=where
                ) from None

        settings = settings_of(given)
        token = settings.read_token()  # an unreadable token file must stop start-up, not open the routes
        settings.check_exposure(token)  # beyond loopback, mutating routes need a token (checked before it binds)
        deploy = _deploy_of(settings)
        # Bound (or taken over from --fd) before anything starts: a port in use is refused here, not
        # after start-up ran the journal's recovery; and --port 0 is the port the OS picked in the
        # state dir's name, the lock and the banner, not 0.
        sock = _listening(settings.host, settings.port, fd)
        try:
            bound = sock.getsockname()
            if isinstance(bound, tuple) and bound[1] != settings.port:
                settings = settings_of({**given, "port": bound[1]})
            _serve_on(sock, settings, deploy, log_level=log_level)
        finally:
            sock.close()


# The flag of each setting whose name differs from its field's (the others: --field-name)
_FLAGS = {"upstream_url": "--upstream", "artifact_roots": "--artifact-root", "allowed_hosts": "--allowed-host"}


def _named(field: str, flags: dict[str, Any]) -> str:
    """`` (--keep-days or OMNI_SIDECAR_KEEP_DAYS)``: where a setting is given, so the message names
    what to change (a value from the environment is otherwise nowhere on the command line)."""
    if field not in SidecarSettings.model_fields:
        return ""
    env = f"OMNI_SIDECAR_{field.upper()}"
    return f" ({_FLAGS.get(field, '--' + field.replace('_', '-'))} or {env})" if field in flags else f" ({env})"


def _listening(host: str, port: int, fd: int | None) -> Any:
    """The listening socket: ``fd`` (a launcher's, systemd's), else ``host:port`` bound now."""
    import errno

    from sidecar._process import inherited_socket, listening_socket
    from sidecar.errors import SettingInvalid

    if fd is not None:
        try:
            return inherited_socket(fd)
        except OSError as exc:
            raise SettingInvalid(f"--fd {fd} is not an open socket ({exc.strerror}): pass the descriptor of a "
                                 "listening socket this process inherited, or leave --fd out", key="fd") from None
    bare = host.strip("[]")  # "[::1]" is how a URL writes the address ::1
    try:
        return listening_socket(bare, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = (f"--port {port} on {host} is in use by another process ({exc.strerror}): pick another --port (--port 0 takes a "
                   f"free one), or stop what listens there (`ss -ltnp 'sport = :{port}'` names it)")
        elif exc.errno == errno.EACCES:
            why = f"--port {port} needs privileges this user lacks (ports below 1024): pick a --port above 1023"
        else:
            why = (f"--host {host} cannot be listened on ({exc.strerror or exc}): pass an address of this machine, "
                   "e.g. --host 127.0.0.1")
        raise SettingInvalid(why, key="port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "host",
                             details={"host": host, "port": port}) from None


def _deploy_of(settings: SidecarSettings) -> Any:
    """The server's config as the sidecar reads it, refused on errors; its warnings printed."""
    from sidecar.config.deploy import load_server_config
    from sidecar.config.rules import validate_deploy
    from sidecar.errors import ValidationFailed

    deploy_config = settings.deploy_config
    # A legacy `stage_args:` file is refused: a 0.30 server cannot have started with it.
    deploy = load_server_config(
        deploy_config,
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
            f"{deploy_config or 'the server config'} is not a valid deploy for profiling; fix the errors "
            "below (`omni-sidecar validate` with the same --deploy-config / --stage-overrides / "
            "--profiler-config checks it)",
            findings=errors,
        )
    for finding in findings:
        err_console.print(f"[yellow]{escape(str(finding))}[/]", highlight=False)
    return deploy


def _serve_on(sock: Any, settings: SidecarSettings, deploy: Any, *, log_level: str) -> None:
    """Check the journal, take the state dir, then serve on ``sock`` until a shutdown signal."""
    from sidecar.control.journal import CaptureJournal, StateDirLock
    from sidecar.scrub import scrub_secrets

    deploy_config = settings.deploy_config
    state = Path(settings.state_dir or ".")  # never None: the settings fill it in per sidecar
    CaptureJournal(state).check_writable()  # no journal = no history and no recovery
    # Held while this sidecar runs (the kernel drops it even on kill -9): a second sidecar on
    # this dir would recover, and so stop, the captures this one runs.
    lock = StateDirLock(state)
    lock.acquire(upstream=scrub_secrets(settings.upstream_url), port=settings.port)
    try:
        from sidecar.api.app import build_app

        fastapi_app = build_app(settings, deploy)
        where = f"[{settings.host.strip('[]')}]" if ":" in settings.host else settings.host
        err_console.print(
            f"omni-sidecar: upstream {scrub_secrets(settings.upstream_url)}, deploy {deploy_config or '(--profiler-config)'}, "
            f"http://{where}:{settings.port} (docs at /docs), state {settings.state_dir}",
            highlight=False,
        )
        for note in (lock.swept_note(), settings.token_file_note()):
            if note:
                err_console.print(f"omni-sidecar: {escape(note)}", highlight=False)
        _run_server(fastapi_app, sock, host=settings.host, port=settings.port, log_level=log_level)
    finally:
        lock.release()


# Requests in flight get this long once the shutdown begins. Short: the active capture's stop has
# begun already (begin_shutdown), and a client still waiting then is answered 503 sidecar_closing.
GRACE_S = 5


def _log_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging, with the sidecar's own loggers (``sidecar.*``: capture starts and ends,
    recovery, the journal) through its handler, format and ``--log-level`` (without them Python
    printed their warnings bare and dropped the rest), every line scrubbed of secrets."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["sidecar"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    # secrets never reach a log line: a token in a URL's query or path is scrubbed (sidecar/scrub.py)
    config["filters"] = {**config.get("filters", {}), "scrub": {"()": "sidecar.scrub.ScrubLogs"}}
    for handler in config["handlers"].values():
        handler["filters"] = [*handler.get("filters", []), "scrub"]
    return config


def _run_server(app: Any, sock: Any, *, host: str, port: int, log_level: str) -> None:
    """uvicorn on the listening socket ``sock`` (``host:port``) until SIGINT, SIGTERM or SIGHUP, with
    the sidecar's shutdown order: the active capture's stop begins as the shutdown does, before the
    requests' grace (uvicorn runs the lifespan's shutdown only after it); a second Ctrl-C cuts the
    grace short, never that stop (bounded by close_timeout_s)."""
    import contextlib
    import signal
    import socket
    import threading
    from collections.abc import Iterator

    import uvicorn

    from sidecar.api.app import begin_shutdown

    hangup = getattr(signal, "SIGHUP", None)

    class SidecarServer(uvicorn.Server):
        hung_up = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.hung_up = self.hung_up or sig == hangup
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # A closed terminal or ssh session (SIGHUP) would kill the process at once, the profiler
            # left recording upstream; it shuts down like SIGTERM. Left alone when SIGHUP is not at its
            # default (nohup ignores it), and re-raised after, as uvicorn does with the signals it handles.
            own = (hangup is not None and threading.current_thread() is threading.main_thread()
                   and signal.getsignal(hangup) is signal.SIG_DFL)
            if own:
                signal.signal(hangup, self.handle_exit)
            try:
                with super().capture_signals():
                    yield
            finally:
                if own:
                    signal.signal(hangup, signal.SIG_DFL)
            if own and self.hung_up:
                signal.raise_signal(hangup)

        async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
            begin_shutdown(app)
            await super().shutdown(sockets)
            if self.force_exit:  # uvicorn skips the lifespan's shutdown then: the capture's stop with it
                err_console.print("omni-sidecar: forced exit: not waiting for requests; still stopping the active "
                                  "capture (kill -9 leaves it to recovery at the next start)", highlight=False)
                await self.lifespan.shutdown()

    server = SidecarServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=_log_config(log_level),
                                          timeout_graceful_shutdown=GRACE_S))
    server.run(sockets=[sock])
