"""``steps`` windows on a real vLLM 0.30 CPU server started WITH its stat loggers (its /metrics
then has ``vllm:iteration_tokens_total``, the step counter): a 20-step capture ends by itself and
its trace holds 20 +- 2 engine steps; the window's server metrics are the real ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.client import SidecarClient
from sidecar.config.rules import max_iterations_for
from sidecar.control.budget import trace_bytes
from tests.fixtures.load import steady_load


@pytest.fixture(scope="module")
def counted(vllm_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    trace_dir = tmp_path_factory.mktemp("vllm-steps-traces")
    pc = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False}
    return {"server": vllm_factory(pc, log_stats=True), "profiler_config": pc}


@pytest.fixture
def sidecar(counted: dict[str, Any], sidecar_factory: Any, tmp_path: Path) -> Any:
    return sidecar_factory(counted["server"].url, None, flavor="vllm", state_dir=tmp_path / "state",
                           extra_args=["--profiler-config", json.dumps(counted["profiler_config"])])  # fmt: skip


@pytest.fixture
def load(counted: dict[str, Any]) -> Iterator[None]:
    # one-token requests one after another: a step per request, paced by its round trip (~ a GPU
    # server's step time); the tiny CPU model's back-to-back decode steps take ~5 ms, below the
    # read's own round trip here (docs/captures.md: precision)
    with steady_load(counted["server"].url, max_tokens=1):
        yield


def test_twenty_steps_end_by_themselves_and_the_trace_holds_them(sidecar: Any, load: None) -> None:
    with SidecarClient(sidecar.url, timeout=300) as client:
        cap = client.start_capture(steps=20, label="steps")
        cap = client.wait_capture(cap.id, timeout=600)
    assert (cap.state.value, cap.stop_reason.value if cap.stop_reason else None) == ("completed", "steps"), cap
    (verdict,) = cap.verdicts
    print(f"asked 20: counted {cap.steps_counted}, traced {verdict.steps_traced}")
    # The sidecar's own precision: the count it stopped at, from the server's counter; unless the
    # host did not run the sidecar when its stop was due (the server keeps both cores busy: a run
    # here paced 351 steps/s and woke the sidecar 40 ms late, counted 34), or the server's first
    # profiler start took longer than the window while its engine stepped on (a CI run at 7b1fc7d:
    # the start was answered 3.98 s after it was sent, the first count after it was 1016), which
    # the capture says; or a read of the counter was not back when the rate said the window was full
    # (a CI run at 95a9e36: not back after 335 ms, the one before took 13 ms; the stop went by the
    # rate of the first 3 steps counted, at 24), which it says too.
    late = any(n for n in cap.notes for why in ("the sidecar was not running meanwhile",
                                                  "by the first count after the start was answered",
                                                  "reads had not come back") if why in n)
    assert cap.steps_counted is not None and (late or abs(cap.steps_counted - 20) <= 2), (cap.steps_counted, cap.notes)
    # The trace: short by the steps the engine ran between the base read and its profiler's start
    # (the start travels too: a CI run at f8f679b counted 20 and traced 16), long by the steps it ran
    # while the stop travelled (API server, engine core, worker): the server's, not the sidecar's.
    # Mostly 0 to 4 here; a CI run at e5e1370 ran 22 steps in the 0.18 s window and the stop took
    # 0.64 s to be answered: traced 48 (docs/captures.md, precision). Never more than the server's
    # own counter ran over the window, and the verdict says what the trace holds.
    # A window whose start outlasted it: the window's metrics begin at the start's answer, the
    # trace at the profiler's start, so its bound is the count the stop was sent at, plus the travel.
    (engine,) = cap.window_metrics.engines  # type: ignore[union-attr]
    upper = max(engine.engine_steps, cap.steps_counted + 10) if late else engine.engine_steps
    assert verdict.steps_traced is not None and 14 <= verdict.steps_traced <= upper, (verdict, engine, cap.notes)
    if verdict.steps_traced != 20:
        assert f"the trace holds {verdict.steps_traced} engine steps, 20 were asked" in " ".join(cap.notes), cap.notes
    ran = 0 if late else 20  # a late window's metrics hold only what ran after the start's answer
    assert engine.engine == "0" and engine.engine_steps >= ran and engine.generation_tokens >= ran, engine


def test_the_plan_predicts_a_twenty_step_window_within_a_quarter(sidecar: Any, load: None) -> None:
    with SidecarClient(sidecar.url, timeout=1800) as client:
        plan = client.plan(budget_mb=150, max_stop_s=60)
        cap = client.start_capture(steps=20, label="planned")
        cap = client.wait_capture(cap.id, timeout=600)
    predicted_mb, predicted_stop_s = plan.predict(20)
    # the size line at the steps the trace holds: the step count's own error is the test above's
    (verdict,) = cap.verdicts
    at_traced_mb = plan.predict(verdict.steps_traced or 0)[0]
    actual_mb = trace_bytes(cap.verdicts) / 1e6
    print(f"20 steps: predicted {predicted_mb:.2f} MB ({at_traced_mb:.2f} at the {verdict.steps_traced} steps "
          f"traced), actual {actual_mb:.2f} MB; stop predicted {predicted_stop_s:.2f}s; plan fits {plan.steps} "
          f"steps ({plan.limited_by})")
    assert 0.75 <= at_traced_mb / actual_mb <= 1.25, (plan, cap.verdicts)


@pytest.fixture(scope="module")
def capped(vllm_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # as `omni-sidecar render --steps 20` writes it: 22 iterations, vLLM counting idle ones too
    trace_dir = tmp_path_factory.mktemp("vllm-capped-traces")
    pc = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False,
          "max_iterations": max_iterations_for(20)}
    return {"server": vllm_factory(pc, log_stats=True), "profiler_config": pc}


@pytest.mark.parametrize("window", range(3))
def test_twenty_steps_on_a_server_that_caps_them_hold_twenty_give_or_take_two(
    capped: dict[str, Any], sidecar_factory: Any, tmp_path: Path, window: int
) -> None:
    # The server ends the window itself after its 22 iterations, whatever the stop's travel; the
    # sidecar's stop waits until the engine's own count is past them. Two 8-token requests at a time
    # keep the engine stepping (one short request at a time leaves an idle iteration at each end).
    sc = sidecar_factory(capped["server"].url, None, flavor="vllm", state_dir=tmp_path / "state",
                         extra_args=["--profiler-config", json.dumps(capped["profiler_config"])])  # fmt: skip
    url = capped["server"].url
    with steady_load(url, max_tokens=8), steady_load(url, max_tokens=8), SidecarClient(sc.url, timeout=300) as client:
        cap = client.wait_capture(client.start_capture(steps=20, label="capped").id, timeout=600)
    (verdict,) = cap.verdicts
    print(f"asked 20 on max_iterations {max_iterations_for(20)}: counted {cap.steps_counted}, traced "
          f"{verdict.steps_traced}, notes {cap.notes}")
    assert (cap.state.value, cap.stop_reason.value if cap.stop_reason else None) == ("completed", "steps"), cap
    assert any(n.startswith("the stop was sent at ") and "ends its own window after 22 engine iterations" in n
               for n in cap.notes), cap.notes
    assert verdict.steps_traced is not None and abs(verdict.steps_traced - 20) <= 2, (verdict, cap.notes)
