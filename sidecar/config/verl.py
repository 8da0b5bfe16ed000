"""Reading a verl / verl-omni trainer config (plain YAML, a Hydra-composed dump, a dict or an
OmegaConf object) into the rollout or reward profiler plan the sidecar hook must follow, and the
rules for what verl would silently skip (docs/rl.md; the verl versions checked: KNOWN_VERL below).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sidecar.config._yaml import MarkedDict, load_yaml, yaml_type
from sidecar.errors import Finding, Severity, Where
from sidecar.errors import (
    ConfigEmpty,
    ConfigNotMapping,
    VerlConfigInvalid,
    VerlInterpolation,
    VerlRanksPastReplicas,
    VerlRoleInvalid,
    VerlVersionUnknown,
)

__all__ = [
    "NO_STEP_PROFILING",
    "ROLE_PATHS",
    "RankMode",
    "VerlProfilerPlan",
    "format_replicas",
    "KNOWN_VERL",
    "VerlSeams",
    "VerlSupport",
    "checked_verl",
    "installed_rank_mode",
    "installed_verl",
    "read_verl_config",
    "verl_findings",
]

Role = Literal["rollout", "reward"]
# How verl reads ``profiler.ranks`` for rollout servers: verl 0.9.1 maps global GPU ranks to the
# replica that owns them (``rank // (tp*dp*pp)``, verl/utils/profiler/profile.py
# ``build_rollout_dist_profiler``); older verl (the one verl-omni pins) reads them as replica indices.
RankMode = Literal["global", "replica"]

# Trainer entry points that never drive step-scoped rollout profiling: verl calls no start/stop,
# so nothing can follow it. Keyed by module; the value says what to run instead.
NO_STEP_PROFILING: dict[str, str] = {
    "verl_omni.trainer.main_diffusion_v1": (
        "verl-omni's main_diffusion_v1 trainer does not drive step-scoped profiling; run "
        "`python -m verl_omni.trainer.main_diffusion` (trainer.use_v1=False) for a profiled run"
    ),
}

# Where each role's profiler block lives in the composed trainer config.
ROLE_PATHS: dict[str, str] = {
    "rollout": "actor_rollout_ref.rollout.profiler",
    "reward": "reward.reward_model.rollout.profiler",
}
CONFIG_KEY = "omni_sidecar"  # the integration's own block of the trainer config
_INTERP = re.compile(r"^\$\{(?:oc\.select:)?([^,}]+)(?:,([^}]*))?\}$")


class VerlProfilerPlan(BaseModel):
    """What verl will do for one role: profile ``steps`` (1-based) with ``tool`` on ``replica_ranks``."""

    model_config = ConfigDict(frozen=True)

    role: Role = "rollout"
    steps: list[int] = Field(default_factory=list)
    enable: bool = False
    tool: str | None = None
    discrete: bool = False
    all_ranks: bool = False
    ranks: list[int] = Field(default_factory=list)
    save_path: str | None = None
    resume_mode: str = "auto"
    profile_continuous_steps: bool = False
    # Rollout parallelism: one replica spans tp*dp*pp GPUs (verl's ``replica_world_size``).
    tp: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    # GPUs of the rollout (hybrid engine: the trainer's ``n_gpus_per_node * nnodes``); None: unknown.
    n_gpus: int | None = None
    use_v1: bool = True
    # ``omni_sidecar.trainer``: the entry point module, when the user names it (the composed config
    # does not say which one runs it).
    trainer_entry: str | None = None
    # verl's rollout skip (``skip.<name>.steps`` with ``enable``): name -> its steps, whose rollout
    # verl loads from its cache dump when one is there (no request reaches the servers)
    skipped: dict[str, list[int]] = Field(default_factory=dict)
    source: str | None = None
    # Where each dotted key was written, for findings (only when read from a file).
    marks: dict[str, Where] = Field(default_factory=dict, repr=False, exclude=True)

    @property
    def replica_world_size(self) -> int:
        """GPUs per rollout replica, as verl computes it (tp * dp * pp)."""
        return self.tp * self.dp * self.pp

    @property
    def n_replicas(self) -> int | None:
        """Rollout replicas verl launches (``world_size // replica_world_size``), when known."""
        if self.n_gpus is None:
            return None
        return self.n_gpus // self.replica_world_size

    def requested_replicas(self, rank_mode: RankMode = "global") -> list[int] | None:
        """The one rank rule: the replica indices verl profiles (``None``: every replica, with
        ``all_ranks``). ``ranks`` empty → replica 0; ``rank_mode="global"`` (verl 0.9.1): each
        global GPU rank → ``rank // (tp*dp*pp)``; ``"replica"`` (older verl): replica indices."""
        if self.all_ranks:
            return None
        if not self.ranks:
            return [0]
        if rank_mode == "global":
            return sorted({r // self.replica_world_size for r in self.ranks})
        return sorted(set(self.ranks))

    def replica_ranks(self, n_replicas: int, rank_mode: RankMode = "global") -> list[int]:
        """The profiled replicas among ``n_replicas``. A rank naming no replica is refused (verl
        would silently profile fewer replicas than asked): ``ConfigError`` ``verl_ranks_past_replicas``."""
        wanted = self.requested_replicas(rank_mode)
        if wanted is None:
            return list(range(n_replicas))
        past = [r for r in wanted if r >= n_replicas]
        if past:
            raise VerlRanksPastReplicas(
                _past_message(self, past, n_replicas, rank_mode),
                key=f"{ROLE_PATHS[self.role]}.ranks", where=self.marks.get(f"{ROLE_PATHS[self.role]}.ranks"),
            )
        return wanted

    @property
    def trace_dir(self) -> str | None:
        """verl puts reward-model traces under ``<save_path>/reward_model/``."""
        if self.save_path is None:
            return None
        return str(Path(self.save_path) / "reward_model") if self.role == "reward" else self.save_path


# verl 0.9.1's rollout skip blocks (verl/utils/skip/config.py: SkipManagerConfig)
SKIP_BLOCKS = ("rollout", "async_rollout", "rollout_tq")


def format_replicas(replicas: list[int] | None) -> str:
    """``0, 1`` (or ``all``): how ``validate`` and the logs name the profiled replicas."""
    return "all" if replicas is None else ", ".join(str(r) for r in replicas)


def _past_message(plan: VerlProfilerPlan, past: list[int], n: int, rank_mode: RankMode) -> str:
    key = f"{ROLE_PATHS[plan.role]}.ranks"
    how = (
        f"global GPU ranks {plan.ranks} map to replicas {plan.requested_replicas(rank_mode)} "
        f"(rank // {plan.replica_world_size}, tp*dp*pp)"
        if rank_mode == "global" else f"ranks {plan.ranks} are replica indices in this verl"
    )
    return (
        f"{key}: {how}, but there are only {n} rollout replicas (0..{n - 1}); replica(s) {past} do not exist. "
        f"Name ranks below {n * plan.replica_world_size if rank_mode == 'global' else n}, or set "
        f"`{ROLE_PATHS[plan.role]}.all_ranks=True`"
    )


def _to_plain(src: Any) -> Any:
    """An OmegaConf object becomes plain containers without resolving (we resolve ourselves)."""
    mod = type(src).__module__
    if mod.startswith("omegaconf"):
        from omegaconf import OmegaConf  # only reachable when the caller passes one

        return OmegaConf.to_container(src, resolve=False)
    return src


def _get(root: Any, dotted: str) -> tuple[bool, Any]:
    node = root
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _literal(text: str) -> Any:
    t = text.strip()
    if t in ("null", "None", "~", ""):
        return None
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    try:
        return int(t)
    except ValueError:
        pass
    return t.strip("'\"")


def _resolve(root: Any, value: Any, depth: int = 0) -> Any:
    """Resolve ``${a.b}`` and ``${oc.select:a.b,default}`` (what verl's YAMLs use for profiler keys)."""
    if not isinstance(value, str) or depth > 10:
        return value
    m = _INTERP.match(value.strip())
    if not m:
        return value
    found, target = _get(root, m.group(1).strip())
    if not found:
        if m.group(2) is not None:
            return _literal(m.group(2))
        raise VerlInterpolation(
            f"interpolation {value!r} points at a missing key {m.group(1)!r}; pass the composed config "
            "(e.g. dump it with `OmegaConf.to_yaml(cfg, resolve=True)`)",
        )
    return _resolve(root, target, depth + 1)


def _where(root: Any, dotted: str) -> Where | None:
    parent, _, leaf = dotted.rpartition(".")
    found, node = _get(root, parent) if parent else (True, root)
    if found and isinstance(node, MarkedDict):
        return node.where_of(leaf)
    return None


def _as_bool(value: Any, key: str, where: Where | None) -> bool:
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise VerlConfigInvalid(f"{key} must be true or false, got {value!r}", where=where, key=key)


def _as_int_list(value: Any, key: str, where: Where | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise VerlConfigInvalid(
        f"{key} must be a list of integers (e.g. [1, 3]), got {value!r}", where=where, key=key
    )


def read_verl_config(src: dict[str, Any] | str | Path | Any, *, role: Role = "rollout") -> VerlProfilerPlan:
    """Read ``global_profiler.steps`` and the role's profiler block from a verl trainer config."""
    if role not in ROLE_PATHS:
        raise VerlRoleInvalid(f"role must be one of {sorted(ROLE_PATHS)}, got {role!r}")
    source: str | None = None
    if isinstance(src, (str, Path)):
        source = str(src)
        root = load_yaml(src)
        if root is None:
            raise ConfigEmpty(f"{src} is empty; pass a verl trainer config", where=Where(file=source))
    else:
        root = _to_plain(src)
    if not isinstance(root, dict):
        raise ConfigNotMapping(
            f"a verl trainer config must be a mapping, got {yaml_type(root)}",
            where=Where(file=source, line=1, column=1) if source else None,
        )
    base = ROLE_PATHS[role]
    marks: dict[str, Where] = {}

    def value(dotted: str, default: Any = None) -> Any:
        found, raw = _get(root, dotted)
        w = _where(root, dotted)
        if w:
            marks[dotted] = w
        return _resolve(root, raw) if found else default

    found, block = _get(root, base)
    if found and block is not None and not isinstance(block, dict):
        raise VerlConfigInvalid(f"{base} must be a mapping", where=_where(root, base), key=base)
    steps = _as_int_list(value("global_profiler.steps"), "global_profiler.steps", marks.get("global_profiler.steps"))
    tool = value(f"{base}.tool")
    if tool is None:
        tool = value("global_profiler.tool")
    save_path = value(f"{base}.save_path")
    if save_path is None:
        save_path = value("global_profiler.save_path")
    def int_of(dotted: str, default: int) -> int:
        v = value(dotted, default)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default

    rollout = "actor_rollout_ref.rollout"
    n_gpus = None
    gpus, nodes = value("trainer.n_gpus_per_node"), value("trainer.nnodes")
    if isinstance(gpus, int) and isinstance(nodes, int) and gpus > 0 and nodes > 0:
        n_gpus = gpus * nodes
    entry = value(f"{CONFIG_KEY}.trainer")
    skipped: dict[str, list[int]] = {}
    for name in SKIP_BLOCKS:
        if value(f"skip.{name}.enable") is True:
            skipped[name] = _as_int_list(value(f"skip.{name}.steps"), f"skip.{name}.steps", marks.get(f"skip.{name}.steps"))
    plan = VerlProfilerPlan(
        role=role,
        steps=steps,
        enable=_as_bool(value(f"{base}.enable"), f"{base}.enable", marks.get(f"{base}.enable")),
        tool=None if tool is None else str(tool),
        discrete=_as_bool(
            value(f"{base}.tool_config.torch.discrete"),
            f"{base}.tool_config.torch.discrete",
            marks.get(f"{base}.tool_config.torch.discrete"),
        ),
        all_ranks=_as_bool(value(f"{base}.all_ranks"), f"{base}.all_ranks", marks.get(f"{base}.all_ranks")),
        ranks=_as_int_list(value(f"{base}.ranks"), f"{base}.ranks", marks.get(f"{base}.ranks")),
        save_path=None if save_path is None else str(save_path),
        resume_mode=str(value("trainer.resume_mode", "auto")),
        profile_continuous_steps=_as_bool(value("global_profiler.profile_continuous_steps"),
                                          "global_profiler.profile_continuous_steps", None),
        tp=int_of(f"{rollout}.tensor_model_parallel_size", 1),
        dp=int_of(f"{rollout}.data_parallel_size", 1),
        pp=int_of(f"{rollout}.pipeline_model_parallel_size", 1),
        n_gpus=n_gpus,
        use_v1=_as_bool(value("trainer.use_v1", True), "trainer.use_v1", marks.get("trainer.use_v1")),
        trainer_entry=None if entry is None else str(entry),
        skipped=skipped,
        source=source,
        marks=marks,
    )
    return plan


def verl_findings(
    plan: VerlProfilerPlan, *, n_replicas: int | None = None, rank_mode: RankMode = "global",
    trainer: str | None = None,
) -> list[Finding]:
    """Refuse what verl would silently skip for the plan's role, ranks naming no replica
    (``n_replicas``, else the count the config implies) and a trainer with no step profiling
    (``trainer``: its entry module, else ``omni_sidecar.trainer``); warn on resume past the step."""
    base = ROLE_PATHS[plan.role]
    src = Where(file=plan.source) if plan.source else None
    out: list[Finding] = []

    def add(code: str, key: str, message: str, severity: Severity = Severity.error) -> None:
        out.append(
            Finding(code=code, severity=severity, message=message, key=key, where=plan.marks.get(key) or src)
        )

    if not plan.steps:
        add(
            "verl_steps_empty",
            "global_profiler.steps",
            "global_profiler.steps is empty: verl profiles no step; set e.g. `global_profiler.steps=[1]`",
        )
    if any(s < 1 for s in plan.steps):
        add(
            "verl_steps_invalid",
            "global_profiler.steps",
            f"global_profiler.steps are 1-based training steps, got {plan.steps}",
        )
    if not plan.enable:
        add(
            "verl_profiler_disabled",
            f"{base}.enable",
            f"{base}.enable is false: verl never calls start/stop for {plan.role}; set `{base}.enable=True`",
        )
    if plan.tool != "torch":
        add(
            "verl_tool_not_torch",
            f"{base}.tool",
            f"{base}.tool is {plan.tool!r}: the vLLM-Omni {plan.role} server is profiled only with torch "
            f"(verl records nothing otherwise); set `{base}.tool=torch` (or `global_profiler.tool=torch`)",
        )
    if not plan.discrete:
        add(
            "verl_not_discrete",
            f"{base}.tool_config.torch.discrete",
            f"{base}.tool_config.torch.discrete is false: verl skips server profiling in continuous mode without "
            f"an error; set `{base}.tool_config.torch.discrete=True`",
        )
    n = n_replicas if n_replicas is not None else plan.n_replicas
    if n is not None and plan.enable:
        try:
            plan.replica_ranks(n, rank_mode)
        except VerlRanksPastReplicas as err:
            add("verl_ranks_past_replicas", f"{base}.ranks", err.message)
    entry = trainer or plan.trainer_entry
    if entry is not None and entry in NO_STEP_PROFILING:
        add("verl_no_step_profiling", f"{CONFIG_KEY}.trainer", NO_STEP_PROFILING[entry])
    for name, steps in plan.skipped.items() if plan.role == "rollout" else ():
        both = sorted(set(plan.steps) & set(steps))
        if both:
            add("verl_steps_rollout_skipped", f"skip.{name}.steps",
                f"global_profiler.steps {both} are in skip.{name}.steps too: on such a step verl loads the rollout "
                "from its cache dump when one is there, so no request reaches the rollout servers and their traces "
                f"record nothing (verdict empty); profile other steps, or set `skip.{name}.enable=False`",
                Severity.warning)
    if plan.resume_mode != "disable":
        add(
            "verl_resume_enabled",
            "trainer.resume_mode",
            f"trainer.resume_mode is {plan.resume_mode!r}: a leftover checkpoint resumes past the profiled step; "
            "set `trainer.resume_mode=disable` for a profiling run",
            Severity.warning,
        )
    return out


class VerlSeams(BaseModel):
    """What the hook relies on in one verl release (checked against its real code in tests/verl)."""

    model_config = ConfigDict(frozen=True)

    rank_mode: RankMode  # how rollout ``profiler.ranks`` are read
    v1_trainer: bool  # ``verl.trainer.ppo.v1`` exists and ``trainer.use_v1`` defaults to true
    # ``build_vllm_profiler_args(config, tool_config, rank, legacy_env=...)``: the keyword exists
    profiler_args_legacy_env: bool


# The one table: verl releases the hook was checked against (the real wheel, tests/verl) → the
# rank rule and the seams it uses. Any other version is refused (strict) or warned about once.
KNOWN_VERL: dict[str, VerlSeams] = {
    "0.9.1": VerlSeams(rank_mode="global", v1_trainer=True, profiler_args_legacy_env=True),
}
ASSUMED_WITHOUT_VERL = "0.9.1"  # the registry release: what `validate` assumes with no verl installed


class VerlSupport(BaseModel):
    """The installed verl as the hook sees it: its version, whether it is in :data:`KNOWN_VERL`,
    and the seams used (from the table, or assumed from its source when it is not)."""

    model_config = ConfigDict(frozen=True)

    version: str | None  # None: verl is not installed
    known: bool
    seams: VerlSeams
    assumed: str | None = None  # why the seams are a guess (outside the table)

    @property
    def rank_mode(self) -> RankMode:
        return self.seams.rank_mode

    def describe(self) -> str:
        """One line for ``validate`` and the logs."""
        rule = f"the {self.seams.rank_mode} rank rule"
        if self.version is None:
            return f"verl not installed: assumed the {ASSUMED_WITHOUT_VERL} rule ({rule})"
        if self.known:
            return f"verl {self.version}: {rule} (a checked version)"
        return (f"verl {self.version} is not a version omni-sidecar was checked against "
                f"({', '.join(KNOWN_VERL)}): assumed {rule} ({self.assumed}); "
                "rollout replicas may be chosen wrongly. Pin a checked verl, or set omni_sidecar.strict "
                "to refuse")


def _verl_root() -> list[Path]:
    import importlib.util

    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _sniff_seams(roots: list[Path]) -> tuple[VerlSeams, str]:
    """The seams of a verl outside the table, read from its source (verl takes seconds to import)."""
    def text(rel: str) -> str:
        for root in roots:
            try:
                return (root / rel).read_text(encoding="utf-8")
            except OSError:
                continue
        return ""

    profile = text("utils/profiler/profile.py")
    global_rule = "def build_rollout_dist_profiler" in profile
    seams = VerlSeams(
        rank_mode="global" if global_rule else "replica",
        v1_trainer=any((r / "trainer" / "ppo" / "v1").is_dir() for r in roots),
        profiler_args_legacy_env="legacy_env" in text("utils/profiler/__init__.py") + profile
        + text("utils/profiler/config.py"),
    )
    why = ("its source has build_rollout_dist_profiler: ranks read as global GPU ranks" if global_rule
           else "its source has no build_rollout_dist_profiler: ranks read as replica indices")
    return seams, why


def installed_verl() -> VerlSupport:
    """The installed verl (version from its distribution metadata, never imported), its seams
    from :data:`KNOWN_VERL`, or assumed from its source when the version is not in the table."""
    from importlib import metadata

    roots = _verl_root()
    if not roots:
        return VerlSupport(version=None, known=False, seams=KNOWN_VERL[ASSUMED_WITHOUT_VERL])
    try:
        version: str | None = metadata.version("verl")
    except metadata.PackageNotFoundError:
        version = None
    if version in KNOWN_VERL:
        return VerlSupport(version=version, known=True, seams=KNOWN_VERL[version])
    seams, why = _sniff_seams(roots)
    return VerlSupport(version=version or "of unknown version (no distribution metadata)", known=False,
                       seams=seams, assumed=why)


_warned: set[str] = set()


def checked_verl(*, strict: bool = False, log: Any = None) -> VerlSupport:
    """:func:`installed_verl`, refused (``VerlVersionUnknown``) with ``strict`` when the version is
    outside the table; otherwise a version outside it is warned about once per process, loudly."""
    import logging

    support = installed_verl()
    if support.version is None or support.known:
        return support
    if strict:
        raise VerlVersionUnknown(support.describe(), key=f"{CONFIG_KEY}.strict")
    if support.version not in _warned:
        _warned.add(support.version)
        (log or logging.getLogger("sidecar.integrations.verl")).warning("omni-sidecar: %s", support.describe())
    return support


def installed_rank_mode() -> RankMode:
    """How the installed verl reads rollout ``ranks`` (:func:`installed_verl`)."""
    return installed_verl().rank_mode
