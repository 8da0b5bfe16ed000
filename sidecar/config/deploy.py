"""Deploy YAML loader: reads a vLLM-Omni 0.30 deploy file the way the server does
(``base_config`` chains, flat keys with ``engine_args:`` merged over them, ``runtime:``,
``platforms.<name>.stages[]`` overlays, legacy ``stage_args:``) and returns a typed
``DeployConfig`` whose stages carry their effective, validated ``ProfilerConfig``.

Raises ``ConfigUnreadable`` (cannot read or parse) or ``ConfigError`` (invalid content); both name
file:line:col and the key. Merge rules mirror ``vllm_omni/config/stage_config.py`` (0.30.0).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sidecar.config._yaml import MarkedDict, MarkedList, load_yaml, yaml_type
from sidecar.files import not_a_file
from sidecar.config.models import DeployConfig, Stage, StageKind
from sidecar.config.overrides import (
    PROFILER_CONFIG_FLAG,
    RUNTIME_KEYS,
    STAGE_OVERRIDES_FLAG,
    cli_profiler_config,
    deep_merge,
    parse_profiler_config_arg,
    parse_stage_overrides,
    profiler_config_error,
)
from sidecar.config.profiler import ProfilerConfig, _is_uri_path, check_for_version
from sidecar.errors import (
    BaseConfigCycle,
    BaseConfigInvalid,
    BaseConfigMissing,
    ConfigEmpty,
    ConfigError,
    ConfigNotMapping,
    DeployConfigMissing,
    StagesFlagMisplaced,
    DeployStagesInvalid,
    Finding,
    LegacySchemaRefused,
    NumReplicasInvalid,
    PlatformUnknown,
    PlatformsInvalid,
    ProfilerConfigArgInvalid,
    ProfilerConfigInvalid,
    Severity,
    StageIdDuplicate,
    StageIdInvalid,
    StageIdMissing,
    StageInvalid,
    StageKindInvalid,
    StageOverridesInvalid,
    Where,
)
from sidecar.versions import (OmniDialect, VllmDialect, omni_deploy_keys_removed, omni_deploy_keys_unknown,
                              worker_refusal)

__all__ = [
    "PLATFORMS",
    "STAGE_KIND_KEYS",
    "check_platform",
    "deploy_from_profiler_config",
    "load_deploy_config",
    "load_server_config",
    "profiler_config_error",
    "resolve_deploy",
    "version_findings",
]

PLATFORMS = ("cuda", "rocm", "npu", "xpu", "musa")
# The emulator-only key wins over ``stage_type`` (the legacy schema's own field).
STAGE_KIND_KEYS = ("emulator_stage_kind", "stage_type")

# vllm_omni.platforms.interface.OmniPlatformEnum (less OOT / UNSPECIFIED): the overlay key is the
# platform's lower-case device name.
# vllm_omni.config.stage_config._STAGE_RESERVED_KEYS: not engine args.
_STAGE_RESERVED_KEYS = frozenset(
    {
        "async_chunk",
        "stage_id",
        "devices",
        "num_replicas",
        "env",
        "output_connectors",
        "input_connectors",
        "default_sampling_params",
        "default_pooling_params",
        "engine_extras",
        "engine_args",
        "runtime",
    }
)
# vllm_omni.config.stage_config._DEEP_MERGE_KEYS: merged key by key across base_config.
_DEEP_MERGE_KEYS = frozenset(
    {"default_sampling_params", "default_pooling_params", "subtalker_sampling_params", "engine_extras", "engine_args"}
)
_LEGACY_MIGRATION = (
    "rename the top-level `stage_args:` key to `stages:` (each stage's `engine_args:` and `runtime:` "
    "blocks are still read there)"
)


# --- merging with marks -------------------------------------------------------------------


def _marked(src: Any = None) -> MarkedDict:
    new = MarkedDict(src or {})
    if isinstance(src, MarkedDict):
        new.where = src.where
        new.key_where = dict(src.key_where)
        new.value_where = dict(src.value_where)
    return new


def _set(dst: MarkedDict, key: Any, value: Any, src: Any) -> None:
    dst[key] = value
    if isinstance(src, MarkedDict):
        if key in src.key_where:
            dst.key_where[key] = src.key_where[key]
        if key in src.value_where:
            dst.value_where[key] = src.value_where[key]


def _merge(original: Any, update: Any) -> MarkedDict:
    """``_get_recursively_merged_dict``: nested dicts merge, anything else is replaced."""
    merged = _marked(original)
    for key, value in update.items():
        old = merged.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            _set(merged, key, _merge(old, value), update)
        else:
            _set(merged, key, value, update)
    return merged


def _deep_merge_stage(base: MarkedDict, overlay: MarkedDict) -> MarkedDict:
    merged = _marked(base)
    for key, value in overlay.items():
        _set(merged, key, value, overlay)
    base_sub = {k: v for k, v in base.items() if k in _DEEP_MERGE_KEYS}
    over_sub = _marked({k: v for k, v in overlay.items() if k in _DEEP_MERGE_KEYS})
    over_sub.key_where = dict(overlay.key_where)
    over_sub.value_where = dict(overlay.value_where)
    for key, value in _merge(_marked(base_sub), over_sub).items():
        merged[key] = value
    return merged


def _merge_stage_lists(base: list[Any] | None, overlay: list[Any] | None) -> MarkedList:
    by_id: dict[int, MarkedDict] = {s["stage_id"]: s for s in (base or [])}
    for stage in overlay or []:
        sid = stage["stage_id"]
        by_id[sid] = _deep_merge_stage(by_id[sid], stage) if sid in by_id else stage
    out = MarkedList(by_id.values())
    out.where = getattr(overlay, "where", None) or getattr(base, "where", None)
    return out


def _merge_platforms(base: Any, overlay: Any) -> MarkedDict | None:
    if not base and not overlay:
        return None
    base, overlay = base or {}, overlay or {}
    merged = _marked(overlay if isinstance(overlay, MarkedDict) else base)
    merged.clear()
    for plat in list(base) + [p for p in overlay if p not in base]:
        bp, op = base.get(plat) or {}, overlay.get(plat) or {}
        plat_merged = _marked(bp)
        for k, v in op.items():
            if k != "stages":
                _set(plat_merged, k, v, op)
        plat_merged["stages"] = _merge_stage_lists(bp.get("stages"), op.get("stages"))
        merged[plat] = plat_merged
    return merged


# --- shape checks (per file, before merging) ---------------------------------------------


def _check_stage_list(doc: MarkedDict, key: str, file: str) -> None:
    """A ``stages``-like list: mappings with a unique, non-negative int ``stage_id``."""
    stages = doc.get(key)
    if stages is None:
        return
    if not isinstance(stages, list):
        raise DeployStagesInvalid(
            f"`{key}` must be a list of stage entries (`- stage_id: 0 ...`), got {yaml_type(stages)}",
            where=doc.where_of(key, value=True),
            key=key,
        )
    seen: dict[int, Where | None] = {}
    for i, entry in enumerate(stages):
        item_where = stages.item_where[i] if isinstance(stages, MarkedList) and i < len(stages.item_where) else None
        if not isinstance(entry, dict):
            raise StageInvalid(
                f"`{key}[{i}]` must be a mapping with a `stage_id`, got {yaml_type(entry)}",
                where=item_where or Where(file=file),
                key=f"{key}[{i}]",
            )
        if "stage_id" not in entry:
            raise StageIdMissing(
                f"`{key}[{i}]` has no `stage_id`; add `stage_id: <int>` to the entry",
                where=getattr(entry, "where", None) or item_where,
                key=f"{key}[{i}].stage_id",
            )
        sid = entry["stage_id"]
        sid_where = entry.where_of("stage_id", value=True) if isinstance(entry, MarkedDict) else item_where
        if isinstance(sid, bool) or not isinstance(sid, int) or sid < 0:
            raise StageIdInvalid(
                f"stage_id must be a non-negative integer, got {sid!r} ({yaml_type(sid)}); "
                f"write e.g. `stage_id: {i}` without quotes",
                where=sid_where,
                key=f"{key}[{i}].stage_id",
            )
        if sid in seen:
            first = seen[sid]
            raise StageIdDuplicate(
                f"duplicate stage_id {sid} (first at {first}); each stage entry needs its own id "
                "(vLLM-Omni would silently keep only the last one)",
                where=sid_where,
                key=f"{key}[{i}].stage_id",
                details={"stage_id": sid},
            )
        seen[sid] = sid_where
        for block in ("engine_args", "runtime", "profiler_config"):
            if block in entry and entry[block] is not None and not isinstance(entry[block], dict):
                raise (ProfilerConfigInvalid if block == "profiler_config" else StageInvalid)(
                    f"stage {sid}: `{block}` must be a mapping, got {yaml_type(entry[block])}",
                    where=entry.where_of(block, value=True) if isinstance(entry, MarkedDict) else sid_where,
                    key=f"{key}[{i}].{block}",
                )


def _check_platforms(doc: MarkedDict) -> None:
    platforms = doc.get("platforms")
    if platforms is None:
        return
    if not isinstance(platforms, dict):
        raise PlatformsInvalid(
            "`platforms` must be a mapping of platform name to overrides (e.g. `platforms: {npu: {stages: [...]}}`)",
            where=doc.where_of("platforms", value=True),
            key="platforms",
        )
    for name, section in platforms.items():
        if section is None:
            continue
        if not isinstance(section, dict):
            raise PlatformsInvalid(
                f"`platforms.{name}` must be a mapping with a `stages:` list",
                where=platforms.where_of(name, value=True) if isinstance(platforms, MarkedDict) else None,
                key=f"platforms.{name}",
            )
        _check_stage_list(section, "stages", str(doc.where.file if doc.where else ""))


def _read_document(path: Path) -> MarkedDict:
    doc = load_yaml(path)
    where = Where(file=str(path), line=1, column=1)
    if doc is None:
        raise ConfigEmpty(
            f"{path} is empty; a deploy file needs a top-level `stages:` list", where=where
        )
    if not isinstance(doc, dict):
        raise ConfigNotMapping(
            f"{path}: the top level must be a mapping (`stages: [...]`), got {yaml_type(doc)}",
            where=getattr(doc, "where", None) or where,
        )
    _check_stage_list(doc, "stages", str(path))
    _check_stage_list(doc, "stage_args", str(path))
    _check_platforms(doc)
    return doc


def _resolve(path: Path, chain: list[Path]) -> tuple[MarkedDict, list[Path]]:
    """``resolve_deploy_yaml`` with cycle detection; returns the merged doc and the base chain."""
    doc = _read_document(path)
    base = doc.pop("base_config", None)
    if base is None:
        return doc, []
    base_where = doc.where_of("base_config", value=True)
    if not isinstance(base, str) or not base:
        raise BaseConfigInvalid(
            f"base_config must be a file path (relative to {path.parent}), got {base!r}",
            where=base_where,
            key="base_config",
        )
    base_path = path.parent / base
    try:
        kind = not_a_file(base_path.stat().st_mode)
    except OSError:
        kind = "missing"
    if kind is not None and kind != "missing":
        raise BaseConfigInvalid(
            f"base_config {base!r} is {kind} ({base_path}), not a YAML file; name the base deploy YAML, relative "
            "to the folder of the file that names it",
            where=base_where,
            key="base_config",
        )
    if kind == "missing":
        raise BaseConfigMissing(
            f"base_config {base!r} not found (looked for {base_path}); the path is relative to the folder "
            "of the file that names it",
            where=base_where,
            key="base_config",
        )
    resolved = base_path.resolve()
    seen = [p.resolve() for p in chain] + [path.resolve()]
    if resolved in seen:
        cycle = " -> ".join(str(p) for p in [*seen, resolved])
        raise BaseConfigCycle(
            f"base_config cycle: {cycle}; one of these files must stop naming a base_config",
            where=base_where,
            key="base_config",
        )
    base_doc, base_chain = _resolve(base_path, [*chain, path])
    merged = _marked(base_doc)
    for k, v in doc.items():
        if k not in ("connectors", "stages", "platforms"):
            _set(merged, k, v, doc)
    if base_doc.get("connectors") or doc.get("connectors"):
        merged["connectors"] = _merge(base_doc.get("connectors") or {}, doc.get("connectors") or {})
    merged["stages"] = _merge_stage_lists(base_doc.get("stages"), doc.get("stages"))
    platforms = _merge_platforms(base_doc.get("platforms"), doc.get("platforms"))
    if platforms is not None:
        merged["platforms"] = platforms
    return merged, [base_path, *base_chain]


def resolve_deploy(path: str | Path) -> MarkedDict:
    """The merged raw document after ``base_config`` inheritance (what vLLM-Omni parses)."""
    return _resolve(Path(path), [])[0]


# --- per stage ----------------------------------------------------------------------------


def _flatten_stage(entry: MarkedDict) -> MarkedDict:
    """``_parse_stage_deploy``: flat keys, then ``engine_args`` merged over them."""
    flat = _marked()
    flat.where = getattr(entry, "where", None)
    for k, v in entry.items():
        if k not in _STAGE_RESERVED_KEYS:
            _set(flat, k, v, entry)
    engine_args = entry.get("engine_args") or {}
    for k, v in engine_args.items():
        old = flat.get(k)
        _set(flat, k, _merge(old, v) if isinstance(v, dict) and isinstance(old, dict) else v, engine_args)
    # ``profiler_config`` is a StageDeployConfig field, so it never lands in the extras from the
    # flat keys; an explicit ``engine_extras.profiler_config`` is kept apart: it wins (see _yaml_pc).
    extras = {k: v for k, v in (entry.get("engine_extras") or {}).items() if k != "profiler_config"}
    return _merge(extras, flat) if extras else flat


def _explicit_extras_pc(entry: MarkedDict) -> tuple[Any, Where | None] | None:
    """``engine_extras.profiler_config`` of a stage entry (value, where), or None when absent."""
    extras = entry.get("engine_extras")
    if not isinstance(extras, dict) or "profiler_config" not in extras:
        return None
    where = extras.where_of("profiler_config") if isinstance(extras, MarkedDict) else getattr(entry, "where", None)
    return extras["profiler_config"], where


def _runtime(entry: MarkedDict) -> dict[str, Any]:
    runtime = entry.get("runtime") or {}
    return {
        "devices": runtime.get("devices", entry.get("devices")),
        "num_replicas": runtime.get("num_replicas", entry.get("num_replicas", 1)),
        "env": runtime.get("env", entry.get("env")),
    }


def _apply_platform(stage: dict[str, Any], ps: MarkedDict) -> None:
    """``_apply_platform_overrides`` for one stage: replaces keys (profiler_config included)."""
    if "engine_args" in ps:
        overrides = dict(ps["engine_args"] or {})
        runtime = ps.get("runtime") or {}
        if "num_replicas" in runtime:
            overrides["num_replicas"] = runtime["num_replicas"]
        devices = runtime.get("devices")
        src = ps["engine_args"]
    else:
        overrides = {k: v for k, v in ps.items() if k not in ("stage_id", "devices", "env")}
        devices = ps.get("devices")
        src = ps
    if devices is not None:
        stage["devices"] = devices
    for key, value in overrides.items():
        if key in ("num_replicas", "devices", "env"):
            # StageDeployConfig fields: ``setattr`` upstream, never engine extras.
            stage[key] = value
        elif key == "engine_extras" and isinstance(value, dict):
            # A dict-valued _DEEP_MERGE_KEYS field: shallow-merged; its profiler_config wins later.
            if "profiler_config" in value:
                where = value.where_of("profiler_config") if isinstance(value, MarkedDict) else None
                stage["extras_pc"] = (value["profiler_config"], where)
            rest = {k: v for k, v in value.items() if k != "profiler_config"}
            for k, v in rest.items():
                _set(stage["flat"], k, v, value)
        elif key in _DEEP_MERGE_KEYS and isinstance(value, dict) and isinstance(stage["flat"].get(key), dict):
            stage["flat"][key] = {**stage["flat"][key], **value}
        else:
            _set(stage["flat"], key, value, src)


def _build_stage(stage: dict[str, Any], file: str) -> tuple[Stage, list[Finding]]:
    flat: MarkedDict = stage["flat"]
    sid: int = stage["stage_id"]
    findings: list[Finding] = []
    marks: dict[str, Where] = {}
    entry_where = stage["where"]
    if entry_where:
        marks["stage"] = entry_where
    if "stage_id" in stage["marks"]:
        marks["stage_id"] = stage["marks"]["stage_id"]
    raw_pc, pc_where, source = stage["pc"], stage["pc_where"] or entry_where, stage["pc_source"]
    profiler: ProfilerConfig | None = None
    if raw_pc is not None:
        if not isinstance(raw_pc, dict):
            raise ProfilerConfigInvalid(
                f"stage {sid}: profiler_config must be a mapping (e.g. `{{profiler: torch, torch_profiler_dir: /tmp/x}}`)",
                where=pc_where,
                key="profiler_config",
            )
        if pc_where:
            marks["profiler_config"] = pc_where
        for k in raw_pc:
            w = raw_pc.where_of(k) if isinstance(raw_pc, MarkedDict) else None
            w = stage["pc_key_where"].get(k) or w
            if w:
                marks[f"profiler_config.{k}"] = w
        try:
            profiler = ProfilerConfig(**{str(k): v for k, v in raw_pc.items()})
        except ValidationError as err:
            message, key = profiler_config_error(err)
            where = marks.get(f"profiler_config.{key}") if key else None
            # A merge the command line took part in is the command line's to fix.
            flag = source if source in (STAGE_OVERRIDES_FLAG, PROFILER_CONFIG_FLAG) else None
            error_cls: type[ConfigError] = ProfilerConfigInvalid
            hint = ""
            if flag == STAGE_OVERRIDES_FLAG:
                error_cls, hint = StageOverridesInvalid, (
                    f" (from {STAGE_OVERRIDES_FLAG}[\"{sid}\"].profiler_config, deep-merged over the deploy file's; "
                    "fix the JSON)"
                )
            elif flag == PROFILER_CONFIG_FLAG:
                error_cls, hint = ProfilerConfigArgInvalid, (
                    f" (after merging {PROFILER_CONFIG_FLAG} over the deploy file's: vLLM-Omni passes every field of "
                    "that JSON, the ones it leaves out at vLLM's defaults; set the key in the JSON, or give this "
                    f"stage its own {STAGE_OVERRIDES_FLAG} entry)"
                )
            raise error_cls(
                f"stage {sid}: profiler_config: {message}{hint}",
                where=where or pc_where,
                key=f"profiler_config.{key}" if key else "profiler_config",
                details={"stage_id": sid, "vllm_error": err.errors()[0].get("msg"), "source": source},
            ) from None
        raw_dir = raw_pc.get("torch_profiler_dir")
        if isinstance(raw_dir, str) and "${" in raw_dir:
            # vLLM-Omni reads the file with OmegaConf and resolves interpolations in the server's own
            # environment: the dir the traces land in is not the text the sidecar reads.
            findings.append(
                Finding(
                    code="profiler_dir_interpolation",
                    severity=Severity.warning,
                    message=(
                        f"torch_profiler_dir {raw_dir!r} holds an OmegaConf interpolation: vLLM-Omni resolves it "
                        "in the server's environment, so the sidecar cannot tell where the traces land and would "
                        "look in a folder literally named so; write the path itself (render --dir DIR writes one)"
                    ),
                    stage_id=sid,
                    key="profiler_config.torch_profiler_dir",
                    where=marks.get("profiler_config.torch_profiler_dir") or pc_where,
                )
            )
        elif isinstance(raw_dir, str) and raw_dir and not _is_uri_path(raw_dir) and not os.path.isabs(
            os.path.expanduser(raw_dir)
        ):
            findings.append(
                Finding(
                    code="profiler_dir_relative",
                    severity=Severity.warning,
                    message=(
                        f"torch_profiler_dir {raw_dir!r} is relative: vLLM resolves it against the server's working "
                        "directory, which the sidecar cannot see; write an absolute path"
                    ),
                    stage_id=sid,
                    key="profiler_config.torch_profiler_dir",
                    where=marks.get("profiler_config.torch_profiler_dir") or pc_where,
                )
            )
    replicas = stage["num_replicas"]
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        try:
            replicas = int(replicas)
            if replicas < 1:
                raise ValueError
        except (TypeError, ValueError):
            raise NumReplicasInvalid(
                f"stage {sid}: num_replicas must be a positive integer, got {stage['num_replicas']!r}",
                where=entry_where,
                key="num_replicas",
            ) from None
    extras = {str(k): v for k, v in flat.items() if k != "profiler_config"}
    kind = StageKind.unknown
    for kind_key in STAGE_KIND_KEYS:
        if kind_key in extras:
            value = str(extras[kind_key]).lower()
            if value not in ("llm", "diffusion"):
                raise StageKindInvalid(
                    f"stage {sid}: {kind_key} must be `llm` or `diffusion`, got {extras[kind_key]!r}",
                    where=flat.where_of(kind_key, value=True),
                    key=kind_key,
                )
            kind = StageKind(value)
            if kind_key == "emulator_stage_kind":
                findings.append(
                    Finding(
                        code="emulator_only_key",
                        severity=Severity.warning,
                        message=(
                            "`emulator_stage_kind` is for the emulator only: vLLM-Omni 0.30's resolver refuses unknown "
                            "stage keys at start-up (\"no structured config owner\" / \"Unknown diffusion config "
                            "field(s)\"); drop it for a real server (the emulator also takes --diffusion-stages)"
                        ),
                        stage_id=sid,
                        key=kind_key,
                        where=flat.where_of(kind_key),
                    )
                )
            break
    devices = stage["devices"]
    return (
        Stage(
            stage_id=sid,
            kind=kind,
            profiler_config=profiler,
            devices=None if devices is None else str(devices),
            num_replicas=replicas,
            where=entry_where,
            extras=extras,
            marks=marks,
            profiler_source=source if profiler is not None else None,
        ),
        findings,
    )


def check_platform(platform: str | None) -> str | None:
    """``platform`` when it is one of vLLM-Omni's names (or None: no overlay), else ``PlatformUnknown``."""
    if platform is None or platform in PLATFORMS:
        return platform
    close = difflib.get_close_matches(str(platform), PLATFORMS, n=1, cutoff=0.5)
    hint = f"did you mean `{close[0]}`? " if close else ""
    raise PlatformUnknown(
        f"unknown platform {platform!r}: vLLM-Omni applies `platforms.<name>` overlays for "
        f"{', '.join(PLATFORMS)} only (a typo would silently apply none); {hint}pass --platform one of those",
        key="platform",
        details={"platform": platform, "choices": list(PLATFORMS)},
    )


def _yaml_pc(stage: dict[str, Any]) -> tuple[Any, Where | None, str | None]:
    """The deploy file's profiler_config for a stage: ``engine_extras.profiler_config`` when present
    (``engine_args.update(engine_extras)`` upstream: it replaces the flat key, even with null)."""
    if stage["extras_pc"] is not None:
        value, where = stage["extras_pc"]
        return value, where, "engine_extras"
    flat: MarkedDict = stage["flat"]
    if flat.get("profiler_config") is None:
        return None, None, None
    return flat["profiler_config"], flat.where_of("profiler_config"), "yaml"


def _apply_cli(
    stage: dict[str, Any],
    stage_overrides: dict[str, dict[str, Any]] | None,
    global_pc: dict[str, Any] | None,
) -> None:
    """The command line over one stage: profiler_config deep-merged (the stage's own override
    replacing the global one), ``devices`` / ``num_replicas`` replaced, the rest kept as extras."""
    sid = stage["stage_id"]
    raw, where, source = _yaml_pc(stage)
    stage["pc_key_where"] = {}
    cli_pc, flag = cli_profiler_config(sid, stage_overrides, global_pc)
    if cli_pc is not None:
        if isinstance(raw, dict):
            merged = _marked(raw)
            for k, v in deep_merge(raw, cli_pc).items():
                merged[k] = v
            raw = merged
        else:
            raw = cli_pc
        # Findings and errors about a key the command line set point at the flag, not the file.
        stage["pc_key_where"] = {k: Where(file=flag) for k in cli_pc}
        where = where or Where(file=flag)
        source = flag
    stage["pc"], stage["pc_where"], stage["pc_source"] = raw, where, source
    own = (stage_overrides or {}).get(str(sid)) or {}
    for key, value in own.items():
        if key == "profiler_config" or value is None:
            continue  # None: vLLM-Omni drops unset overrides
        if key in RUNTIME_KEYS:
            stage[key] = value
        else:
            old = stage["flat"].get(key)
            stage["flat"][key] = deep_merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value


def _legacy_finding(doc: MarkedDict) -> Finding:
    return Finding(
        code="legacy_schema",
        severity=Severity.warning,
        message=f"uses the removed `stage_args` schema, which vLLM-Omni 0.30 rejects at start-up; {_LEGACY_MIGRATION}",
        key="stage_args",
        where=doc.where_of("stage_args"),
    )


def load_deploy_config(
    path: str | Path,
    *,
    platform: str | None = "cuda",
    stage_overrides: str | Mapping[str, Any] | None = None,
    profiler_config: str | Mapping[str, Any] | None = None,
) -> DeployConfig:
    """Read a deploy YAML as vLLM-Omni 0.30 would on ``platform`` (``None``: no platform overlay),
    started with ``--stage-overrides`` / ``--profiler-config`` (JSON text or mappings).

    Each stage's ``profiler_config`` is the server's effective one: the file's (``engine_args``
    over the flat key, the platform overlay replacing it, ``engine_extras.profiler_config``
    winning over both), then the command line deep-merged over it. A stage override naming a stage
    the file lacks is refused (``StageOverridesInvalid``): the server would silently ignore it.
    """
    path = Path(path)
    platform = check_platform(platform)
    overrides = parse_stage_overrides(stage_overrides)
    global_pc = parse_profiler_config_arg(profiler_config)
    doc, chain = _resolve(path, [])
    findings: list[Finding] = []
    legacy = "stage_args" in doc
    if legacy:
        entries = doc.get("stage_args") or []
        findings.append(_legacy_finding(doc))
    else:
        entries = doc.get("stages") or []
    stages: dict[int, dict[str, Any]] = {}
    for entry in entries:
        rt = _runtime(entry)
        stages[entry["stage_id"]] = {
            "stage_id": entry["stage_id"],
            "flat": _flatten_stage(entry),
            "extras_pc": _explicit_extras_pc(entry),
            "where": getattr(entry, "where", None),
            "marks": {"stage_id": entry.where_of("stage_id", value=True)} if isinstance(entry, MarkedDict) else {},
            **rt,
        }
    if platform is not None and isinstance(doc.get("platforms"), dict):
        section = doc["platforms"].get(platform) or {}
        for ps in section.get("stages") or []:
            if ps["stage_id"] in stages:
                _apply_platform(stages[ps["stage_id"]], ps)
    unknown = sorted(int(k) for k in (overrides or {}) if int(k) not in stages)
    if unknown:
        raise StageOverridesInvalid(
            f"{STAGE_OVERRIDES_FLAG} names stages {unknown} that {path} does not define (it has "
            f"{sorted(stages)}); vLLM-Omni would ignore them silently. Use the deploy file's stage ids",
            key=f"stage_overrides[\"{unknown[0]}\"]",
            where=Where(file=STAGE_OVERRIDES_FLAG),
            details={"stages": unknown, "known": sorted(stages)},
        )
    built: list[Stage] = []
    for stage in stages.values():
        _apply_cli(stage, overrides, global_pc)
        s, f = _build_stage(stage, str(path))
        built.append(s)
        findings.extend(f)
    return DeployConfig(
        path=path,
        platform=platform or "",
        stages=built,
        legacy_schema=legacy,
        base_chain=chain,
        findings=findings,
        stage_overrides=overrides,
        profiler_config_arg=global_pc,
    )


def deploy_from_profiler_config(
    profiler_config: str | Mapping[str, Any],
    *,
    stage_overrides: str | Mapping[str, Any] | None = None,
    stage_ids: Sequence[int] | None = None,
) -> DeployConfig:
    """A server described by its command line alone (no deploy YAML): plain ``vllm serve`` (one
    engine, modelled as stage 0; ``stage_ids`` None), or ``vllm serve --omni`` without
    ``--deploy-config`` (``stage_ids``: the stages its pipeline defines), each stage with the
    ``--profiler-config`` JSON given to the server and its own ``--stage-overrides``."""
    if stage_overrides is not None and stage_ids is None:
        raise StageOverridesInvalid(
            f"{STAGE_OVERRIDES_FLAG} is a `vllm serve --omni` flag; plain vLLM has one engine and takes only "
            f"{PROFILER_CONFIG_FLAG}. Drop {STAGE_OVERRIDES_FLAG}, or pass --deploy-config for an Omni server",
            key="stage_overrides",
            where=Where(file=STAGE_OVERRIDES_FLAG),
        )
    pc = parse_profiler_config_arg(profiler_config)
    assert pc is not None
    overrides = parse_stage_overrides(stage_overrides)
    ids = [0] if stage_ids is None else list(stage_ids)
    unknown = sorted(int(k) for k in (overrides or {}) if int(k) not in ids)
    if unknown:
        raise StageOverridesInvalid(
            f"{STAGE_OVERRIDES_FLAG} names stages {unknown} that --stages does not list ({ids}); vLLM-Omni would "
            "ignore them silently. List every stage of the server's pipeline in --stages",
            key=f"stage_overrides[\"{unknown[0]}\"]",
            where=Where(file=STAGE_OVERRIDES_FLAG),
            details={"stages": unknown, "known": ids},
        )
    built: list[Stage] = []
    findings: list[Finding] = []
    for sid in ids:
        stage = {"stage_id": sid, "flat": _marked(), "extras_pc": None, "where": None, "marks": {},
                 "devices": None, "num_replicas": 1, "env": None}  # fmt: skip
        _apply_cli(stage, overrides, pc)
        s, f = _build_stage(stage, PROFILER_CONFIG_FLAG)
        built.append(s)
        findings.extend(f)
    return DeployConfig(path=None, platform="", stages=built, findings=findings, stage_overrides=overrides,
                        profiler_config_arg=pc, plain_vllm=stage_ids is None)  # fmt: skip


def load_server_config(
    deploy_config: str | Path | None,
    *,
    flavor: str = "omni",
    platform: str | None = "cuda",
    stage_overrides: str | Mapping[str, Any] | None = None,
    profiler_config: str | Mapping[str, Any] | None = None,
    allow_legacy: bool = False,
    stages: Sequence[int] | None = None,
) -> DeployConfig:
    """What the surfaces (serve, validate, fleet) call: the server's config from its deploy YAML and
    command line, or from its command line alone: plain vLLM (``flavor="vllm"``) from
    ``--profiler-config``, ``vllm serve --omni`` without a deploy YAML from ``--profiler-config``
    and the pipeline's ``stages`` (the server lists them nowhere: vLLM-Omni 0.30 has no route for it).
    A legacy ``stage_args:`` file is refused like 0.30 refuses it, unless ``allow_legacy``."""
    if stages is not None and (deploy_config is not None or flavor == "vllm"):
        raise StagesFlagMisplaced(
            "--stages lists the stages of a `vllm serve --omni` started without --deploy-config; "
            + ("the deploy file defines its stages: drop --stages" if deploy_config is not None
               else "plain `vllm serve` has one engine: drop --stages"),
            key="stages",
        )
    if deploy_config is None:
        if profiler_config is None:
            raise DeployConfigMissing(
                "no server config: pass --deploy-config FILE (the YAML `vllm serve --omni` was started with), "
                "or the server's --profiler-config JSON with --stages (the pipeline's stage ids, e.g. 0,1) for "
                "`vllm serve --omni` without one, or with --flavor vllm for plain `vllm serve`",
                key="deploy_config",
            )
        if flavor != "vllm" and stages is None:
            raise DeployConfigMissing(
                "--profiler-config without --deploy-config: name the server's stages with --stages (e.g. "
                "--stages 0,1; `vllm serve --omni` without a deploy file runs the model's bundled pipeline, "
                "vllm_omni/deploy/<model>.yaml, or one diffusion stage 0, and no route of the server lists "
                "them), pass the --deploy-config it was started with, or --flavor vllm for plain `vllm serve`",
                key="stages",
            )
        check_platform(platform)
        return deploy_from_profiler_config(profiler_config, stage_overrides=stage_overrides, stage_ids=stages)
    deploy = load_deploy_config(
        deploy_config, platform=platform, stage_overrides=stage_overrides, profiler_config=profiler_config
    )
    if deploy.legacy_schema and not allow_legacy:
        legacy = next(f for f in deploy.findings if f.code == "legacy_schema")
        raise LegacySchemaRefused(
            f"{deploy.path} {legacy.message} (or pass --allow-legacy to read it anyway)",
            where=legacy.where,
            key="stage_args",
        )
    return deploy


def version_findings(deploy: DeployConfig, vllm: VllmDialect, omni: OmniDialect | None,
                     device: str | None = None) -> list[Finding]:
    """What a server of these versions says of ``deploy`` that the newest known version's rules
    (the loader's) let through: a profiler_config key or value that vLLM refuses (its own message,
    naming the version that brought a key), a profiler or activities its workers on ``device``
    (cpu, cuda, xpu) refuse at start, a deploy key the vLLM-Omni release does not know yet (it
    refuses to start), and the options that version ignores (warnings)."""
    out: list[Finding] = []
    for stage in deploy.stages:
        pc = stage.profiler_config
        if pc is None:
            continue
        code, refused = "profiler_config_version", check_for_version(
            {k: getattr(pc, k) for k in pc.model_fields_set}, vllm)
        if refused is None:
            activities = None if pc.torch_profiler_activities is None else list(pc.torch_profiler_activities)
            code, refused = "profiler_config_device", worker_refusal(vllm, pc.profiler, activities, device)
            if refused is not None:  # vLLM's words, and who says them when
                refused = (refused[0], f"{refused[1]} ({vllm.name}'s {device} workers refuse it at start; "
                                       "--device names the workers' device)")
        if refused is not None:
            key, message = refused
            out.append(Finding(code=code, severity=Severity.error, stage_id=stage.stage_id,
                               message=f"profiler_config: {message}", key=f"profiler_config.{key}" if key else None,
                               where=stage.marks.get(f"profiler_config.{key}") or stage.marks.get("profiler_config")))
            continue
        if pc.capture_torch_profiler and not vllm.capture_torch_profiler:
            out.append(Finding(
                code="capture_torch_profiler_noop", severity=Severity.warning, stage_id=stage.stage_id,
                key="profiler_config.capture_torch_profiler",
                where=stage.marks.get("profiler_config.capture_torch_profiler"),
                message=f"capture_torch_profiler does nothing on {vllm.name} (\"capture_torch_profiler is deprecated "
                        "and has no effect. It will be removed in a future release.\"): drop it"))
        if pc.torch_profiler_activities is not None and omni is not None and omni.ignores_activities:
            out.append(Finding(
                code="activities_ignored", severity=Severity.warning, stage_id=stage.stage_id,
                key="profiler_config.torch_profiler_activities",
                where=stage.marks.get("profiler_config.torch_profiler_activities"),
                message=f"{omni.name}'s torch stages build their profiler with the platform's default activities: "
                        f"torch_profiler_activities {list(pc.torch_profiler_activities)} is accepted and ignored "
                        "(the trace records CPU and the device as without it)"))
    if omni is not None:
        out += _deploy_keys_findings(deploy, omni)
    return out


def _deploy_keys_findings(deploy: DeployConfig, omni: OmniDialect) -> list[Finding]:
    unknown = omni_deploy_keys_unknown(omni)
    stage_keys = {k: since for scope, k, since in unknown if scope == "stage"}
    top_keys = {k: since for scope, k, since in unknown if scope == "top"}
    removed = dict(omni_deploy_keys_removed(omni))
    # what the release says of a key it does not have: added later, or dropped before
    why = {**{k: (f"`{k}` is a stage key of vLLM-Omni {v}: {omni.name} refuses it at start-up; drop it, or run "
                  f"vLLM-Omni {v} or later") for k, v in stage_keys.items()},
           **{k: (f"`{k}` is no stage key of {omni.name} (vLLM-Omni {v} dropped it): it refuses it at start-up as an "
                  f"unknown key; drop it, or run a vLLM-Omni before {v}") for k, v in removed.items()}}
    out: list[Finding] = [
        Finding(code="deploy_key_version", severity=Severity.error, stage_id=stage.stage_id, key=key,
                where=stage.where, message=why[key])
        for stage in deploy.stages for key in sorted(set(stage.extras) & set(why))]
    if deploy.path is not None and top_keys:
        doc = resolve_deploy(deploy.path)
        for key in sorted(set(doc) & set(top_keys)):
            out.append(Finding(
                code="deploy_key_version", severity=Severity.error, key=key, where=doc.where_of(key),
                message=f"top-level `{key}` is a key of vLLM-Omni {top_keys[key]}: {omni.name} refuses it at start-up; "
                f"drop it, or run vLLM-Omni {top_keys[key]} or later"))
    return out
