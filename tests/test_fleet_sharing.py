"""Shared profiler dirs: the pure rule (sidecar.config.sharing) and the fleet's up-front refusal,
its override (verdicts `ambiguous`, never `ok`) and host-local dirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sidecar.config.deploy import load_deploy_config
from sidecar.config.sharing import shared_profiler_dirs
from sidecar.control.controller import ControlSettings
from sidecar.control.models import Verdict
from sidecar.errors import ProfilerDirShared
from sidecar.fleet import Fleet, Target
from tests.fixtures.stubs import StubFleet

FAST = ControlSettings(collect_timeout_s=30, close_timeout_s=3, summarize=False)


def _deploy(path: Path, dirs: dict[int, str]) -> Path:
    stages = [{"stage_id": sid, "profiler_config": {"profiler": "torch", "torch_profiler_dir": d}} for sid, d in dirs.items()]
    path.write_text(yaml.safe_dump({"stages": stages}))
    return path


def test_two_deploys_writing_one_dir_are_one_finding_naming_both_and_the_fix(tmp_path):
    a = load_deploy_config(_deploy(tmp_path / "a.yaml", {0: "/data/perf", 1: "/data/perf/"}))
    b = load_deploy_config(_deploy(tmp_path / "b.yaml", {0: "/data/perf"}))
    (finding,) = shared_profiler_dirs({"A": a, "B": b})
    assert finding.code == "profiler_dir_shared" and finding.is_error
    assert "A and B" in finding.message and "'/data/perf'" in finding.message
    assert "--dir '/data/perf/{host}/replica{replica}' --replica N" in finding.message


def test_stages_of_one_deploy_may_share_a_dir_and_unselected_stages_do_not_count(tmp_path):
    a = load_deploy_config(_deploy(tmp_path / "a.yaml", {0: "/d", 1: "/d", 2: "/shared"}))
    b = load_deploy_config(_deploy(tmp_path / "b.yaml", {2: "/shared"}))
    assert shared_profiler_dirs({"A": a}) == []
    assert shared_profiler_dirs({"A": a, "B": b}, {"A": [0, 1], "B": [2]}) == []
    assert len(shared_profiler_dirs({"A": a, "B": b})) == 1


def test_same_path_on_other_hosts_is_shared_unless_dirs_are_host_local(tmp_path):
    deploy = load_deploy_config(_deploy(tmp_path / "d.yaml", {0: "/local/perf"}))
    targets = {"h1": deploy, "h2": deploy, "h2b": deploy}
    hosts = {"h1": "10.0.0.1", "h2": "10.0.0.2", "h2b": "10.0.0.2"}
    (shared,) = shared_profiler_dirs(targets, hosts=hosts)
    assert "--dirs-host-local" in shared.message
    (same_host,) = shared_profiler_dirs(targets, hosts=hosts, host_local=True)
    assert "h2 and h2b" in same_host.message  # one host, one path: always one folder


def test_the_fleet_refuses_upstream_targets_sharing_a_deploy_before_anything_is_sent(tmp_path):
    deploy = _deploy(tmp_path / "d.yaml", {0: str(tmp_path / "perf")})
    with pytest.raises(ProfilerDirShared) as info:
        Fleet([Target.upstream("http://127.0.0.1:9", deploy), Target.upstream("http://127.0.0.1:10", deploy)])
    assert info.value.code == "profiler_dir_shared"
    (shared,) = info.value.details["shared"]
    assert shared["targets"] == ["upstream=http://127.0.0.1:9", "upstream=http://127.0.0.1:10"]


async def test_allowed_shared_dirs_give_ambiguous_verdicts_never_ok(tmp_path):
    with StubFleet(2, mode="upstream", root=tmp_path) as stubs:
        deploy = _deploy(tmp_path / "d.yaml", {0: str(tmp_path / "replica0" / "stage0")})
        targets = [Target.upstream(u, deploy) for u in stubs.urls]
        async with Fleet(targets, allow_shared_dirs=True, control_settings=FAST) as fleet:
            fc = await fleet.stop(await fleet.start())
    assert not fc.ok
    for r in fc.targets.values():
        (v,) = r.verdicts
        assert v.verdict is Verdict.ambiguous and "shared with" in v.reason and r.state.value == "degraded"


async def test_sidecar_targets_are_compared_by_their_stages_reply(tmp_path):
    with StubFleet(3, mode="sidecar", root=tmp_path) as stubs:
        targets = [Target.sidecar(u) for u in stubs.urls]
        async with Fleet(targets) as fleet:  # each stub sidecar reports its own dir: accepted
            fc = await fleet.stop(await fleet.start())
        assert fc.ok
