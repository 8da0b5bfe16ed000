"""Stage profiles: named per-stage profiler presets (light, ops, shapes, memory, stacks, nsys)
and rendering them for chosen stages into a deploy overlay (``base_config:`` + per-stage
``engine_args.profiler_config``) or the ``--stage-overrides`` JSON of ``vllm serve --omni``.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from sidecar.config._yaml import MarkedDict, load_yaml
from sidecar.files import not_a_file
from sidecar.config.deploy import load_deploy_config, profiler_config_error
from sidecar.config.models import DeployConfig
from sidecar.config.placeholders import expand_dir_placeholders
from sidecar.config.profiler import ProfilerConfig
from sidecar.config.rules import check_stage_ids
from sidecar.errors import Where
from sidecar.errors import ProfileDirMissing, ProfileInvalid, ProfileUnknown, ProfileUnreadable, SettingInvalid

__all__ = [
    "StageProfile",
    "list_profiles",
    "load_profile",
    "nsys_command",
    "nsys_report_pattern",
    "profiles_dir",
    "render_overlay",
    "render_stage_overrides",
    "stage_profiler_configs",
    "write_overlay",
]


class StageProfile(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    description: str = ""
    # Keys of ProfilerConfig, without torch_profiler_dir (chosen per stage at render time).
    profiler_config: dict[str, Any]
    source: str | None = None


def profiles_dir() -> Path:
    """The presets shipped inside the package (the top-level ``stage_profiles/`` holds the same files)."""
    return Path(str(resources.files("sidecar") / "_data" / "stage_profiles"))


def list_profiles() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> StageProfile:
    """A preset by name (``light``) or a profile YAML by path; the preset is validated here."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        path = candidate
    else:
        path = profiles_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ProfileUnknown(
                f"unknown stage profile {str(name_or_path)!r}; choose one of {', '.join(list_profiles())} "
                "or pass a profile YAML path",
                details={"profiles": list_profiles()},
            )
    doc = load_yaml(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("profiler_config"), dict):
        raise ProfileUnreadable(
            f"{path}: a stage profile is a mapping with a `profiler_config:` mapping",
            where=getattr(doc, "where", None) or Where(file=str(path)),
        )
    pc = dict(doc["profiler_config"])
    if "torch_profiler_dir" in pc:
        raise ProfileInvalid(
            f"{path}: a stage profile must not set torch_profiler_dir (render chooses one per stage with --dir)",
            where=doc["profiler_config"].where_of("torch_profiler_dir")
            if isinstance(doc["profiler_config"], MarkedDict)
            else None,
            key="profiler_config.torch_profiler_dir",
        )
    probe = {**pc, "torch_profiler_dir": "/probe"} if pc.get("profiler") == "torch" else pc
    try:
        ProfilerConfig(**probe)
    except ValidationError as err:
        message, key = profiler_config_error(err)
        raise ProfileInvalid(
            f"{path}: profiler_config: {message}", where=Where(file=str(path)), key=key
        ) from None
    return StageProfile(
        name=str(doc.get("name") or path.stem), description=str(doc.get("description") or ""), profiler_config=pc,
        source=str(path),
    )


def stage_profiler_configs(
    deploy: DeployConfig,
    profile: StageProfile,
    stages: list[int],
    *,
    out_dir: str | Path | None = None,
    replica: int | None = None,
    host: str | None = None,
    iterations: dict[str, int] | None = None,
    stage_iterations: dict[int, dict[str, int]] | None = None,
) -> dict[int, dict[str, Any]]:
    """The full profiler_config to write for each stage (every torch field explicit, so nothing from
    the base file's own profiler_config leaks through the merge). ``{replica}`` / ``{host}`` in
    ``out_dir`` (or in a kept dir) are expanded here, never left for the server. ``iterations``
    (``max_iterations`` / ``delay_iterations``) bound every window of these stages in engine steps;
    ``stage_iterations`` sets them per stage over that (a fed stage's cap with its idle iterations)."""
    check_stage_ids(deploy, stages, valid=deploy.stage_ids)  # any stage may be given a profiler
    if out_dir is not None and not str(out_dir).strip():  # Path("") would be "." and scatter traces in the cwd
        raise ProfileDirMissing(
            "--dir is empty; pass the trace root, e.g. --dir /data/perf (each stage writes to DIR/stage<id>), or "
            "leave --dir out to keep each stage's own dir",
            key="dir",
        )
    if out_dir is not None:
        out_dir = expand_dir_placeholders(str(out_dir), replica=replica, host=host)
    out: dict[int, dict[str, Any]] = {}
    for sid in stages:
        pc = {**profile.profiler_config, **(iterations or {}), **(stage_iterations or {}).get(sid, {})}
        if pc.get("profiler") == "torch":
            if out_dir is not None:
                pc["torch_profiler_dir"] = os.path.join(os.path.abspath(os.path.expanduser(str(out_dir))), f"stage{sid}")
            else:
                existing = deploy.stage(sid).profiler_dir  # type: ignore[union-attr]
                if existing and "${" in existing:
                    raise ProfileDirMissing(
                        f"stage {sid}'s torch_profiler_dir {existing!r} holds an OmegaConf interpolation, which only "
                        "the server resolves (in its environment): the sidecar could not tell where the traces land. "
                        "Pass --dir DIR (each stage writes to DIR/stage<id>)", key="torch_profiler_dir")
                if existing:
                    existing = expand_dir_placeholders(existing, replica=replica, host=host,
                                                       what=f"stage {sid}'s torch_profiler_dir")
                if not existing:
                    raise ProfileDirMissing(
                        f"stage {sid} has no torch_profiler_dir to keep; pass --dir DIR "
                        f"(each stage writes to DIR/stage<id>)",
                        key="torch_profiler_dir",
                    )
                pc["torch_profiler_dir"] = existing
        try:
            full = ProfilerConfig(**pc)
        except ValidationError as err:
            message, key = profiler_config_error(err)
            raise ProfileInvalid(f"stage {sid}: profile {profile.name}: {message}", key=key) from None
        out[sid] = full.torch_dict()
    return out


def render_overlay(
    deploy_path: str | Path,
    profile: str | StageProfile,
    stages: list[int],
    *,
    out_path: str | Path,
    out_dir: str | Path | None = None,
    platform: str | None = "cuda",
    replica: int | None = None,
    host: str | None = None,
    iterations: dict[str, int] | None = None,
    stage_iterations: dict[int, dict[str, int]] | None = None,
) -> str:
    """YAML text of an overlay for ``out_path``: ``base_config`` points back at ``deploy_path``
    (relative to ``out_path``'s folder) and the chosen stages get the profile's profiler_config."""
    prof = profile if isinstance(profile, StageProfile) else load_profile(profile)
    deploy = load_deploy_config(deploy_path, platform=platform)
    configs = stage_profiler_configs(deploy, prof, stages, out_dir=out_dir, replica=replica, host=host,
                                     iterations=iterations, stage_iterations=stage_iterations)
    base = os.path.relpath(Path(deploy_path).resolve(), Path(out_path).resolve().parent)
    doc = {
        "base_config": base,
        "stages": [{"stage_id": sid, "engine_args": {"profiler_config": pc}} for sid, pc in configs.items()],
    }
    header = (
        f"# Rendered by `omni-sidecar render`: profile {prof.name!r} on stages {stages}.\n"
        "# Inherits everything else from base_config; use with `vllm serve <model> --omni --deploy-config <this file>`.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False)


def _overlay_target(out_path: str | Path, inputs: list[tuple[str, Path]]) -> Path:
    """Where ``render -o OUT`` may write: the resolved path of a regular file (or none yet) that is
    none of the files the overlay is made from; ``SettingInvalid`` naming the fix otherwise."""
    if not str(out_path).strip():
        raise SettingInvalid("-o is empty; name the overlay file to write, e.g. -o overlay.yaml", key="output")
    target = Path(out_path).resolve()  # symlinks and ./ spellings: compare the files themselves
    try:
        kind = not_a_file(target.stat().st_mode)
    except OSError:
        kind = None  # not there yet: the write makes it (or says why it cannot)
    if kind is not None:
        raise SettingInvalid(
            f"-o {out_path}: that is {kind}, not a file; name the overlay file to write"
            + (f", e.g. -o {Path(out_path) / 'overlay.yaml'}" if kind == "a folder" else ""),
            key="output",
        )
    for what, path in inputs:
        if path.resolve() == target:
            raise SettingInvalid(
                f"-o {out_path} is {what} this overlay is rendered from ({path}); writing there would destroy it"
                + ("" if what == "the stage profile" else " (and make the overlay its own base_config)")
                + ": write the overlay to another file, e.g. "
                + f"-o {Path(out_path).with_name(Path(out_path).stem + '.profiled' + (Path(out_path).suffix or '.yaml'))}",
                key="output",
                details={"input": str(path)},
            )
    return target


def write_overlay(
    deploy_path: str | Path,
    profile: str | StageProfile,
    stages: list[int],
    *,
    out_path: str | Path,
    platform: str | None = "cuda",
    **render: Any,
) -> DeployConfig:
    """Render the overlay (``render_overlay``) and write it to ``out_path``, refusing before anything
    is written an ``out_path`` that is a folder, a device or one of the files read (the deploy file,
    its base chain, the profile). The overlay is written beside its place and loaded as a deploy
    file first, then renamed over it: a failure leaves nothing, half-written or broken, behind."""
    prof = profile if isinstance(profile, StageProfile) else load_profile(profile)
    deploy = load_deploy_config(deploy_path, platform=platform)
    inputs = [("the deploy file", Path(deploy_path))] + [("a base_config", p) for p in deploy.base_chain]
    if prof.source is not None and Path(prof.source).is_file():
        inputs.append(("the stage profile", Path(prof.source)))
    target = _overlay_target(out_path, inputs)
    text = render_overlay(deploy_path, prof, stages, out_path=target, platform=platform, **render)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as err:
        raise SettingInvalid(f"-o {out_path}: cannot write there: {err.strerror}", key="output") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as a plain write would make it (mkstemp's 0600 would hide it from others)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        load_deploy_config(tmp, platform=platform)  # the overlay must load exactly like any deploy file
        os.replace(tmp, target)
    except OSError as err:
        raise SettingInvalid(f"-o {out_path}: cannot write there: {err.strerror}", key="output") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return load_deploy_config(out_path, platform=platform)


def render_stage_overrides(
    deploy_path: str | Path,
    profile: str | StageProfile,
    stages: list[int],
    *,
    out_dir: str | Path | None = None,
    platform: str | None = "cuda",
    replica: int | None = None,
    host: str | None = None,
    iterations: dict[str, int] | None = None,
    stage_iterations: dict[int, dict[str, int]] | None = None,
) -> str:
    """The JSON for ``vllm serve --omni --stage-overrides '<json>'``."""
    prof = profile if isinstance(profile, StageProfile) else load_profile(profile)
    deploy = load_deploy_config(deploy_path, platform=platform)
    configs = stage_profiler_configs(deploy, prof, stages, out_dir=out_dir, replica=replica, host=host,
                                     iterations=iterations, stage_iterations=stage_iterations)
    return json.dumps({str(sid): {"profiler_config": pc} for sid, pc in configs.items()}, separators=(",", ":"))


# --- nsys (profiler: cuda) ------------------------------------------------------------------

NSYS_FLAGS = (
    "--trace=cuda,nvtx,osrt",
    "--trace-fork-before-exec=true",  # stage workers are child processes of the server
    "--cuda-graph-trace=node",
    "--capture-range=cudaProfilerApi",  # record only between the workers' cudaProfilerStart/Stop
    "--capture-range-end=repeat",  # every start/stop window is its own report; the server keeps running
)
DEFAULT_NSYS_OUTPUT = "/tmp/omni-sidecar/nsys/omni_%p"


def nsys_report_pattern(output: str | Path = DEFAULT_NSYS_OUTPUT) -> str:
    """Where the reports of ``nsys profile -o OUTPUT`` land: one ``.nsys-rep`` per capture range,
    named from OUTPUT (``%p``: the server's pid; nsys numbers the repeated ranges)."""
    pattern = str(output).replace("%p", "*")
    return pattern + ("" if pattern.endswith("*") else "*") + ".nsys-rep"


def nsys_command(
    deploy: DeployConfig,
    *,
    model: str = "<model>",
    output: str | Path = DEFAULT_NSYS_OUTPUT,
    deploy_config: str | Path | None = None,
) -> str:
    """The ``nsys profile ... vllm serve ...`` line a server with ``profiler: cuda`` stages must be
    started under (``profiler: cuda`` writes nothing itself: it only opens and closes CUDA capture
    ranges for this wrapper), with the server's own flags as ``deploy`` records them. Pure text."""
    import shlex

    serve = ["vllm", "serve", model]
    path = deploy_config if deploy_config is not None else deploy.path
    if path is not None:
        serve += ["--omni", "--deploy-config", str(path)]
    if deploy.stage_overrides:
        serve += ["--stage-overrides", json.dumps(deploy.stage_overrides, separators=(",", ":"))]
    if deploy.profiler_config_arg is not None:
        given = {k: v for k, v in deploy.profiler_config_arg.items() if v != ProfilerConfig.model_fields[k].default}
        serve += ["--profiler-config", json.dumps(given, separators=(",", ":"))]
    return " ".join(["nsys", "profile", *NSYS_FLAGS, "-o", shlex.quote(str(output)), *map(shlex.quote, serve)])
