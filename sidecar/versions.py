"""What each vLLM and vLLM-Omni version does, in one table: a server's *dialect* (as SQLAlchemy keeps
one per database backend, made from its ``server_version_info``), whose capability flags every
other module asks. No other module compares versions.

Facts read from the released wheels (docs/versions.md): plain vLLM 0.30 to 0.34, vLLM-Omni 0.30.0,
0.31.0rc1 and 0.32.0rc1. A version newer than the newest known gets the newest known behaviour and a
warning naming it; an older one the oldest's. Pure: imports nothing of the sidecar, so every layer
may ask it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

_RELEASE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.?(a|b|rc)(\d+))?(?:\.?(dev|post)(\d+))?(?:\+[\w.]+)?$")


@dataclass(frozen=True, order=True)
class Release:
    """A version as its package names it (``0.32.0``, ``0.32.0rc1``, ``0.30.0+cpu``), ordered as
    PEP 440 orders those forms (a pre-release before its final)."""

    major: int
    minor: int
    patch: int = 0
    # (0, 'rc', 1) for a pre-release, (1, '', 0) for a final: 0.32.0rc1 < 0.32.0
    pre: tuple[int, str, int] = (1, "", 0)
    text: str = field(default="", compare=False)

    @classmethod
    def parse(cls, text: object) -> Release | None:
        """``text`` as a release, or None when it is not one (``dev``, empty, not a string)."""
        if not isinstance(text, str):
            return None
        m = _RELEASE.match(text.strip())
        if m is None:
            return None
        major, minor, patch, pre, pre_n = m.group(1), m.group(2), m.group(3), m.group(4), m.group(5)
        return cls(int(major), int(minor), int(patch or 0), (0, pre, int(pre_n)) if pre else (1, "", 0),
                   text.strip())

    @property
    def line(self) -> tuple[int, int]:
        """major.minor: what vLLM-Omni pairs with vLLM by."""
        return (self.major, self.minor)

    def __str__(self) -> str:
        return self.text or f"{self.major}.{self.minor}.{self.patch}"


def _line(line: tuple[int, int]) -> str:
    return f"{line[0]}.{line[1]}"


# --- file names -----------------------------------------------------------------------------
# Plain vLLM's worker trace on CPU: 0.30 names it after the engine instance
# (``<instance_id>-rank-<r>.<ns>.pt.trace.json.gz``), 0.31 on like the GPU worker
# (``[<prefix>_]dp0_pp0_tp0_dcp0_ep0_rank0.<ns>.pt.trace.json.gz``, or ``[<prefix>_]rank0...`` where the
# worker's parallel state is not up when its profiler is made: the CPU worker); the front end writes
# ``[<prefix>_]<host>_<pid>.async_llm.<ns>.pt.trace.json.gz``.
TRACE_BY_INSTANCE = re.compile(r"^(?P<worker>.+-rank-(?P<rank>\d+))\.(?P<stamp>\d+)\.pt\.trace\.json(\.gz)?$")
TRACE_BY_RANK_SUFFIX = re.compile(
    r"^(?P<worker>(?:[A-Za-z0-9][A-Za-z0-9._-]*_)?(?:dp\d+_pp\d+_tp\d+_dcp\d+_ep\d+_)?rank(?P<rank>\d+))"
    r"\.(?P<stamp>\d+)\.pt\.trace\.json(\.gz)?$")
# The key_averages table, rewritten in place by every later stop: ``profiler_out_<r>.txt`` up to
# 0.31 (and vLLM-Omni's workers), ``<worker>.profiler_out.txt`` from 0.32.
TABLE_BY_RANK = re.compile(r"^profiler_out_(?P<rank>\d+)\.txt$")
TABLE_BY_WORKER = re.compile(r"^(?P<worker>.+)\.profiler_out\.txt$")
TABLE_FILES = (TABLE_BY_RANK, TABLE_BY_WORKER)


def is_table_file(name: str) -> bool:
    """A key_averages table of any known version (both namings can share one folder)."""
    return any(p.match(name) for p in TABLE_FILES)


# --- per-capture options ----------------------------------------------------------------------
# vLLM's own rule for a start body's profile_prefix (vllm/config/profiler.py, 0.32).
_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
PREFIX_RULE = ("profile_prefix must be 1-128 ASCII characters, start with a letter or number, and contain only "
               "letters, numbers, '.', '_', or '-'")
# torch.profiler.profile's keyword arguments a stage preset may set per capture (vLLM >= 0.33 passes
# profiler_kwargs into it unchecked: an unknown key answers 200 and writes no trace).
# A stage preset's ProfilerConfig flag -> the torch.profiler.profile keyword it sets.
PROFILER_KWARGS: dict[str, str] = {
    "torch_profiler_record_shapes": "record_shapes",
    "torch_profiler_with_memory": "profile_memory",
    "torch_profiler_with_stack": "with_stack",
    "torch_profiler_with_flops": "with_flops",
}
TORCH_PROFILER_KWARGS = frozenset(PROFILER_KWARGS.values())


def profiler_kwargs(profiler_config: dict[str, Any]) -> dict[str, bool]:
    """The per-capture torch options of a stage preset's ``profiler_config`` (known keys only: vLLM
    passes ``profiler_kwargs`` into torch unchecked, and an unknown key writes no trace)."""
    return {PROFILER_KWARGS[k]: bool(v) for k, v in profiler_config.items() if k in PROFILER_KWARGS}


def profile_prefix(capture_id: str) -> str:
    """A capture's file-name prefix: its id as vLLM's rule allows it (``cap-<id>``)."""
    text = re.sub(r"[^A-Za-z0-9._-]", "-", f"cap-{capture_id}")[:128]
    assert _PREFIX.match(text), text
    return text


def prefix_ok(prefix: str) -> bool:
    return bool(_PREFIX.match(prefix))


# --- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmDialect:
    """What one plain-vLLM major.minor does (``vllm serve``; vLLM-Omni keeps its own surface)."""

    line: tuple[int, int]
    # keys of POST /start_profile's body it reads (0.30/0.31: none, the body is ignored)
    start_body: tuple[str, ...] = ()
    # a second start before a stop is 409 (also after a window that max_iterations ended itself)
    conflict_on_second_start: bool = False
    # the start body bounds one window (max_iterations / delay_iterations)
    per_capture_bounds: bool = False
    # the start body's profile_prefix starts every file name of that window
    per_capture_prefix: bool = False
    # the start body's profiler_kwargs go into torch.profiler.profile (unchecked)
    per_capture_kwargs: bool = False
    # the CPU worker's trace name (file names above)
    cpu_trace: Literal["instance", "rank_suffix"] = "rank_suffix"
    table: Literal["rank", "worker"] = "worker"
    # ProfilerConfig fields of the newest known version that this one does not have
    profiler_fields_missing: frozenset[str] = frozenset()
    # workers check the profiler against their platform at start (CPU: torch, CPU activity only)
    platform_profilers: bool = True
    # capture_torch_profiler still does something (0.34: deprecated, no effect)
    capture_torch_profiler: bool = True

    @property
    def name(self) -> str:
        return f"vLLM {_line(self.line)}"

    def trace_pattern(self) -> re.Pattern[str]:
        return TRACE_BY_INSTANCE if self.cpu_trace == "instance" else TRACE_BY_RANK_SUFFIX

    def table_pattern(self) -> re.Pattern[str]:
        return TABLE_BY_RANK if self.table == "rank" else TABLE_BY_WORKER


_V030 = VllmDialect((0, 30), cpu_trace="instance", table="rank",
                    profiler_fields_missing=frozenset({"torch_profiler_activities"}), platform_profilers=False)
_V031 = VllmDialect((0, 31), table="rank")
_V032 = VllmDialect((0, 32), start_body=("profile_prefix", "delay_iterations", "max_iterations"),
                    conflict_on_second_start=True, per_capture_bounds=True, per_capture_prefix=True)
_V033 = VllmDialect((0, 33), start_body=(*_V032.start_body, "profiler_kwargs"), conflict_on_second_start=True,
                    per_capture_bounds=True, per_capture_prefix=True, per_capture_kwargs=True)
_V034 = VllmDialect((0, 34), start_body=_V033.start_body, conflict_on_second_start=True, per_capture_bounds=True,
                    per_capture_prefix=True, per_capture_kwargs=True, capture_torch_profiler=False)
VLLM_DIALECTS: tuple[VllmDialect, ...] = (_V030, _V031, _V032, _V033, _V034)
NEWEST_VLLM = VLLM_DIALECTS[-1]
OLDEST_VLLM = VLLM_DIALECTS[0]


@dataclass(frozen=True)
class OmniDialect:
    """What one vLLM-Omni release does. Its HTTP profile surface is the same in every known release:
    body ``{"stages": [...]}`` only (other keys dropped), ``{"status": "SUCCESS"}``, no 409, the
    same trace writer (session folders, ``profiler_out_<N>.txt``)."""

    release: Release
    vllm_line: tuple[int, int]  # the vLLM major.minor it pairs with (vllm_omni/version.py)
    # AsyncOmni.start_profile takes delay/max iterations in-process (never over HTTP)
    bounds_in_process: bool = False
    # deploy keys new in this release (per stage, top level), and stage keys it no longer has
    stage_keys_added: tuple[str, ...] = ()
    top_keys_added: tuple[str, ...] = ()
    stage_keys_removed: tuple[str, ...] = ()
    # a pipeline may split diffusion over several stages (an encode-only stage runs no denoise step)
    diffusion_stages: bool = False
    # its torch stages build their profiler without torch_profiler_activities (platform default)
    ignores_activities: bool = True

    @property
    def name(self) -> str:
        return f"vLLM-Omni {self.release}"


_O030 = OmniDialect(Release.parse("0.30.0"), (0, 30))  # type: ignore[arg-type]
_O031 = OmniDialect(Release.parse("0.31.0rc1"), (0, 31),  # type: ignore[arg-type]
                    stage_keys_added=("model_runner", "hsdp_weight_load_strategy"),
                    top_keys_added=("cuda_mps", "speech_cache"))
# 0.31.0rc1's StageDeployConfig still has auxiliary_text_encoder; 0.32.0rc1 has it nowhere, so the
# key lands in the stage's engine extras and is refused at start-up as any unknown key is.
_O032 = OmniDialect(Release.parse("0.32.0rc1"), (0, 32), bounds_in_process=True,  # type: ignore[arg-type]
                    stage_keys_added=("attention_backend", "moe_backend", "linear_backend", "enable_cuda_graph_decode",
                                      "vae_encode_fast_path"),
                    top_keys_added=("weight_transfer_config",), stage_keys_removed=("auxiliary_text_encoder",),
                    diffusion_stages=True)
OMNI_DIALECTS: tuple[OmniDialect, ...] = (_O030, _O031, _O032)
NEWEST_OMNI = OMNI_DIALECTS[-1]
OLDEST_OMNI = OMNI_DIALECTS[0]


def vllm_dialect(version: Release | None) -> VllmDialect:
    """The dialect of a vLLM version: its major.minor's, the newest known for a newer one or an
    unknown version, the oldest known for an older one."""
    if version is None:
        return NEWEST_VLLM
    for d in VLLM_DIALECTS:
        if d.line == version.line:
            return d
    return OLDEST_VLLM if version.line < OLDEST_VLLM.line else NEWEST_VLLM


def omni_dialect(version: Release | None) -> OmniDialect:
    """The dialect of a vLLM-Omni release (by major.minor), as :func:`vllm_dialect` chooses."""
    if version is None:
        return NEWEST_OMNI
    for d in OMNI_DIALECTS:
        if d.release.line == version.line:
            return d
    return OLDEST_OMNI if version.line < OLDEST_OMNI.release.line else NEWEST_OMNI


def omni_for_vllm(version: Release | None) -> OmniDialect | None:
    """The vLLM-Omni release made for this vLLM's major.minor, or None (none exists: 0.33, 0.34)."""
    if version is None:
        return None
    return next((d for d in OMNI_DIALECTS if d.vllm_line == version.line), None)


def profiler_field_since(name: str) -> VllmDialect | None:
    """The first known vLLM whose ProfilerConfig has ``name`` (None: a field of every known one)."""
    if all(name not in d.profiler_fields_missing for d in VLLM_DIALECTS):
        return None
    return next((d for d in VLLM_DIALECTS if name not in d.profiler_fields_missing), None)


# vllm/profiler/wrapper.py (0.31 to 0.34): what a worker of each device type accepts at start
# (validate_worker_profiler_config), and the torch activities it records when none are configured.
WORKER_PROFILERS: dict[str, frozenset[str]] = {
    "cpu": frozenset({"torch"}), "cuda": frozenset({"torch", "cuda", "proton"}), "xpu": frozenset({"torch"})}
WORKER_ACTIVITIES: dict[str, tuple[str, ...]] = {"cpu": ("CPU",), "cuda": ("CPU", "CUDA"), "xpu": ("CPU", "XPU")}
# vLLM-Omni's platform names -> vLLM's device type (ROCm's is "cuda"); npu/musa run their own workers
PLATFORM_DEVICE = {"cuda": "cuda", "rocm": "cuda", "xpu": "xpu", "cpu": "cpu"}


def worker_refusal(dialect: VllmDialect, profiler: str | None, activities: list[str] | None,
                   device: str | None) -> tuple[str, str] | None:
    """What a worker of ``device`` says at start of this profiler and activities (vLLM >= 0.31 checks;
    the server then fails to start), as ``(key, vLLM's own message)``; None when it accepts them or
    the device is not one vLLM's table knows (its own workers decide)."""
    if not dialect.platform_profilers or profiler is None or device not in WORKER_PROFILERS:
        return None
    kinds = WORKER_PROFILERS[device]
    if profiler not in kinds:
        return "profiler", (f"Unsupported profiler type for {device}: {profiler}. Supported profiler types: "
                            f"{', '.join(sorted(kinds))}.")
    supported = frozenset(WORKER_ACTIVITIES[device])  # the defaults are the supported set, as in vLLM
    unsupported = set(activities or ()) - supported
    if profiler == "torch" and unsupported:
        return "torch_profiler_activities", (
            f"Unsupported torch profiler activities for {device}: {', '.join(sorted(unsupported))}. "
            f"Supported activities: {', '.join(sorted(supported))}.")
    return None


def known(version: Release, dialects: tuple[Any, ...]) -> bool:
    lines = {getattr(d, "line", None) or d.release.line for d in dialects}
    return version.line in lines


def omni_deploy_keys_unknown(dialect: OmniDialect) -> list[tuple[str, str, str]]:
    """The deploy keys a vLLM-Omni release does not know, from the releases after it:
    ``(scope, key, since)`` with scope ``stage`` or ``top`` and the release that brought the key."""
    out: list[tuple[str, str, str]] = []
    for d in OMNI_DIALECTS:
        if d.release > dialect.release:
            out += [("stage", k, str(d.release)) for k in d.stage_keys_added]
            out += [("top", k, str(d.release)) for k in d.top_keys_added]
    return out


def omni_deploy_keys_removed(dialect: OmniDialect) -> list[tuple[str, str]]:
    """The stage keys a vLLM-Omni release no longer has (an older one did): ``(key, the release that
    dropped it)``, for this release and those before it."""
    return [(k, str(d.release)) for d in OMNI_DIALECTS if d.release <= dialect.release for k in d.stage_keys_removed]


def major_minor_pair(vllm: Release | None, omni: Release | None) -> bool:
    """Whether a vLLM and a vLLM-Omni version pair (same major.minor); True when either is unknown."""
    return vllm is None or omni is None or vllm.line == omni.line


def pair_fix(vllm: Release | None, omni: Release | None) -> str:
    """The install that makes a mismatched pair match: the vLLM-Omni made for this vLLM, else the
    vLLM of the newest vLLM-Omni."""
    made = omni_for_vllm(vllm)
    if made is not None:
        return f"pip install --pre 'vllm-omni=={made.release}' (the vLLM-Omni made for vLLM {vllm})"
    return (f"pip install 'vllm=={_line(NEWEST_OMNI.vllm_line)}.*' --pre 'vllm-omni=={NEWEST_OMNI.release}' "
            f"(no vLLM-Omni is made for vLLM {vllm}; the newest, {NEWEST_OMNI.release}, pairs with vLLM "
            f"{_line(NEWEST_OMNI.vllm_line)})")


# --- a server's version -----------------------------------------------------------------------

Kind = Literal["vllm", "omni"]


@dataclass(frozen=True)
class ServerVersion:
    """What a server is: plain vLLM or vLLM-Omni, its vLLM version (``GET /version``; None when it
    does not answer it) and, for vLLM-Omni, its release: told by the user, or else the one made for
    that vLLM's major.minor (vLLM-Omni serves its own version nowhere)."""

    kind: Kind
    vllm: Release | None = None
    omni: Release | None = None
    omni_told: bool = False

    @classmethod
    def of(cls, kind: Kind, vllm: str | None, omni: str | None = None) -> ServerVersion:
        v = Release.parse(vllm)
        told = Release.parse(omni)
        if kind == "omni" and told is None:
            made = omni_for_vllm(v)
            return cls(kind, v, made.release if made is not None else None, False)
        return cls(kind, v, told if kind == "omni" else None, told is not None and kind == "omni")

    @property
    def dialect(self) -> VllmDialect:
        """The vLLM dialect it speaks; the oldest known where the server did not say its version (a
        start then carries nothing an older server would not read)."""
        return vllm_dialect(self.vllm) if self.vllm is not None else OLDEST_VLLM

    @property
    def omni_dialect(self) -> OmniDialect | None:
        return omni_dialect(self.omni) if self.kind == "omni" else None

    # The capability questions the controller, collect and render ask. vLLM-Omni keeps its own HTTP
    # profile surface whatever vLLM it runs on.
    @property
    def start_body(self) -> tuple[str, ...]:
        return ("stages",) if self.kind == "omni" else self.dialect.start_body

    @property
    def per_capture_bounds(self) -> bool:
        return self.kind == "vllm" and self.dialect.per_capture_bounds

    @property
    def per_capture_prefix(self) -> bool:
        return self.kind == "vllm" and self.dialect.per_capture_prefix

    @property
    def per_capture_kwargs(self) -> bool:
        return self.kind == "vllm" and self.dialect.per_capture_kwargs

    @property
    def conflict_on_second_start(self) -> bool:
        return self.kind == "vllm" and self.dialect.conflict_on_second_start

    @property
    def mismatched(self) -> bool:
        """vLLM-Omni on a vLLM of another major.minor (it warns of it itself, in its log only); where
        the server does not say its vLLM-Omni, a vLLM no vLLM-Omni is made for. A vLLM-Omni newer than
        the table on the vLLM of its own line is no mismatch (its version is unknown: said apart)."""
        if self.kind != "omni" or self.vllm is None:
            return False
        if self.omni is not None:
            return self.omni.line != self.vllm.line
        return omni_for_vllm(self.vllm) is None

    def warnings(self) -> list[dict[str, Any]]:
        """Facts (a code and its figures) a reader should see: a version the table does not know,
        a mismatched pair, a vLLM version the server would not tell."""
        out: list[dict[str, Any]] = []
        if self.vllm is None:
            out.append({"code": "version_unknown", "what": "vLLM", "assumed": self.dialect.name})
        elif not known(self.vllm, VLLM_DIALECTS):
            out.append({"code": "version_unknown", "what": "vLLM", "version": str(self.vllm),
                        "assumed": self.dialect.name})
        if self.kind == "omni" and self.omni is not None and not known(self.omni, OMNI_DIALECTS):
            out.append({"code": "version_unknown", "what": "vLLM-Omni", "version": str(self.omni),
                        "assumed": self.omni_dialect.name if self.omni_dialect else ""})
        if self.mismatched:
            out.append({"code": "version_mismatch", "vllm": str(self.vllm),
                        "omni": str(self.omni) if self.omni is not None else None,
                        "fix": pair_fix(self.vllm, self.omni)})
        return out

    def figures(self) -> dict[str, Any]:
        """The version as JSON-shaped figures (kept on captures, served by the API)."""
        return {"kind": self.kind, "vllm": str(self.vllm) if self.vllm else None,
                "omni": str(self.omni) if self.omni else None, "omni_told": self.omni_told,
                "per_capture_bounds": self.per_capture_bounds, "per_capture_prefix": self.per_capture_prefix,
                "per_capture_kwargs": self.per_capture_kwargs,
                "conflict_on_second_start": self.conflict_on_second_start}

    def describe(self) -> str:
        """One line: what the server is and which way a ``steps`` window is bounded there."""
        vllm = f"vLLM {self.vllm}" if self.vllm else "vLLM (version not served)"
        if self.kind == "omni":
            if self.omni is None:
                omni = "vLLM-Omni (no release made for this vLLM)"
            else:
                omni = f"vLLM-Omni {self.omni}"
            head = f"{omni} on {vllm}"
        else:
            head = vllm
        if self.per_capture_bounds:
            how = "per-capture bounds, file prefixes" + (" and profiler_kwargs" if self.per_capture_kwargs else "") \
                + " over HTTP"
        elif self.kind == "omni":
            how = "per-capture bounds not available over HTTP; the deploy's max_iterations caps bound a steps window"
        else:
            how = "per-capture bounds not available; the deploy's max_iterations caps bound a steps window"
        return f"{head}: {how}"


def server_version(figures: dict[str, Any] | None) -> ServerVersion | None:
    """:meth:`ServerVersion.figures` back into a version (None for None)."""
    if not figures:
        return None
    kind = "omni" if figures.get("kind") == "omni" else "vllm"
    if figures.get("omni_told"):
        return ServerVersion.of(kind, figures.get("vllm"), figures.get("omni"))
    return ServerVersion.of(kind, figures.get("vllm"))


__all__ = [
    "NEWEST_OMNI",
    "NEWEST_VLLM",
    "OLDEST_OMNI",
    "OLDEST_VLLM",
    "OMNI_DIALECTS",
    "PREFIX_RULE",
    "PROFILER_KWARGS",
    "TABLE_BY_RANK",
    "TABLE_BY_WORKER",
    "TABLE_FILES",
    "TORCH_PROFILER_KWARGS",
    "TRACE_BY_INSTANCE",
    "TRACE_BY_RANK_SUFFIX",
    "VLLM_DIALECTS",
    "OmniDialect",
    "Release",
    "ServerVersion",
    "VllmDialect",
    "is_table_file",
    "major_minor_pair",
    "omni_deploy_keys_removed",
    "omni_deploy_keys_unknown",
    "omni_dialect",
    "omni_for_vllm",
    "pair_fix",
    "prefix_ok",
    "profile_prefix",
    "profiler_field_since",
    "profiler_kwargs",
    "server_version",
    "vllm_dialect",
]
