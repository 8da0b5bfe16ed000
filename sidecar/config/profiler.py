"""ProfilerConfig: our mirror of vLLM's ``vllm.config.ProfilerConfig`` (same fields, defaults,
ranges, path normalisation and error texts; extra keys forbidden). :class:`ProfilerConfig` is the
newest known version's (what a deploy file is read with); :func:`profiler_config_class` gives each
version's own (``sidecar/versions.py`` says which fields it lacks), and :func:`check_for_version`
refuses what that version would refuse, with its own messages. Contract tests diff each against the
real class of that version. Pure: no vllm import.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from sidecar.versions import VllmDialect, profiler_field_since

ProfilerKind = Literal["torch", "cuda", "proton"]
TorchProfilerActivity = Literal["CPU", "CUDA", "PrivateUse1", "XPU"]
ProtonBackend = Literal["cupti"]
ProtonContext = Literal["shadow", "python"]
ProtonData = Literal["tree", "trace"]
ProtonHook = Literal["triton"]
ProtonOutputFormat = Literal["hatchet", "hatchet_msgpack", "chrome_trace"]

# Fields vLLM-Omni's torch workers read; the proton_* fields exist in vLLM but Omni ignores them.
TORCH_FIELDS: tuple[str, ...] = (
    "profiler",
    "torch_profiler_dir",
    "torch_profiler_with_stack",
    "torch_profiler_with_flops",
    "torch_profiler_use_gzip",
    "torch_profiler_dump_cuda_time_total",
    "torch_profiler_record_shapes",
    "torch_profiler_with_memory",
    "capture_torch_profiler",
    "detailed_trace_annotation",
    "ignore_frontend",
    "delay_iterations",
    "max_iterations",
    "warmup_iterations",
    "active_iterations",
    "wait_iterations",
)


def _is_uri_path(path: str) -> bool:
    # Same rule as vLLM: "gs://x" is a URI, "C://x" is a Windows drive.
    if "://" in path:
        return len(path.split("://")[0]) > 1
    return False


def _vllm_rules(self: Any) -> Any:
    # Order and texts follow vllm/config/profiler.py::_validate_profiler_config.
    activities = getattr(self, "torch_profiler_activities", None)  # absent before vLLM 0.31
    if activities is not None:
        if self.profiler != "torch":
            raise ValueError("torch_profiler_activities is only applicable when profiler is set to 'torch'")
        if len(activities) != len(set(activities)):
            raise ValueError("torch_profiler_activities must not contain duplicates")
    if self.torch_profiler_dir and self.profiler != "torch":
        raise ValueError("torch_profiler_dir is only applicable when profiler is set to 'torch'")
    if self.profiler == "torch" and not self.torch_profiler_dir:
        raise ValueError("torch_profiler_dir must be set when profiler is 'torch'")
    if self.torch_profiler_dir and not _is_uri_path(self.torch_profiler_dir):
        # vLLM makes the dir absolute against the *server's* working directory.
        object.__setattr__(
            self, "torch_profiler_dir", os.path.abspath(os.path.expanduser(self.torch_profiler_dir))
        )
    non_default_proton = [
        name
        for name, value, default in (
            ("proton_profiler_dir", self.proton_profiler_dir, ""),
            ("proton_context", self.proton_context, "shadow"),
            ("proton_data", self.proton_data, "tree"),
            ("proton_backend", self.proton_backend, None),
            ("proton_mode", self.proton_mode, None),
            ("proton_hook", self.proton_hook, None),
            ("proton_output_format", self.proton_output_format, None),
            ("proton_graph_attribution", self.proton_graph_attribution, False),
        )
        if value != default
    ]
    if self.profiler != "proton" and non_default_proton:
        raise ValueError(f"{', '.join(non_default_proton)} only applicable when profiler is set to 'proton'")
    if self.profiler == "proton" and not self.proton_profiler_dir:
        raise ValueError("proton_profiler_dir must be set when profiler is 'proton'")
    if self.proton_profiler_dir:
        if _is_uri_path(self.proton_profiler_dir):
            raise ValueError("proton_profiler_dir must be a local directory")
        object.__setattr__(
            self, "proton_profiler_dir", os.path.abspath(os.path.expanduser(self.proton_profiler_dir))
        )
    if self.profiler == "proton":
        fmt = self.proton_output_format
        if self.proton_graph_attribution and self.proton_data != "tree":
            raise ValueError("proton_graph_attribution requires proton_data='tree'")
        if (
            self.proton_graph_attribution
            and self.proton_mode
            and self.proton_mode.split(":", 1)[0].lower() == "periodic_flushing"
        ):
            raise ValueError(
                "proton_graph_attribution is incompatible with periodic_flushing: "
                "both manage Proton data phases."
            )
        if fmt == "chrome_trace" and self.proton_data != "trace":
            raise ValueError("chrome_trace output requires proton_data='trace'")
        if fmt in ("hatchet", "hatchet_msgpack") and self.proton_data != "tree":
            raise ValueError(f"{fmt} output requires proton_data='tree'")
    if self.capture_torch_profiler and self.profiler != "torch":
        raise ValueError("capture_torch_profiler is only applicable when profiler is set to 'torch'")
    return self


class _Rules(BaseModel):
    """vLLM's ProfilerConfig rules, shared by every version's field set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _vllm_rules(self) -> Any:
        return _vllm_rules(self)


class ProfilerConfig(_Rules):
    """A stage's ``profiler_config`` (vLLM's ``ProfilerConfig`` keys, every supported version's), checked
    by vLLM's own rules when made; the sidecar's discrete-mode rules are ``sidecar.config.rules``."""

    profiler: ProfilerKind | None = None
    torch_profiler_dir: str = ""
    # vLLM >= 0.31; vLLM-Omni's torch stages ignore it (up to 0.32.0rc1)
    torch_profiler_activities: list[TorchProfilerActivity] | None = Field(default=None, min_length=1)
    proton_profiler_dir: str = ""
    proton_context: ProtonContext = "shadow"
    proton_data: ProtonData = "tree"
    proton_backend: ProtonBackend | None = None
    proton_mode: str | None = None
    proton_hook: ProtonHook | None = None
    proton_output_format: ProtonOutputFormat | None = None
    proton_graph_attribution: bool = False
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    capture_torch_profiler: bool = False
    detailed_trace_annotation: bool = False
    ignore_frontend: bool = False
    delay_iterations: int = Field(default=0, ge=0)
    max_iterations: int = Field(default=0, ge=0)
    warmup_iterations: int = Field(default=0, ge=0)
    active_iterations: int = Field(default=5, ge=1)
    wait_iterations: int = Field(default=0, ge=0)

    def torch_dict(self) -> dict[str, object]:
        """The torch-relevant fields, every one explicit (what ``render`` writes); a field newer
        than vLLM 0.30 only when set (an older server refuses a key it does not know)."""
        out = {k: getattr(self, k) for k in TORCH_FIELDS}
        if self.torch_profiler_activities is not None:
            out["torch_profiler_activities"] = list(self.torch_profiler_activities)
        return out


@cache
def profiler_config_class(missing: frozenset[str] = frozenset()) -> type[ProfilerConfig]:
    """The ProfilerConfig of a vLLM version that lacks ``missing`` fields of the newest (its
    dialect's ``profiler_fields_missing``): same rules, those keys unknown."""
    if not missing:
        return ProfilerConfig
    fields: dict[str, Any] = {n: (f.annotation, f) for n, f in ProfilerConfig.model_fields.items() if n not in missing}
    return create_model("ProfilerConfig", __base__=_Rules, **fields)  # type: ignore[call-overload,no-any-return]


def check_for_version(values: dict[str, Any], dialect: VllmDialect) -> tuple[str, str] | None:
    """What ``dialect``'s vLLM says of a profiler_config's ``values`` (the keys a deploy or command
    line set): None when it accepts them, else ``(key, message)`` in that version's words: a key it
    does not know names the version that brought it."""
    cls = profiler_config_class(dialect.profiler_fields_missing)
    try:
        cls(**values)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        msg = str(first.get("msg", err)).removeprefix("Value error, ")
        key = loc[0] if loc else next((f for f in ProfilerConfig.model_fields if msg.startswith(f)), "")
        since = profiler_field_since(key) if first.get("type") == "extra_forbidden" else None
        if since is not None:
            return key, (f"unknown key `{key}` for {dialect.name}: {since.name} brought it (an older server refuses "
                         "to start with it)")
        if first.get("type") == "extra_forbidden":
            return key, f"unknown key `{key}`"
        return key, f"`{key}`: {msg}" if loc else msg
    return None
