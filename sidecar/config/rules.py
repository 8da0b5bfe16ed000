"""Discrete-torch rules (docs/design.md §4): which stages a capture may target, and what a deploy
file gets refused or warned for. ``select_stages`` is the one place the stage-selection rule
lives; the controller, API, CLI and rollout hook all call it. Pure functions over ``DeployConfig``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sidecar.config.models import DeployConfig, ProfilerConfig, Stage
from sidecar.config.placeholders import dir_placeholders
from sidecar.errors import Finding, Severity, StageNotCuda, StageSelectionError, Where
from sidecar.errors import StageDuplicate, StageNotProfiled, StageNotTorch, StageUnknown, StagesEmpty

__all__ = [
    "IDLE_ITERATIONS", "MAX_IDLE_SHARE", "capped_by_server", "check_stage_list", "max_iterations_for", "select_stages", "validate_deploy", "selection_finding",
    "server_bounded_stages", "steps_bounded_by_server", "server_window_end", "server_window_ends",
]


def check_stage_list(stages: Sequence[Any], *, valid: list[int] | None = None) -> None:
    """The part of the stage-list rule that needs no deploy: non-empty, integers (a bool is no
    stage id), each once. ``valid`` is what the messages offer instead; None where no deploy is read
    yet (a fleet, before it reads its targets'): the rest of the rule is ``check_stage_ids``'."""
    offer = "" if valid is None else f" (valid: {valid})"
    if len(stages) == 0:
        raise StagesEmpty(
            "the stage list is empty: the server would profile nothing and still answer SUCCESS; "
            f"name at least one stage{offer} or omit `stages` for all of them",
            details={"stages": [], "valid": valid},
        )
    bad_type = [s for s in stages if isinstance(s, bool) or not isinstance(s, int)]
    if bad_type:
        raise StageUnknown(
            f"stage ids must be integers, got {bad_type}; "
            + (f"valid: {valid}" if valid is not None else "list them as integers, e.g. [0, 2]"),
            details={"stages": bad_type, "valid": valid},
        )
    dupes = sorted(sid for sid, n in Counter(stages).items() if n > 1)
    if dupes:
        raise StageDuplicate(
            f"stage ids listed more than once: {dupes}; list each stage once",
            details={"stages": dupes, "valid": valid},
        )


def check_stage_ids(deploy: DeployConfig, stages: list[int], *, valid: list[int]) -> None:
    """The part of the stage-list rule every caller shares (capture, render): ``check_stage_list``
    and each a stage of ``deploy``. ``valid`` is what the error messages offer instead."""
    check_stage_list(stages, valid=valid)
    unknown = [s for s in stages if deploy.stage(s) is None]
    if unknown:
        raise StageUnknown(
            f"unknown stage ids {unknown}: the deploy file has stages {deploy.stage_ids} "
            f"(the server would skip them and still answer SUCCESS); valid: {valid}",
            details={"stages": unknown, "valid": valid, "known": deploy.stage_ids},
        )


def select_stages(
    deploy: DeployConfig, stages: list[int] | None, *, allow_cuda: bool = False, kind: str | None = None
) -> list[int]:
    """The explicit stage list to send upstream (never empty, never ``None``).

    ``kind`` is the capture's kind: ``"torch"`` (default) takes torch-profiled stages and refuses
    ``cuda`` ones (``stage_not_torch``, they write no trace files); ``"nsys"`` takes only
    ``profiler: cuda`` stages (``stage_not_cuda`` otherwise). ``None`` stages means every stage
    of that kind, listed explicitly. ``allow_cuda`` (validate's mode, no capture kind): torch and
    cuda stages both. A given list must be non-empty, without duplicates, and name only stages
    that exist and are profiled that way. Raises ``StageSelectionError`` whose ``details`` name
    the offending and the valid ids.
    """
    if kind == "nsys":
        return _select_nsys(deploy, stages)
    if kind not in (None, "torch"):
        raise StageSelectionError.relay(
            "capture_kind_invalid", f"capture kind must be 'torch' or 'nsys', got {kind!r}", details={"kind": kind}
        )
    allowed_kinds = ("torch", "cuda") if allow_cuda else ("torch",)
    valid = [s.stage_id for s in deploy.stages if s.profiler in allowed_kinds]
    what = "torch- or cuda-profiled" if allow_cuda else "torch-profiled"
    if stages is None:
        if not valid:
            profiled = {s.stage_id: s.profiler for s in deploy.profiled_stages}
            hint = (
                f" (profiled with another profiler: {profiled})"
                if profiled
                else "; add `profiler_config: {profiler: torch, torch_profiler_dir: /abs/dir}` to the stages to capture"
            )
            raise StageNotProfiled(
                f"no stage is {what}{hint}",
                details={"stages": [], "valid": valid, "known": deploy.stage_ids},
            )
        return list(valid)
    check_stage_ids(deploy, stages, valid=valid)
    unprofiled = [s for s in stages if deploy.stage(s).profiler is None]  # type: ignore[union-attr]
    if unprofiled:
        raise StageNotProfiled(
            f"stages {unprofiled} have no profiler_config.profiler (the server would fail inside the worker "
            f"and still answer SUCCESS); set `profiler: torch` and `torch_profiler_dir` there, or pick from {valid}",
            details={"stages": unprofiled, "valid": valid},
        )
    wrong = [s for s in stages if deploy.stage(s).profiler not in allowed_kinds]  # type: ignore[union-attr]
    if wrong:
        kinds = {s: deploy.stage(s).profiler for s in wrong}  # type: ignore[union-attr]
        fix = (
            "cuda stages write no trace files; use an nsys capture for them"
            if not allow_cuda and all(k == "cuda" for k in kinds.values())
            else "set `profiler: torch` there"
        )
        raise StageNotTorch(
            f"stages {kinds} are not profiled with torch; {fix}; torch stages: {valid}",
            details={"stages": wrong, "valid": valid, "profilers": {str(k): v for k, v in kinds.items()}},
        )
    return list(stages)


def _select_nsys(deploy: DeployConfig, stages: list[int] | None) -> list[int]:
    valid = [s.stage_id for s in deploy.stages if s.profiler == "cuda"]
    if stages is None:
        if not valid:
            raise StageNotCuda(
                "no stage is profiled with `profiler: cuda`, so an nsys capture has nothing to target; "
                "render the nsys preset (`omni-sidecar render --profile nsys`) for the stages to capture",
                details={"stages": [], "valid": valid, "known": deploy.stage_ids},
            )
        return list(valid)
    check_stage_ids(deploy, stages, valid=valid)
    wrong = [s for s in stages if deploy.stage(s).profiler != "cuda"]  # type: ignore[union-attr]
    if wrong:
        kinds = {s: deploy.stage(s).profiler for s in wrong}  # type: ignore[union-attr]
        raise StageNotCuda(
            f"an nsys capture targets `profiler: cuda` stages only; stages {kinds} are not (a torch "
            f"stage is captured with kind 'torch'); cuda stages: {valid}",
            details={"stages": wrong, "valid": valid, "profilers": {str(k): v for k, v in kinds.items()}},
        )
    return list(stages)


# vLLM's profiler counts idle iterations (nothing scheduled) towards ``max_iterations``
# (vllm/profiler/wrapper.py ``step()``, called on every ``execute_model``): on the real two-stage
# vLLM-Omni server under steady load, 20 iterations held 18 steps on the stage the requests step and
# 17 on the one downstream of it (docs/captures.md). So a window meant to hold N steps is capped
# at N + IDLE_ITERATIONS iterations: with 0 to 4 idle ones it holds N give or take 2.
IDLE_ITERATIONS = 2
# A stage fed by another idles more: it waits for what the other hands it (on the real two-stage
# vLLM-Omni server, 3 to 5 of 22 iterations on stage 1, 0 to 2 on stage 0). Its cap is given the
# share of its iterations it idles (``render --steps N --idle STAGE=IDLE/ITERATIONS``, from a
# window's note), at most this share: a stage idling more is fed too little for a window counted in
# steps, and a cap above N + N/2 is the deploy's own bound, not a window of N.
MAX_IDLE_SHARE = 1 / 3


def max_iterations_for(steps: int, idle_share: float = 0.0) -> int:
    """The ``max_iterations`` that caps a window of ``steps`` engine steps (``render --steps``) on a
    stage that idles ``idle_share`` of its iterations: the steps, plus the idle iterations that
    share adds to them (rounded up; at least ``IDLE_ITERATIONS``): 20 steps at 5 of 22 idle, 26."""
    if not 0.0 <= idle_share <= MAX_IDLE_SHARE + 1e-9:
        raise ValueError(f"idle share {idle_share:.3f} is outside 0 to {MAX_IDLE_SHARE:.3f}")
    return steps + max(IDLE_ITERATIONS, math.ceil(steps * idle_share / (1.0 - idle_share) - 1e-9))


def server_bounded_stages(deploy: DeployConfig, stages: list[int]) -> list[tuple[int, ProfilerConfig]]:
    """The stages of ``stages`` whose profiler bounds its own window (``delay_iterations`` or
    ``max_iterations`` set), with their profiler config."""
    out = []
    for sid in stages:
        stage = deploy.stage(sid)
        pc = stage.profiler_config if stage is not None else None
        if pc is not None and (pc.max_iterations > 0 or pc.delay_iterations > 0):
            out.append((sid, pc))
    return out


def capped_by_server(deploy: DeployConfig, stages: list[int], steps: int) -> bool:
    """Every stage of ``stages`` ends its own window within the iterations a window of ``steps``
    engine steps takes: each has an end of its own (``max_iterations`` set), the first to end does
    within ``max_iterations_for(steps)``, and the others within what a stage idling the most a cap
    allows for (``MAX_IDLE_SHARE``: a stage fed by another, given its idle iterations by ``render
    --steps N --idle``). The server, not the sidecar's stop, then decides what such a ``steps``
    window traces."""
    ends = server_window_ends(deploy, stages)
    return (bool(stages) and set(ends) == set(stages) and min(ends.values()) <= max_iterations_for(steps)
            and max(ends.values()) <= max_iterations_for(steps, MAX_IDLE_SHARE))


def server_window_ends(deploy: DeployConfig, stages: list[int]) -> dict[int, int]:
    """Each stage of ``stages`` whose server ends its windows itself, with the iterations it does so after."""
    return {sid: server_window_end(pc) for sid, pc in server_bounded_stages(deploy, stages) if pc.max_iterations > 0}


def server_window_end(pc: ProfilerConfig) -> int:
    """The engine iterations from a profiler's start to its own end of a window
    (``delay_iterations + max_iterations``; 0: it has no end of its own)."""
    return pc.delay_iterations + pc.max_iterations if pc.max_iterations > 0 else 0


def steps_bounded_by_server(deploy: DeployConfig, stages: list[int], steps: int) -> list[tuple[int, dict[str, Any]]]:
    """What the server's own iteration bounds do to a ``steps`` window of ``stages``: per stage that
    has them, its figures (``how``: ``delay`` (it skips ``delay_iterations``), ``capped`` (it ends
    the window: the trace holds at most ``max_iterations``) or ``ends_first`` (the steps end it
    before its cap); ``max_iterations``, ``delay_iterations``, ``end``, ``steps``). vLLM's profiler
    skips ``delay_iterations`` engine iterations from its start and stops itself after
    ``max_iterations`` more (vllm/profiler/wrapper.py ``step()``; both fixed at the server's
    start). Its iterations include idle ones (no token scheduled), so the trace holds at most
    ``max_iterations`` steps, never more however late the sidecar's stop lands."""
    out: list[tuple[int, dict[str, Any]]] = []
    # the iterations within which a stage's own end ends this window: a fed stage's larger cap is
    # that window's where every stage ends its own (capped_by_server)
    capped = capped_by_server(deploy, stages, steps)
    limit = max_iterations_for(steps, MAX_IDLE_SHARE) if capped else max_iterations_for(steps)
    for sid, pc in server_bounded_stages(deploy, stages):
        end = server_window_end(pc)
        how = "delay" if pc.max_iterations <= 0 else "capped" if end <= limit else "ends_first"
        out.append((sid, {"how": how, "max_iterations": pc.max_iterations, "delay_iterations": pc.delay_iterations,
                          "end": end, "steps": steps}))
    return out


def selection_finding(err: StageSelectionError, where: Where | None = None) -> Finding:
    stages = err.details.get("stages") or []
    return Finding(
        code=err.code,
        severity=Severity.error,
        message=err.message,
        stage_id=stages[0] if len(stages) == 1 and isinstance(stages[0], int) else None,
        key="stages",
        where=where,
    )


def _w(stage: Stage, key: str) -> Where | None:
    return stage.marks.get(f"profiler_config.{key}") or stage.marks.get("profiler_config") or stage.where


def _stage_findings(stage: Stage, window_iterations: int | None, *, plain_vllm: bool) -> list[Finding]:
    pc = stage.profiler_config
    assert pc is not None
    out: list[Finding] = []

    def warn(code: str, key: str, message: str) -> None:
        out.append(
            Finding(
                code=code,
                severity=Severity.warning,
                message=message,
                stage_id=stage.stage_id,
                key=f"profiler_config.{key}",
                where=_w(stage, key),
            )
        )

    if pc.torch_profiler_with_stack:
        warn(
            "stack_enabled",
            "torch_profiler_with_stack",
            "Python stacks are on (vLLM's default): traces get several times larger and stop takes minutes "
            "per ~100 requests; set `torch_profiler_with_stack: false` unless you need stacks",
        )
    if pc.max_iterations == 0:
        warn(
            "max_iterations_unbounded",
            "max_iterations",
            "max_iterations is 0 (unbounded): the trace grows until stop; set e.g. `max_iterations: 64`",
        )
    # max_iterations is no window to compare the delay with: vLLM counts it from the end of the delay
    # (vllm/profiler/wrapper.py step(): recording starts at iteration delay_iterations, and stops
    # once max_iterations iterations were recorded), so delay 40 with max 8 traces iterations 40-48.
    if window_iterations is not None and 0 < window_iterations <= pc.delay_iterations:
        warn(
            "delay_exceeds_window",
            "delay_iterations",
            f"delay_iterations={pc.delay_iterations} is not below the capture window of {window_iterations} "
            "iterations: the trace will be empty; lower delay_iterations",
        )
    # plain vLLM only: vLLM-Omni's start reaches its stages alone (AsyncOmni.start_profile is a
    # collective_rpc to the stages) and never reads ignore_frontend, so there it is no advice
    if plain_vllm and (pc.delay_iterations > 0 or pc.max_iterations > 0) and not pc.ignore_frontend:
        warn(
            "frontend_overhead",
            "ignore_frontend",
            "delay/max_iterations with ignore_frontend false: the front-end profiler ignores the iteration bounds "
            "and records the whole window (vLLM warns of high overhead); set `ignore_frontend: true`",
        )
    schedule = {
        k: getattr(pc, k)
        for k, default in (("warmup_iterations", 0), ("active_iterations", 5), ("wait_iterations", 0))
        if getattr(pc, k) != default
    }
    if schedule:
        key = next(iter(schedule))
        warn(
            "schedule_ignored",
            key,
            f"{schedule} set, but vLLM-Omni workers use no profiler schedule and ignore them; "
            "use delay_iterations / max_iterations instead",
        )
    return out


def validate_deploy(
    deploy: DeployConfig,
    *,
    stages: list[int] | None = None,
    window_iterations: int | None = None,
    allow_cuda: bool = False,
) -> list[Finding]:
    """Refusals (errors) and caveats (warnings) for capturing ``stages`` (``None``: all torch stages).

    Loader findings (``legacy_schema``, ``profiler_dir_relative``) come first; then
    ``profiler_dir_placeholder`` (an unexpanded ``{replica}`` / ``{host}``); then stage selection
    (``allow_cuda``: an nsys capture, cuda stages may be targeted; implied when ``stages`` is None and
    every profiled stage is ``cuda``); then per targeted torch stage
    ``stack_enabled``, ``max_iterations_unbounded``, ``delay_exceeds_window``,
    ``frontend_overhead``, ``schedule_ignored``; and ``proton_not_wired`` for proton stages.
    """
    findings: list[Finding] = list(deploy.findings)
    if not deploy.stages:
        findings.append(
            Finding(
                code="no_stages",
                severity=Severity.error,
                message="the deploy file defines no stages; add a `stages:` list with profiler_config per stage",
                where=Where(file=str(deploy.path)) if deploy.path else None,
            )
        )
        return findings
    for stage in deploy.stages:
        left = dir_placeholders(stage.profiler_dir or "")
        if left:
            findings.append(
                Finding(
                    code="profiler_dir_placeholder",
                    severity=Severity.error,
                    message=(
                        f"torch_profiler_dir {stage.profiler_dir!r} still holds "
                        + ", ".join(f"{{{n}}}" for n in left)
                        + ": the server never expands it and would write every replica into a folder literally "
                        "named so; render one deploy per replica: `omni-sidecar render DEPLOY --profile P "
                        "--dir '/data/perf/{host}/replica{replica}' --replica N -o replicaN.yaml`"
                    ),
                    stage_id=stage.stage_id,
                    key="profiler_config.torch_profiler_dir",
                    where=_w(stage, "torch_profiler_dir"),
                )
            )
        if "\x00" in (stage.profiler_dir or ""):
            findings.append(
                Finding(
                    code="profiler_dir_invalid",
                    severity=Severity.error,
                    message=(f"torch_profiler_dir {stage.profiler_dir!r} holds a NUL byte, which no path can: the "
                             "worker fails to make the folder and writes no trace; write the folder's path"),
                    stage_id=stage.stage_id,
                    key="profiler_config.torch_profiler_dir",
                    where=_w(stage, "torch_profiler_dir"),
                )
            )
    if stages is None and not allow_cuda and not deploy.torch_stages and any(
        s.profiler == "cuda" for s in deploy.stages
    ):
        # An nsys-only deploy: nothing to refuse; its captures are `kind: nsys` ones.
        allow_cuda = True
    try:
        targets = select_stages(deploy, stages, allow_cuda=allow_cuda)
    except StageSelectionError as err:
        findings.append(selection_finding(err, Where(file=str(deploy.path)) if deploy.path else None))
        targets = [
            s
            for s in (stages if stages is not None else [])
            if isinstance(s, int) and not isinstance(s, bool) and (st := deploy.stage(s)) and st.profiler == "torch"
        ]
    for stage in deploy.stages:
        if stage.profiler == "proton":
            findings.append(
                Finding(
                    code="proton_not_wired",
                    severity=Severity.warning,
                    message="profiler 'proton' is accepted by vLLM but not wired in vLLM-Omni workers: no profile "
                    "will be written; use `profiler: torch`",
                    stage_id=stage.stage_id,
                    key="profiler_config.profiler",
                    where=_w(stage, "profiler"),
                )
            )
    for sid in dict.fromkeys(targets):
        stage = deploy.stage(sid)
        if stage is not None and stage.profiler == "torch":
            findings.extend(_stage_findings(stage, window_iterations, plain_vllm=deploy.plain_vllm))
    return findings
