"""The rollout hook: ``with prof.step(n):`` (or ``async with prof.astep(n):``) around generation
profiles exactly the chosen steps, replicas and stages through a :class:`~sidecar.fleet.Fleet`.
Outside those steps it costs nothing (no I/O, no thread, no event loop). Failures are logged and
recorded by default (training goes on); ``strict=True`` raises. An exception inside the block is
re-raised unchanged after the stop was sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import numbers
import threading
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Literal

from pydantic import BaseModel, Field

from sidecar._loop_thread import LoopThread, at_exit
from sidecar.control.limits import check_window
from sidecar.errors import FleetError, SidecarError, ValidationFailed
from sidecar.errors import EngineStepsInvalid, FleetClosed, LeaseInvalid, RanksInvalid, StepsEmpty
from sidecar.errors import StepsInvalid
from sidecar.fleet import FanOutResult, Fleet, FleetCapture, Target, TargetError, TargetResult, parse_targets
from sidecar.fleet._fleet import check_label, check_seconds

__all__ = ["DEFAULT_LEASE_S", "RolloutProfiler", "StepResult"]

# A hook's window is bounded by default: a trainer that dies mid-step leaves no profiler running
# past this (its heartbeats stop). Generous: a rollout step takes minutes; heartbeats keep it open.
DEFAULT_LEASE_S = 120.0
MAX_STEPS = 100_000  # training steps one profiler may list (each profiled writes traces on every replica)

log = logging.getLogger(__name__)

_NULL = contextlib.nullcontext(None)  # one shared no-op for every step that is not profiled


class StepResult(BaseModel, FanOutResult):
    """What one profiled step produced: per target (replica) its capture id, verdicts and the
    session folders holding the traces (``folders``). ``error`` is set when the step could not be
    profiled; ``done`` once every artifact check is over (always when the step failed to start)."""

    step: int
    label: str
    targets: dict[str, TargetResult] = Field(default_factory=dict)
    error: TargetError | None = None

    @property
    def ok(self) -> bool:
        # unlike a fleet capture, a step with no target profiled is not a success
        return self.error is None and bool(self.targets) and super().ok


def _shown(values: list[int], most: int = 10) -> str:
    """``values`` in a message, the first ``most`` of them: a bad range of a million steps is
    named, not printed."""
    head = ", ".join(map(str, values[:most]))
    return f"[{head}, ... ({len(values)} in all)]" if len(values) > most else f"[{head}]"


def _as_step(value: Any, what: str) -> int:
    # numpy integers are fine (verl's meta_info may carry them); bools and floats are not steps.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StepsInvalid(
            f"{what} must be an integer training step (1-based, as verl's global_steps), got {value!r} "
            f"of type {type(value).__name__}",
            details={"value": repr(value)},
        )
    return int(value)


def _close_at_exit(ref: weakref.ReferenceType[RolloutProfiler]) -> None:
    prof = ref()
    if prof is not None:
        prof.close(timeout=30.0)


class RolloutProfiler:
    """Profile generation at ``steps`` on the selected replicas (``targets`` in replica order).

    Replica selection: every target given, or only ``ranks`` (indices into ``targets``); a list
    given by hand is an explicit choice. :meth:`from_verl_config` applies verl's rule instead.
    ``stages=None`` profiles every torch-profiled stage of each target (sent explicitly).
    ``wait_artifacts=False`` returns from the block once every upstream answered stop; the
    artifact check then finishes in the background (see :meth:`results`, :meth:`wait`).
    ``lease_s`` (default :data:`DEFAULT_LEASE_S`; ``None`` for none) makes each target's controller
    stop the capture itself when its renewals stop (a dead or hung trainer): the fleet renews it
    every ``lease_s / 3`` while the window is open.
    ``engine_steps``: each target's capture also stops itself once its server has run that many
    engine steps (a ``steps`` window, docs/captures.md), even if the block is still running.
    Other keyword arguments (``deploy_config``, ``flavor``, ``token``, ``stop_budget_s``,
    ``client_timeout_s``, ``start_timeout_s``, ``control_settings``, ``state_dir``, ``drivers``) go
    to :class:`Fleet`. ``on_result(step_result)`` is called once per step, when its result is final
    (its check over, or the step failed): from the profiler's own thread, before :meth:`wait` or
    :meth:`close` return.
    """

    def __init__(
        self,
        targets: Iterable[str | Target] | str,
        steps: Iterable[int],
        stages: list[int] | None = None,
        *,
        strict: bool = False,
        wait_artifacts: bool = True,
        ranks: list[int] | None = None,
        all_ranks: bool = False,
        artifact_timeout_s: float | None = 600.0,
        lease_s: float | None = DEFAULT_LEASE_S,
        label_prefix: str = "step",
        on_result: Callable[[StepResult], None] | None = None,
        engine_steps: int | None = None,
        **fleet_options: Any,
    ) -> None:
        parse_opts = {k: fleet_options[k] for k in ("deploy_config", "flavor", "token") if k in fleet_options}
        all_targets = parse_targets(targets, **parse_opts)
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise StepsInvalid(f"steps must be a list of training steps, e.g. [1, 5]; got {steps!r}")
        listed = list(itertools.islice(steps, MAX_STEPS + 1))  # a range(1, 10**12) is not expanded
        if len(listed) > MAX_STEPS:
            raise StepsInvalid(f"steps lists more than {MAX_STEPS:,} training steps: each profiled step writes traces "
                               "on every replica; profile a few chosen ones, e.g. steps=range(10, 1000, 100)")
        self.steps: frozenset[int] = frozenset(_as_step(s, "each of steps") for s in listed)
        if not self.steps:
            raise StepsEmpty("steps is empty: nothing would be profiled; pass e.g. steps=[1]")
        if min(self.steps) < 1:
            bad = sorted(s for s in self.steps if s < 1)
            raise StepsInvalid(f"steps are 1-based training steps (as verl's global_steps); {_shown(bad)} "
                               "name no step: drop them, or count from 1", details={"steps": bad[:10]})
        self.ranks = self._select(len(all_targets), ranks, all_ranks)
        self.targets = [all_targets[r] for r in self.ranks]
        self.stages = stages
        self.strict = strict
        self.wait_artifacts = wait_artifacts
        if artifact_timeout_s is not None:
            check_seconds(artifact_timeout_s, "artifact_timeout_s", none=" (or None to wait as long as the check takes)")
        self.artifact_timeout_s = artifact_timeout_s
        self.lease_s = lease_s
        check_label(label_prefix, "label_prefix")
        self.label_prefix = label_prefix
        self.on_result = on_result
        if engine_steps is not None and (isinstance(engine_steps, bool) or not isinstance(engine_steps, int)
                                         or engine_steps < 1):
            raise EngineStepsInvalid(f"engine_steps must be a whole number >= 1, got {engine_steps!r}",
                                     key="engine_steps")
        self.engine_steps = engine_steps
        if lease_s is not None:  # the controller's own rule on a window's lease, checked before any step
            if isinstance(lease_s, bool) or not isinstance(lease_s, numbers.Real):
                raise LeaseInvalid(f"lease_s must be a number of seconds > 0 (or None for no lease), got {lease_s!r}",
                                   key="lease_s")
            check_window(None, float(lease_s), max_duration_s=None, default_lease_s=None)
        # Built now so every input error surfaces here; nothing is contacted until a profiled step.
        self._fleet = Fleet(self.targets, stages=stages, **fleet_options)
        self._results: dict[int, StepResult] = {}
        self._checks: set[asyncio.Task[None]] = set()  # background artifact checks (private loop)
        self._loop: LoopThread | None = None
        self._lock = threading.Lock()
        self._opened = False
        self._closed = False

    @staticmethod
    def _select(n: int, ranks: list[int] | None, all_ranks: bool) -> list[int]:
        if all_ranks or ranks is None:
            return list(range(n))
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise RanksInvalid(f"ranks must be a list of replica indices (0-based, into targets), e.g. [0, 1]; "
                               f"got {ranks!r}", details={"ranks": repr(ranks), "targets": n})
        ranks = list(ranks)
        if len(ranks) == 0:
            raise RanksInvalid("ranks is empty: no target would be profiled; leave ranks out to profile every "
                               "target, or name some", details={"ranks": [], "targets": n})
        wrong = [r for r in ranks if isinstance(r, bool) or not isinstance(r, numbers.Integral)]
        if wrong:
            raise RanksInvalid(f"ranks are replica indices (0-based integers, into targets); got {wrong[0]!r} of "
                               f"type {type(wrong[0]).__name__}", details={"ranks": repr(ranks)[:200], "targets": n})
        chosen = [int(r) for r in ranks]
        bad = [r for r in chosen if not 0 <= r < n]
        if bad:
            raise RanksInvalid(
                f"ranks {_shown(bad)} name no replica: there are {n} targets (ranks 0..{n - 1}, in the order given)",
                details={"ranks": bad[:10], "targets": n},
            )
        return sorted(set(chosen))

    # --- construction from a verl config ------------------------------------------------------

    @classmethod
    def from_verl_config(
        cls,
        cfg: Any,
        targets: Iterable[str | Target] | str,
        *,
        role: Literal["rollout", "reward"] = "rollout",
        rank_mode: Literal["global", "replica"] = "global",
        **kwargs: Any,
    ) -> RolloutProfiler:
        """Steps and replicas from a verl / verl-omni trainer config (dict, OmegaConf, or a YAML
        path): ``global_profiler.steps`` and the role's profiler block, ``targets`` in replica order.
        ``rank_mode`` is how this verl reads ``ranks`` (``global``: verl 0.9.1 GPU ranks;
        ``replica``: older verl's replica indices). Refuses what verl would silently skip (``ValidationFailed`` with the rule's message); logs the resume warning."""
        from sidecar.config.verl import read_verl_config, verl_findings

        plan = read_verl_config(cfg, role=role)
        parse_opts = {k: kwargs[k] for k in ("deploy_config", "flavor", "token") if k in kwargs}
        n = len(parse_targets(targets, **parse_opts))
        findings = verl_findings(plan, n_replicas=n, rank_mode=rank_mode)
        for f in findings:
            if not f.is_error:
                log.warning("%s", f)
        errors = [f for f in findings if f.is_error]
        if errors:
            raise ValidationFailed.relay(errors[0].code, "; ".join(f.message for f in errors), findings=errors)
        if plan.all_ranks:
            return cls(targets, plan.steps, all_ranks=True, **kwargs)
        # The one rank rule (config/verl.py; none given: replica 0); ranks naming no target are refused there.
        return cls(targets, plan.steps, ranks=plan.replica_ranks(n, rank_mode), **kwargs)

    # --- the hook -----------------------------------------------------------------------------

    def _wanted(self, n: Any) -> int | None:
        step = _as_step(n, "the step")
        if step not in self.steps:
            return None
        if step in self._results:
            # verl may generate more than once per step (filter_groups, REMAX); one trace set per step.
            log.debug("step %d was profiled already; not profiling it again", step)
            return None
        if self._closed:
            if self.strict:
                raise FleetClosed(f"step {step}: this RolloutProfiler is closed")
            log.warning("step %d is not profiled: this RolloutProfiler is closed", step)
            return None
        return step

    def step(self, n: int) -> contextlib.AbstractContextManager[StepResult | None]:
        """Sync hook: ``with prof.step(global_step): generate(...)``. Yields the step's
        :class:`StepResult` (updated in place in :meth:`results`) or ``None`` when not profiled."""
        step = self._wanted(n)
        if step is None:
            return _NULL
        return _SyncStep(self, step)

    def astep(self, n: int) -> contextlib.AbstractAsyncContextManager[StepResult | None]:
        """Async hook: ``async with prof.astep(global_step): await generate(...)``."""
        step = self._wanted(n)
        if step is None:
            return _NULL  # nullcontext is an async context manager too
        return _AsyncStep(self, step)

    def results(self) -> dict[int, StepResult]:
        """Per profiled step (ascending), per target: capture id, verdicts, artifact folders.
        With ``wait_artifacts=False`` a step may still be checking (``done`` is false)."""
        snapshot = dict(self._results)  # the private loop thread may be adding a step right now
        return {k: snapshot[k] for k in sorted(snapshot)}

    def wait(self, timeout: float | None = None) -> dict[int, StepResult]:
        """Wait for background artifact checks (``wait_artifacts=False``), then :meth:`results`."""
        if self._loop is not None and self._loop.here:
            # on_result runs on the profiler's own loop: blocking it on itself would hang (until the
            # timeout) the very checks waited for
            log.warning("RolloutProfiler.wait() from on_result (the profiler's own thread) cannot wait; "
                        "returning the results as they are")
            return self.results()
        if self._loop is not None and self._checks:
            try:
                self._loop.submit(self._await_checks(timeout)).result(None if timeout is None else timeout + 5)
            except concurrent.futures.TimeoutError:
                pass
        return self.results()

    def close(self, timeout: float | None = 60.0) -> None:
        """Finish background checks (within ``timeout``), close clients and controllers, stop the
        private loop. Safe to call more than once; also runs at interpreter exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._loop is None:
            return
        if self._loop.here:
            # from on_result: this thread is the loop the close must run on; finish on a thread of
            # its own (not a daemon: the interpreter waits for it at exit)
            threading.Thread(target=self._close_now, args=(timeout,), name="omni-sidecar-rollout-close").start()
            return
        self._close_now(timeout)

    def _close_now(self, timeout: float | None) -> None:
        assert self._loop is not None
        self.wait(timeout)
        try:
            self._loop.submit(self._fleet.close()).result(timeout)
        except Exception as exc:  # closing must not raise into a trainer's shutdown
            log.warning("RolloutProfiler: closing the fleet failed: %s", exc)
        self._loop.close()

    def __enter__(self) -> RolloutProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals (run on the private loop) --------------------------------------------------

    def _ensure_loop(self) -> LoopThread:
        with self._lock:
            if self._loop is None:
                self._loop = LoopThread()
                at_exit(_close_at_exit, weakref.ref(self))
            return self._loop

    async def _astart(self, step: int) -> FleetCapture | None:
        """None: the step is profiled already (two ``prof.step(n)`` taken before either block ran:
        this loop runs one at a time, so the second finds the first's result here)."""
        if step in self._results:
            log.debug("step %d was profiled already; not profiling it again", step)
            return None
        label = f"{self.label_prefix}{step}"
        result = StepResult(step=step, label=label)
        self._results[step] = result
        # One capture at a time per server: the previous step's artifact check must end first.
        await self._await_checks()
        try:
            if not self._opened:
                await self._fleet.open()
                self._opened = True
            fc = await self._fleet.start(label=label, lease_s=self.lease_s, steps=self.engine_steps)
        except SidecarError as exc:
            details = exc.details.get("targets")
            targets = {}
            if isinstance(details, list):
                targets = {d["target"]: TargetResult.model_validate(d) for d in details
                           if isinstance(d, dict) and "kind" in d}
            self._results[step] = result.model_copy(update={
                "targets": targets, "error": TargetError(code=exc.code, message=exc.message)})
            raise
        except Exception as exc:
            self._results[step] = result.model_copy(update={
                "error": TargetError(code="internal_error", message=f"{type(exc).__name__}: {exc}")})
            raise
        except asyncio.CancelledError:
            # the caller gave up on the start (a timeout around `async with`): the fleet rolled back
            # what had started; the step says so, and its result is final
            self._results[step] = result.model_copy(update={"error": TargetError(
                code="start_cancelled", message=f"step {step}: the start was cancelled by the caller; the "
                                                "replicas that had started were stopped; generation ran unprofiled")})
            self._final(step)
            raise
        self._results[step] = result.model_copy(update={"targets": dict(fc.targets)})
        return fc  # the fleet renews the leases until the stop

    async def _await_checks(self, timeout: float | None = None) -> None:
        """The background checks, for at most ``timeout`` (default: one artifact timeout and the
        start timeout, what a check itself is bounded by): a check never holds a step longer."""
        if not self._checks:
            return
        if timeout is None and self.artifact_timeout_s is not None:
            timeout = self.artifact_timeout_s + self._fleet.start_timeout_s
        await asyncio.wait(list(self._checks), timeout=timeout)

    def _final(self, step: int) -> None:
        """The step's result is final: hand it to ``on_result`` (whose failure is only logged)."""
        if self.on_result is None:
            return
        try:
            self.on_result(self._results[step])
        except Exception as exc:
            log.warning("RolloutProfiler: on_result for step %d failed: %s", step, exc)

    async def _astop(self, step: int, fc: FleetCapture) -> StepResult:
        fc = await self._fleet.stop(fc, wait_artifacts=self.wait_artifacts,
                                    artifact_timeout_s=self.artifact_timeout_s)
        result = self._results[step].model_copy(update={"targets": dict(fc.targets)})
        self._results[step] = result
        if not self.wait_artifacts and not fc.done:
            task = asyncio.get_running_loop().create_task(self._afinish(step, fc))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
            return result
        if not result.ok:
            log.warning("%s", self._describe(result))
        self._final(step)
        return result

    async def _afinish(self, step: int, fc: FleetCapture) -> None:
        fc = await self._fleet.refresh(fc, wait=True, timeout=self.artifact_timeout_s)
        result = self._results[step].model_copy(update={"targets": dict(fc.targets)})
        self._results[step] = result
        if not result.ok:
            log.warning("%s", self._describe(result))
        self._final(step)

    @staticmethod
    def _describe(result: StepResult) -> str:
        parts = []
        for r in result.failures():
            why = r.error.message if r.error else (
                "; ".join(v.reason or f"stage {v.stage_id}: {v.verdict}" for v in r.verdicts
                          if v.verdict is not None and v.verdict.value != "ok") or (r.state.value if r.state else "?"))
            parts.append(f"{r.target}: {why}")
        return f"rollout profiling of {result.label}: " + ("; ".join(parts) or "no target profiled")

    def _start_failed(self, step: int, exc: BaseException) -> None:
        """Best effort: log and go on (the result already records the error)."""
        log.warning("rollout profiling of step %d did not start; generation runs unprofiled: %s", step, exc)
        self._final(step)

    def _stop_failed(self, step: int, exc: BaseException) -> None:
        prev = self._results.get(step)
        if prev is not None and prev.error is None:
            code = exc.code if isinstance(exc, SidecarError) else "internal_error"
            msg = exc.message if isinstance(exc, SidecarError) else f"{type(exc).__name__}: {exc}"
            self._results[step] = prev.model_copy(update={"error": TargetError(code=code, message=msg)})
        log.warning("rollout profiling of step %d: stop failed: %s", step, exc)
        self._final(step)

    def _strict_error(self, result: StepResult) -> FleetError | None:
        if not self.strict or result.ok:
            return None
        if result.error is not None:
            return FleetError.relay(result.error.code, f"step {result.step}: {result.error.message}",
                              details={"step": result.step, "targets": [r.model_dump(mode="json")
                                                                         for r in result.targets.values()]})
        if not self.wait_artifacts and not result.done:
            # Only start/stop failures are known yet; verdicts land later in results().
            if all(r.error is None for r in result.targets.values()):
                return None
        return result.to_error(f"rollout profiling of {result.label}")


class _Step:
    """One profiled step's block. The sync and async hooks differ only in how they wait on the
    private loop; what a failure means (strict raises, best effort records and goes on) is here."""

    __slots__ = ("prof", "step", "fc")

    def __init__(self, prof: RolloutProfiler, step: int) -> None:
        self.prof = prof
        self.step = step
        self.fc: FleetCapture | None = None

    def _start_failed(self, exc: Exception) -> StepResult:
        if self.step not in self.prof._results:  # refused before the start ran (a closed profiler)
            code = exc.code if isinstance(exc, SidecarError) else "internal_error"
            self.prof._results[self.step] = StepResult(
                step=self.step, label=f"{self.prof.label_prefix}{self.step}",
                error=TargetError(code=code, message=str(exc)))
        if self.prof.strict:
            self.prof._final(self.step)
            raise exc
        self.prof._start_failed(self.step, exc)
        return self.prof._results[self.step]

    def _started(self, fc: FleetCapture | None) -> StepResult | None:
        self.fc = fc
        # None: profiled already (the block runs unprofiled, as for a step not chosen)
        return None if fc is None else self.prof._results[self.step]

    def _stopped(self, outcome: StepResult | Exception, exc: BaseException | None) -> Literal[False]:
        """``outcome``: the stop's result, or what it raised. The block's own exception ``exc``
        always wins: it propagates unchanged (return False) whatever the stop did."""
        if isinstance(outcome, FleetClosed):
            outcome = FleetClosed(f"step {self.step}: the RolloutProfiler was closed while this step's window was "
                                  "open; its closing sweep stopped the captures, whose traces are not checked: "
                                  "close the profiler after the last `with prof.step(n)` block")
        if isinstance(outcome, Exception):
            self.prof._stop_failed(self.step, outcome)
            if self.prof.strict and exc is None:
                raise outcome
            return False
        err = self.prof._strict_error(outcome)
        if err is not None and exc is None:
            raise err
        return False


class _SyncStep(_Step):
    __slots__ = ()

    def __enter__(self) -> StepResult | None:
        loop = self.prof._ensure_loop()
        try:
            fc = loop.run(self.prof._astart(self.step))
        except Exception as exc:
            return self._start_failed(exc)
        return self._started(fc)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if self.fc is None:
            return False
        try:
            result = self.prof._ensure_loop().run(self.prof._astop(self.step, self.fc))
        except Exception as stop_exc:
            return self._stopped(stop_exc, exc)
        return self._stopped(result, exc)


class _AsyncStep(_Step):
    __slots__ = ()

    async def __aenter__(self) -> StepResult | None:
        loop = self.prof._ensure_loop()
        try:
            fc = await loop.arun(self.prof._astart(self.step))
        except Exception as exc:
            return self._start_failed(exc)
        return self._started(fc)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> Literal[False]:
        if self.fc is None:
            return False
        try:
            # shielded: a cancelled caller must not leave the profiler running
            result = await self.prof._ensure_loop().arun(self.prof._astop(self.step, self.fc), shield=True)
        except Exception as stop_exc:
            return self._stopped(stop_exc, exc)
        return self._stopped(result, exc)
