"""RolloutProfiler at its edges: odd ranks, steps and budgets are refused by name at construction;
a step taken twice, a profiler closed inside a window, a start cancelled by its caller and a close
from ``on_result`` each leave a true result and no capture recording (in-process fake upstreams:
real sockets and session folders, as tests/test_rollout.py's rule tests)."""

from __future__ import annotations

import asyncio

import pytest

from sidecar import RolloutProfiler
from sidecar.control.controller import ControlSettings
from sidecar.errors import BudgetInvalid, FleetClosed, RanksInvalid, StepsInvalid
from sidecar.fleet import Target
from tests.fixtures.waits import apoll, poll

FAST = ControlSettings(collect_timeout_s=30, close_timeout_s=5, summarize=False)
UNREACHABLE = ["sidecar=http://127.0.0.1:9", "sidecar=http://127.0.0.1:10"]


def _profiler(replicas, **kwargs) -> RolloutProfiler:
    kwargs.setdefault("control_settings", FAST)
    return RolloutProfiler([Target.upstream(r.url, r.deploy) for r in replicas], **kwargs)


@pytest.mark.parametrize("ranks", [1, "0", [True], [0.0]])
def test_ranks_that_are_no_list_of_indices_are_refused_as_ranks(ranks):
    with pytest.raises(RanksInvalid) as info:
        RolloutProfiler(UNREACHABLE, steps=[1], ranks=ranks)
    assert "replica indices" in info.value.message


def test_a_huge_list_of_bad_steps_is_named_not_printed_whole():
    with pytest.raises(StepsInvalid) as info:
        RolloutProfiler(UNREACHABLE, steps=range(-50_000, 10))
    assert len(info.value.message) < 300 and "50001 in all" in info.value.message


def test_a_range_of_more_steps_than_any_run_profiles_is_refused_without_expanding_it():
    # range(1, 10**12) was expanded into a set: minutes of CPU and GBs before anything was said
    with pytest.raises(StepsInvalid) as info:
        RolloutProfiler(UNREACHABLE, steps=range(1, 10**12))
    assert "more than 100,000 training steps" in info.value.message, info.value.message


@pytest.mark.parametrize("value", ["600", 0, -1.0, True, float("nan")])
def test_an_artifact_timeout_that_is_no_positive_number_is_refused_at_construction(value):
    with pytest.raises(BudgetInvalid) as info:
        RolloutProfiler(UNREACHABLE, steps=[1], artifact_timeout_s=value)
    assert info.value.details.get("key", "artifact_timeout_s") == "artifact_timeout_s"
    assert "artifact_timeout_s" in info.value.message


def test_a_step_taken_twice_before_either_block_is_profiled_once(fake_replica_factory):
    (replica,) = fake_replica_factory(1)
    with _profiler([replica], steps=[1]) as prof:
        first, second = prof.step(1), prof.step(1)
        with first as res1:
            pass
        with second as res2:
            pass
    assert res1 is not None and res2 is None
    assert len(replica.calls("/start_profile")) == 1 and prof.results()[1].ok


@pytest.mark.parametrize("strict", [False, True])
def test_closing_inside_a_window_stops_it_and_says_so(fake_replica_factory, strict):
    (replica,) = fake_replica_factory(1)
    prof = _profiler([replica], steps=[1], strict=strict)
    with pytest.raises(FleetClosed) if strict else _nothing():
        with prof.step(1):
            assert any(replica.profiling().values())
            prof.close()
    res = prof.results()[1]
    assert res.error is not None and res.error.code == "fleet_closed" and not res.ok
    assert not any(replica.profiling().values())  # the closing sweep stopped it


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


async def test_a_start_cancelled_by_its_caller_is_recorded_and_rolled_back(fake_replica_factory):
    (replica,) = fake_replica_factory(1)
    replica.fake.start_delay = 2.0  # the server holds the start: the caller's timeout comes first
    seen = []
    prof = _profiler([replica], steps=[1], on_result=seen.append)
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.5) if hasattr(asyncio, "timeout") else _atimeout(0.5):
            async with prof.astep(1):
                pytest.fail("the block ran although its start was cancelled")
    assert await apoll(lambda: seen, timeout=30)
    assert seen[0].error is not None and seen[0].error.code == "start_cancelled" and not seen[0].ok
    assert await apoll(lambda: replica.calls("/stop_profile"), timeout=30)  # what had started was stopped
    assert not any(replica.profiling().values())
    await asyncio.to_thread(prof.close)


class _atimeout:  # Python 3.10: asyncio.timeout is 3.11+
    def __init__(self, s):
        self.s = s

    async def __aenter__(self):
        task = asyncio.current_task()
        self.handle = asyncio.get_running_loop().call_later(self.s, task.cancel)

    async def __aexit__(self, exc_type, exc, tb):
        self.handle.cancel()
        if exc_type is asyncio.CancelledError:
            raise asyncio.TimeoutError from exc
        return False


def test_close_from_on_result_does_not_hang_and_closes(fake_replica_factory):
    (replica,) = fake_replica_factory(1)
    prof: RolloutProfiler

    def on_result(_res):
        prof.wait()
        prof.close()

    prof = _profiler([replica], steps=[1, 2], on_result=on_result)
    with prof.step(1):
        pass
    assert poll(lambda: not prof._loop.thread.is_alive(), timeout=30), "the profiler's loop never stopped"  # was 2 min: blocked on itself
    assert prof.results()[1].ok
    with prof.step(2) as res:  # closed: step 2 runs unprofiled
        assert res is None
    assert len(replica.calls("/start_profile")) == 1


@pytest.mark.parametrize("prefix", ["step\n", 5, "\x1b[31m"])
def test_a_label_prefix_every_target_would_refuse_is_refused_at_construction(prefix):
    # it reached every sidecar as a start's label, refused there (422) at the first profiled step
    from sidecar.errors import LabelInvalid

    with pytest.raises(LabelInvalid) as info:
        RolloutProfiler(UNREACHABLE, steps=[1], label_prefix=prefix)
    assert info.value.message.startswith("label_prefix "), info.value.message


def test_a_block_exiting_while_another_thread_closes_the_profiler_does_not_hang(fake_replica_factory):
    # the block's stop was sent to the profiler's loop as close() began on another thread: the loop
    # stopped under it and the block waited forever
    import threading

    (replica,) = fake_replica_factory(1)
    replica.fake.stop_delay = 60.0  # the server holds the stop: the block is still exiting when close() runs
    prof = _profiler([replica], steps=[1])
    done = threading.Event()

    def trainer() -> None:
        with prof.step(1):
            pass
        done.set()

    worker = threading.Thread(target=trainer, daemon=True)
    worker.start()
    assert poll(lambda: replica.calls("/stop_profile"), timeout=30)
    prof.close(timeout=2)
    replica.fake.stop_delay = 0
    assert done.wait(60), "the block's exit hung after close()"
    res = prof.results()[1]
    assert res.error is not None and not res.ok, res
    # what the close gave up on was cancelled and unwound (its connections closed), not destroyed
    # pending with the loop ("Task was destroyed but it is pending!", unclosed client sessions)
    left = [t for t in asyncio.all_tasks(prof._loop.loop) if not t.done()]
    assert left == [], left
