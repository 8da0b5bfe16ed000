"""What a start may ask for: its window's bounds in time (``duration_s``, ``lease_s``, against the
sidecar's limits) and in engine steps (``steps``, ``delay_steps``, and what will end a ``steps``
window: the start itself where the server takes per-capture bounds, the server's own cap, or a
best-effort count asked for by name), and the per-capture options its start body carries. Pure;
raises typed errors.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

from sidecar.config.models import DeployConfig
from sidecar.config.profiles import list_profiles, load_profile
from sidecar.config.rules import capped_by_server, max_iterations_for
from sidecar.control.models import MAX_ENGINE_STEPS
from sidecar.control.steps import Bound
from sidecar.errors import (DurationInvalid, EngineStepsInvalid, LeaseInvalid, ProfileNotPerCapture, ProfileUnknown,
                            StepsUnbounded)
from sidecar.versions import ServerVersion, profile_prefix, profiler_kwargs

StepsAsk = Literal["server", "count"]


def check_window(duration_s: float | None, lease_s: float | None, *, max_duration_s: float | None,
                 default_lease_s: float | None) -> tuple[float | None, float | None]:
    """The window's ``(duration_s, lease_s)`` as the sidecar runs it: a bounded sidecar never
    leaves a window open-ended; refused out of range."""
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise DurationInvalid(f"duration_s must be a finite number of seconds above 0, got {duration_s}", key="duration_s")
    if max_duration_s is not None:
        if duration_s is None:
            duration_s = max_duration_s
        elif duration_s > max_duration_s:
            raise DurationInvalid(
                f"duration_s {duration_s:g} is above this sidecar's limit of {max_duration_s:g}s; ask for less "
                "or raise the sidecar's OMNI_SIDECAR_MAX_DURATION_S",
                key="duration_s", details={"max_duration_s": max_duration_s})
    if lease_s is None:
        lease_s = default_lease_s
    elif not (lease_s > 0 and math.isfinite(lease_s)):
        raise LeaseInvalid(f"lease_s must be a finite number of seconds above 0, got {lease_s}", key="lease_s")
    return duration_s, lease_s


def check_steps(steps: int | None, delay_steps: int | None) -> None:
    for key, value, low in (("steps", steps, 1), ("delay_steps", delay_steps, 0)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_ENGINE_STEPS:
            raise EngineStepsInvalid(f"{key} must be a whole number of engine steps from {low} to "
                                     f"{MAX_ENGINE_STEPS}, got {value!r}", key=key)


def steps_bound(deploy: DeployConfig, stages: list[int], steps: int | None, asked: StepsAsk | None, *,
                per_capture: bool = False) -> Bound | None:
    """What will end a ``steps`` window on ``stages``: the start itself where the server takes
    per-capture bounds (``per_capture``: vLLM >= 0.32 ends the window after exactly the steps its
    start body asks), else the server's own cap where every stage has one that a window of ``steps``
    reaches (``render --steps N`` writes it), the sidecar's count where the caller asked for it by
    name (``"count"``); refused (``StepsUnbounded``) otherwise."""
    if steps is None:
        return None
    if asked == "count":
        return Bound.count
    if per_capture:
        return Bound.per_capture
    if capped_by_server(deploy, stages, steps):
        return Bound.server_cap
    cap = max_iterations_for(steps)
    raise StepsUnbounded(
        f"a window of {steps} engine steps on stages {stages} needs their server to end it: the profiler_config of "
        f"{'this stage' if len(stages) == 1 else 'these stages'} sets no max_iterations that {steps} steps reach, so "
        "only the sidecar's stop could end it, and the engines step on while the stop travels (on real servers "
        "with no cap, 5 steps asked traced 33 on vLLM 0.30 and 20 asked traced 225 on vLLM 0.32). For exactly "
        f"{steps} steps restart the server with the profiler config `omni-sidecar render --steps {steps}` writes "
        f"(max_iterations {cap}); or ask for a best-effort count by name: \"steps_bound\": \"count\" (CLI: "
        "--count-steps), whose result says how many steps each trace holds",
        key="steps", details={"stages": stages, "steps": steps, "max_iterations": cap,
                              "fix": f"omni-sidecar render --steps {steps}"})


@functools.cache
def _preset_kwargs() -> dict[str, dict[str, bool]]:
    """Each shipped stage preset's torch options (``{}``: none, ``nsys``), read once per process."""
    return {n: profiler_kwargs(load_profile(n).profiler_config) for n in list_profiles()}


def capture_profiles() -> list[str]:
    """The stage presets a capture may carry: those that set torch options (not ``nsys``)."""
    return [n for n, kwargs in _preset_kwargs().items() if kwargs]


def check_profile(version: ServerVersion | None, profile: str | None) -> dict[str, bool] | None:
    """The torch options a stage preset (``memory``, ``shapes``...) sets for one capture, as a
    start body's ``profiler_kwargs`` (vLLM >= 0.33 merges them over the deploy's profiler_config
    for that session only); refused where the server cannot take them, naming the restart that
    can. Known torch keys only (versions.profiler_kwargs): vLLM passes the dict into torch
    unchecked, and an unknown key there answers 200 and writes no trace."""
    if profile is None:
        return None
    names = capture_profiles()
    if profile not in _preset_kwargs():
        raise ProfileUnknown(f"unknown stage profile {profile!r}; a capture takes one of {', '.join(names)}",
                             key="profile", details={"profiles": names})
    kwargs = dict(_preset_kwargs()[profile])
    if not kwargs:
        raise ProfileNotPerCapture(
            f"stage profile {profile!r} is not a set of torch options a capture can carry; it is the stages' own "
            f"profiler_config: restart them with `omni-sidecar render --profile {profile}`. A capture takes one of "
            f"{', '.join(names)}", key="profile", details={"profiles": names, "fix": f"omni-sidecar render --profile {profile}"})
    if version is None or not version.per_capture_kwargs:
        server = version.describe().split(":", 1)[0] if version is not None else "a server whose version is not known"
        raise ProfileNotPerCapture(
            f"stage profile {profile!r} for one capture needs plain vLLM 0.33 or newer (its start body's "
            f"profiler_kwargs); this is {server}, whose start takes none. Restart the stages with the profiler_config "
            f"`omni-sidecar render --profile {profile}` writes, then capture without `profile`",
            key="profile", details={"profile": profile, "profiler_kwargs": kwargs,
                                    "server": version.figures() if version is not None else None,
                                    "fix": f"omni-sidecar render --profile {profile}"})
    return kwargs


def start_options(version: ServerVersion | None, capture_id: str, bound: Bound | None, steps: int | None,
                  delay_steps: int | None, kwargs: dict[str, bool] | None = None) -> dict[str, object]:
    """The per-capture keys of a start's body, as far as the server takes them (``version``'s
    dialect): its files' prefix (the capture's id, so its files are told apart from any other's in
    a shared folder), a per-capture window's bounds (the server ends it after exactly ``steps``,
    ``delay_steps`` after the start) and a stage preset's torch options (``check_profile``)."""
    out: dict[str, object] = {}
    if version is None:
        return out
    if version.per_capture_prefix:
        out["profile_prefix"] = profile_prefix(capture_id)
    if bound is Bound.per_capture and version.per_capture_bounds and steps is not None:
        out["max_iterations"] = steps
        out["delay_iterations"] = delay_steps or 0
    if kwargs and version.per_capture_kwargs:
        out["profiler_kwargs"] = dict(kwargs)
    return out


__all__ = ["StepsAsk", "capture_profiles", "check_profile", "check_steps", "check_window", "start_options", "steps_bound"]
