"""``steps`` windows on the real two-stage ``vllm serve --omni`` (its /metrics labels each stage's
``vllm:iteration_tokens_total``): a 20-step capture of both stages ends by itself near 20
(the spread measured here is in the test), and each trace holds what ran until the stop landed; the window's
server metrics come per stage; the plan's size prediction holds within a quarter.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sidecar.client import SidecarClient
from sidecar.control.budget import trace_bytes
from tests.fixtures.load import steady_load
from tests.omni.conftest import Setup



@pytest.fixture
def load(two_stage: Setup) -> Iterator[None]:
    with steady_load(two_stage.url, max_tokens=4):  # through both stages
        yield


def test_twenty_steps_on_both_stages_end_by_themselves(client: SidecarClient, load: None) -> None:
    cap = client.start_capture(stages=[0, 1], steps=20, label="omni-steps")
    cap = client.wait_capture(cap.id, timeout=900)
    traced = {v.stage_id: v.steps_traced for v in cap.verdicts}
    print(f"asked 20: counted {cap.steps_counted}, traced {traced}")
    assert (cap.state.value, cap.stop_reason.value if cap.stop_reason else None) == ("completed", "steps"), cap
    # vLLM-Omni's counter moves by a request's steps at once and its stop travels 0-220 ms through
    # the API server, the orchestrator and each stage's queue: on this loaded 2-core machine the
    # count the sidecar stopped at was 13-22 and the traces held 19-44 steps of 20 asked
    # (docs/captures.md, precision). What holds every run: it ended by itself, near the count.
    # When the engines step faster than the start's round trip (a CI run: 48 steps by the first
    # count, 0.14 s after the start was sent; the traces held 44 and 47), the window cannot be
    # shorter: the capture stops at once and says so.
    assert cap.steps_counted is not None, cap.notes
    if not any(n.startswith(f"the server had run {cap.steps_counted} engine steps by the first count after the start "
                            "was answered") for n in cap.notes):
        assert 10 <= cap.steps_counted <= 30, (cap.steps_counted, cap.notes)
    assert set(traced) == {0, 1} and all(n is not None and 10 <= n <= cap.steps_counted + 40 for n in traced.values()), (
        traced, cap.notes)
    stages = {e.stage for e in cap.window_metrics.engines}  # type: ignore[union-attr]
    assert stages == {"0", "1"}, cap.window_metrics


def test_the_plan_predicts_a_twenty_step_window_within_a_quarter(client: SidecarClient, load: None) -> None:
    plan = client.plan(stages=[0, 1], budget_mb=150, max_stop_s=60)
    cap = client.wait_capture(client.start_capture(stages=[0, 1], steps=20).id, timeout=900)
    predicted_mb, predicted_stop_s = plan.predict(20)
    # the size line at the steps each stage's trace holds: the step count's own error is the test above's
    traced = {v.stage_id: v.steps_traced or 0 for v in cap.verdicts}
    at_traced_mb = sum(p.bytes_fixed + p.bytes_per_step * traced[p.stage_id] for p in plan.per_stage) / 1e6
    actual_mb = trace_bytes(cap.verdicts) / 1e6
    print(f"20 steps: predicted {predicted_mb:.3f} MB ({at_traced_mb:.3f} at the {traced} steps traced), "
          f"actual {actual_mb:.3f} MB; stop predicted {predicted_stop_s:.2f}s")
    assert 0.75 <= at_traced_mb / actual_mb <= 1.25, (plan, cap.verdicts)
