"""Worker-side profilers, mirroring vLLM 0.30's ``WorkerProfiler`` state machine and
vLLM-Omni 0.30's ``OmniTorchProfilerWrapper`` (session folders, file names, background gzip,
tables) line by line, minus vllm. Imported only inside worker processes (needs torch).
"""

from __future__ import annotations

import logging
import os
import subprocess
from datetime import datetime
from typing import Any

import torch

from sidecar.config.profiler import ProfilerConfig

logger = logging.getLogger("sidecar.emulator.worker")


def _torch_profile(config: ProfilerConfig, on_trace_ready: Any) -> torch.profiler.profile:
    """The ``torch.profiler.profile`` both torch wrappers build from ``config``. CPU only: the
    emulator has no device activity (the real default is CPU+CUDA)."""
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        record_shapes=config.torch_profiler_record_shapes,
        profile_memory=config.torch_profiler_with_memory,
        with_stack=config.torch_profiler_with_stack,
        with_flops=config.torch_profiler_with_flops,
        on_trace_ready=on_trace_ready,
    )


class WorkerProfiler:
    """vllm/profiler/wrapper.py ``WorkerProfiler``: delayed start, max-iteration auto-stop,
    start-while-active and stop-while-idle ignored."""

    def __init__(self, config: ProfilerConfig) -> None:
        self._delay_iters = config.delay_iterations
        self._max_iters = config.max_iterations
        self._active_iteration_count = 0
        self._active = False
        self._profiling_for_iters = 0
        self._running = False

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def is_active(self) -> bool:
        return self._active

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def _call_start(self) -> None:
        try:
            self._start()
            self._running = True
        except Exception as e:  # vLLM logs and carries on
            logger.warning("Failed to start profiler: %s", e)

    def _call_stop(self) -> None:
        try:
            self._stop()
            logger.info("Profiler stopped successfully.")
        except Exception as e:
            logger.warning("Failed to stop profiler: %s", e)
        self._running = False

    def start(self) -> None:
        if self._active:
            logger.debug("start_profile received when profiler is already active. Ignoring request.")
            return
        self._active = True
        if self._delay_iters == 0:
            self._call_start()

    def step(self) -> None:
        if not self._active:
            return
        self._active_iteration_count += 1
        if not self._running and self._delay_iters > 0 and self._active_iteration_count == self._delay_iters:
            logger.info("Starting profiler after delay...")
            self._call_start()
        if self._running:
            self._profiling_for_iters += 1
        if self._max_iters > 0 and self._running and self._profiling_for_iters > self._max_iters:
            logger.info("Max profiling iterations reached. Stopping profiler...")
            self.stop()

    def stop(self) -> None:
        if not self._active:
            logger.debug("stop_profile received when profiler is not active. Ignoring request.")
            return
        self._active = False
        self._active_iteration_count = 0
        self._profiling_for_iters = 0
        if self._running:
            self._call_stop()

    def annotate(self, name: str) -> Any:
        return torch.profiler.record_function(name)


class CudaRangeProfiler(WorkerProfiler):
    """``profiler: cuda``: the real worker opens/closes a cudaProfilerApi capture range for an
    outer ``nsys``; it writes no files. On CPU there is no range to open, so only log."""

    def _start(self) -> None:
        logger.info("cudaProfilerStart (emulated: CPU only, nothing is written)")

    def _stop(self) -> None:
        logger.info("cudaProfilerStop (emulated: CPU only, nothing is written)")


class OmniTorchProfiler(WorkerProfiler):
    """vllm_omni/profiler/omni_torch_profiler.py on CPU: one session folder per start, named
    ``<YYYYmmdd-HHMMSS>_<trace filename>``; at stop ``trace_rank<N>.json`` (gzipped by a background
    process), ``stacks_cpu_rank<N>.txt``, ``ops_rank<N>.xlsx``, ``profiler_out_<N>.txt``."""

    def __init__(
        self, config: ProfilerConfig, worker_name: str, local_rank: int, *, gzip_delay_s: float = 0.0
    ) -> None:
        super().__init__(config)
        self.config = config
        self.local_rank = local_rank
        self._worker_name = worker_name
        self._trace_dir = config.torch_profiler_dir or "."
        self._use_gzip = config.torch_profiler_use_gzip
        self._gzip_delay_s = gzip_delay_s
        self._trace_filename: str | None = None
        self._session_dir: str | None = None
        self._pending_gzip: str | None = None
        self.sessions: list[str] = []
        self.profiler = _torch_profile(config, self._on_trace_ready)

    def set_trace_filename(self, filename: str) -> None:
        # Called on every start, even one the state machine ignores: that is why a second start
        # makes a fresh (and, as it stays, empty-until-stop) session folder.
        self._trace_filename = filename
        self._session_dir = None
        self._ensure_session_dir()

    def _ensure_session_dir(self) -> str:
        if self._session_dir is not None:
            os.makedirs(self._session_dir, exist_ok=True)
            return self._session_dir
        ts = datetime.now().strftime("%Y%m%d-%H%M%S")
        base = self._trace_filename or self._worker_name
        self._session_dir = os.path.join(self._trace_dir, f"{ts}_{base}")
        os.makedirs(self._session_dir, exist_ok=True)
        if self._session_dir not in self.sessions:
            self.sessions.append(self._session_dir)
        return self._session_dir

    def _artifact_path(self, stem: str, suffix: str) -> str:
        return os.path.join(self._ensure_session_dir(), f"{stem}_rank{self.local_rank}{suffix}")

    def _on_trace_ready(self, prof: Any) -> None:
        json_file = self._artifact_path("trace", ".json")
        try:
            prof.export_chrome_trace(json_file)
            logger.info("[Rank %s] Trace exported to %s", self.local_rank, json_file)
            if self._use_gzip:
                self._pending_gzip = json_file
        except Exception as e:
            logger.warning("[Rank %s] Failed to export trace: %s", self.local_rank, e)

    def _background_gzip(self, json_file: str) -> None:
        # The real worker starts `gzip -f` and replies at once. Emulator traces are tiny, so an
        # optional delay models the seconds a real trace takes; its own session so it outlives us.
        if self._gzip_delay_s > 0:
            cmd = ["sh", "-c", 'sleep "$0" && exec gzip -f "$1"', str(self._gzip_delay_s), json_file]
        else:
            cmd = ["gzip", "-f", json_file]
        try:
            subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)
            logger.info("[Rank %s] Triggered background compression for %s", self.local_rank, json_file)
        except Exception as e:
            logger.warning("[Rank %s] Background gzip failed to start: %s", self.local_rank, e)

    def _start(self) -> None:
        self._ensure_session_dir()
        if self.config.torch_profiler_with_memory:
            # The real wrapper records CUDA/NPU/XPU memory history; a CPU build has none.
            logger.info(
                "[Rank %s] memory snapshot skipped: no device memory history on CPU "
                "(memory_snapshot_rank%s.pickle is not written)",
                self.local_rank,
                self.local_rank,
            )
        self.profiler.start()

    def _stop(self) -> None:
        try:
            self.profiler.stop()
            self._on_stop_hook()
        finally:
            # The real worker starts gzip right after the export; the emulator starts it once the
            # tables are written, so its delay (standing for a big trace's gzip time) runs from
            # the moment the worker replies.
            if self._pending_gzip is not None:
                self._background_gzip(self._pending_gzip)
                self._pending_gzip = None

    def _on_stop_hook(self) -> None:
        rank = self.local_rank
        if self.config.torch_profiler_with_stack:
            try:
                self.profiler.export_stacks(self._artifact_path("stacks_cpu", ".txt"), metric="self_cpu_time_total")
            except Exception as e:
                logger.warning("[Rank %s] export_stacks(cpu) failed: %s", rank, e)
        self._write_excel()
        if self.config.torch_profiler_dump_cuda_time_total:
            table = self.profiler.key_averages().table(sort_by="self_cuda_time_total")
            with open(os.path.join(self._ensure_session_dir(), f"profiler_out_{rank}.txt"), "w") as f:
                print(table, file=f)

    def _write_excel(self) -> None:
        try:
            import pandas as pd  # noqa: F401
            import openpyxl  # noqa: F401
        except Exception as e:
            logger.info("[Rank %s] pandas/openpyxl not available, skip Excel export: %s", self.local_rank, e)
            return
        sheets: dict[str, Any] = {"summary": self.profiler.key_averages()}
        if self.config.torch_profiler_record_shapes:
            sheets["by_shape"] = self.profiler.key_averages(group_by_input_shape=True)
        if self.config.torch_profiler_with_stack:
            sheets["by_stack"] = self.profiler.key_averages(group_by_stack_n=8)
        try:
            with pd.ExcelWriter(self._artifact_path("ops", ".xlsx"), engine="openpyxl") as writer:
                for name, events in sheets.items():
                    rows = [
                        {
                            "name": e.key,
                            "count": e.count,
                            "self_cpu_time_total_us": e.self_cpu_time_total,
                            "cpu_time_total_us": e.cpu_time_total,
                            "input_shapes": str(getattr(e, "input_shapes", None)),
                            "stack": "\n".join(getattr(e, "stack", []) or []),
                        }
                        for e in events
                    ]
                    pd.DataFrame(rows).to_excel(writer, sheet_name=name, index=False)
        except Exception as e:
            logger.warning("[Rank %s] Failed to export Excel workbook: %s", self.local_rank, e)


class PlainVllmTorchProfiler(WorkerProfiler):
    """Plain vLLM 0.30 ``TorchProfilerWrapper``: tensorboard_trace_handler files straight in
    ``torch_profiler_dir`` (``<worker>.<ms>.pt.trace.json[.gz]``) and ``profiler_out_<rank>.txt``."""

    def __init__(self, config: ProfilerConfig, worker_name: str, local_rank: int) -> None:
        super().__init__(config)
        self.config = config
        self.local_rank = local_rank
        self.sessions: list[str] = []
        trace_dir = config.torch_profiler_dir or "."
        self.profiler = _torch_profile(
            config,
            torch.profiler.tensorboard_trace_handler(
                trace_dir, worker_name=worker_name, use_gzip=config.torch_profiler_use_gzip
            ),
        )

    def set_trace_filename(self, filename: str) -> None:  # plain vLLM names once, at creation
        return None

    def _start(self) -> None:
        os.makedirs(self.config.torch_profiler_dir or ".", exist_ok=True)
        self.profiler.start()

    def _stop(self) -> None:
        self.profiler.stop()
        out = os.path.join(self.config.torch_profiler_dir or ".", f"profiler_out_{self.local_rank}.txt")
        if self.config.torch_profiler_dump_cuda_time_total:
            with open(out, "w") as f:
                print(self.profiler.key_averages().table(sort_by="self_cuda_time_total"), file=f)
