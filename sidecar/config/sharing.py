"""The shared-dir rule: two servers whose profiled stages write into the same ``torch_profiler_dir``
cannot be told apart afterwards (session folder names carry no server identity, docs/design.md §3), so
a capture across them cannot prove which trace is whose. Pure functions over ``DeployConfig``.

Stages of ONE deploy may share a dir (folder names carry the stage id). The same path on the same
host always collides. On different hosts the same path is treated as one folder (a shared
filesystem is the common RL case) unless the caller says the dirs are host-local.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sidecar.config.models import DeployConfig
from sidecar.errors import Finding, Severity

__all__ = ["SharedDir", "shared_dir_groups", "shared_profiler_dirs", "RENDER_FIX"]

RENDER_FIX = (
    "give each replica its own dir: "
    "`omni-sidecar render DEPLOY --profile light --dir '/data/perf/{host}/replica{replica}' --replica N`"
)


@dataclass(frozen=True)
class SharedDir:
    """One dir written by stages of more than one target: ``members`` are (target, stage_id)."""

    dir: str
    host: str | None  # set when dirs are host-local: the host on which they collide
    members: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    @property
    def targets(self) -> list[str]:
        return list(dict.fromkeys(t for t, _ in self.members))


def _dir_key(path: str) -> str:
    if "://" in path:  # a URI (gs://...) is one place wherever it is written from
        return path.rstrip("/")
    return os.path.normpath(path)


def shared_dir_groups(
    targets: Mapping[str, DeployConfig],
    stages: Mapping[str, Sequence[int]] | None = None,
    *,
    hosts: Mapping[str, str] | None = None,
    host_local: bool = False,
) -> list[SharedDir]:
    """Dirs that stages of two or more targets write into. ``stages[name]`` limits a target to
    the stages it will capture (default: every stage with a ``torch_profiler_dir``). With
    ``host_local`` (and ``hosts``: target name → host), the same path on different hosts is two
    dirs; the same path on one host is always one."""
    groups: dict[tuple[str | None, str], list[tuple[str, int]]] = {}
    for name, deploy in targets.items():
        wanted = None if stages is None or name not in stages else set(stages[name])
        for stage in deploy.stages:
            if stage.profiler_dir is None or (wanted is not None and stage.stage_id not in wanted):
                continue
            host = hosts.get(name) if host_local and hosts is not None else None
            groups.setdefault((host, _dir_key(stage.profiler_dir)), []).append((name, stage.stage_id))
    return [
        SharedDir(dir=d, host=h, members=tuple(m))
        for (h, d), m in groups.items()
        if len({t for t, _ in m}) > 1
    ]


def _describe(group: SharedDir, targets: Mapping[str, DeployConfig], hosts: Mapping[str, str] | None,
              host_local: bool) -> str:
    names = group.targets
    first, second = names[0], names[1]
    more = f" and {len(names) - 2} more" if len(names) > 2 else ""
    where = ""
    if hosts is not None and not host_local and len({hosts.get(n) for n in names}) > 1:
        where = (" (on different hosts: treated as one folder on a shared filesystem; if each host's "
                 "dir is local to it, say so with dirs_host_local=True / --dirs-host-local)")
    return (
        f"targets {first} and {second}{more} write their traces into the same torch_profiler_dir "
        f"{group.dir!r}{where}: session folder names carry no server identity, so one server's trace "
        f"cannot be told from (or may overwrite) the other's; {RENDER_FIX} for replica N, "
        "or run anyway with allow_shared_dirs=True / --allow-shared-dirs (the verdicts are then `ambiguous`)"
    )


def shared_profiler_dirs(
    targets: Mapping[str, DeployConfig],
    stages: Mapping[str, Sequence[int]] | None = None,
    *,
    hosts: Mapping[str, str] | None = None,
    host_local: bool = False,
) -> list[Finding]:
    """One error finding (code ``profiler_dir_shared``) per dir that stages of two or more targets
    share; the message names two of the targets, the dir and the fix."""
    findings = []
    for group in shared_dir_groups(targets, stages, hosts=hosts, host_local=host_local):
        name, sid = group.members[0]
        stage = targets[name].stage(sid)
        findings.append(Finding(
            code="profiler_dir_shared",
            severity=Severity.error,
            message=_describe(group, targets, hosts, host_local),
            stage_id=sid,
            key="profiler_config.torch_profiler_dir",
            where=stage.where if stage is not None else None,
        ))
    return findings
