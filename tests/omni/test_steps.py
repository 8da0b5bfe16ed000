"""``steps`` windows on the real two-stage ``vllm serve --omni`` (its /metrics labels each stage's
``vllm:iteration_tokens_total``): a 20-step capture of both stages ends by itself near 20
(the spread measured here is in the test), and each trace holds what ran until the stop landed; the window's
server metrics come per stage; the plan's size prediction holds within a quarter.
"""

from __future__ import annotations

import re
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


@pytest.mark.parametrize("window", range(3))  # one after another: the third may send its stop ahead (lead.py)
def test_twenty_steps_on_both_stages_end_by_themselves(client: SidecarClient, load: None, window: int) -> None:
    cap = client.start_capture(stages=[0, 1], steps=20, label="omni-steps")
    cap = client.wait_capture(cap.id, timeout=900)
    traced = {v.stage_id: v.steps_traced for v in cap.verdicts}
    print(f"asked 20: counted {cap.steps_counted}, traced {traced}, notes {cap.notes}")
    assert (cap.state.value, cap.stop_reason.value if cap.stop_reason else None) == ("completed", "steps"), cap
    # The count the sidecar stopped at: vLLM-Omni's counter is read 20-160 ms late on this machine
    # (recorded in its busy API server process: docs/captures.md) and its stop travels 0-220 ms through the API server, the orchestrator and each stage's queue: on
    # this loaded 2-core machine it was 13-22 (docs/captures.md, precision), unless the capture says
    # why it could not be (the engines ran past 20 before the sidecar could see it: a server's first
    # profiler start on CPU holds its engines for seconds, then they run the queue in a burst; a run
    # here counted 8, then 48 one read later).
    assert cap.steps_counted is not None, cap.notes
    past = ("by the first count after the start was answered", "the server ran past the 20 steps asked",
            "the sidecar was not running meanwhile")
    # A window sent ahead by what the last ones traced past their counts says by how much (a CI run
    # at 71b86d2: 12 ahead, counted 8); its count is that much lower.
    ahead = re.search(r"the stop was sent at \d+ of the 20 steps counted, (\d+) ahead", " ".join(cap.notes))
    lead = int(ahead.group(1)) if ahead else 0
    if not any(p in n for n in cap.notes for p in past):
        assert 10 - lead <= cap.steps_counted <= 30 - lead, (cap.steps_counted, cap.notes)
    # What each trace holds: what the engines ran until the stop landed, never more than the
    # server's own counter ran over the window, give or take the steps it had not recorded yet when
    # the window's last read was made (the load sends one 4-token request at a time). A CI run at
    # fd57d51 counted 20 and traced 66 and 64; a run here counted 48 and traced 51 and 52 of 52 run.
    ran = {int(e.stage): e.engine_steps for e in cap.window_metrics.engines}  # type: ignore[union-attr]
    print(f"the server ran {ran} over the window")
    assert set(traced) == {0, 1} == set(ran), (traced, cap.window_metrics)
    # Short by the steps run while the start travelled (counted from the base read, not yet traced: a
    # CI run at 3fec853 counted 20 and traced 8 and 11), which the notes say below.
    assert all(n is not None and 1 <= n <= ran[s] + 4 for s, n in traced.items()), (traced, ran, cap.notes)
    for s, n in traced.items():
        if n != 20:
            assert f"stage {s}: the trace holds {n} engine steps, 20 were asked" in " ".join(cap.notes), cap.notes


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
