"""Windows counted in engine steps and the window's server metrics (sidecar/upstream/metrics.py):
the reader on the real servers' saved ``/metrics`` (tests/data/metrics/), the emulator's
``/metrics`` against them, a ``steps`` capture that ends by itself, and the refusals.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.config import load_deploy_config
from sidecar.config.rules import capped_by_server
from sidecar.control.budget import Probe, check_budget, make_plan, run_plan
from sidecar.client import SidecarClient
from sidecar.control.models import CaptureState, StopReason
from sidecar.errors import BudgetExceeded, SidecarError
from sidecar.upstream.metrics import KEPT_FAMILIES, MetricsUnreadable, engine_steps, parse_metrics, quantile, step_counts, steps_since, window_metrics
from tests.fixtures.emulator import EmulatorPool, emulator_state, make_deploy
from tests.fixtures.sidecar import AppClient, ModuleSidecar, error_of, start_in_background
from tests.fixtures.load import steady_load
from tests.fixtures.waits import poll

DATA = Path(__file__).parent / "data" / "metrics"
# the real vllm serve (CPU, vLLM 0.30, stat loggers on) idle (0), after 3 completions of 8 tokens
# one after another (1), after 2 more inside a profiled window (2); model_name scrubbed
VLLM = [(DATA / f"vllm-0.30-cpu-{i}.prom").read_text() for i in range(3)]
STAGES = {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}}
THREAD = ["--workers", "thread"]


def test_real_vllm_counts_one_step_per_generated_token() -> None:
    idle, after = parse_metrics(VLLM[0]), parse_metrics(VLLM[1])
    # 3 requests x 8 tokens, one after another: 1 prefill + 7 decode steps each
    assert (engine_steps(idle), engine_steps(after)) == ({(("engine", "0"),): 0}, {(("engine", "0"),): 24})


def test_real_vllm_window_keeps_requests_tokens_and_latency() -> None:
    (engine,) = window_metrics(parse_metrics(VLLM[0]), parse_metrics(VLLM[1])).engines
    got = (engine.engine, engine.engine_steps, engine.requests_finished, engine.prompt_tokens,
           engine.generation_tokens, sorted(engine.latency), engine.latency["itl"].count,
           engine.latency["e2e"].count)  # fmt: skip
    assert got == ("0", 24, 3, 9, 24, ["e2e", "itl", "queue", "ttft"], 21, 3)


def test_window_is_the_difference_of_its_edges() -> None:
    (engine,) = window_metrics(parse_metrics(VLLM[1]), parse_metrics(VLLM[2])).engines
    assert (engine.engine_steps, engine.requests_finished, engine.generation_tokens) == (16, 2, 16)


def test_quantile_interpolates_within_the_bucket() -> None:
    buckets = {0.1: 10.0, 0.2: 30.0, float("inf"): 40.0}
    got = [round(quantile(buckets, q) or -1, 6) for q in (0.5, 0.125, 0.99)]
    assert got == [0.15, 0.05, 0.2]  # the +Inf bucket answers its lower bound


def _label_names(text: str) -> dict[str, set[str]]:
    return {f.name: {k for s in f.samples for k in s.labels if k != "le"}
            for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    root = tmp_path_factory.mktemp("steps")
    yield from ModuleSidecar.for_module(emulator_pool, make_deploy(root, STAGES), emulator_args=THREAD,
                                        state_dir=root / "state", log_path=root / "sidecar.log")  # fmt: skip


@pytest.fixture
def shared(_shared: ModuleSidecar) -> Iterator[ModuleSidecar]:
    yield from _shared.each_test()


def test_emulator_metrics_are_the_real_servers_families(shared: ModuleSidecar) -> None:
    emu = shared.emulator
    emu.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    text = emu.http.get("/metrics").text
    ours, real = _label_names(text), _label_names(VLLM[1])
    # the same names, the real labels with vLLM-Omni's engine label (stage, replica) for vLLM's
    assert {name: labels - {"stage", "replica"} | ({"engine"} if "stage" in labels else set())
            for name, labels in ours.items()} == {name: real[name] for name in ours}
    steps = engine_steps(parse_metrics(text))
    assert {dict(k)["stage"] for k, n in steps.items() if n >= 3} == {"0", "1", "2"}


def _stage0_steps(shared: ModuleSidecar) -> int:
    return engine_steps(parse_metrics(shared.emulator.http.get("/metrics").text)).get((("stage", "0"), ("replica", "0")), 0)


def test_a_counted_window_starts_after_its_delay_ends_at_its_count_and_says_what_the_traces_hold(
    shared: ModuleSidecar
) -> None:
    # No cap on these stages: a steps window is a best-effort count, asked for by name
    with steady_load(shared.emulator.url, max_tokens=1, chat=True):
        with shared.client() as client:
            before = _stage0_steps(shared)
            cap = client.start_capture(stages=[0, 2], steps=20, delay_steps=10, steps_bound="count")
            after = _stage0_steps(shared)
            final = client.wait_capture(cap.id, timeout=120)
    assert after - before >= 10, (before, after)
    assert (final.state.value, final.stop_reason.value, final.steps, final.steps_bound.value,
            final.steps_ended_by.value) == ("completed", "steps", 20, "count", "steps"), final
    assert final.steps_counted is not None and final.steps_counted >= 20, final.steps_counted
    (ended,) = final.fact("steps_ended")
    assert (ended.figures["ended_by"], ended.figures["counted"], ended.figures["bound"]) == (
        "steps", final.steps_counted, "count"), ended
    traced = {v.stage_id: v.steps_traced for v in final.verdicts}
    assert set(traced) == {0, 2} and all(n is not None and n > 0 for n in traced.values()), traced
    # every stage whose trace holds other than the 20 asked says so, with its figures
    differs = {n.stage_id: n.figures["steps_traced"] for n in final.fact("steps_traced")}
    assert differs == {s: n for s, n in traced.items() if n != 20}, (differs, traced)
    wm = final.window_metrics
    assert wm is not None and wm.unavailable is None and {e.stage for e in wm.engines} >= {"0", "2"}, wm


def test_a_delayed_windows_metrics_cover_the_window_only(shared: ModuleSidecar) -> None:
    # The window's server metrics are the difference of the read at the start's send and the one
    # after its stop: the delay's steps (100 here) are before the window, not in it. (They were
    # taken from the read before the delay: `--steps 20 --delay-steps 300` reported 345 engine steps
    # for a window open 0.09 s.)
    with steady_load(shared.emulator.url, max_tokens=1, chat=True), shared.client() as client:
        final = client.wait_capture(client.start_capture(stages=[0, 2], steps=5, delay_steps=100,
                                                         steps_bound="count").id, timeout=120)
    assert (final.state.value, final.steps_ended_by.value) == ("completed", "steps"), final
    wm = final.window_metrics
    assert wm is not None and wm.unavailable is None, wm
    ran = {e.stage: e.engine_steps for e in wm.engines}
    traced = {str(v.stage_id): v.steps_traced or 0 for v in final.verdicts}
    # what the window ran: its count, the stop's travel, and the steps while the traces were written;
    # far from the 100 before it
    assert 0 < ran["0"] < 100 and ran["0"] >= traced["0"], (ran, traced, final.steps_counted)


def test_a_steps_window_on_an_idle_server_ends_by_itself_and_says_why(capped: ModuleSidecar, sidecar_factory: Any) -> None:
    # No traffic: the counter never moves. The window ends once it has stood still steps_stall_s
    # (1 s here, 10 by default), stopped, with its reason as a fact; before, it recorded forever.
    sc = sidecar_factory(capped.emulator.url, capped.deploy, env={"OMNI_SIDECAR_STEPS_STALL_S": "1"})
    with SidecarClient(sc.url, timeout=60) as client:
        final = client.wait_capture(client.start_capture(stages=[0, 2], steps=8).id, timeout=60)
        # and /metrics answering late, as a busy server does (the real two-stage server beside
        # another's start: up to 5 s, 13 ms alone): the fact says how long the window went unread
        capped.emulator.set_faults(metrics_delay_s=0.3)
        try:
            counted = client.wait_capture(client.start_capture(stages=[0, 2], steps=8, steps_bound="count").id,
                                          timeout=60)
        finally:
            capped.emulator.set_faults(metrics_delay_s=0)
    for cap in (final, counted):
        assert (cap.state.value in ("completed", "degraded"), cap.stop_reason.value, cap.steps_ended_by.value) == (
            True, "steps", "stalled"), cap
        (ended,) = cap.fact("steps_ended")
        assert (ended.figures["counted"], ended.figures["still_s"] >= 1) == (0, True), ended
    assert counted.fact("steps_ended")[0].figures["read_gap_s"] >= 0.3, counted.facts
    starts = [c["path"] for c in emulator_state(capped.emulator)["calls"] if c["path"].endswith("_profile")]
    assert starts[-4:] == ["/start_profile", "/stop_profile"] * 2, starts  # each window stopped on the server


def test_a_steps_window_the_server_cannot_end_is_refused_with_the_fix(shared: ModuleSidecar) -> None:
    # No max_iterations on these stages: only the sidecar's stop could end the window, late by what
    # the engines step while it travels. Refused before anything is sent, naming the render that caps
    # it and the best-effort count by name; the CLI says the same and exits 1.
    with shared.client() as client, pytest.raises(SidecarError) as err:
        client.start_capture(stages=[0, 2], steps=20)
    assert (err.value.code, err.value.http_status, err.value.details["max_iterations"]) == (
        "steps_unbounded", 422, 22), err.value
    assert err.value.details["fix"] == "omni-sidecar render --steps 20" and "--count-steps" in err.value.message
    env = {**os.environ, "OMNI_SIDECAR_URL": shared.url, "COLUMNS": "200"}
    cli = subprocess.run([sys.executable, "-m", "sidecar", "capture", "--stages", "0,2", "--steps", "20"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert cli.returncode != 0 and "omni-sidecar render --steps 20" in cli.stdout + cli.stderr, cli
    assert "Traceback" not in cli.stderr, cli.stderr
    starts = [c for c in emulator_state(shared.emulator)["calls"] if c["path"] == "/start_profile"]
    assert starts == [], starts


def test_delay_steps_a_server_never_runs_end_in_steps_not_reached_and_nothing_started(
    shared: ModuleSidecar, sidecar_factory: Any
) -> None:
    # no load: the server's counter stands still; the sidecar's bound is its steps_wait_s setting
    sc = sidecar_factory(shared.emulator.url, shared.deploy, env={"OMNI_SIDECAR_STEPS_WAIT_S": "1"})
    with SidecarClient(sc.url, timeout=60) as client, pytest.raises(SidecarError) as err:
        client.start_capture(stages=[0, 2], steps=5, delay_steps=5, steps_bound="count")
    assert (err.value.code, err.value.details["delay_steps"], err.value.details["counted"]) == (
        "steps_not_reached", 5, 0), err.value
    assert "send load to it" in err.value.message and "within 1s" in err.value.message, err.value.message
    with SidecarClient(sc.url, timeout=60) as client:
        (cap,) = client.list_captures()
    assert (cap.state.value, cap.errors[0].code) == ("failed", "steps_not_reached"), cap
    starts = [c for c in emulator_state(shared.emulator)["calls"] if c["path"] == "/start_profile"]
    assert starts == [], starts


def test_a_stop_while_a_start_waits_for_its_delay_steps_cancels_it_at_once(
    shared: ModuleSidecar, sidecar_factory: Any
) -> None:
    """No load: the delay never ends by itself (steps_wait_s 600). The stop ends the wait at once,
    nothing is sent; before, the stop was taken and ignored, and the slot held."""
    sc = sidecar_factory(shared.emulator.url, shared.deploy, env={"OMNI_SIDECAR_STEPS_WAIT_S": "600"})
    waiting, outcome = start_in_background(sc.url, timeout=600, stages=[0, 2], steps=5, delay_steps=5,
                                           steps_bound="count")
    with SidecarClient(sc.url, timeout=60) as client:
        assert poll(lambda: [c.state.value for c in client.list_captures()] == ["starting"], timeout=60)
        (cap,) = client.list_captures()
        client.stop_capture(cap.id)
        final = client.wait_capture(cap.id, timeout=60)
        waiting.join(timeout=60)
        again = client.start_capture(stages=[0], duration_s=30)  # the slot is free
        client.stop_capture(again.id, wait=True, timeout=60)
    err = outcome.get("error")
    assert (final.state.value, final.errors[0].code, getattr(err, "code", None), waiting.is_alive()) == (
        "failed", "start_cancelled", "start_cancelled", False), (final, err)
    starts = [c for c in emulator_state(shared.emulator)["calls"] if c["path"] == "/start_profile"]
    assert [c["stages"] for c in starts] == [[0]], starts  # only the second capture's


async def test_steps_on_a_server_without_metrics_is_refused_before_any_start(api: AppClient, fake_omni: Any) -> None:
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": [0], "steps": 5, "steps_bound": "count"})
    assert (reply.status_code, error_of(reply)["code"], fake_omni.starts()) == (422, "steps_unavailable", [])


@pytest.mark.parametrize("body", [{"steps": 0}, {"steps": 2.5}, {"delay_steps": -1}, {"steps": True},
                                  {"steps": 5, "steps_bound": "guess"}])
async def test_bad_steps_are_422(api: AppClient, body: dict[str, Any]) -> None:
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": [0], **body})
    assert reply.status_code == 422, reply.text


async def test_window_metrics_say_why_when_the_server_has_none(api: AppClient) -> None:
    client = await api()
    cap = (await client.post("/v1/captures", json={"stages": [0, 2]})).json()
    done = (await client.post(f"/v1/captures/{cap['id']}/stop", params={"wait": "true"})).json()
    wm = done["window_metrics"]
    assert (done["state"], wm["engines"], "404" in wm["unavailable"]) == ("completed", [], True), wm


OMNI = [(DATA / f"omni-0.30-cpu-{i}.prom").read_text() for i in range(3)]


def test_real_omni_labels_each_stage_and_counts_its_steps() -> None:
    # vllm serve --omni, two AR stages: 3 completions of 4 tokens (1), 2 more in a profiled window (2)
    w = window_metrics(parse_metrics(OMNI[1]), parse_metrics(OMNI[2]))
    got = [(e.stage, e.replica, e.engine_steps, e.requests_finished, e.generation_tokens) for e in w.engines]
    assert got == [("0", "0", 8, 2, 8), ("1", "0", 8, 2, 8)]
    assert steps_since({}, engine_steps(parse_metrics(OMNI[2])), [1]) == 20


def _reference(text: str) -> tuple[dict[Any, float], dict[Any, tuple[float, float, dict[float, float]]]]:
    """The kept families as prometheus_client's own parser reads them, summed per engine."""
    counters: dict[Any, float] = {}
    hists: dict[Any, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in KEPT_FAMILIES:
            continue
        for s in family.samples:
            key = (family.name, tuple((k, s.labels[k]) for k in ("stage", "replica", "engine") if k in s.labels))
            if family.type == "counter" and s.name.endswith("_total"):
                counters[key] = counters.get(key, 0.0) + s.value
            elif family.type == "histogram":
                h = hists.setdefault(key, [0.0, 0.0, {}])
                if s.name.endswith("_bucket"):
                    bound = float(s.labels["le"])
                    h[2][bound] = h[2].get(bound, 0.0) + s.value
                elif s.name.endswith("_count"):
                    h[0] += s.value
                elif s.name.endswith("_sum"):
                    h[1] += s.value
    return counters, {k: (c, t, b) for k, (c, t, b) in hists.items()}


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.prom")))
def test_the_fast_reads_equal_prometheus_clients_parse_on_each_real_reply(name: str) -> None:
    text = (DATA / name).read_text()
    snap = parse_metrics(text)
    counters, hists = _reference(text)
    assert snap.counters == counters and counters, name
    assert {k: (h.count, h.sum, h.buckets) for k, h in snap.histograms.items()} == hists and hists, name
    assert step_counts(text) == engine_steps(snap)


def test_the_fast_reads_refuse_what_is_not_a_number() -> None:
    for read in (step_counts, parse_metrics):
        with pytest.raises(MetricsUnreadable, match="not Prometheus text"):
            read('vllm:iteration_tokens_total_count{engine="0"} twelve\n')


def test_each_engine_is_measured_from_its_own_base() -> None:
    # stage 0 far ahead in total, stage 1 ahead in this window: the window ran stage 1's 9, not 0's 2
    base = {(("stage", "0"),): 1000, (("stage", "1"),): 500}
    now = {(("stage", "0"),): 1002, (("stage", "1"),): 509, (("stage", "2"),): 7}
    assert (steps_since(base, now, [0, 1]), steps_since(base, now, [0]), steps_since(base, now, [2])) == (9, 2, 7)
    assert steps_since(base, {(("stage", "0"),): 3}, [0]) == 0  # a restarted engine has run none


def _probe(steps: int, mb: float, stop_s: float) -> Probe:
    return Probe(capture_id=f"p{steps}", steps_asked=steps, steps_traced={0: steps}, bytes={0: int(mb * 1e6)},
                 stop_s=stop_s)


def test_plan_is_a_line_through_the_probes_cut_by_the_tighter_bound() -> None:
    probes = [_probe(1, 1.1, 1.5), _probe(2, 2.1, 2.0)]  # 0.1 MB + 1 MB per step; 1 s + 0.5 s per step
    by_size = make_plan([0], probes, {}, budget_mb=10.1, max_stop_s=None)
    by_stop = make_plan([0], probes, {}, budget_mb=10.1, max_stop_s=3.0)
    assert (by_size.steps, by_size.limited_by, round(by_size.predicted_mb or 0, 3)) == (10, "budget_mb", 10.1)
    assert (by_stop.steps, by_stop.limited_by, round(by_stop.predicted_stop_s or 0, 3)) == (4, "max_stop_s", 3.0)


def test_a_plan_whose_probes_show_no_growth_is_bounded_by_their_bytes_per_step() -> None:
    # two probes of the same size (a line with no slope): the budget's bound was infinite and a 1 MB
    # budget planned 1,000,000 steps; now all of a probe's bytes count per step (the safe side)
    probes = [Probe(capture_id=f"p{n}", steps_asked=n, steps_traced={0: n}, bytes={0: 200_000}, stop_s=1.0)
              for n in (1, 2)]
    plan = make_plan([0], probes, {}, budget_mb=1.0, max_stop_s=None)
    assert (plan.steps, plan.limited_by) == (5, "budget_mb"), plan  # 0.2 MB per step at most: 5 fit


class _ScriptedProbes:
    """The controller surface ``run_plan`` drives (start, wait, deploy), with each probe's traced
    steps and bytes scripted: the engines' pace, which decides them, is the input under test."""

    def __init__(self, traced: list[dict[int, int]], size: Callable[[int], int] = lambda n: 1000 + 5000 * n,
                 window_s: float | None = None, max_iterations: int = 0,
                 write: Callable[[int], float] | None = None, flags: dict[str, bool] | None = None) -> None:
        self.traced, self.asked, self.size, self.window_s, self.write = traced, [], size, window_s, write
        self.bounds: list[str] = []
        self.stopped: list[str] = []
        self.states: list[CaptureState] = []
        self.hang: asyncio.Event | None = None
        pc = SimpleNamespace(max_iterations=max_iterations, delay_iterations=0,  # each stage's, fixed at its start
                             **(flags or {}))
        self.deploy = SimpleNamespace(stage=lambda sid: SimpleNamespace(profiler_config=pc) if max_iterations else None)

    def stages_for(self, stages: list[int] | None) -> list[int]:
        return list(stages or [0])

    async def start(self, stages: list[int] | None, *, steps: int, label: str, budget_check: bool,
                    steps_bound: str) -> Any:
        self.asked.append(steps)
        self.bounds.append(steps_bound)
        return SimpleNamespace(id=label, stages=stages)

    async def stop(self, capture_id: str, **_: Any) -> Any:
        self.stopped.append(capture_id)

    async def wait(self, capture_id: str) -> Any:
        if self.hang is not None:
            await self.hang.wait()
        traced = self.traced[len(self.asked) - 1]
        state = self.states[len(self.asked) - 1] if len(self.asked) <= len(self.states) else CaptureState.completed
        verdicts = [SimpleNamespace(stage_id=sid, steps_traced=n, trace_write_s=self.write(n) if self.write else None,
                                    sessions=[SimpleNamespace(files=[SimpleNamespace(name="trace_rank0.json.gz",
                                                                                     size=self.size(n))])])
                    for sid, n in traced.items()]
        started = datetime(2026, 12, 3, tzinfo=timezone.utc) if self.window_s is not None else None
        asked = started + timedelta(seconds=self.window_s) if started is not None else None  # type: ignore[arg-type]
        return SimpleNamespace(id=capture_id, verdicts=verdicts, steps=self.asked[-1], steps_counted=None,
                               started_at=started, stop_requested_at=asked, stopped_at=None, state=state,
                               stop_reason=StopReason.steps)


@pytest.mark.parametrize(("traced", "asked", "noted"), [
    # an engine faster than the start's round trip: the 1-step probe traced nothing, so did the 2-step one
    ([{0: 0}, {0: 0}, {0: 9}], [1, 2, 8], ["stage 0's probes of 1, 2 steps traced 0, 0: probed again with 8 steps"]),
    ([{0: 3}, {0: 3}, {0: 3}, {0: 40}], [1, 2, 8, 32], ["traced 3, 3: probed again with 8", "traced 3, 3, 3: probed again with 32"]),
    ([{0: 1}, {0: 2}], [1, 2], []),  # a line at once: nothing more
])
def test_probes_that_give_no_line_are_taken_again_longer(traced: list[dict[int, int]], asked: list[int],
                                                         noted: list[str]) -> None:
    controller = _ScriptedProbes(traced)
    plan = asyncio.run(run_plan(controller, sorted(traced[0]), budget_mb=1, max_stop_s=None,  # type: ignore[arg-type]
                                refine=False))
    assert controller.asked == asked and all(any(n in note for note in plan.notes) for n in noted), plan.notes
    assert len(plan.notes) == len(noted), plan.notes
    line = plan.per_stage[0]
    assert (line.bytes_fixed, line.bytes_per_step) == pytest.approx((1000, 5000)), plan.per_stage


def test_a_plan_whose_probes_traced_no_step_on_a_stage_is_refused_naming_it() -> None:
    # stage 2 never steps in its probes (no request reaches it): two longer tries, then refused: its
    # size per step is unknown, and a plan from it would be unbounded (a 1 MB budget gave 1,000,000 steps)
    controller = _ScriptedProbes([{0: 1, 2: 0}, {0: 2, 2: 0}, {0: 8, 2: 0}, {0: 30, 2: 0}])
    with pytest.raises(SidecarError) as err:
        asyncio.run(run_plan(controller, [0, 2], budget_mb=1, max_stop_s=None, refine=False))  # type: ignore[arg-type]
    assert (err.value.code, err.value.details["stages"], controller.asked) == ("plan_unmeasurable", [2], [1, 2, 8, 32])
    assert "stage 2 traced no engine step in 4 probes" in err.value.message, err.value.message


def test_a_plan_ignores_probes_that_did_not_complete_and_refuses_with_too_few() -> None:
    traced = [{0: 1}, {0: 2}, {0: 8}]
    skipping = _ScriptedProbes(traced)
    skipping.states = [CaptureState.degraded, CaptureState.completed, CaptureState.completed]
    plan = asyncio.run(run_plan(skipping, [0], budget_mb=1, max_stop_s=None, refine=False))  # type: ignore[arg-type]
    assert ([p.steps_asked for p in plan.probes], plan.skipped) == ([2, 8], {"plan-probe-1": "degraded"}), plan
    failing = _ScriptedProbes([*traced, {0: 32}])
    failing.states = [CaptureState.failed] * 4
    with pytest.raises(SidecarError) as err:
        asyncio.run(run_plan(failing, [0], budget_mb=1, max_stop_s=None, refine=False))  # type: ignore[arg-type]
    assert (err.value.code, err.value.details["completed"]) == ("plan_unmeasurable", 0), err.value


@pytest.mark.parametrize("bounds", [{"budget_mb": 5e-324}, {"max_stop_s": 5e-324}, {"budget_mb": 0.001}])
def test_a_plan_no_window_could_meet_is_refused_before_any_probe(bounds: dict[str, float]) -> None:
    controller = _ScriptedProbes([{0: 1}, {0: 2}])
    with pytest.raises(SidecarError) as err:
        asyncio.run(run_plan(controller, [0], **{"budget_mb": None, "max_stop_s": None, **bounds}))  # type: ignore[arg-type]
    assert (err.value.code, controller.asked) == ("plan_invalid", []), err.value


def test_a_plan_whose_first_probe_is_over_the_budget_is_refused_at_once() -> None:
    controller = _ScriptedProbes([{0: 1}, {0: 2}], size=lambda n: 2_000_000 * n)
    with pytest.raises(SidecarError) as err:
        asyncio.run(run_plan(controller, [0], budget_mb=1, max_stop_s=None))  # type: ignore[arg-type]
    assert (err.value.code, controller.asked, err.value.details["probe_mb"]) == ("plan_unmeasurable", [1], 2.0)


def test_a_plan_answers_within_its_bound_and_stops_the_probe_it_was_running() -> None:
    controller = _ScriptedProbes([{0: 1}, {0: 2}])
    controller.hang = asyncio.Event()  # a probe that never ends
    with pytest.raises(SidecarError) as err:
        asyncio.run(run_plan(controller, [0], budget_mb=1, max_stop_s=None, max_s=0.2))  # type: ignore[arg-type]
    assert (err.value.code, err.value.details["bound_s"], controller.stopped) == ("plan_timeout", 0.2, ["plan-probe-1"])


def test_probes_on_stages_the_server_caps_are_server_bound_and_the_others_counted() -> None:
    counted = _ScriptedProbes([{0: 1}, {0: 2}])
    asyncio.run(run_plan(counted, [0], budget_mb=1, max_stop_s=None, refine=False))  # type: ignore[arg-type]
    capped = _ScriptedProbes([{0: 1}, {0: 2}, {0: 8}, {0: 8}, {0: 8}], max_iterations=10)
    asyncio.run(run_plan(capped, [0], budget_mb=1, max_stop_s=None))  # type: ignore[arg-type]
    # 1 and 2 steps are counted; the server's whole window (8 steps: its cap of 10 less 2) is its own
    assert counted.bounds == ["count", "count"], counted.bounds
    assert list(zip(capped.asked, capped.bounds)) == [(1, "count"), (2, "count")] + [(8, "server")] * 3, capped.bounds


def test_a_plan_far_beyond_its_probes_is_probed_at_half_and_planned_from_the_longest_probes() -> None:
    # bytes per step grow with the window (stacks on): 1 kB + 5 kB x n + 100 B x n^2
    def size(n: int) -> int:
        return 1000 + 5000 * n + 100 * n * n

    controller = _ScriptedProbes([{0: 1}, {0: 2}, {0: 77}], size)
    plan = asyncio.run(run_plan(controller, [0], budget_mb=2, max_stop_s=None))  # type: ignore[arg-type]
    # the tiny probes' line (5.3 kB/step) plans 377 steps; probed at 188, the engine traced 77
    line = plan.per_stage[0]
    assert (controller.asked, line.bytes_per_step) == ([1, 2, 188], pytest.approx((size(77) - size(2)) / 75))
    assert plan.notes == ["planned 377 steps, 188x the longest probe (2): probed again with 188 steps; the lines go "
                          "through the two longest probes"]
    # nearer the truth at the window it plans than the tiny probes' line is at its own
    tiny = asyncio.run(run_plan(_ScriptedProbes([{0: 1}, {0: 2}], size), [0], budget_mb=2,  # type: ignore[arg-type]
                                max_stop_s=None, refine=False))
    assert plan.steps is not None and tiny.steps is not None
    refined, unrefined = plan.predict(plan.steps)[0] * 1e6 / size(plan.steps), tiny.predict(tiny.steps)[0] * 1e6 / size(tiny.steps)
    assert (round(unrefined, 2), round(refined, 2)) == (0.12, 0.63), (tiny, plan)
    near = asyncio.run(run_plan(_ScriptedProbes([{0: 1}, {0: 2}], size), [0], budget_mb=0.05,  # type: ignore[arg-type]
                                max_stop_s=None))
    assert near.notes == [] and len(near.probes) == 2  # 8 steps planned: within reach of the probes


def test_the_refining_probe_lasts_at_most_five_seconds_of_the_servers_steps() -> None:
    # probes of 1 and 2 steps, each a 1 s window: 2 steps/s at most, so 10 steps, not half of 377
    slow = _ScriptedProbes([{0: 1}, {0: 2}, {0: 10}], window_s=1.0)
    plan = asyncio.run(run_plan(slow, [0], budget_mb=2, max_stop_s=None))  # type: ignore[arg-type]
    assert slow.asked == [1, 2, 10] and [p.window_s for p in plan.probes] == [1.0, 1.0, 1.0], plan.probes
    # two thirds of a step per second: a 3-step probe would not reach twice the longest one; none is taken
    slower = _ScriptedProbes([{0: 1}, {0: 2}], window_s=3.0)
    plan = asyncio.run(run_plan(slower, [0], budget_mb=2, max_stop_s=None))  # type: ignore[arg-type]
    assert (slower.asked, plan.notes) == ([1, 2], [])


def test_a_plan_where_the_server_ends_every_window_is_held_to_its_cap_and_predicts_the_engines_write() -> None:
    # max_iterations 8 on both stages (the stacks profile's): --steps 6 asks for the server's whole
    # window (render --steps 6 caps at 8), which holds up to 8 steps (no idle iteration: the real
    # vLLM CPU server's held 8 of 8) and is predicted at 8; its trace is written inside the engine
    # (0.5 s + 0.25 s per step), not at the stop (1 s + 1 s per step: the round trip that carries
    # the write where the sidecar's stop ends the window)
    probes = [Probe(capture_id=f"p{n}", steps_asked=n, steps_traced={0: n, 2: n}, bytes={0: 1000 * n, 2: 1000 * n},
                    stop_s=1.0 + n, write_s=0.5 + 0.25 * n) for n in (1, 2)]  # fmt: skip
    plan = make_plan([0, 2], probes, {}, budget_mb=1.0, max_stop_s=100.0, server_cap_steps=6)
    assert (plan.steps, plan.limited_by) == (6, "max_iterations"), plan
    assert (plan.predicted_mb, plan.predicted_stop_s) == pytest.approx((0.016, 2.5)), plan
    assert plan.predict(3) == pytest.approx((0.006, 4.0))  # below the cap the sidecar's stop ends it
    tight = make_plan([0, 2], probes, {}, budget_mb=0.008, max_stop_s=None, server_cap_steps=6)
    assert (tight.steps, tight.limited_by) == (4, "budget_mb"), tight  # a tighter bound still wins
    # 6.5 steps fit the budget, the server's whole window (up to 8) does not: one step short of it
    short = make_plan([0, 2], probes, {}, budget_mb=0.013, max_stop_s=None, server_cap_steps=6)
    assert (short.steps, short.limited_by, short.predicted_mb) == (5, "budget_mb", pytest.approx(0.010)), short
    # a probe of the server's whole window: its stop answered at once (the engine had written its
    # trace), and the stop line leaves it out; its write is the server's own, and the write line is
    # drawn from it alone (the others' hold the stop's travel)
    whole = Probe(capture_id="p6", steps_asked=6, steps_traced={0: 8, 2: 8}, bytes={0: 8000, 2: 8000}, stop_s=0.01,
                  write_s=2.0)
    with_whole = make_plan([0, 2], [*probes, whole], {}, budget_mb=1.0, max_stop_s=None, server_cap_steps=6)
    assert (with_whole.stop_fixed_s, with_whole.stop_per_step_s) == pytest.approx((1.0, 1.0)), with_whole
    assert (with_whole.write_fixed_s, with_whole.write_per_step_s, with_whole.predicted_stop_s) == pytest.approx(
        (0.0, 0.25, 2.0)), with_whole
    unwritten = [p.model_copy(update={"write_s": None}) for p in probes]  # traces with no wall-clock base
    assert make_plan([0, 2], unwritten, {}, budget_mb=1.0, max_stop_s=None, server_cap_steps=6).predicted_stop_s == 9.0


def test_the_servers_whole_window_probed_three_times_is_predicted_at_their_median_with_their_range() -> None:
    # windows of equal steps that differ (stacks on the real vLLM CPU server: 8 steps held 0.37 to
    # 1.84 MB, the Python calls of its worker's busy-wait between steps): the median, not a line
    lines = [Probe(capture_id=f"p{n}", steps_asked=n, steps_traced={0: n}, bytes={0: 100_000 * n}, stop_s=1.0,
                   write_s=0.1 * n) for n in (1, 2)]  # fmt: skip
    whole = [Probe(capture_id=f"w{i}", steps_asked=6, steps_traced={0: 8}, bytes={0: size}, stop_s=0.01, write_s=w)
             for i, (size, w) in enumerate([(1_840_000, 2.6), (370_000, 0.7), (900_000, 1.1)])]  # fmt: skip
    plan = make_plan([0], [*lines, *whole], {}, budget_mb=5.0, max_stop_s=None, server_cap_steps=6)
    assert (plan.steps, plan.limited_by, plan.predicted_mb, plan.predicted_stop_s) == (
        6, "max_iterations", pytest.approx(0.9), pytest.approx(1.1)), plan
    assert (plan.predicted_mb_range, plan.predicted_stop_range_s) == (pytest.approx((0.37, 1.84)), pytest.approx((0.7, 2.6)))
    line = plan.per_stage[0]  # below the cap: the lines (through every probe), no range
    assert plan.predict(3) == pytest.approx(((line.bytes_fixed + 3 * line.bytes_per_step) / 1e6, 1.0))
    assert plan.predict_range(3) is None
    # a budget under the median: one step short of the whole window, which the sidecar's stop ends
    short = make_plan([0], [*lines, *whole], {}, budget_mb=0.8, max_stop_s=None, server_cap_steps=6)
    assert (short.steps, short.predicted_mb_range) == (5, None), short


def test_a_capped_servers_probes_are_never_longer_than_its_windows_and_the_plan_says_why() -> None:
    # 1- and 2-step probes that traced the same count: the probe again would be 8 steps, past the
    # 6 a window of max_iterations 8 holds, so it is 6; a third would be no longer, and is not taken;
    # the plan is then the server's whole window, and that 6-step probe is one of its three
    controller = _ScriptedProbes([{0: 3}] * 5, max_iterations=8, write=lambda n: 0.5 + 0.25 * n)
    plan = asyncio.run(run_plan(controller, [0], budget_mb=1, max_stop_s=None))  # type: ignore[arg-type]
    assert controller.asked == [1, 2, 6, 6, 6], controller.asked
    assert "no longer probe fits the server's own bound on its windows (max_iterations: at most 6 steps)" in plan.notes[1]
    assert plan.notes[-1].startswith("the server ends each window of stages [0] itself after 8 engine iterations"), plan.notes
    # a line at once, and the plan is the server's whole window: probed three times as it is (each held 8)
    whole = _ScriptedProbes([{0: 1}, {0: 2}] + [{0: 8}] * 3, max_iterations=8, write=lambda n: 0.5 + 0.25 * n)
    lined = asyncio.run(run_plan(whole, [0], budget_mb=1, max_stop_s=None))  # type: ignore[arg-type]
    assert whole.asked == [1, 2, 6, 6, 6], whole.asked
    assert lined.notes[0].startswith("planned the server's whole window (6 steps asked): probed it 3 times; at equal "
                                     "steps they held 0.04-0.04 MB and wrote in 2.50-2.50s: predicted at their median"), lined.notes
    assert (lined.steps, lined.limited_by, lined.predicted_stop_s) == (6, "max_iterations", pytest.approx(2.5)), lined
    assert "--steps 6 or more asks for that whole window (render --steps 6 caps at 8)" in lined.notes[-1], lined.notes
    assert ("is predicted from its 3 probes of it; the server writes its trace inside the engine when it ends the window: "
            "about 2.5s (the median of its probes' writes)") in lined.notes[-1], lined.notes
    assert "differ by" not in lined.notes[0], lined.notes  # equal sizes: no spread to explain
    # whole windows that differ (stacks on, the real vLLM CPU server: 0.64-1.08 MB at equal steps):
    # the note says by how much and why, naming the busy-wait where a stage records stacks
    sizes = iter([6_000, 11_000, 640_000, 1_080_000, 700_000])
    spread = _ScriptedProbes([{0: 1}, {0: 2}] + [{0: 8}] * 3, size=lambda n: next(sizes), max_iterations=8,
                             write=lambda n: 0.5 + 0.25 * n, flags={"torch_profiler_with_stack": True})
    noted = asyncio.run(run_plan(spread, [0], budget_mb=5, max_stop_s=None))  # type: ignore[arg-type]
    assert (noted.predicted_mb, noted.predicted_mb_range) == (pytest.approx(0.70), pytest.approx((0.64, 1.08))), noted
    assert noted.notes[0].endswith("predicted at their median, the range beside it; their sizes differ by 1.7x: with "
                                   "stacks on, most of a window can be the Python calls an engine's worker makes while "
                                   "it waits for its next step (a multiprocess executor's busy-wait: vLLM on CPU, or a "
                                   "stage of more than one GPU), which follow how the host schedules it, not the steps "
                                   "(docs/captures.md)"), noted.notes
    # no cap on one stage: the sidecar's stop ends the window, the plan is not held
    open_plan = asyncio.run(run_plan(_ScriptedProbes([{0: 1}, {0: 2}]), [0], budget_mb=1, max_stop_s=None,  # type: ignore[arg-type]
                                     refine=False))
    assert open_plan.server_cap_steps is None and open_plan.limited_by == "budget_mb", open_plan


def test_a_steps_capture_above_the_planned_budget_is_refused_or_warned() -> None:
    plan = make_plan([0], [_probe(1, 1.1, 1.0), _probe(2, 2.1, 1.0)], {}, budget_mb=None, max_stop_s=None)
    with pytest.raises(BudgetExceeded) as refused:
        check_budget(plan, [0], 50, 20.0, "refuse")
    warned = check_budget(plan, [0], 50, 20.0, "warn")
    assert (refused.value.details["max_steps"], refused.value.http_status) == (19, 422)
    assert warned is not None and "50.1 MB" in warned and check_budget(plan, [0], 10, 20.0, "refuse") is None


def test_plan_probes_the_server_and_predicts_a_window(shared: ModuleSidecar) -> None:
    with steady_load(shared.emulator.url, max_tokens=1, chat=True):
        with shared.client() as client:
            plan = client.plan(stages=[0, 2], budget_mb=5, max_stop_s=60)
            last = client._http.get("/v1/plan", params={"steps": 20}).json()  # the web page's prediction
        printed = subprocess.run([sys.executable, "-m", "sidecar", "plan", "--sidecar", shared.url, "--stages", "0,2",
                                  "--budget-mb", "5", "--no-refine"], capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "COLUMNS": "200"}, cwd=Path(__file__).resolve().parents[1])
    assert printed.returncode == 0 and "fits: --steps" in printed.stdout, printed.stdout + printed.stderr
    with shared.client() as client:
        latest = client._http.get("/v1/plan").json()["plan"]
    assert [ln for ln in printed.stdout.splitlines() if ln.startswith("note: ")] == [
        f"note: {n}" for n in latest["notes"]], (printed.stdout, latest["notes"])
    # 1 and 2 steps; the emulator's engines often trace 0 or 1 in both (its one-token requests end
    # before the start lands), and then the plan probes again, longer, and says why
    asked = [p.steps_asked for p in plan.probes]
    asked = [*asked, *([0] * len(plan.skipped))]  # a probe that did not complete is not measured, and says so
    again = [n for n in plan.notes if "probed again with" in n]
    assert [p.steps_asked for p in plan.probes][:1] in ([1], [2]) and len(again) == len(asked) - 2, (plan.notes, plan.probes)
    assert bool(plan.skipped) is any(n.startswith("not measured: ") for n in plan.notes), plan.notes
    assert not any("the lines go through" in n for n in latest["notes"]), latest["notes"]  # --no-refine
    assert all(len({p.steps_traced[s] for p in plan.probes}) >= 2 for s in (0, 2)), plan.probes
    assert {p.stage_id for p in plan.per_stage} == {0, 2} and all(p.bytes_fixed + p.bytes_per_step > 0
                                                                    for p in plan.per_stage), plan
    assert plan.steps is not None and plan.predicted_mb is not None and plan.predicted_mb <= 5
    assert last["prediction"]["steps"] == 20 and last["plan"]["stages"] == [0, 2], last


def test_rollout_profiler_windows_end_after_the_engine_steps(capped: ModuleSidecar) -> None:
    from sidecar.rollout import RolloutProfiler

    with steady_load(capped.emulator.url, max_tokens=1, chat=True):
        with RolloutProfiler([f"sidecar={capped.url}"], steps=[1], stages=[0, 2], engine_steps=8) as prof:
            with prof.step(1):
                with capped.client() as client:  # the block runs on; the server's steps end the window
                    assert poll(lambda: client.list_captures()[0].stop_reason is not None, timeout=120)
            results = prof.wait(timeout=120)
    (target,) = results[1].targets.values()
    with capped.client() as client:
        cap = client.get_capture(target.capture_id)
    assert (cap.steps, cap.stop_reason.value, cap.state.value, cap.steps_ended_by.value) == (
        8, "steps", "completed", "server"), cap


def test_render_bounds_the_rendered_stages_in_engine_steps(tmp_path: Path) -> None:
    from sidecar.config import render_overlay

    deploy = make_deploy(tmp_path, {0: {"profiler": "torch"}, 1: None})
    out = tmp_path / "overlay.yaml"
    out.write_text(render_overlay(deploy, "light", [0, 1], out_path=out, out_dir=tmp_path / "perf",
                                  iterations={"max_iterations": 20, "delay_iterations": 5}))  # fmt: skip
    got = {s.stage_id: (s.profiler_config.max_iterations, s.profiler_config.delay_iterations)
           for s in load_deploy_config(out).stages if s.profiler_config}  # fmt: skip
    assert got == {0: (20, 5), 1: (20, 5)}


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    """Both profiled stages end each window themselves after 10 engine iterations (render --steps 8)."""
    root = tmp_path_factory.mktemp("capped-steps")
    stages = {0: {"profiler": "torch", "max_iterations": 10}, 1: None, 2: {"profiler": "torch", "max_iterations": 10}}
    yield from ModuleSidecar.for_module(emulator_pool, make_deploy(root, stages), emulator_args=THREAD,
                                        state_dir=root / "state", log_path=root / "sidecar.log")  # fmt: skip


@pytest.mark.parametrize(("stage2", "steps", "capped"), [
    ({"max_iterations": 10}, 10, True),
    ({"max_iterations": 10}, 12, True),    # the servers end their windows first
    ({"max_iterations": 10}, 8, True),     # 10 iterations: render --steps 8's cap (idle ones count)
    ({"max_iterations": 10}, 7, False),    # the window's own steps end it first
    ({"max_iterations": 5, "delay_iterations": 7}, 10, True),
    # a stage ending later, within what a stage fed by another is given for its idle iterations
    # (render --steps 10 --idle: up to a third of its iterations idle, 15), ends its own too
    ({"max_iterations": 5, "delay_iterations": 8}, 10, True),
    ({"max_iterations": 15}, 10, True),
    ({"max_iterations": 16}, 10, False),   # past that: the deploy's own bound, not this window's
    ({"max_iterations": 5, "delay_iterations": 11}, 10, False),
    ({"delay_iterations": 5}, 10, False),  # no end of its own
    ({}, 10, False),
])
def test_a_window_is_capped_by_the_server_when_every_stage_ends_its_own_within_the_steps(
    tmp_path: Path, stage2: dict[str, int], steps: int, capped: bool
) -> None:
    deploy = load_deploy_config(make_deploy(tmp_path, {0: {"profiler": "torch", "max_iterations": 10}, 1: None,
                                                       2: {"profiler": "torch", **stage2}}))  # fmt: skip
    assert capped_by_server(deploy, [0, 2], steps) is capped
    assert capped_by_server(deploy, [0], steps) is (steps >= 8)


def test_a_window_the_server_caps_is_not_cut_short_by_a_start_that_travelled(capped: ModuleSidecar) -> None:
    # The start reaches the workers 0.3 s after it arrives, while the engines step on unrecorded
    # (--fault-start-travel): a stop sent when the count reaches 10 would land before the profilers
    # had run their 10 iterations. Every stage ends its own window, so the stop waits for the steps
    # run by the start's answer, and both traces hold the 10 the servers cap them at.
    capped.emulator.set_faults(start_travel_s=0.3)
    try:
        with steady_load(capped.emulator.url, max_tokens=1, chat=True), capped.client() as client:
            cap = client.start_capture(stages=[0, 2], steps=10)
            final = client.wait_capture(cap.id, timeout=120)
    finally:
        capped.emulator.set_faults(start_travel_s=0.0)
    traced = {v.stage_id: v.steps_traced for v in final.verdicts}
    assert (final.state.value, final.stop_reason.value, traced) == ("completed", "steps", {0: 10, 2: 10}), (
        traced, final.notes)
    (ended,) = final.fact("steps_ended")
    assert (ended.figures["ended_by"], ended.figures["ends"], ended.figures["bound"]) == (
        "server", {"0": 10, "2": 10}, "server_cap"), ended
    assert final.steps_counted is not None and final.steps_counted > 10, final.steps_counted


def test_a_plan_on_stages_the_server_caps_is_held_to_the_cap_and_predicts_the_write_its_windows_report(
    capped: ModuleSidecar
) -> None:
    # Both stages end each window after 10 iterations: the plan is never more than 8 steps (10 less
    # the 2 idle iterations render --steps adds), its probes' traces say how long the server took to
    # write them, and so does each verdict of the planned window, where the engine wrote its trace.
    with steady_load(capped.emulator.url, max_tokens=1, chat=True), capped.client() as client:
        plan = client.plan(stages=[0, 2], budget_mb=500, max_stop_s=600)
        final = client.wait_capture(client.start_capture(stages=[0, 2], steps=plan.steps).id, timeout=120)
        shown = client._http.get("/v1/plan", params={"steps": 8}).json()["prediction"]
    assert (plan.steps, plan.limited_by, plan.server_cap_steps) == (8, "max_iterations", 8), plan
    # the whole window probed three times: predicted at their median, their range beside it, in the API too
    whole = [sum(p.bytes.values()) / 1e6 for p in plan.probes if p.steps_asked == 8]
    assert len(whole) == 3 and plan.predicted_mb_range == pytest.approx((min(whole), max(whole))), plan
    assert shown["mb_range"] == [round(min(whole), 3), round(max(whole), 3)] and shown["stop_range_s"], shown
    # every probe that traced a step says when its trace was written (a 1-step probe on a loaded host
    # can trace none: its windows are `empty`, with no last event to count from), the whole window's all
    unwritten = [p for p in plan.probes if (any(p.steps_traced.values()) or p.steps_asked == 8)
                 and (p.write_s is None or not 0 <= p.write_s < 60)]
    assert not unwritten and len(plan.whole_probes()) == 3, [
        (p.capture_id, p.steps_asked, p.steps_traced, p.write_s) for p in plan.probes]
    assert any(n.startswith("the server ends each window of stages [0, 2] itself after 10 engine iterations")
               for n in plan.notes), plan.notes
    assert plan.write_fixed_s is not None and plan.predicted_stop_s == pytest.approx(plan.predict(8)[1]), plan
    assert final.stop_reason.value == "steps" and {v.stage_id for v in final.verdicts} == {0, 2}, final
    assert all(v.trace_write_s is not None and 0 <= v.trace_write_s < 60 for v in final.verdicts), final.verdicts


@contextmanager
def _idling(deploy: Path, root: Path, max_tokens: int = 4) -> Iterator[SidecarClient]:
    """A client of a sidecar in front of an emulator whose stage 2 idles once after each request
    (vLLM steps once more as a request ends with nothing else running: a stage fed by another idles
    so between what it is handed), under one ``max_tokens`` request after another. The emulator is
    its own (the session pool's would evict one a module's fixture holds) and stopped after."""
    pool = EmulatorPool(size=1)
    try:
        shared = ModuleSidecar(pool, deploy, emulator_args=[*THREAD, "--idle-after-request", "2=1"],
                               state_dir=root / "state", log_path=root / "sidecar.log")  # fmt: skip
        try:
            with steady_load(shared.emulator.url, max_tokens=max_tokens, chat=True), shared.client() as client:
                yield client
        finally:
            shared.close()
    finally:
        pool.stop_all()


def _window(client: SidecarClient, steps: int) -> Any:
    return client.wait_capture(client.start_capture(stages=[0, 2], steps=steps).id, timeout=120)


def test_a_stage_that_idles_is_told_the_cap_that_holds_the_steps_and_then_holds_them(tmp_path: Path) -> None:
    # Both stages capped at 22 (render --steps 20). Stage 2 idles one iteration per 4-token request,
    # and its cap counts them: its 22 iterations hold 17-18 steps. Its note gives the share it idled
    # and the render that caps it for 20; the server restarted with that config holds 20 +- 2 there.
    caps = {0: {"profiler": "torch", "max_iterations": 22}, 1: None, 2: {"profiler": "torch", "max_iterations": 22}}
    (tmp_path / "a").mkdir()
    deploy = make_deploy(tmp_path / "a", caps)
    with _idling(deploy, tmp_path / "a") as client:
        # through the CLI, as a user reads the note: its output lists the capture's notes
        env = {**os.environ, "OMNI_SIDECAR_URL": client.base_url, "COLUMNS": "200"}
        cli = subprocess.run([sys.executable, "-m", "sidecar", "capture", "--stages", "0,2", "--steps", "20"],
                             capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        (first,) = client.list_captures()
    traced = {v.stage_id: v.steps_traced for v in first.verdicts}
    out = cli.stdout + cli.stderr
    assert cli.returncode == 0 and f"steps: 20 asked, {first.steps_counted} counted by the server; in the traces: stage " \
        f"0: 22, stage 2: {traced[2]}" in out, out
    flat = " ".join(out.split())  # the CLI wraps a long note to the terminal's width
    assert "\nnotes:\n" in out and all(f"- {' '.join(n.split())}" in flat for n in first.notes), out
    assert (first.stop_reason.value, traced[0]) == ("steps", 22) and traced[2] is not None and traced[2] < 20, (
        traced, first.notes)
    (render,) = first.fact("idle_render")
    assert render.figures["idle"] == {"2": [22 - traced[2], 22]}, (render, traced)
    (held,) = [n for n in first.fact("steps_traced") if n.stage_id == 2]
    assert (held.figures["steps_traced"], held.figures["idle_iterations"], held.figures["iterations"]) == (
        traced[2], 22 - traced[2], 22), first.facts
    fix = render.text
    # the render the note names, through the CLI, on the same deploy
    flags = re.search(r"`omni-sidecar render (--steps 20 --idle 2=\d+/22)`", out)  # as the CLI printed it
    assert flags is not None, fix
    rendered = tmp_path / "b" / "capped.yaml"
    proc = subprocess.run([sys.executable, "-m", "sidecar", "render", str(deploy), "--profile", "light", "--stages",
                           "0,2", "--dir", str(tmp_path / "b" / "perf"), *flags.group(1).split(), "-o", str(rendered)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cap2 = re.search(r"max_iterations (\d+) on stage 2", fix)
    got = {s.stage_id: s.profiler_config.max_iterations for s in load_deploy_config(rendered).stages if s.profiler_config}
    assert cap2 is not None and got == {0: 22, 2: int(cap2.group(1))} and got[2] > 22, (got, fix)
    with _idling(rendered, tmp_path / "b") as client:
        second = _window(client, 20)
        # the plan holds to the first stage's end: 20 steps ask for the whole window of both
        plan = client.plan(stages=[0, 2], budget_mb=500, max_stop_s=600)
    traced = {v.stage_id: v.steps_traced for v in second.verdicts}
    print(f"capped at 22: {first.notes}\nrendered {got}: traced {traced}, {second.notes}")
    (ended,) = second.fact("steps_ended")
    assert (ended.figures["ended_by"], ended.figures["ends"]) == ("server", {"0": 22, "2": got[2]}), second.facts
    assert traced[0] == 22 and abs(traced[2] - 20) <= 2, (traced, second.notes)  # fmt: skip
    assert (plan.steps, plan.limited_by, plan.server_cap_steps) == (20, "max_iterations", 20), plan
    assert any(n.startswith(f"the server ends each window of stages [0, 2] itself after 22 (stage 0) and {got[2]} "
                            "(stage 2) engine iterations (max_iterations, fixed at its start; idle ones count; "
                            "a stage that ends later was given the iterations it idles") for n in plan.notes), plan.notes


def test_a_stage_idling_more_than_a_cap_allows_for_is_told_it_is_fed_too_little(tmp_path: Path) -> None:
    # one 1-token request at a time: stage 2 idles after every step, half its iterations, more than
    # a cap gives a stage (a third): no render holds 20 steps there, and the note says why instead
    caps = {0: {"profiler": "torch", "max_iterations": 22}, 1: None, 2: {"profiler": "torch", "max_iterations": 22}}
    with _idling(make_deploy(tmp_path, caps), tmp_path, max_tokens=1) as client:
        cap = _window(client, 20)
    traced = {v.stage_id: v.steps_traced for v in cap.verdicts}
    assert traced[0] == 22 and traced[2] is not None and traced[2] <= 12, (traced, cap.notes)
    (said,) = cap.fact("idle_fed_too_little")
    assert (said.stage_id, said.figures["idle_iterations"], said.figures["iterations"]) == (2, 22 - traced[2], 22), said
    assert not cap.fact("idle_render"), cap.facts


def _idle_fix(steps: int, short: dict[int, tuple[int, int]], ends: dict[int, int]) -> list[dict[str, Any]]:
    from sidecar.config.rules import IDLE_ITERATIONS, MAX_IDLE_SHARE, max_iterations_for
    from sidecar.control.steps import idle_fix

    return idle_fix(steps, short, ends, idle_iterations=IDLE_ITERATIONS, max_share=MAX_IDLE_SHARE,
                    max_iterations_for=max_iterations_for)


def test_the_render_a_short_stage_is_told_keeps_the_stage_that_ends_first_at_the_windows_own_end() -> None:
    # the render named must leave a window the server ends (capped_by_server: the first stage to
    # end does within N + 2): that stage, where it idled short, keeps its cap and is told to feed it
    first, fix = _idle_fix(20, {0: (3, 22), 1: (5, 22)}, {0: 22, 1: 22})
    assert (first["code"], first["stage_id"], fix["code"], fix["idle"], fix["caps"]) == (
        "idle_ends_first", 0, "idle_render", {1: [5, 22]}, {1: 26}), (first, fix)
    # the first to end is the one kept, whichever idled more: here stage 1 keeps what it was given
    first, fix = _idle_fix(20, {0: (6, 22), 1: (5, 25)}, {0: 22, 1: 25})
    assert (first["stage_id"], fix["idle"]) == (0, {1: [5, 25]}), (first, fix)
    # on the real vLLM-Omni server at 50 steps (52 and 62), stage 0 idled 5 of 52 and stage 1 held 50
    (first,) = _idle_fix(50, {0: (5, 52)}, {0: 52, 1: 62})
    assert (first["code"], first["stage_id"]) == ("idle_ends_first", 0), first
    (one,) = _idle_fix(20, {0: (3, 22)}, {0: 22})  # a one-stage server (plain vLLM)
    assert one["code"] == "idle_ends_first", one
    fed, fix = _idle_fix(20, {0: (3, 22), 1: (12, 22)}, {0: 22, 1: 22})
    assert (fed["code"], fed["stage_id"], fix["idle"]) == ("idle_fed_too_little", 1, {0: [3, 22]}), (fed, fix)
    assert _idle_fix(20, {1: (0, 22)}, {0: 22, 1: 22}) == []  # short without idling: the stop, not the cap


def test_a_cap_for_a_stage_that_idles_adds_the_iterations_its_share_adds_to_the_steps(tmp_path: Path) -> None:
    from sidecar.config.rules import MAX_IDLE_SHARE, max_iterations_for
    from sidecar.control.budget import server_cap_steps

    # 4 and 5 of 22 idle (the real vLLM-Omni server's stage 1) cap 20 steps at 25 and 26; no share
    # or a small one, at the 2 every window is given; a third at most
    assert [max_iterations_for(20, share) for share in (0, 1 / 22, 4 / 22, 5 / 22, 0.2, 1 / 3)] == [22, 22, 25, 26, 25, 30]
    with pytest.raises(ValueError, match="outside 0 to 0.333"):
        max_iterations_for(20, MAX_IDLE_SHARE + 0.01)
    # the plan on a server whose fed stage ends later holds to the first stage's end; one that ends
    # past what a stage fed by another is given is the deploy's own bound, and the sidecar's stop ends windows
    for stage2, cap_steps in ((25, 20), (30, 20), (31, None), (20, 18)):
        deploy = load_deploy_config(make_deploy(tmp_path, {0: {"profiler": "torch", "max_iterations": 22}, 1: None,
                                                           2: {"profiler": "torch", "max_iterations": stage2}}))  # fmt: skip
        assert server_cap_steps(deploy, [0, 2]) == cap_steps, (stage2, cap_steps)


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    """Stage 0's server profiler ends each window itself after 10 engine steps (max_iterations)."""
    root = tmp_path_factory.mktemp("bounded-steps")
    stages = {0: {"profiler": "torch", "max_iterations": 10}, 1: None, 2: {"profiler": "torch"}}
    yield from ModuleSidecar.for_module(emulator_pool, make_deploy(root, stages), emulator_args=THREAD,
                                        state_dir=root / "state", log_path=root / "sidecar.log")  # fmt: skip


@pytest.mark.parametrize(("asked", "how"), [(20, "capped"), (7, "ends_first")])
def test_a_counted_window_on_a_stage_the_server_bounds_says_what_its_trace_holds(
    bounded: ModuleSidecar, asked: int, how: str
) -> None:
    # stage 2 has no cap: the window is refused unless counted by name, and stage 0's own bound is
    # said at the start, before the window runs, as a fact with its figures
    with bounded.client() as client, pytest.raises(SidecarError) as err:
        client.start_capture(stages=[0, 2], steps=asked)
    assert err.value.code == "steps_unbounded", err.value
    with steady_load(bounded.emulator.url, max_tokens=1, chat=True), bounded.client() as client:
        cap = client.start_capture(stages=[0, 2], steps=asked, steps_bound="count")
        (said,) = cap.fact("server_bound")
        assert (said.stage_id, said.figures["how"], said.figures["max_iterations"]) == (0, how, 10), said
        final = client.wait_capture(cap.id, timeout=120)
    why = [(v.stage_id, v.verdict.value, v.reason) for v in final.verdicts], final.notes
    assert (final.state.value, final.stop_reason.value) == ("completed", "steps"), why
    traced = {v.stage_id: v.steps_traced for v in final.verdicts}
    if asked > 10:  # the server's bound, whatever the stop's travel (the emulator runs no idle iteration;
        assert traced[0] == 10, (traced, final.notes)  # the real server's count: tests/omni/test_server_flags.py)


def test_a_window_the_server_caps_goes_on_without_a_stage_that_no_longer_steps(
    capped: ModuleSidecar, sidecar_factory: Any
) -> None:
    # A capped window's stop waits for every stage's own count (on the real vLLM-Omni server the
    # downstream stage counted 17-30 where stage 0 counted 38-56: tests/omni/test_steps_capped.py).
    # Here stage 2's worker is dead (the server still answers the start and the stop SUCCESS, as
    # vLLM-Omni 0.30 does) and its count stands still while stage 0 steps on: the stop goes once it
    # has stood still steps_stall_s (2 s here, 10 by default), and says which stage it did not wait for.
    sc = sidecar_factory(capped.emulator.url, capped.deploy, env={"OMNI_SIDECAR_STEPS_STALL_S": "2"})
    capped.emulator.set_faults(dead_stage=2)
    try:
        with steady_load(capped.emulator.url, max_tokens=1, chat=True), SidecarClient(sc.url, timeout=60) as client:
            final = client.wait_capture(client.start_capture(stages=[0, 2], steps=10).id, timeout=120)
    finally:
        capped.emulator.reset()
    traced = {v.stage_id: v.steps_traced for v in final.verdicts}
    assert (final.state.value, final.stop_reason.value, traced[0]) == ("degraded", "steps", 10), (traced, final.notes)
    (ended,) = final.fact("steps_ended")
    assert (final.steps_ended_by.value, ended.figures["behind"], ended.figures["per_stage"]["2"]) == (
        "stage_stalled", ["2"], 0), ended
    assert ended.figures["still_s"] >= 2 and ended.figures["per_stage"]["0"] >= 12, ended




def test_a_window_in_time_on_a_capped_server_says_its_trace_holds_only_the_first_iterations(
    capped: ModuleSidecar,
) -> None:
    """Every shipped profile caps max_iterations (light 32): a 10 s window under load held 22 of
    528 steps, called ok with no word of it. Now each capped stage says so, from the start."""
    with capped.client() as client:
        cap = client.start_capture(stages=[0, 2], duration_s=60)
        done = client.stop_capture(cap.id, wait=True, timeout=60)
    said = {n.stage_id: n.figures for n in done.facts if n.code == "window_capped"}
    assert said == {0: {"max_iterations": 10, "delay_iterations": 0}, 2: {"max_iterations": 10, "delay_iterations": 0}}
    assert any("records at most 10 engine iterations from the start, however long the window" in t for t in done.notes)
