"""Worker-side profilers, mirroring vLLM 0.30's ``WorkerProfiler`` state machine, vLLM-Omni 0.30's
``OmniTorchProfilerWrapper`` (session folders, file names, background gzip, tables) and plain
vLLM 0.30's ``TorchProfilerWrapper`` (tensorboard-style names flat in the dir), minus vllm.

Imports no torch: what records is a ``Recorder`` from a backend (``_torch_backend``: real
``torch.profiler``; ``_synthetic``: a torch-free stand-in that writes the same files).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from typing import Any, Protocol

from sidecar.config.profiler import ProfilerConfig

logger = logging.getLogger("sidecar.emulator.worker")

VLLM_VERSION = "0.30.0"


class Recorder(Protocol):
    """What both backends offer: one recording window at a time, exported after ``stop``."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def discard(self) -> None: ...  # stop without keeping anything (the emulator's reset)
    def export_chrome_trace(self, path: str) -> None: ...  # gzip when the path ends in .gz
    def export_stacks(self, path: str, metric: str) -> None: ...
    def table(self, sort_by: str, row_limit: int = 100) -> str: ...
    def write_excel(self, path: str, config: ProfilerConfig) -> None: ...
    def add_metadata_json(self, key: str, value: str) -> None: ...
    def annotate(self, name: str) -> AbstractContextManager[Any]: ...


RecorderFactory = Callable[[ProfilerConfig], Recorder]


class WorkerProfiler:
    """vllm/profiler/wrapper.py ``WorkerProfiler``: delayed start, max-iteration auto-stop,
    start-while-active and stop-while-idle ignored."""

    recorder: Recorder | None = None

    def __init__(self, config: ProfilerConfig) -> None:
        self._delay_iters = config.delay_iterations
        self._max_iters = config.max_iterations
        self._active_iteration_count = 0
        self._active = False
        self._profiling_for_iters = 0
        self._running = False
        self.sessions: list[str] = []

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

    def discard(self) -> None:
        """Emulator-only (reset between tests): back to idle, nothing written."""
        if self._running and self.recorder is not None:
            self.recorder.discard()
        self._active = self._running = False
        self._active_iteration_count = self._profiling_for_iters = 0
        self.sessions = []

    def set_trace_filename(self, filename: str, at: float | None = None) -> None:
        return None  # only the Omni wrapper names its output per start

    def annotate(self, name: str) -> AbstractContextManager[Any]:
        return self.recorder.annotate(name) if self.recorder is not None else nullcontext()


class CudaRangeProfiler(WorkerProfiler):
    """``profiler: cuda``: the real worker opens/closes a cudaProfilerApi capture range for an
    outer ``nsys``; it writes no files. On CPU there is no range to open, so only log."""

    def _start(self) -> None:
        logger.info("cudaProfilerStart (emulated: CPU only, nothing is written)")

    def _stop(self) -> None:
        logger.info("cudaProfilerStop (emulated: CPU only, nothing is written)")


class OmniTorchProfiler(WorkerProfiler):
    """vllm_omni/profiler/omni_torch_profiler.py: one session folder per start, named
    ``<YYYYmmdd-HHMMSS>_<trace filename>``; at stop ``trace_rank<N>.json`` (gzip started in the
    background right after the export, as the real ``_on_trace_ready`` does), then, still inside
    the stop, ``stacks_cpu_rank<N>.txt`` (+ ``stacks_cuda`` with ``cuda_activity``),
    ``ops_rank<N>.xlsx`` and ``profiler_out_<N>.txt``."""

    def __init__(
        self,
        config: ProfilerConfig,
        recorder: Recorder,
        worker_name: str,
        local_rank: int,
        *,
        gzip_delay_s: float = 0.0,
        cuda_activity: bool = True,
    ) -> None:
        super().__init__(config)
        self.config = config
        # The real wrapper records CPU+CUDA on a GPU platform (and writes stacks_cuda); CPU only on
        # the CPU platform. The recorder is CPU-only either way: this decides the files.
        self.cuda_activity = cuda_activity
        self.recorder = recorder
        self.local_rank = local_rank
        self._worker_name = worker_name
        self._trace_dir = config.torch_profiler_dir or "."
        self._use_gzip = config.torch_profiler_use_gzip
        self._gzip_delay_s = gzip_delay_s
        self._trace_filename: str | None = None
        self._session_dir: str | None = None
        self._session_at: float | None = None

    def set_trace_filename(self, filename: str, at: float | None = None) -> None:
        # Called on every start, even one the state machine ignores: that is why a second start
        # makes a fresh session folder, the one the trace then lands in (the first stays empty).
        # ``at``: the second the folder is named after (the emulator gives all replicas of one
        # call the same one; real replicas, called within milliseconds, nearly always share it).
        self._trace_filename = filename
        self._session_dir = None
        self._session_at = at
        self._ensure_session_dir()

    def _ensure_session_dir(self) -> str:
        if self._session_dir is not None:
            os.makedirs(self._session_dir, exist_ok=True)
            return self._session_dir
        now = datetime.fromtimestamp(self._session_at) if self._session_at is not None else datetime.now()
        ts = now.strftime("%Y%m%d-%H%M%S")
        base = self._trace_filename or self._worker_name
        self._session_dir = os.path.join(self._trace_dir, f"{ts}_{base}")
        os.makedirs(self._session_dir, exist_ok=True)
        if self._session_dir not in self.sessions:
            self.sessions.append(self._session_dir)
        return self._session_dir

    def _artifact_path(self, stem: str, suffix: str) -> str:
        return os.path.join(self._ensure_session_dir(), f"{stem}_rank{self.local_rank}{suffix}")

    def _export_trace(self) -> None:
        json_file = self._artifact_path("trace", ".json")
        try:
            self.recorder.export_chrome_trace(json_file)
            logger.info("[Rank %s] Trace exported to %s", self.local_rank, json_file)
            if self._use_gzip:
                self._background_gzip(json_file)
        except Exception as e:
            logger.warning("[Rank %s] Failed to export trace: %s", self.local_rank, e)

    def _background_gzip(self, json_file: str) -> None:
        # The real worker starts `gzip -f` and goes on with the tables: a small trace is gzipped
        # before the reply, a big one after. Emulator traces are tiny, so an optional delay models
        # the seconds a big trace takes; its own session so it outlives us.
        if self._gzip_delay_s > 0:
            cmd = ["sh", "-c", 'sleep "$0" && exec gzip -f "$1"', str(self._gzip_delay_s), json_file]
        else:
            cmd = ["gzip", "-f", json_file]
        try:
            subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        self.recorder.start()

    def _stop(self) -> None:
        self.recorder.stop()
        self._export_trace()
        self._on_stop_hook()  # inside the stop: the xlsx is most of a real stop's cost
        logger.info("[Rank %s] Stop hook done: tables written to %s", self.local_rank, self._ensure_session_dir())

    def _on_stop_hook(self) -> None:
        rank = self.local_rank
        if self.config.torch_profiler_with_stack:
            stacks = [("stacks_cpu", "self_cpu_time_total")]
            if self.cuda_activity:
                stacks.append(("stacks_cuda", "self_cuda_time_total"))
            for stem, metric in stacks:
                try:
                    self.recorder.export_stacks(self._artifact_path(stem, ".txt"), metric)
                except Exception as e:
                    logger.warning("[Rank %s] export_stacks(%s) failed: %s", rank, stem, e)
        try:
            self.recorder.write_excel(self._artifact_path("ops", ".xlsx"), self.config)
        except Exception as e:
            logger.warning("[Rank %s] Failed to export Excel workbook: %s", rank, e)
        if self.config.torch_profiler_dump_cuda_time_total:
            table = self.recorder.table("self_cuda_time_total")
            with open(os.path.join(self._ensure_session_dir(), f"profiler_out_{rank}.txt"), "w") as f:
                print(table, file=f)


class PlainVllmTorchProfiler(WorkerProfiler):
    """Plain vLLM 0.30 ``TorchProfilerWrapper`` with CPU activity only (the CPU worker, and the
    API server's ``AsyncLLM`` front-end profiler): ``tensorboard_trace_handler`` names,
    ``<worker_name>.<time_ns>.pt.trace.json[.gz]`` flat in ``torch_profiler_dir``, the vLLM
    version stamped into the trace, and ``profiler_out_<rank>.txt`` rewritten by every stop."""

    def __init__(
        self, config: ProfilerConfig, recorder: Recorder, worker_name: str, local_rank: int, *, write_table: bool = True
    ) -> None:
        super().__init__(config)
        # The front-end profiler (rank 0 too) writes the same profiler_out_0.txt as the worker,
        # concurrently; the emulator keeps the worker's table (real ops) and skips the front-end's.
        self.write_table = write_table
        self.config = config
        self.recorder = recorder
        self.local_rank = local_rank
        self.worker_name = worker_name
        self._dir = config.torch_profiler_dir or "."

    def _start(self) -> None:
        self.recorder.start()
        self.recorder.add_metadata_json("vllm_version", f'"{VLLM_VERSION}"')

    def _stop(self) -> None:
        self.recorder.stop()
        os.makedirs(self._dir, exist_ok=True)
        name = f"{self.worker_name}.{time.time_ns()}.pt.trace.json"
        if self.config.torch_profiler_use_gzip:
            name += ".gz"
        path = os.path.join(self._dir, name)
        self.recorder.export_chrome_trace(path)
        self.sessions.append(path)
        if not self.write_table:
            return
        out = os.path.join(self._dir, f"profiler_out_{self.local_rank}.txt")
        # Both tables go to the same file, the CPU one last: with CPU activity only, vLLM writes
        # the cuda-sorted table (if dump_cuda_time_total) and then overwrites it (50 rows).
        if self.config.torch_profiler_dump_cuda_time_total:
            with open(out, "w") as f:
                print(self.recorder.table("self_cuda_time_total"), file=f)
        with open(out, "w") as f:
            print(self.recorder.table("self_cpu_time_total", row_limit=50), file=f)
