"""Stage workers and their handles in the API process. A worker owns one stage replica's workload
and profiler and handles one command at a time, so a long stop blocks that stage exactly as a
real engine core does. Two kinds of handle:

- ``ProcessWorker``: a child process with real torch (forked from a forkserver that has torch
  preloaded, or spawned), dying with the API process, also on SIGKILL;
- ``ThreadWorker``: the same command loop in the API process on the torch-free synthetic
  backend (``--workers thread``): starts at once, for tests that do not read trace contents.

This module imports no torch: the torch backend is imported inside the worker (or forkserver).
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
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

logger = logging.getLogger("sidecar.emulator")

PROFILING_NOT_ENABLED = (
    "Profiling is not enabled. For diffusion models, set --profiler-config via CLI. "
    "For omni models, add profiler_config to the relevant deploy config stage."
)
DIE_AFTER_START_S = 0.2
IDLE_STATE: dict[str, Any] = {"profiling": False, "active": False, "iterations": 0, "sessions": []}


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
    idle_after: int = 0  # idle iterations after each request's steps (options.idle_after_request)
    gzip_delay_s: float = 0.0
    backend: str = "torch"  # "torch" | "synthetic"
    platform: str = "cuda"  # "cuda" | "cpu": the files a GPU server's workers write, or a CPU server's
    instance_id: str = ""  # plain vLLM's VllmConfig.instance_id (time_ns at start-up)


class WorkerDead(RuntimeError):
    """The worker is gone; the real stage pool turns the failed RPC into a logged non-result."""


# --- the engine core of one stage replica (both kinds) ------------------------------------------


class _Stage:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        if spec.backend == "torch":
            from sidecar.emulator._torch_backend import TorchBackend

            self.backend: Any = TorchBackend()
        else:
            from sidecar.emulator._synthetic import SyntheticBackend

            self.backend = SyntheticBackend()
        self.model = self.backend.workload(spec.kind)
        self.iterations = 0
        self.profiler: Any = self._make_profiler(spec.profiler_config)

    def _make_profiler(self, raw: dict[str, Any] | None) -> Any:
        from sidecar.config.profiler import ProfilerConfig
        from sidecar.emulator import _profiler

        spec = self.spec
        cfg = ProfilerConfig(**raw) if raw else None
        if cfg is None or cfg.profiler is None:
            return None
        if cfg.profiler == "torch" and spec.flavor == "vllm":
            # vllm/v1/worker/cpu_worker.py: worker_name = f"{instance_id}-rank-{rank}"
            name = f"{spec.instance_id}-rank-{spec.rank}"
            return _profiler.PlainVllmTorchProfiler(cfg, self.backend.recorder(cfg), name, spec.rank)
        if cfg.profiler == "torch":
            if spec.platform == "cpu" and spec.kind == "llm":
                # vLLM's CPU platform turns the CUDA table off for its workers: no profiler_out_<N>.txt
                # (the diffusion worker, built apart from that platform code, still writes it)
                cfg = cfg.model_copy(update={"torch_profiler_dump_cuda_time_total": False})
            return _profiler.OmniTorchProfiler(
                cfg, self.backend.recorder(cfg), f"stage{spec.stage_id}_rank{spec.rank}", spec.rank,
                gzip_delay_s=spec.gzip_delay_s, cuda_activity=spec.platform == "cuda",
            )  # fmt: skip
        if cfg.profiler == "cuda":
            return _profiler.CudaRangeProfiler(cfg)
        logger.warning("Unknown profiler backend %r on stage %s worker", cfg.profiler, spec.stage_id)
        return None  # proton is not wired in Omni workers

    def profile(self, is_start: bool, at: float | None = None) -> None:
        spec = self.spec
        if self.profiler is None:
            if spec.kind == "diffusion":
                return  # the diffusion worker returns silently
            raise RuntimeError(PROFILING_NOT_ENABLED)
        if is_start:
            at = time.time() if at is None else at
            if spec.kind == "diffusion":
                name = f"stage_{spec.stage_id}_rep_{spec.replica}_diffusion_{int(at)}"
            else:
                name = f"stage{spec.stage_id}_rank{spec.rank}_{int(at)}"
            self.profiler.set_trace_filename(name, at)
            self.profiler.start()
        else:
            self.profiler.stop()

    def run_steps(self, n: int) -> list[int]:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            if self.spec.kind == "diffusion":
                # the diffusion worker steps its profiler after the forward
                self.iterations += 1
                prof = self.profiler
                with _span(prof, "diffusion_forward"):
                    out.append(self.model.step())
                if prof:
                    prof.step()
            else:
                # vLLM's own step marker: a request's first step prefills, the rest decode
                out.append(self._iteration(_STEP_NAMES[i > 0], self.model.step))
            spare = self.spec.step_ms / 1000 - (time.perf_counter() - t0)
            if spare > 0:
                time.sleep(spare)
        for _ in range(self.spec.idle_after):
            # the request ended with nothing else running: vLLM steps once more, scheduling nothing
            # (its profiler counts the iteration; the step counter, which counts outputs, does not)
            self._iteration(_IDLE_STEP, lambda: 0)
        return out

    def _iteration(self, marker: str, forward: Callable[[], int]) -> int:
        """One engine iteration of an LLM stage: the GPU worker steps its profiler before the forward
        (annotate_profile), which runs inside ``execute_model`` and vLLM's step marker."""
        self.iterations += 1
        prof = self.profiler
        if prof:
            prof.step()
        with _span(prof, "execute_model"), _span(prof, marker):
            return forward()

    def reset(self, profiler_config: dict[str, Any] | None, reconfigure: bool) -> None:
        """Emulator-only: profiler idle (a window in progress is dropped, nothing written), no
        sessions, step count 0; with ``reconfigure``, a new profiler config (e.g. a fresh dir)."""
        if self.profiler is not None:
            self.profiler.discard()
        if reconfigure:
            self.profiler = self._make_profiler(profiler_config)
        self.iterations = 0

    def shutdown(self) -> None:
        if self.profiler is not None and self.profiler.is_running:
            self.profiler.stop()

    def state(self) -> dict[str, Any]:
        p = self.profiler
        return {
            "profiling": bool(p is not None and p.is_running),
            "active": bool(p is not None and p.is_active),
            "iterations": self.iterations,
            "sessions": list(getattr(p, "sessions", []) or []),
        }


_STEP_NAMES = ("execute_context_1(1)_generation_0(0)", "execute_context_0(0)_generation_1(1)")
_IDLE_STEP = "execute_context_0(0)_generation_0(0)"


def _span(prof: Any, name: str) -> Any:
    """``name`` annotated in a running profiler's trace; nothing otherwise."""
    return prof.annotate(name) if prof and prof.is_running else _null()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def handle(stage: _Stage, msg: dict[str, Any]) -> dict[str, Any]:
    """One command; every failure is an ``ok: False`` reply (the engine core survives it)."""
    op = msg.get("op")
    try:
        result: Any = None
        if op == "profile":
            stage.profile(bool(msg["is_start"]), msg.get("at"))
        elif op == "steps":
            result = stage.run_steps(int(msg["n"]))
        elif op == "reset":
            stage.reset(msg.get("profiler_config"), bool(msg.get("reconfigure")))
        elif op != "state":
            raise ValueError(f"unknown op {op!r}")
        return {"ok": True, "result": result, "state": stage.state()}
    except Exception as e:
        logger.warning("%s failed: %s", op, e)
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "state": stage.state()}


# --- process workers ------------------------------------------------------------------------------


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG covers SIGKILL of the parent (the API process, or the forkserver, which
    # exits when the API process is gone); the poll covers races.
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _die_soon(stage_id: int) -> None:
    # The start was acknowledged first (SUCCESS upstream); the exit comes a moment later, so the
    # session folder exists but the trace is never written, as when a GPU worker crashes mid-window.
    logger.warning("fault injected (die_after_start %s): worker exits in %.1fs", stage_id, DIE_AFTER_START_S)
    timer = threading.Timer(DIE_AFTER_START_S, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process: build, say ready, then serve commands until shutdown."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [stage {spec.stage_id} rep {spec.replica}] %(message)s",
        force=True,
    )
    try:
        stage = _Stage(spec)
    except Exception as e:
        conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    conn.send({"ok": True, "state": stage.state(), "pid": os.getpid()})
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg.get("op") == "shutdown":
            stage.shutdown()
            conn.send({"ok": True, "state": stage.state()})
            return
        reply = handle(stage, msg)
        conn.send(reply)
        if msg.get("die_after") and reply["ok"]:
            _die_soon(spec.stage_id)


# What every worker needs, imported once in the forkserver so a forked worker only builds its
# model.
_PRELOAD = ["sidecar.emulator._torch_backend", "sidecar.emulator._profiler", "sidecar.emulator.worker"]
# torch.profiler.profile.start() asks ``hasattr(torch, "_inductor")``, which imports it and dynamo
# with it: ~2.5 s of CPU in every worker at its first capture (a real vLLM worker has it loaded
# anyway). Preloaded when some stage has a torch profiler; spawned workers pay it there.
_PRELOAD_TORCH_PROFILER = ["torch._inductor.config"]


def worker_context(start_method: str, torch_profiler: bool = True) -> BaseContext:
    """``forkserver``: one interpreter imports torch once and forks every worker from it;
    ``spawn``: each worker is a fresh interpreter importing torch itself (slower, no sharing).
    ``torch_profiler``: some worker will start a torch profiler (preload what that needs)."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD + (_PRELOAD_TORCH_PROFILER if torch_profiler else []))  # type: ignore[attr-defined]
    return ctx


class WorkerHandle:
    """The API process's end of one worker: one command in flight at a time, no timeout."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._lock: asyncio.Lock | None = None
        self.last_state: dict[str, Any] = dict(IDLE_STATE)

    @property
    def label(self) -> str:
        return f"stage {self.spec.stage_id} replica {self.spec.replica}"

    @property
    def pid(self) -> int | None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def wait_ready(self, deadline: float) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        """Fault injection: the worker is gone from now on."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 3.0) -> None:
        raise NotImplementedError

    def _roundtrip(self, msg: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def respawn(self, deadline: float) -> None:
        self.shutdown()
        self.start()
        self.wait_ready(deadline)

    async def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            reply = await asyncio.to_thread(self._roundtrip, {"op": op, **kwargs})
        if "state" in reply:
            self.last_state = reply["state"]
        return reply


class ProcessWorker(WorkerHandle):
    def __init__(self, spec: WorkerSpec, ctx: BaseContext) -> None:
        super().__init__(spec)
        self._ctx = ctx
        self.process: Any = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def start(self) -> None:
        self._conn, child_conn = self._ctx.Pipe()
        self.process = self._ctx.Process(  # type: ignore[attr-defined]
            target=worker_main,
            args=(child_conn, self.spec),
            name=f"omni-emulator-stage{self.spec.stage_id}-rep{self.spec.replica}",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.last_state = dict(IDLE_STATE)

    def _poll_until(self, deadline: float | None) -> bool:
        assert self._conn is not None
        while deadline is None or time.monotonic() < deadline:
            if self._conn.poll(0.1):
                return True
            if not self.process.is_alive():
                return self._conn.poll(0)
        return False

    def wait_ready(self, deadline: float) -> None:
        if not self._poll_until(deadline):
            raise WorkerDead(f"{self.label} worker did not start within the start-up timeout")
        assert self._conn is not None
        reply = self._conn.recv()
        if not reply.get("ok"):
            raise WorkerDead(f"{self.label} worker failed to start: {reply.get('error')}")
        self.last_state = reply["state"]

    def _dead(self) -> WorkerDead:
        return WorkerDead(f"{self.label} worker process is dead (exit code {self.process.exitcode})")

    def _roundtrip(self, msg: dict[str, Any]) -> dict[str, Any]:
        if not self.alive or self._conn is None:
            raise self._dead()
        try:
            self._conn.send(msg)
            if not self._poll_until(None):
                raise self._dead()
            return self._conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError, BrokenPipeError):
            raise self._dead() from None

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
            self.process.join(5.0)

    def shutdown(self, timeout: float = 3.0) -> None:
        if self.process is None:
            return
        if self.process.is_alive() and self._conn is not None:
            try:
                self._conn.send({"op": "shutdown"})
            except (OSError, BrokenPipeError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class ThreadWorker(WorkerHandle):
    """The command loop of a worker, run in the API process on the synthetic backend."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self._stage: _Stage | None = None
        self._dead_flag = True
        self._timer: threading.Timer | None = None

    @property
    def pid(self) -> int | None:
        return os.getpid()

    @property
    def alive(self) -> bool:
        return not self._dead_flag

    def start(self) -> None:
        self._stage = _Stage(self.spec)
        self._dead_flag = False
        self.last_state = self._stage.state()

    def wait_ready(self, deadline: float) -> None:
        return None

    def _roundtrip(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self._dead_flag or self._stage is None:
            raise WorkerDead(f"{self.label} worker is dead (thread worker killed by a fault)")
        reply = handle(self._stage, msg)
        if msg.get("die_after") and reply["ok"]:
            logger.warning("fault injected (die_after_start %s): worker dies in %.1fs", self.spec.stage_id,
                           DIE_AFTER_START_S)  # fmt: skip
            self._timer = threading.Timer(DIE_AFTER_START_S, self.kill)
            self._timer.daemon = True
            self._timer.start()
        return reply

    def kill(self) -> None:
        self._dead_flag = True

    def shutdown(self, timeout: float = 3.0) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._stage is not None and not self._dead_flag:
            self._stage.shutdown()
        self._dead_flag = True


class StageRuntime:
    """One deploy stage in the API process: its kind, profiler and replica workers."""

    def __init__(
        self, stage_id: int, kind: str, profiler: str | None, workers: list[WorkerHandle],
        profiler_config: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.stage_id = stage_id
        self.kind = kind
        self.profiler = profiler
        self.profiler_config = profiler_config
        self.startup_profiler_config = profiler_config
        self.workers = workers
        self._rr = itertools.cycle(range(len(workers)))

    def next_worker(self) -> WorkerHandle:
        return self.workers[next(self._rr)]

    @property
    def alive(self) -> bool:
        """Some replica is alive (0.30's ``check_health``: a stage with no live replica is dead)."""
        return any(w.alive for w in self.workers)

    def state(self) -> dict[str, Any]:
        states = [w.last_state for w in self.workers]
        sessions: list[str] = []
        for s in states:  # LLM replicas of one call share one folder: list it once
            sessions += [p for p in s["sessions"] if p not in sessions]
        return {
            "kind": self.kind,
            "profiler": self.profiler,
            "profiling": any(s["profiling"] for s in states),
            "active": any(s["active"] for s in states),
            "iterations": sum(s["iterations"] for s in states),
            "sessions": sessions,
            "alive": all(w.alive for w in self.workers),
            "replicas_alive": [w.alive for w in self.workers],
            "pids": [w.pid for w in self.workers],
        }
