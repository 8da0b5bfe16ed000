"""One worker process per stage replica (multiprocessing, spawn) and its handle in the API
process. The worker owns the torch workload and profiler and handles one command at a time, so
a long stop blocks that stage exactly as a real engine core does. This module imports no torch:
``worker_main`` imports it inside the child.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger("sidecar.emulator")

PROFILING_NOT_ENABLED = (
    "Profiling is not enabled. For diffusion models, set --profiler-config via CLI. "
    "For omni models, add profiler_config to the relevant deploy config stage."
)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start (picklable: plain values only)."""

    stage_id: int
    kind: str  # "llm" | "diffusion"
    profiler_config: dict[str, Any] | None
    replica: int = 0
    rank: int = 0
    flavor: str = "omni"
    step_ms: float = 5.0
    gzip_delay_s: float = 0.0
    die_after_start: bool = False
    die_after_profile_start: bool = False
    parent_pid: int = field(default_factory=os.getpid)


class WorkerDead(RuntimeError):
    """The worker process is gone; the real server reports it as a failed RPC (HTTP 500)."""


# --- child side -----------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    # PR_SET_PDEATHSIG covers SIGKILL of the parent; the poll covers races and non-Linux.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class _Stage:
    """The engine core of one stage replica: workload, step counter, profiler."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch

        from sidecar.config.profiler import ProfilerConfig
        from sidecar.emulator import _profiler
        from sidecar.emulator._workload import build_workload

        torch.set_num_threads(1)  # several workers share a couple of cores
        self.spec = spec
        self.model = build_workload(spec.kind)
        self.model.step()  # warm-up outside any capture
        self.iterations = 0
        self.profiler: Any = None
        cfg = ProfilerConfig(**spec.profiler_config) if spec.profiler_config else None
        if cfg is None or cfg.profiler is None:
            self.profiler = None
        elif cfg.profiler == "torch" and spec.flavor == "vllm":
            self.profiler = _profiler.PlainVllmTorchProfiler(cfg, f"dp0_pp0_tp0_dcp0_ep0_rank{spec.rank}", spec.rank)
        elif cfg.profiler == "torch":
            self.profiler = _profiler.OmniTorchProfiler(
                cfg, f"stage{spec.stage_id}_rank{spec.rank}", spec.rank, gzip_delay_s=spec.gzip_delay_s
            )
        elif cfg.profiler == "cuda":
            self.profiler = _profiler.CudaRangeProfiler(cfg)
        else:  # proton is not wired in Omni workers
            logger.warning("Unknown profiler backend %r on stage %s worker", cfg.profiler, spec.stage_id)

    def profile(self, is_start: bool) -> None:
        spec = self.spec
        if self.profiler is None:
            if spec.kind == "diffusion":
                return  # the diffusion worker returns silently
            raise RuntimeError(PROFILING_NOT_ENABLED)
        if is_start:
            if hasattr(self.profiler, "set_trace_filename"):
                epoch = int(time.time())
                if spec.kind == "diffusion":
                    name = f"stage_{spec.stage_id}_rep_{spec.replica}_diffusion_{epoch}"
                else:
                    name = f"stage{spec.stage_id}_rank{spec.rank}_{epoch}"
                self.profiler.set_trace_filename(name)
            self.profiler.start()
        else:
            self.profiler.stop()

    def run_steps(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.iterations += 1
            prof = self.profiler
            if self.spec.kind == "diffusion":
                # the diffusion worker steps its profiler after the forward
                with prof.annotate("diffusion_forward") if prof and prof.is_running else _null():
                    out.append(self.model.step())
                if prof:
                    prof.step()
            else:
                # the GPU worker steps its profiler before the forward (annotate_profile)
                if prof:
                    prof.step()
                with prof.annotate("execute_model") if prof and prof.is_running else _null():
                    out.append(self.model.step())
            spare = self.spec.step_ms / 1000 - (time.perf_counter() - t0)
            if spare > 0:
                time.sleep(spare)
        return out

    def state(self) -> dict[str, Any]:
        p = self.profiler
        return {
            "profiling": bool(p is not None and p.is_running),
            "active": bool(p is not None and p.is_active),
            "iterations": self.iterations,
            "sessions": list(getattr(p, "sessions", []) or []),
        }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _die_soon(stage_id: int, after_s: float = 0.2) -> None:
    # The start was acknowledged first (SUCCESS upstream); the exit comes a moment later, so the
    # session folder exists but the trace is never written, as when a GPU worker crashes mid-window.
    logger.warning("fault injected (--fault-die-after-start %s): worker exits in %.1fs", stage_id, after_s)
    timer = threading.Timer(after_s, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process: build, say ready, then serve commands until shutdown."""
    _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [stage {spec.stage_id} rep {spec.replica}] %(message)s",
    )
    try:
        stage = _Stage(spec)
    except Exception as e:
        conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    conn.send({"ok": True, "state": stage.state(), "pid": os.getpid()})
    if spec.die_after_start:
        logger.warning("fault injected (--fault-dead-stage %s): worker exits now", spec.stage_id)
        os._exit(1)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        op = msg.get("op")
        if op == "shutdown":
            if stage.profiler is not None and stage.profiler.is_running:
                stage.profiler.stop()
            conn.send({"ok": True, "state": stage.state()})
            return
        try:
            result: Any = None
            if op == "profile":
                stage.profile(bool(msg["is_start"]))
            elif op == "steps":
                result = stage.run_steps(int(msg["n"]))
            elif op != "state":
                raise ValueError(f"unknown op {op!r}")
            conn.send({"ok": True, "result": result, "state": stage.state()})
            if op == "profile" and msg["is_start"] and spec.die_after_profile_start:
                _die_soon(spec.stage_id)
        except Exception as e:
            logger.warning("%s failed: %s", op, e)
            conn.send({"ok": False, "error": f"{type(e).__name__}: {e}", "state": stage.state()})


# --- parent side ----------------------------------------------------------------------------


class WorkerHandle:
    """The API process's end of one worker: one command in flight at a time, no timeout."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=worker_main,
            args=(child_conn, spec),
            name=f"omni-emulator-stage{spec.stage_id}-rep{spec.replica}",
            daemon=True,
        )
        self._child_conn = child_conn
        self._lock: asyncio.Lock | None = None
        self.last_state: dict[str, Any] = {"profiling": False, "active": False, "iterations": 0, "sessions": []}

    @property
    def label(self) -> str:
        return f"stage {self.spec.stage_id} replica {self.spec.replica}"

    def start(self) -> None:
        self.process.start()
        self._child_conn.close()

    def wait_ready(self, deadline: float) -> None:
        if not self._poll_until(deadline):
            raise WorkerDead(f"{self.label} worker did not start within the start-up timeout")
        reply = self._conn.recv()
        if not reply.get("ok"):
            raise WorkerDead(f"{self.label} worker failed to start: {reply.get('error')}")
        self.last_state = reply["state"]

    def _poll_until(self, deadline: float | None) -> bool:
        while deadline is None or time.monotonic() < deadline:
            if self._conn.poll(0.1):
                return True
            if not self.process.is_alive():
                return self._conn.poll(0)
        return False

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def _roundtrip(self, msg: dict[str, Any]) -> dict[str, Any]:
        dead = WorkerDead(f"{self.label} worker process is dead (exit code {self.process.exitcode})")
        if not self.process.is_alive():
            raise dead
        try:
            self._conn.send(msg)
            if not self._poll_until(None):
                raise dead
            reply = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            dead = WorkerDead(f"{self.label} worker process is dead (exit code {self.process.exitcode})")
            raise dead from None
        if "state" in reply:
            self.last_state = reply["state"]
        return reply

    async def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await asyncio.to_thread(self._roundtrip, {"op": op, **kwargs})

    def shutdown(self, timeout: float = 3.0) -> None:
        if self.process.is_alive():
            try:
                self._conn.send({"op": "shutdown"})
            except (OSError, BrokenPipeError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)


class StageRuntime:
    """One deploy stage in the API process: its kind, profiler and replica workers."""

    def __init__(self, stage_id: int, kind: str, profiler: str | None, workers: list[WorkerHandle]) -> None:
        self.stage_id = stage_id
        self.kind = kind
        self.profiler = profiler
        self.workers = workers
        self._rr = itertools.cycle(range(len(workers)))

    def next_worker(self) -> WorkerHandle:
        return self.workers[next(self._rr)]

    def state(self) -> dict[str, Any]:
        states = [w.last_state for w in self.workers]
        return {
            "kind": self.kind,
            "profiler": self.profiler,
            "profiling": any(s["profiling"] for s in states),
            "active": any(s["active"] for s in states),
            "iterations": sum(s["iterations"] for s in states),
            "sessions": [p for s in states for p in s["sessions"]],
            "alive": all(w.alive for w in self.workers),
            "pids": [w.process.pid for w in self.workers],
        }
