"""CLI: ``validate`` (check a deploy YAML, and optionally a verl trainer config, before a job
starts) and ``render`` (turn a stage profile into a deploy overlay or ``--stage-overrides`` JSON).
Exit codes: 0 clean (warnings allowed), 1 invalid, 2 unreadable input. Never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, NamedTuple, Optional

import typer
from rich.markup import escape
from rich.text import Text

from sidecar.cli._app import EXIT_ERROR, EXIT_OK, EXIT_UNREADABLE, app, cli_errors, console, err_console, parse_stage_list
from sidecar.cli._layout import Column, print_table, print_text
from sidecar.config.deploy import PLATFORMS, load_deploy_config, load_server_config, version_findings
from sidecar.config.models import DeployConfig
from sidecar.config.profiles import (
    list_profiles,
    load_profile,
    nsys_command,
    nsys_report_pattern,
    render_overlay,
    render_stage_overrides,
    write_overlay,
)
from sidecar.config.rules import MAX_IDLE_SHARE, max_iterations_for, validate_deploy
from sidecar.config.verl import format_replicas, installed_verl, read_verl_config, verl_findings
from sidecar.control.models import MAX_ENGINE_STEPS  # the bound of a steps window, as the API has it
from sidecar.errors import ConfigUnreadable, DeployConfigMissing, Finding, SettingInvalid, Severity, SidecarError
from sidecar.urls import http_url, with_scheme, without_query
from sidecar.versions import (NEWEST_OMNI, NEWEST_VLLM, PLATFORM_DEVICE, WORKER_PROFILERS, Release, ServerVersion,
                             omni_dialect)


def _exit_code(err: SidecarError) -> int:
    return EXIT_UNREADABLE if isinstance(err, ConfigUnreadable) else EXIT_ERROR


def _print_error_line(err: SidecarError) -> None:
    where = escape(f"{err.where}: ") if err.where else ""
    err_console.print(
        f"{where}[bold red]error[/]{escape(f'[{err.code}]: {err.message}')}", highlight=False, soft_wrap=True
    )
    for finding in err.findings:
        err_console.print(f"  {escape(str(finding))}", highlight=False, soft_wrap=True)


def _stage_rows(deploy: DeployConfig, findings: list[Finding]) -> list[dict[str, Any]]:
    rows = []
    for s in deploy.stages:
        rows.append(
            {
                "stage_id": s.stage_id,
                "kind": s.kind.value,
                "profiler": s.profiler,
                "dir": s.profiler_dir,
                "devices": s.devices,
                "num_replicas": s.num_replicas,
                "findings": [f.code for f in findings if f.stage_id == s.stage_id],
            }
        )
    return rows


def _print_table(deploy: DeployConfig, rows: list[dict[str, Any]], findings: list[Finding]) -> None:
    title = str(deploy.path) if deploy.path else "plain vLLM (--profiler-config)"
    cells = []
    for row in rows:
        codes = Text(" ").join(Text(f.code, style="red" if f.is_error else "yellow")
                               for f in findings if f.stage_id == row["stage_id"])
        cells.append([str(row["stage_id"]), row["kind"], row["profiler"] or "-", row["dir"] or "-",
                      codes if codes.plain else Text("ok", style="green")])
    print_table(console, f"{title} (platform {deploy.platform or 'none'})",
                [Column("id"), Column("kind"), Column("profiler"), Column("dir"), Column("findings", prose=True)], cells)
    for f in findings:
        print_text(console, Text(str(f), style="red" if f.is_error else "yellow"), hang="  ")


def _version_option(value: str | None, flag: str) -> Release | None:
    if value is None:
        return None
    release = Release.parse(value)
    if release is None:
        raise typer.BadParameter(f"{flag} takes a version such as 0.32.0 or 0.32.0rc1, got {value!r}")
    return release


class _Target(NamedTuple):
    """The versions a deploy is checked for and, for a live server (``--server``), why it serves
    no profiler routes now (None: it does, or no server was asked)."""

    version: ServerVersion
    unmounted: str | None = None

    def warnings(self) -> list[dict[str, Any]]:
        """The version's warnings, and the server's missing profiler routes: a capture there fails
        until it is restarted with a profiler (which the config checked may be the one to give it)."""
        out = self.version.warnings()
        if self.unmounted is not None:
            out.append({"code": "profiler_not_mounted", "why": self.unmounted})
        return out


def _read_server(url: str, omni_version: str | None) -> _Target:
    """What the server at ``url`` is (sidecar.upstream.server.UpstreamServer.identify), and whether
    it serves the profiler routes."""
    import asyncio

    from sidecar.upstream.server import Flavor, UpstreamServer

    async def read() -> _Target:
        async with UpstreamServer(url) as upstream:
            upstream.omni_version = omni_version
            probe = await upstream.probe()
            if not probe.reachable:
                raise typer.BadParameter(f"--server: {probe.reason}")
            version = await upstream.identify()
            if probe.profiler_mounted is False and version.kind == "vllm":
                upstream.flavor = Flavor.vllm  # its fix in a plain vLLM's words (--profiler-config)
                probe = await upstream.probe()
            return _Target(version, probe.reason if probe.healthy and probe.profiler_mounted is False else None)

    return asyncio.run(read())


def _target(kind: str, vllm_version: str | None, omni_version: str | None, server: str | None) -> _Target:
    """The versions a deploy is checked for: the server's own (``--server``), or the ones named, or
    the newest known vLLM (and the vLLM-Omni made for it)."""
    given_vllm = _version_option(vllm_version, "--vllm-version")
    _version_option(omni_version, "--omni-version")
    unmounted = None
    if server is not None:
        url = http_url(server)
        if url is None:  # else an unreachable "server" would be invented, of a guessed version
            raise SettingInvalid(f"--server {server!r} is not an http(s) URL; pass the server's URL with its scheme, "
                                 f"e.g. --server {with_scheme(server)}", key="server", details={"url": server})
        if (base := without_query(url)) is not None:
            raise SettingInvalid(f"--server {server!r} has a query or a fragment, which the server's routes cannot "
                                 f"follow; pass its address alone, e.g. --server {base}", key="server", details={"url": server})
        found = _read_server(url, omni_version)
        if given_vllm is None:
            return found
        kind, unmounted = found.version.kind, found.unmounted
    if given_vllm is not None:
        line = given_vllm.line
    elif kind == "omni":  # the vLLM of the vLLM-Omni named (its major.minor: one the table does not know
        # yet runs on the vLLM of its own line, not the nearest known's), or of the newest
        line = Release.parse(omni_version).line if omni_version else NEWEST_OMNI.vllm_line
    else:
        line = NEWEST_VLLM.line
    vllm = str(given_vllm) if given_vllm is not None else f"{line[0]}.{line[1]}.0"
    return _Target(ServerVersion.of(kind, vllm, omni_version), unmounted)  # type: ignore[arg-type]


def _env_findings() -> list[Finding]:
    import os

    if not os.environ.get("VLLM_TORCH_PROFILER_DIR"):
        return []
    return [Finding(code="env_torch_profiler_dir", severity=Severity.warning, key="VLLM_TORCH_PROFILER_DIR",
                    message="VLLM_TORCH_PROFILER_DIR is set here and no vLLM from 0.30 on reads it (vLLM 0.34 warns "
                            "\"Unknown vLLM environment variable\"): nothing is profiled by it; set profiler_config "
                            "(profiler: torch, torch_profiler_dir) instead")]


def _print_server(target: _Target, *, live: bool) -> None:
    from sidecar.control.notes import note, word

    version = target.version
    print_text(console, ("server: " if live else "checked for: ") + version.describe(), hang="  ", markup=False)
    if live and version.kind == "omni" and not version.omni_told and version.omni is not None:
        print_text(console, f"  vLLM-Omni serves its own version nowhere: {version.omni} is the release made for vLLM "
                   f"{version.vllm} (--omni-version to name another)", hang="    ", markup=False)
    for w in target.warnings():
        code = str(w.pop("code"))
        print_text(console, Text(f"  warning[{code}]: {word(note(code, **w))}", style="yellow"), hang="    ")


STAGE_OVERRIDES_HELP = "the server's --stage-overrides JSON, e.g. '{\"0\": {\"profiler_config\": {...}}}'"
PROFILER_CONFIG_HELP = "the server's --profiler-config JSON (reaches every stage; alone: a plain `vllm serve`)"


def validate(
    deploy_file: Annotated[
        Optional[Path], typer.Argument(metavar="[DEPLOY]", help="vLLM-Omni deploy YAML (omit for plain vLLM)")
    ] = None,
    stages: Annotated[
        Optional[str], typer.Option("--stages", help="stages you mean to capture, e.g. 0,2 (default: all torch stages)")
    ] = None,
    verl_config: Annotated[
        Optional[Path], typer.Option("--verl-config", help="verl / verl-omni trainer config (YAML or Hydra dump)")
    ] = None,
    role: Annotated[str, typer.Option("--role", help="verl profiler block to check: rollout or reward")] = "rollout",
    platform: Annotated[str, typer.Option("--platform", help=f"platform overlay to apply: {', '.join(PLATFORMS)}")] = "cuda",
    device: Annotated[Optional[str], typer.Option(
        "--device", help="the workers' device: cpu, cuda or xpu (vLLM 0.31+ workers refuse at start a profiler or "
                         "torch_profiler_activities their device lacks; default: the platform's, cuda)")] = None,
    nsys: Annotated[bool, typer.Option("--nsys", help="the capture is an nsys one: cuda stages may be targeted")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print a machine-readable report")] = False,
    stage_overrides: Annotated[Optional[str], typer.Option("--stage-overrides", help=STAGE_OVERRIDES_HELP)] = None,
    profiler_config: Annotated[Optional[str], typer.Option("--profiler-config", help=PROFILER_CONFIG_HELP)] = None,
    allow_legacy: Annotated[
        bool, typer.Option("--allow-legacy", help="read a pre-0.30 `stage_args:` file (0.30 refuses it) with a warning")
    ] = False,
    vllm_version: Annotated[Optional[str], typer.Option(
        "--vllm-version", help="the vLLM the server runs: its rules check the config (default: the server's with "
                               "--server, else the newest known: 0.34, or 0.32 under the newest vLLM-Omni)")] = None,
    omni_version: Annotated[Optional[str], typer.Option(
        "--omni-version", help="the vLLM-Omni the server runs (default: the one made for --vllm-version)")] = None,
    server: Annotated[Optional[str], typer.Option(
        "--server", metavar="URL", help="read the running server's versions (GET /version; vLLM-Omni by its "
                                        "routes), print them, and check the config for them")] = None,
) -> None:
    """Check a deploy YAML (and a verl config) for discrete torch profiling before anything starts.

    Alone, `--server URL` prints what the server is and which way a steps window is bounded there."""
    with cli_errors():
        stage_list = parse_stage_list(stages)
        if role not in ("rollout", "reward"):
            raise typer.BadParameter(f"--role must be rollout or reward, got {role!r}")
        if device is not None and device not in WORKER_PROFILERS:
            raise typer.BadParameter(f"--device must be one of {', '.join(WORKER_PROFILERS)}, got {device!r}")
        target = _target("omni" if deploy_file is not None else "vllm", vllm_version, omni_version, server)
        if server is not None and deploy_file is None and profiler_config is None:
            if as_json:
                console.print_json(json.dumps({"ok": True, "server": {**target.version.figures(), "summary": target.version.describe(),
                                                                      "warnings": target.warnings()}}))
            else:
                _print_server(target, live=True)
            raise typer.Exit(EXIT_OK)
        try:
            if deploy_file is None and profiler_config is None:  # the loader's own words name serve's options
                raise DeployConfigMissing(
                    "nothing to check: pass the deploy YAML `vllm serve --omni` was started with (`omni-sidecar "
                    "validate DEPLOY`), or for plain `vllm serve` its --profiler-config JSON; --server URL alone "
                    "prints what a running server is",
                    key="deploy_config",
                )
            deploy = load_server_config(
                deploy_file,
                flavor="omni" if deploy_file is not None else "vllm",
                platform=platform,
                stage_overrides=stage_overrides,
                profiler_config=profiler_config,
                allow_legacy=allow_legacy,
            )
            findings = validate_deploy(deploy, stages=stage_list, allow_cuda=nsys)
            findings += version_findings(deploy, target.version.dialect, target.version.omni_dialect,
                                         device or PLATFORM_DEVICE.get(platform)) + _env_findings()
            plan = None
            if verl_config is not None:
                plan = read_verl_config(verl_config, role=role)  # type: ignore[arg-type]
                support = installed_verl()  # its version and the rank rule it reads `ranks` by
                rank_mode = support.rank_mode
                findings += verl_findings(plan, rank_mode=rank_mode)
        except SidecarError as err:
            if as_json:
                console.print_json(
                    json.dumps({"ok": False, "file": str(deploy_file) if deploy_file else None, "error": err.to_dict()})
                )
            else:
                _print_error_line(err)
            raise typer.Exit(_exit_code(err)) from None
        rows = _stage_rows(deploy, findings)
        ok = not any(f.is_error for f in findings)
        if as_json:
            report = {
                "ok": ok,
                "file": str(deploy_file) if deploy_file else None,
                "platform": platform,
                "legacy_schema": deploy.legacy_schema,
                "base_chain": [str(p) for p in deploy.base_chain],
                "stages": rows,
                "findings": [f.model_dump(mode="json") for f in findings],
                "verl": plan.model_dump(mode="json") if plan else None,
                "verl_version": support.model_dump(mode="json") | {"summary": support.describe()} if plan else None,
                # the replicas verl profiles: indices, "all", or null when it profiles none
                "verl_replicas": (plan.requested_replicas(rank_mode) or "all") if plan and plan.enable else None,
                "server": {**target.version.figures(), "summary": target.version.describe(), "warnings": target.warnings(),
                           "live": server is not None},
            }
            console.print_json(json.dumps(report))
        else:
            _print_table(deploy, rows, findings)
            _print_server(target, live=server is not None)
            if plan is not None:
                print_text(console, support.describe(), hang="  ", markup=False)
                print_text(console, f"verl {role}: steps={plan.steps} tool={plan.tool} discrete={plan.discrete} "
                           f"enable={plan.enable} ranks={'all' if plan.all_ranks else plan.ranks or [0]}",
                           hang="  ", markup=False)
                if plan.enable:
                    print_text(console, f"{role} replicas profiled: {format_replicas(plan.requested_replicas(rank_mode))}",
                               hang="  ", markup=False)
            n_err = sum(f.is_error for f in findings)
            n_warn = len(findings) - n_err + len(target.warnings())  # the server's version warnings too
            console.print(
                f"[{'red' if n_err else 'green'}]{n_err} error(s)[/], {n_warn} warning(s)", highlight=False
            )
        raise typer.Exit(EXIT_OK if ok else EXIT_ERROR)


app.command()(validate)


def _idle_caps(values: list[str], steps: int | None, stages: list[int]) -> dict[int, dict[str, int]]:
    """``--idle 1=5/22`` (or ``1=0.23``) per stage → {stage: {"max_iterations": its cap for --steps}}."""
    if values and steps is None:
        raise typer.BadParameter("--idle gives a stage's cap the iterations it idles in a window of --steps N: add --steps")
    out: dict[int, dict[str, int]] = {}
    for value in values:
        stage, _, share = value.partition("=")
        try:
            sid = int(stage)
            idle_n, slash, ran = share.partition("/")
            frac = int(idle_n) / int(ran) if slash else float(share)
        except (ValueError, ZeroDivisionError):
            raise typer.BadParameter(f"--idle takes STAGE=IDLE/ITERATIONS, e.g. 1=5/22 (5 of 22 iterations idle on "
                                     f"stage 1, as a capture's note gives it), or STAGE=SHARE, e.g. 1=0.23; got {value!r}") from None
        if sid not in stages:
            raise typer.BadParameter(f"--idle {value}: stage {sid} is not one this renders (--stages {stages})")
        if not 0.0 <= frac <= 1.0:  # nan too: a negative count, or more idle than run, is a typo
            raise typer.BadParameter(
                f"--idle {value}: the idle iterations are a count from 0 up to the iterations, or a share from 0 to 1; "
                "write e.g. 1=5/22 or 1=0.23")
        try:
            out[sid] = {"max_iterations": max_iterations_for(steps, frac)}  # type: ignore[arg-type]
        except ValueError:
            raise typer.BadParameter(
                f"--idle {value}: a share of {frac:.2f} idle; a cap allows for at most {MAX_IDLE_SHARE:.2f} (a stage "
                "idling more is fed too little for a window counted in steps: send more requests at once)") from None
    return out


@app.command()
def render(
    deploy_file: Annotated[Path, typer.Argument(metavar="DEPLOY", help="the deploy YAML to start from")],
    profile: Annotated[str, typer.Option("--profile", help=f"preset ({', '.join(list_profiles())}) or a profile YAML")],
    stages: Annotated[Optional[str], typer.Option("--stages", help="stages to profile, e.g. 0,2 (default: all)")] = None,
    # str, not Path: Path("") is "." and an empty value would pass for the current folder
    out_dir: Annotated[
        Optional[str], typer.Option("--dir", help="trace root; each stage writes to `DIR/stage<id>` (default: keep the stage's dir)")
    ] = None,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="write the overlay YAML here")] = None,
    stage_overrides: Annotated[
        bool, typer.Option("--stage-overrides", help="print the JSON for `vllm serve --omni --stage-overrides`")
    ] = False,
    platform: Annotated[str, typer.Option("--platform", help="platform overlay to apply when reading DEPLOY")] = "cuda",
    replica: Annotated[
        Optional[int], typer.Option("--replica", help="fills {replica} in --dir: the index of the server this is for")
    ] = None,
    host: Annotated[
        Optional[str], typer.Option("--host", help="fills {host} in --dir (default: this machine's hostname)")
    ] = None,
    steps: Annotated[
        Optional[int], typer.Option("--steps", min=1, max=MAX_ENGINE_STEPS, help="every window of these stages ends itself after about N engine steps: max_iterations N+2 (vLLM counts idle iterations too)")
    ] = None,
    delay_steps: Annotated[
        Optional[int], typer.Option("--delay-steps", min=0, max=MAX_ENGINE_STEPS, help="delay_iterations: a window starts recording N engine steps after its start")
    ] = None,
    idle: Annotated[
        Optional[list[str]], typer.Option(
            "--idle", metavar="STAGE=IDLE/ITERATIONS",
            help="with --steps: a stage that idles this share of its iterations (a stage fed by another; a capture's "
                 "note gives it, e.g. 1=5/22) is capped at N plus those idle iterations; repeat per stage"),
    ] = None,
) -> None:
    """Render a stage profile for chosen stages as a deploy overlay (base_config) or --stage-overrides JSON.

    --dir may hold {replica} and {host} (e.g. '/data/perf/{host}/replica{replica}' --replica 1): they
    are expanded here, so each replica of a fleet gets its own trace folders."""
    with cli_errors():
        if output is not None and stage_overrides:
            raise typer.BadParameter("use either -o OUT (overlay file) or --stage-overrides (JSON), not both")
        stage_list = parse_stage_list(stages)
        try:
            if stage_list is None:
                stage_list = load_deploy_config(deploy_file, platform=platform).stage_ids
            caps = max_iterations_for(steps) if steps is not None else None
            iterations = {k: v for k, v in (("max_iterations", caps), ("delay_iterations", delay_steps)) if v is not None}
            where = {"out_dir": out_dir, "platform": platform, "replica": replica, "host": host,
                     "iterations": iterations or None, "stage_iterations": _idle_caps(idle or [], steps, stage_list) or None}
            if stage_overrides:
                text = render_stage_overrides(deploy_file, profile, stage_list, **where)  # type: ignore[arg-type]
                console.print(text, highlight=False, soft_wrap=True)
                _print_nsys_hint(profile, load_deploy_config(deploy_file, platform=platform, stage_overrides=text), None)
                return
            if output is None:
                text = render_overlay(deploy_file, profile, stage_list, out_path=Path.cwd() / "overlay.yaml",
                                      **where)  # type: ignore[arg-type]
                console.print(text, highlight=False, soft_wrap=True, markup=False)
                _print_nsys_hint(profile, None, "<this overlay>")
                return
            rendered = write_overlay(deploy_file, profile, stage_list, out_path=output, **where)  # type: ignore[arg-type]
            err_console.print(f"wrote {output} (profile {profile}, stages {stage_list})", highlight=False)
            _print_nsys_hint(profile, rendered, None)
        except SidecarError as err:
            _print_error_line(err)
            raise typer.Exit(_exit_code(err)) from None


def _print_nsys_hint(profile: str, deploy: DeployConfig | None, deploy_path: str | None) -> None:
    """For a ``profiler: cuda`` profile, the nsys wrapper the server needs (stderr: stdout stays pasteable)."""
    if load_profile(profile).profiler_config.get("profiler") != "cuda":
        return
    command = nsys_command(deploy or DeployConfig(stages=[]), deploy_config=deploy_path)
    err_console.print(
        "profiler: cuda writes nothing itself; start the server under nsys, e.g.\n"
        f"  {command}\nreports land in {nsys_report_pattern()} (one per capture window)",
        highlight=False,
        soft_wrap=True,
        markup=False,
    )
