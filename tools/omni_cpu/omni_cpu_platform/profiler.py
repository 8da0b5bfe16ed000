"""``CpuTorchProfilerWrapper``: stands in for vLLM-Omni's CUDA profiler wrapper
(``OmniTorchProfilerWrapper`` with CPU + CUDA activities): the same session folders, gzip,
``ops_rank0.xlsx`` and ``profiler_out_<rank>.txt``, recording CPU activity only.

For the diffusion worker it profiles all threads (Kineto's ``profile_all_threads``). A CPU-only Kineto session is held by
the thread that started it; the inline diffusion stage starts and stops its profiler from
different threads of the API server, and a stop on a thread that holds no session crashes the
process in ``ActivityTraceWrapper::save`` ("disableProfiler called but no active profiling
session found", then SIGSEGV): it starts on the ``inline-diffusion`` executor thread, runs the
request and stops on the orchestrator's busy-loop thread. With all threads profiled the session
is process-wide and the trace holds the request.

With stacks on (torch's Python tracer), torch 2.13 on CPU hands back some events whose name is
not UTF-8 (seen: "'utf-8' codec can't decode byte 0xa8 in position 26"): ``KinetoEvent.name()``
then raises ``UnicodeDecodeError`` inside ``key_averages()`` (``_parse_kineto_results``, the
memory-record filter that reads every event's name), vLLM-Omni's stop logs "Failed to stop
profiler" and writes no ``ops_rank0.xlsx``, ``stacks_cpu_rank0.txt`` or ``profiler_out`` (the
exported trace is whole: Kineto writes it in C++). Seen on AR stages (2 runs in 3) and the
diffusion worker. The profile object made here reads such a name as ``<name not UTF-8>`` (and such
a stack as empty), so vLLM-Omni's own table code runs unchanged and writes every file; how many
events were affected is logged at each stop.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm_omni.profiler.omni_torch_profiler import (
    OmniTorchProfilerWrapper,
    TorchProfilerActivity,
    TorchProfilerActivityMap,
)


log = logging.getLogger(__name__)
UNDECODABLE_NAME = "<name not UTF-8>"


class _ReadableEvent:
    """A ``KinetoEvent`` whose name (and stack) read as text even when torch's are not UTF-8."""

    __slots__ = ("_event", "_counts", "_seen")

    def __init__(self, event: Any, counts: dict[str, int]) -> None:
        self._event, self._counts, self._seen = event, counts, set()

    def _bad(self, what: str) -> None:
        if what not in self._seen:  # torch reads a name several times: count each event once
            self._seen.add(what)
            self._counts[what] += 1

    def name(self) -> str:
        try:
            return self._event.name()
        except UnicodeDecodeError:
            self._bad("names")
            return UNDECODABLE_NAME

    def stack(self) -> list[str]:
        try:
            return self._event.stack()
        except UnicodeDecodeError:
            self._bad("stacks")
            return []

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._event, attr)


class _ReadableResult:
    """Kineto's result (``kineto_results``) handing out :class:`_ReadableEvent`; the rest as is."""

    def __init__(self, result: Any) -> None:
        self._result = result
        self.counts = {"names": 0, "stacks": 0}

    def events(self) -> list[_ReadableEvent]:
        return [_ReadableEvent(e, self.counts) for e in self._result.events()]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._result, attr)


class _CpuProfile(torch.profiler.profile):
    """``torch.profiler.profile`` whose op tables survive event names that are not UTF-8."""

    def stop(self) -> None:
        super().stop()  # exports the trace (on_trace_ready) from Kineto's own result
        inner = getattr(self, "profiler", None)
        result = getattr(inner, "kineto_results", None)
        if result is not None and not isinstance(result, _ReadableResult):
            inner.kineto_results = _ReadableResult(result)

    def undecodable(self) -> dict[str, int]:
        result = getattr(getattr(self, "profiler", None), "kineto_results", None)
        return dict(result.counts) if isinstance(result, _ReadableResult) else {"names": 0, "stacks": 0}


class CpuTorchProfilerWrapper(OmniTorchProfilerWrapper):
    def _get_default_activities(self) -> list[TorchProfilerActivity]:
        return ["CPU"]

    def _create_profiler(self, profiler_config: Any, activities: list[TorchProfilerActivity]) -> Any:
        # As vLLM-Omni makes it; the diffusion worker's records every thread (see the docstring).
        extra = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)} \
            if self._all_threads else {}
        return _CpuProfile(
            activities=[TorchProfilerActivityMap[a] for a in activities],
            record_shapes=profiler_config.torch_profiler_record_shapes,
            profile_memory=profiler_config.torch_profiler_with_memory,
            with_stack=profiler_config.torch_profiler_with_stack,
            with_flops=profiler_config.torch_profiler_with_flops,
            on_trace_ready=self._on_trace_ready,
            **extra,
        )

    def _on_stop_hook(self) -> None:
        super()._on_stop_hook()
        bad = self.profiler.undecodable()
        if any(bad.values()):
            log.warning("[Rank %s] %d event name(s) and %d stack(s) in this profile were not UTF-8 (torch's CPU "
                        "Python tracer); the op tables show them as %r", self._rank(), bad["names"], bad["stacks"],
                        UNDECODABLE_NAME)

    @property
    def _all_threads(self) -> bool:
        # vLLM-Omni names the diffusion worker's profiler "diffusion_rank<N>", AR ones "stage<id>_rank<N>".
        return self._worker_name.startswith("diffusion")
