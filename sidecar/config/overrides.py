"""The server's command-line config: ``--stage-overrides`` and ``--profiler-config`` parsed and
checked the way ``vllm serve --omni`` (0.30) parses them, and the rule that merges them over each
stage's deploy-file ``profiler_config``; ``profiler_config_error`` words a ``ProfilerConfig`` that
does not validate, for these flags and the deploy loader alike. Pure: no vllm import;
contract-tested against vLLM-Omni.

Rules (read from vllm_omni/config/resolver.py, stage_config.py and omni_config.py):
- ``--stage-overrides`` is a JSON object ``{"<stage id>": {<engine key>: value}}``; keys are
  digit strings. Each stage's keys become ``stage_<id>_<key>`` CLI overrides.
- ``--profiler-config`` is parsed into vLLM's ``ProfilerConfig`` and handed on as a dict of
  EVERY field (those that are ``None`` with a ``None`` default left out), so a global JSON that
  names one key still resets the others to vLLM's defaults in every stage it reaches.
- Per stage, a ``stage_<id>_profiler_config`` replaces the global one outright (it is flattened
  after it); the winner is deep-merged over the stage's deploy-file ``profiler_config``.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from sidecar.config._yaml import yaml_type
from sidecar.config.profiler import ProfilerConfig
from sidecar.errors import ProfilerConfigArgInvalid, StageOverridesInvalid, Where

__all__ = [
    "PROFILER_CONFIG_FLAG",
    "STAGE_OVERRIDES_FLAG",
    "cli_profiler_config",
    "deep_merge",
    "parse_profiler_config_arg",
    "parse_stage_overrides",
    "profiler_config_error",
]

STAGE_OVERRIDES_FLAG = "--stage-overrides"
PROFILER_CONFIG_FLAG = "--profiler-config"
# Stage-override keys the sidecar reads besides profiler_config (the rest is kept as extras).
RUNTIME_KEYS = ("devices", "num_replicas")


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, list(ProfilerConfig.model_fields), n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else f"; valid keys: {', '.join(ProfilerConfig.model_fields)}"


def profiler_config_error(err: ValidationError) -> tuple[str, str | None]:
    """vLLM's error text for the first problem, and the ProfilerConfig key it is about."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    msg = first.get("msg", str(err))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if first.get("type") == "extra_forbidden" and loc:
        return f"unknown key `{loc[0]}`{_did_you_mean(loc[0])}", loc[0]
    if loc:
        return f"`{loc[0]}`: {msg}", loc[0]
    key = next((f for f in ProfilerConfig.model_fields if msg.startswith(f)), None)
    return msg, key


def _loads(value: str, flag: str, error: type[Exception]) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise error(  # type: ignore[call-arg]
            f"{flag} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            f"quote it for the shell, e.g. {flag} "
            + ("'{\"0\": {\"profiler_config\": {\"profiler\": \"torch\", \"torch_profiler_dir\": \"/data/perf\"}}}'"
               if flag == STAGE_OVERRIDES_FLAG
               else "'{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/data/perf\"}'"),
            key=flag.lstrip("-").replace("-", "_"),
            where=Where(file=flag),
        ) from None


def parse_stage_overrides(value: str | Mapping[str, Any] | None) -> dict[str, dict[str, Any]] | None:
    """``--stage-overrides`` as vLLM-Omni's ``parse_stage_overrides`` accepts it (JSON text or a
    mapping); ``StageOverridesInvalid`` names the bad part and the fix."""
    if value is None:
        return None
    parsed = _loads(value, STAGE_OVERRIDES_FLAG, StageOverridesInvalid) if isinstance(value, str) else value
    if not isinstance(parsed, Mapping):
        raise StageOverridesInvalid(
            f"{STAGE_OVERRIDES_FLAG} must be a JSON object mapping stage id -> overrides, got "
            f"{yaml_type(parsed)}; e.g. '{{\"0\": {{\"profiler_config\": {{...}}}}}}'",
            key="stage_overrides",
            where=Where(file=STAGE_OVERRIDES_FLAG),
        )
    out: dict[str, dict[str, Any]] = {}
    for stage_id, overrides in parsed.items():
        if not isinstance(stage_id, str) or not stage_id.isascii() or not stage_id.isdigit():
            raise StageOverridesInvalid(
                f"{STAGE_OVERRIDES_FLAG} keys must be non-negative integer stage ids as strings "
                f"(\"0\", \"2\"), got {stage_id!r}",
                key=f"stage_overrides[{stage_id!r}]",
                where=Where(file=STAGE_OVERRIDES_FLAG),
            )
        if not isinstance(overrides, Mapping):
            raise StageOverridesInvalid(
                f"{STAGE_OVERRIDES_FLAG}[\"{stage_id}\"] must be an object of engine keys, got "
                f"{yaml_type(overrides)}: {overrides!r}",
                key=f"stage_overrides[\"{stage_id}\"]",
                where=Where(file=STAGE_OVERRIDES_FLAG),
            )
        pc = overrides.get("profiler_config")
        if pc is not None and not isinstance(pc, Mapping):
            raise StageOverridesInvalid(
                f"{STAGE_OVERRIDES_FLAG}[\"{stage_id}\"].profiler_config must be an object "
                f"(e.g. {{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/data/perf\"}}), got {pc!r}",
                key=f"stage_overrides[\"{stage_id}\"].profiler_config",
                where=Where(file=STAGE_OVERRIDES_FLAG),
            )
        out[stage_id] = dict(overrides)
    return out


def parse_profiler_config_arg(value: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``--profiler-config`` as the dict vLLM-Omni merges into every stage: validated by vLLM's
    rules, every field explicit, the ``None``-valued ones left out (``_convert_dataclasses_to_dict``)."""
    if value is None:
        return None
    parsed = _loads(value, PROFILER_CONFIG_FLAG, ProfilerConfigArgInvalid) if isinstance(value, str) else value
    if not isinstance(parsed, Mapping):
        raise ProfilerConfigArgInvalid(
            f"{PROFILER_CONFIG_FLAG} must be a JSON object of ProfilerConfig keys, got {yaml_type(parsed)}; "
            "e.g. '{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/data/perf\"}'",
            key="profiler_config",
            where=Where(file=PROFILER_CONFIG_FLAG),
        )
    try:
        pc = ProfilerConfig(**{str(k): v for k, v in parsed.items()})
    except ValidationError as err:
        message, key = profiler_config_error(err)
        raise ProfilerConfigArgInvalid(
            f"{PROFILER_CONFIG_FLAG}: {message} (vllm serve refuses this flag at start-up)",
            key=f"profiler_config.{key}" if key else "profiler_config",
            where=Where(file=PROFILER_CONFIG_FLAG),
            details={"vllm_error": err.errors()[0].get("msg")},
        ) from None
    return pc.model_dump(exclude_none=True)


def deep_merge(original: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``_get_recursively_merged_dict``: nested mappings merge, anything else is replaced."""
    merged = dict(original)
    for key, value in update.items():
        old = merged.get(key)
        merged[key] = deep_merge(old, value) if isinstance(old, Mapping) and isinstance(value, Mapping) else value
    return merged


def cli_profiler_config(
    stage_id: int,
    stage_overrides: Mapping[str, Mapping[str, Any]] | None,
    global_profiler_config: Mapping[str, Any] | None,
) -> tuple[dict[str, Any] | None, str | None]:
    """The command-line profiler_config that reaches ``stage_id`` and the flag it came from:
    the stage's own ``--stage-overrides`` entry wins over ``--profiler-config`` (no merge)."""
    own = (stage_overrides or {}).get(str(stage_id)) or {}
    if own.get("profiler_config") is not None:
        return dict(own["profiler_config"]), STAGE_OVERRIDES_FLAG
    if global_profiler_config is not None:
        return dict(global_profiler_config), PROFILER_CONFIG_FLAG
    return None, None
