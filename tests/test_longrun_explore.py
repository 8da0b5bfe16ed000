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
  in ``summaries/`` for good.

Every wait is a poll with a deadline, never a fixed sleep.
"""

from __future__ import annotations

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
