"""A sidecar that runs for weeks: hundreds of captures, its state dir, its summaries cache, its
memory, driven as operators drive it (a real ``omni-sidecar serve`` over the emulator's thread
workers, on free 127.0.0.1 ports).

The exploratory pass ran 300 captures (``--keep 50``): the state dir stayed at ``--keep`` records and
summaries, every capture was listed once across pages; a journal of 5,000 records loaded and paged
(50 pages of 100, each id once). The tests here are the defects it found in the state dir:

- plain vLLM: the copy of ``profiler_out_<r>.txt`` each capture keeps (``<state dir>/artifacts/<id>/``,
  the server rewrites the table at every stop) stayed when retention dropped the capture, one
  folder per capture for good;
- a summary being computed when retention dropped its capture (``--keep 0``: every capture, as it
  ends, before its summary is made) was written after the capture's files were deleted, and stayed
  in ``summaries/`` for good;
- every capture kept in history held the listing of the server's profiler dirs its start took
  (~5 MB a capture at 20,000 old session folders a stage: gigabytes over a week at ``--keep 1000``);
- with ``--keep 0`` a ``stop?wait=true`` answered 404: the capture it waited for had been dropped.

Every wait is a poll with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.emulator import make_deploy
from tests.fixtures.waits import poll

pytestmark = pytest.mark.slow

THREAD = ["--workers", "thread", "--step-ms", "1"]  # trace contents hardly matter: thread workers start in ~1 s
HTTP_TIMEOUT = 60


def _capture(sidecar: httpx.Client, emulator: httpx.Client | None = None, *, wait: bool = True) -> str:
    """One capture, started and stopped (``wait``: until it is terminal), with a request in its
    window when ``emulator`` is given (an ``ok`` verdict, so its summary is made)."""
    started = sidecar.post("/v1/captures", json={})
    assert started.status_code == 201, started.text
    cid = started.json()["id"]
    if emulator is not None:
        reply = emulator.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    stopped = sidecar.post(f"/v1/captures/{cid}/stop", params={"wait": str(wait).lower(), "timeout": HTTP_TIMEOUT})
    assert stopped.status_code in (200, 202), stopped.text
    assert not wait or stopped.json()["state"] in ("completed", "degraded"), stopped.text
    return cid


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def test_plain_vllm_table_copies_of_dropped_captures_leave_the_state_dir(
        tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]) -> None:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}})
    emu = shared_emulator_factory(deploy, flavor="vllm", extra_args=THREAD, startup_timeout=120)
    sc = sidecar_factory(emu.url, deploy, flavor="vllm", extra_args=["--keep", "2"])
    copies = sc.state_dir / "artifacts"
    with httpx.Client(base_url=sc.url, timeout=HTTP_TIMEOUT) as client:
        made = [_capture(client) for _ in range(5)]
        kept = {c["id"] for c in client.get("/v1/captures").json()["captures"]}
        assert poll(lambda: _names(copies) <= kept, timeout=30)
    # each kept capture still has its copy (what its download serves); the three dropped ones none
    assert (len(kept), _names(copies)) == (2, set(made[-2:])), sorted(_names(copies))


def test_a_summary_made_while_retention_dropped_its_capture_is_not_kept(
        tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]) -> None:
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}, diffusion=[2])
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    # --keep 0: a capture leaves the history as it ends, before its summary (made in the background) is
    sc = sidecar_factory(emu.url, deploy, extra_args=["--keep", "0"])
    summaries = sc.state_dir / "summaries"
    with httpx.Client(base_url=sc.url, timeout=HTTP_TIMEOUT) as client, \
            httpx.Client(base_url=emu.url, timeout=HTTP_TIMEOUT) as emulator:
        cid = _capture(client, emulator, wait=False)
        assert poll(lambda: client.get("/v1/captures").json()["captures"] == [], timeout=60)  # ended, dropped

        def analysed() -> bool:  # the file (kept) or the sidecar's word that it was not
            return bool(_names(summaries)) or f"capture {cid}: summary not cached" in sc.log_path.read_text()

        assert poll(analysed, timeout=60), sc.log_tail()
    assert _names(summaries) == set()


def test_keep_0_stop_and_wait_answers_the_capture_it_waited_for(
        tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]) -> None:
    # --keep 0 drops a capture as it ends: the wait re-read it by id and answered 404 capture_not_found
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    sc = sidecar_factory(emu.url, deploy, extra_args=["--keep", "0"])
    with httpx.Client(base_url=sc.url, timeout=HTTP_TIMEOUT) as client:
        cid = client.post("/v1/captures", json={}).json()["id"]
        stopped = client.post(f"/v1/captures/{cid}/stop", params={"wait": "true", "timeout": HTTP_TIMEOUT})
        assert stopped.status_code == 200, stopped.text
        assert (stopped.json()["id"], stopped.json()["state"] in ("completed", "degraded")) == (cid, True), stopped.text
        assert client.get(f"/v1/captures/{cid}").status_code == 404  # and then it is gone, as --keep 0 says


def test_memory_does_not_grow_with_the_old_session_folders_of_each_kept_capture(
        tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]) -> None:
    # A server's profiler dirs hold weeks of session folders; each start lists them (its baseline),
    # and every capture kept in history (default --keep 1000) held its listing: ~5 MB a capture at
    # 20,000 folders a stage, so the sidecar grew by gigabytes over a week of captures.
    psutil = pytest.importorskip("psutil")
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}, diffusion=[2])
    for stage, name in ((0, "{t}_stage0_rank0_{e}"), (2, "{t}_stage_2_rep_0_diffusion_{e}")):
        folder = tmp_path / "traces" / f"stage{stage}"
        for i in range(20_000):  # a minute apart, a month ago
            e = 1_700_000_000 + 60 * i
            (folder / name.format(t=time.strftime("%Y%m%d-%H%M%S", time.gmtime(e)), e=e)).mkdir(parents=True)
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    sc = sidecar_factory(emu.url, deploy)
    rss = psutil.Process(sc.pid).memory_info
    with httpx.Client(base_url=sc.url, timeout=HTTP_TIMEOUT) as client:
        for _ in range(4):  # warm: first-time allocations, the transient peak of a start's listing
            _capture(client)
        before = rss().rss
        for _ in range(16):
            _capture(client)
        grown = rss().rss - before
    # 16 captures held ~80 MB of listings before; what is left is the allocator's (1 to 12 MiB measured)
    assert grown < 32 << 20, f"RSS grew {grown / 2**20:.1f} MiB over 16 captures"


def test_keep_days_drops_old_captures_from_an_idle_sidecars_list(
        tmp_path: Path, shared_emulator_factory: Callable[..., Any], sidecar_factory: Callable[..., Any]) -> None:
    # retention ran at start-up and as a capture ended: an idle sidecar listed a capture past
    # --keep-days (and kept its files) until the next capture ended, maybe weeks later
    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})
    emu = shared_emulator_factory(deploy, extra_args=THREAD)
    sc = sidecar_factory(emu.url, deploy, extra_args=["--keep-days", "0.00003"])  # 2.6 s
    with httpx.Client(base_url=sc.url, timeout=HTTP_TIMEOUT) as client:
        cid = _capture(client)
        assert poll(lambda: client.get("/v1/captures").json()["captures"] == [], timeout=60)
        assert client.get(f"/v1/captures/{cid}").status_code == 404
    assert poll(lambda: not (sc.state_dir / "captures" / f"{cid}.json").exists(), timeout=30)
