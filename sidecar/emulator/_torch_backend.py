"""The real backend of a stage worker: the tiny torch workload and ``torch.profiler`` (CPU only;
a real server records CPU+CUDA). Imported only in worker processes, or preloaded in the
forkserver that forks them.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.profiler  # noqa: F401  (preloaded in the forkserver with the rest)

from sidecar.config.profiler import ProfilerConfig
from sidecar.emulator._workload import build_workload

logger = logging.getLogger("sidecar.emulator.worker")


_said_no_excel = False  # the emulator's stand-in for the real server's line at every stop is said once


class TorchRecorder:
    """``torch.profiler.profile`` as both vLLM wrappers build it from ``config``."""

    def __init__(self, config: ProfilerConfig) -> None:
        self.config = config
        self.profiler = self._build()

    def _build(self) -> torch.profiler.profile:
        c = self.config
        return torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            record_shapes=c.torch_profiler_record_shapes,
            profile_memory=c.torch_profiler_with_memory,
            with_stack=c.torch_profiler_with_stack,
            with_flops=c.torch_profiler_with_flops,
        )

    def start(self) -> None:
        self.profiler.start()

    def stop(self) -> None:
        self.profiler.stop()

    def discard(self) -> None:
        try:
            self.profiler.stop()
        finally:
            self.profiler = self._build()

    def export_chrome_trace(self, path: str) -> None:
        self.profiler.export_chrome_trace(path)

    def export_stacks(self, path: str, metric: str) -> None:
        self.profiler.export_stacks(path, metric=metric)

    def table(self, sort_by: str, row_limit: int = 100) -> str:
        return str(self.profiler.key_averages().table(sort_by=sort_by, row_limit=row_limit))

    def add_metadata_json(self, key: str, value: str) -> None:
        self.profiler.add_metadata_json(key, value)

    def annotate(self, name: str) -> AbstractContextManager[Any]:
        return torch.profiler.record_function(name)

    def write_excel(self, path: str, config: ProfilerConfig) -> None:
        try:
            import openpyxl  # noqa: F401
            import pandas as pd
        except Exception as e:
            global _said_no_excel
            if not _said_no_excel:
                _said_no_excel = True
                logger.info("pandas/openpyxl not available, skip Excel export (said once): %s", e)
            return
        prof = self.profiler
        sheets: dict[str, Any] = {"summary": prof.key_averages()}
        if config.torch_profiler_record_shapes:
            sheets["by_shape"] = prof.key_averages(group_by_input_shape=True)
        if config.torch_profiler_with_stack:
            sheets["by_stack"] = prof.key_averages(group_by_stack_n=8)
        with pd.ExcelWriter(path, engine="openpyxl") as writer:
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


class TorchBackend:
    name = "torch"

    def __init__(self) -> None:
        torch.set_num_threads(1)  # several workers share a couple of cores

    def workload(self, kind: str) -> Any:
        model = build_workload(kind)
        model.step()  # warm-up outside any capture
        return model

    def recorder(self, config: ProfilerConfig) -> TorchRecorder:
        return TorchRecorder(config)
