"""A fleet of two real ``vllm serve --omni`` servers, each behind a real sidecar: distinct trace
dirs → ``ok`` on each; one dir written by both → refused before anything is sent, or with
``allow_shared_dirs`` every shared stage ``ambiguous`` — never two ``ok``s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.api.launcher import SidecarProcess
from sidecar.errors import ProfilerDirShared
from sidecar.fleet import Fleet
from tests.omni.conftest import Setup, complete, end_open_captures, start_sidecar


@pytest.fixture
def sidecars(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    setups: list[Setup] = [request.getfixturevalue(name) for name in request.param]
    procs = [start_sidecar(s, tmp_path / f"state-{i}") for i, s in enumerate(setups)]
    try:
        yield procs
    finally:
        for proc in procs:
            end_open_captures(proc.url)
            proc.stop(grace=30)


def targets(procs: list[SidecarProcess]) -> str:
    return ",".join(f"sidecar={p.url}" for p in procs)


@pytest.mark.parametrize("sidecars", [("two_stage", "global_profiler")], indirect=True)
async def test_two_servers_with_distinct_dirs_are_ok_each(sidecars: list[SidecarProcess], two_stage: Setup,
                                                          global_profiler: Setup) -> None:  # fmt: skip
    async with Fleet(targets(sidecars)) as fleet:
        fc = await fleet.start(label="fleet")
        await asyncio.gather(*(asyncio.to_thread(complete, s.url, 1) for s in (two_stage, global_profiler)))
        fc = await fleet.stop(fc, artifact_timeout_s=600)
    verdicts = {name: {v.stage_id: v.verdict.value for v in r.verdicts} for name, r in fc.targets.items()}
    assert list(verdicts.values()) == [{0: "ok", 1: "ok"}, {0: "ok"}], verdicts
    folders = [f for r in fc.targets.values() for f in r.folders]
    assert len(folders) == len(set(folders)) == 3


@pytest.mark.parametrize("sidecars", [("bounded", "global_profiler")], indirect=True)
async def test_one_dir_shared_by_two_servers_is_refused_before_anything_is_sent(
    sidecars: list[SidecarProcess], bounded: Setup, global_profiler: Setup
) -> None:
    shared = global_profiler.dirs[0]
    assert bounded.dirs[0] == shared
    before = set(shared.iterdir())
    with pytest.raises(ProfilerDirShared) as err:
        async with Fleet(targets(sidecars), stages=[0]) as fleet:
            await fleet.start(label="shared")
    assert str(shared) in str(err.value)
    assert set(shared.iterdir()) == before  # no server got a start


@pytest.mark.parametrize("sidecars", [("bounded", "global_profiler")], indirect=True)
async def test_one_dir_shared_run_anyway_is_ambiguous_never_two_oks(
    sidecars: list[SidecarProcess], bounded: Setup, global_profiler: Setup
) -> None:
    async with Fleet(targets(sidecars), stages=[0], allow_shared_dirs=True) as fleet:
        fc = await fleet.start(label="shared anyway")
        await asyncio.gather(*(asyncio.to_thread(complete, s.url, 1) for s in (bounded, global_profiler)))
        fc = await fleet.stop(fc, artifact_timeout_s=600)
    verdicts = [v.verdict.value for r in fc.targets.values() for v in r.verdicts]
    assert verdicts == ["ambiguous", "ambiguous"], fc
