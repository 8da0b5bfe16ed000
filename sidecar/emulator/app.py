"""The emulator's HTTP surface: vLLM-Omni 0.30's ``/start_profile`` / ``/stop_profile`` (or plain
vLLM 0.30's), ``/health``, ``/v1/models``, a minimal ``/v1/chat/completions``, and the
emulator-only ``GET /emulator/state`` for tests. Torch never runs here; workers do the work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sidecar.config.models import DeployConfig
from sidecar.emulator._profiler import VLLM_VERSION
from sidecar.emulator.options import EmulatorOptions, Faults
from sidecar.emulator.worker import StageRuntime, WorkerDead

logger = logging.getLogger("sidecar.emulator")


class ProfileRequest(BaseModel):
    """vllm_omni/entrypoints/serve/profile/protocol.py, verbatim."""

    stages: list[int] | None = Field(default=None)


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]]
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)


class ResetRequest(BaseModel):
    """``POST /emulator/reset``: optionally point stages at new profiler dirs (by stage id)."""

    model_config = ConfigDict(extra="forbid")

    profiler_dirs: dict[int, str] | None = None


class ServerMetrics:
    """The families of the real server's ``/metrics`` that the sidecar reads (sidecar/upstream/
    metrics.py; tests/data/metrics/ holds the real ones, tests/omni/test_emulator_fidelity.py checks
    them against the real server): per engine one ``vllm:iteration_tokens_total`` observation per
    engine step, requests by ``finished_reason``, tokens, and the request latencies (time to first
    token, inter-token, queue, e2e); vLLM labels an engine ``engine``, vLLM-Omni ``stage`` and
    ``replica``. vLLM-Omni also serves its own ``vllm_omni:`` families: the pipeline's e2e latency,
    the final stage's generation time (its results are the ones the API server sees) and each
    hand-over's send time."""

    # vLLM declares every reason's counter at start-up (0.0 on an idle server)
    FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

    def __init__(self, flavor: str, model: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.model = model
        self.steps_run: dict[int, int] = {}  # engine steps per stage so far (the call log's ``steps``)
        self.omni = flavor == "omni"
        labels = ["model_name", "stage", "replica"] if self.omni else ["model_name", "engine"]
        reg = {"registry": self.registry}
        self.steps = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                               labels, buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384), **reg)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], **reg)
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, **reg)
        self.generation = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, **reg)
        request_buckets = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=request_buckets, **reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0), **reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                              5.0, 7.5, 10.0, 20.0, 40.0, 80.0), **reg)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", labels,
                               buckets=request_buckets, **reg)
        if self.omni:  # vllm_omni/metrics/definitions.py
            seconds = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
            self.omni_e2e = Histogram("vllm_omni:e2e_request_latency_s", "Pipeline-global end-to-end request "
                                      "latency in seconds (user arrival to complete response).", ["model_name"],
                                      buckets=seconds, **reg)
            self.stage_gen = Histogram("vllm_omni:stage_gen_time_s", "Per-stage generation time in seconds for "
                                       "diffusion / image stages.", ["model_name", "stage", "stage_type"],
                                       buckets=seconds, **reg)
            self.transfer_tx = Histogram("vllm_omni:transfer_tx_s", "Sender-side time in seconds (serialize + "
                                         "submit to connector).",
                                         ["model_name", "from_stage", "to_stage", "from_replica", "to_replica"],
                                         buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                                  10.0, 60.0), **reg)

    def _labels(self, stage: StageRuntime, replica: int) -> dict[str, str]:
        if self.omni:
            return {"model_name": self.model, "stage": str(stage.stage_id), "replica": str(replica)}
        return {"model_name": self.model, "engine": str(replica)}

    def declare(self, stages: list[StageRuntime]) -> None:
        """Every engine's samples from start-up, at 0, as the real server shows them when idle
        (tests/data/metrics/*-0.prom): a steps window started before the first request finds its
        counter, and an idle window finished no request (0, not unknown)."""
        for stage in stages:
            for worker in stage.workers:
                labels = self._labels(stage, worker.spec.replica)
                for family in (self.steps, self.prompt, self.generation, self.e2e, self.ttft, self.itl, self.queue):
                    family.labels(**labels)
                for reason in self.FINISHED_REASONS:
                    self.success.labels(**labels, finished_reason=reason)
        if self.omni:
            self.omni_e2e.labels(model_name=self.model)

    def request_done(self, stage: StageRuntime, replica: int, steps: int, seconds: float, queued: float) -> None:
        """One request's ``steps`` on a stage replica, ``seconds`` from its first step to its
        last, after ``queued`` seconds waiting (the steps are taken as equally long)."""
        self.steps_run[stage.stage_id] = self.steps_run.get(stage.stage_id, 0) + steps
        labels = self._labels(stage, replica)
        hist = self.steps.labels(**labels)
        for _ in range(steps):
            hist.observe(1)
        self.prompt.labels(**labels).inc(1)
        self.generation.labels(**labels).inc(steps)
        self.success.labels(**labels, finished_reason="length").inc()
        self.e2e.labels(**labels).observe(queued + seconds)
        self.queue.labels(**labels).observe(queued)
        per_step = seconds / max(steps, 1)
        self.ttft.labels(**labels).observe(queued + per_step)
        itl = self.itl.labels(**labels)
        for _ in range(steps - 1):
            itl.observe(per_step)

    def pipeline_done(self, hops: list[tuple[StageRuntime, int]], seconds: float) -> None:
        """vLLM-Omni's own families for one request through ``hops`` (each stage and the replica
        that ran it, in order): the API server sees only the final stage's result."""
        if not self.omni or not hops:
            return
        self.omni_e2e.labels(model_name=self.model).observe(seconds)
        last, _ = hops[-1]
        self.stage_gen.labels(model_name=self.model, stage=str(last.stage_id), stage_type=last.kind).observe(
            seconds)
        for (src, src_rep), (dst, dst_rep) in zip(hops, hops[1:]):
            self.transfer_tx.labels(model_name=self.model, from_stage=str(src.stage_id), to_stage=str(dst.stage_id),
                                    from_replica=str(src_rep), to_replica=str(dst_rep)).observe(0.0005)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Emulator:
    """Everything the routes need: the stages in deploy order, the options, faults, the call log."""

    def __init__(self, deploy: DeployConfig, options: EmulatorOptions, stages: list[StageRuntime]) -> None:
        self.deploy = deploy
        self.options = options
        self.stages = stages
        self.calls: list[dict[str, Any]] = []
        self.faults: Faults = options.faults
        self.metrics_reads = 0  # /metrics reads since the last profiler start (the metrics_delay fault)
        # Held for a whole control call: the real orchestrator dispatches no new request while
        # it is busy with one (docs/design.md §3 "new requests are not dispatched meanwhile").
        self.control = asyncio.Lock()
        self.release_hung = asyncio.Event()  # a reset lets hung stops go
        self.frontend = self._make_frontend()
        self.metrics = ServerMetrics(options.flavor, options.model)
        self.metrics.declare(stages)

    def _make_frontend(self) -> Any:
        """Plain vLLM's ``AsyncLLM`` front-end profiler (API process, CPU), unless
        ``ignore_frontend``. Its trace is synthetic: the API process never imports torch."""
        if self.options.flavor != "vllm" or not self.stages:
            return None
        raw = self.stages[0].profiler_config
        if not raw or raw.get("profiler") != "torch" or raw.get("ignore_frontend"):
            return None
        from sidecar.config.profiler import ProfilerConfig
        from sidecar.emulator._profiler import PlainVllmTorchProfiler
        from sidecar.emulator._synthetic import SyntheticRecorder

        cfg = ProfilerConfig(**raw)
        name = f"{socket.gethostname()}_{os.getpid()}.async_llm"
        return PlainVllmTorchProfiler(cfg, SyntheticRecorder(cfg), name, 0, write_table=False)

    @property
    def profiler_mounted(self) -> bool:
        return any(s.profiler is not None for s in self.stages)

    @property
    def dead_stages(self) -> list[int]:
        return [s.stage_id for s in self.stages if not s.alive]

    async def collective_profile(self, is_start: bool, stage_ids: list[int] | None) -> None:
        """The orchestrator's ``collective_rpc("profile")``: positional stage ids, invalid ones
        skipped with a warning, stages then replicas one after another, no timeout. Whatever a
        replica does (fails, is dead), the loop goes on and the call succeeds: 0.30's
        ``StagePool.collective_rpc`` turns the failure into ``{"supported": False, "error"}``,
        which ``AsyncOmni.start_profile`` / ``stop_profile`` return unchecked."""
        if stage_ids is None:
            targets = list(self.stages)
        else:
            targets = []
            for lid in stage_ids:
                if not (0 <= lid < len(self.stages)):
                    logger.warning("[Orchestrator] collective_rpc: ignoring invalid stage_id %s", lid)
                    continue
                targets.append(self.stages[lid])
        if is_start:
            self.metrics_reads = 0
        async with self.control:
            for stage in targets:
                at = time.time()  # one name for every replica of this stage (they are called within ms)
                die_after = is_start and self.faults.die_after_start == stage.stage_id
                for worker in stage.workers:
                    try:
                        reply = await worker.call("profile", is_start=is_start, at=at, die_after=die_after)
                        error = None if reply["ok"] else reply["error"]
                    except WorkerDead as e:
                        error = f"EngineDeadError: {e}"
                    if error is not None:
                        logger.warning(
                            "[StagePool] collective_rpc failed: stage=%s replica=%s method=profile: %s",
                            stage.stage_id,
                            worker.spec.replica,
                            error,
                        )

    async def dispatch_steps(self, stage: StageRuntime, n: int) -> tuple[dict[str, Any], int]:
        """Hand one request's steps to a stage, once no control call is in progress: the
        worker's reply and the replica that ran them."""
        arrived = time.monotonic()
        async with self.control:
            worker = stage.next_worker()
        t0 = time.monotonic()
        reply = await worker.call("steps", n=n)
        if reply.get("ok"):
            self.metrics.request_done(stage, worker.spec.replica, n, time.monotonic() - t0, t0 - arrived)
        return reply, worker.spec.replica

    async def apply_faults(self, update: dict[str, Any]) -> Faults:
        was_hanging = self.faults.hang_stop
        self.faults = Faults(**{**self.faults.model_dump(), **update})
        if was_hanging and not self.faults.hang_stop:
            # turning the knob off lets the stops it holds reply now (a reset does too)
            self.release_hung.set()
            self.release_hung = asyncio.Event()
        await self._kill_dead_stage()
        return self.faults

    async def _kill_dead_stage(self) -> None:
        sid = self.faults.dead_stage
        for stage in self.stages:
            if stage.stage_id == sid:
                for worker in stage.workers:
                    if worker.alive:
                        logger.warning("fault injected (dead_stage %s): %s worker killed", sid, worker.label)
                        await asyncio.to_thread(worker.kill)

    async def reset(self, request: ResetRequest) -> None:
        """Emulator-only: as if freshly started (start-up faults and trace dirs, idle profilers,
        dead workers replaced, empty call log), optionally with new profiler dirs per stage id."""
        self.release_hung.set()
        dirs = request.profiler_dirs or {}
        async with self.control:
            self.release_hung = asyncio.Event()
            deadline = time.monotonic() + self.options.startup_timeout_s
            for stage in self.stages:
                # a dir given, or else the start-up config (a reset is a fresh start)
                target = stage.startup_profiler_config
                if stage.stage_id in dirs and target is not None:
                    target = {**target, "torch_profiler_dir": dirs[stage.stage_id]}
                reconfigure = target != stage.profiler_config
                stage.profiler_config = target
                for worker in stage.workers:
                    respawned = not worker.alive
                    if respawned:  # its spec holds the start-up config: give it the current one
                        await asyncio.to_thread(worker.respawn, deadline)
                    reply = await worker.call(
                        "reset", profiler_config=stage.profiler_config, reconfigure=reconfigure or respawned
                    )
                    if not reply["ok"]:
                        raise RuntimeError(f"{worker.label}: reset failed: {reply['error']}")
            if self.frontend is not None:
                self.frontend.discard()
            self.frontend = self._make_frontend()
            self.calls.clear()
            self.faults = self.options.faults
        await self._kill_dead_stage()

    def state(self) -> dict[str, Any]:
        return {
            "flavor": self.options.flavor,
            "workers": self.options.workers,
            "stages": {str(s.stage_id): s.state() for s in self.stages},
            "frontend_traces": list(self.frontend.sessions) if self.frontend is not None else [],
            "faults": self.faults.model_dump(),
            "calls": list(self.calls),
        }


def _error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    # vLLM's ErrorResponse shape (vllm/entrypoints/serve/engine/protocol.py).
    body = {"error": {"message": message, "type": HTTPStatus(status).phrase, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error_response(str(exc.detail), exc.status_code)

    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        lines = "".join(f"  {err}\n" for err in errors[:10])
        label = "error" if len(errors) == 1 else "errors"
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0].get("loc") else None
        return _error_response(f"{len(errors)} validation {label}:\n{lines}".rstrip(), 400, param)

    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]


async def _hold_start_reply(emu: Emulator) -> None:
    if emu.faults.start_delay_s:
        await asyncio.sleep(emu.faults.start_delay_s)


async def _hold_metrics_reply(emu: Emulator) -> None:
    emu.metrics_reads += 1
    f = emu.faults
    past = emu.metrics_reads - f.metrics_delay_after
    if f.metrics_delay_s and past > 0 and (not f.metrics_delay_count or past <= f.metrics_delay_count):
        await asyncio.sleep(f.metrics_delay_s)


async def _travel(seconds: float) -> None:
    """A start or stop on its way to the workers (``start_travel_s`` / ``stop_travel_s``)."""
    if seconds:
        await asyncio.sleep(seconds)


async def _hold_stop_reply(emu: Emulator) -> None:
    faults = emu.faults
    if faults.stop_delay_s:
        await asyncio.sleep(faults.stop_delay_s)
    if faults.hang_stop:
        logger.warning("fault injected (hang_stop): this stop does not reply until the emulator is reset "
                       "or hang_stop is turned off")
        await emu.release_hung.wait()


def _omni_profiler_router(emu: Emulator) -> APIRouter:
    router = APIRouter()

    @router.post("/start_profile")
    async def start_profile(raw_request: Request, request: ProfileRequest | None = None) -> JSONResponse:
        stages = request.stages if request else None
        raw_request.state.emulator_stages = stages
        logger.info("Starting profiler for stages: %s", stages if stages else "all")
        try:
            if emu.faults.start_500:
                raise RuntimeError("injected fault (--fault-start-500)")
            await _travel(emu.faults.start_travel_s)
            await emu.collective_profile(True, stages)
        except Exception as e:
            logger.error("Failed to start profiler: %s", e)
            raise HTTPException(status_code=500, detail=f"Failed to start profiler: {e}") from None
        await _hold_start_reply(emu)
        logger.info("Profiler started.")
        return JSONResponse(content={"status": "SUCCESS"})

    @router.post("/stop_profile")
    async def stop_profile(raw_request: Request, request: ProfileRequest | None = None) -> JSONResponse:
        stages = request.stages if request else None
        raw_request.state.emulator_stages = stages
        logger.info("Stopping profiler for stages: %s", stages if stages else "all")
        try:
            if emu.faults.stop_500:
                raise RuntimeError("injected fault (--fault-stop-500)")
            await _travel(emu.faults.stop_travel_s)
            await emu.collective_profile(False, stages)
        except Exception as e:
            logger.error("Failed to stop profiler: %s", e)
            raise HTTPException(status_code=500, detail=f"Failed to stop profiler: {e}") from None
        await _hold_stop_reply(emu)
        logger.info("Profiler stopped.")
        return JSONResponse(content={"status": "SUCCESS"})

    return router


def _vllm_profiler_router(emu: Emulator) -> APIRouter:
    """vllm/entrypoints/serve/profile/api_router.py: no body, empty 200, all workers."""
    router = APIRouter()

    @router.post("/start_profile")
    async def start_profile(raw_request: Request) -> Response:
        if emu.faults.start_500:
            raise HTTPException(status_code=500, detail="Failed to start profiler: injected fault (--fault-start-500)")
        await _travel(emu.faults.start_travel_s)
        await _vllm_profile(emu, True)
        await _hold_start_reply(emu)
        return Response(status_code=200)

    @router.post("/stop_profile")
    async def stop_profile(raw_request: Request) -> Response:
        if emu.faults.stop_500:
            raise HTTPException(status_code=500, detail="Failed to stop profiler: injected fault (--fault-stop-500)")
        await _travel(emu.faults.stop_travel_s)
        await _vllm_profile(emu, False)
        await _hold_stop_reply(emu)
        return Response(status_code=200)

    return router


async def _vllm_profile(emu: Emulator, is_start: bool) -> None:
    """``AsyncLLM.start_profile`` / ``stop_profile``: the engine core's workers and the front-end
    profiler. A dead engine core raises (no stage pool to swallow it): 500."""
    action = "start" if is_start else "stop"
    if is_start:
        emu.metrics_reads = 0
    try:
        async with emu.control:
            if emu.frontend is not None:
                await asyncio.to_thread(emu.frontend.start if is_start else emu.frontend.stop)
            for stage in emu.stages:
                for worker in stage.workers:
                    reply = await worker.call("profile", is_start=is_start)
                    if not reply["ok"]:
                        raise RuntimeError(reply["error"])
    except Exception as e:
        raise HTTPException(status_code=500, detail=f"Failed to {action} profiler: {e}") from None


def _emulator_router(emu: Emulator) -> APIRouter:
    """Emulator-only routes for tests (a real server has none of these)."""
    router = APIRouter(prefix="/emulator")

    @router.get("/ready")
    async def ready() -> dict[str, Any]:
        # Serving means every worker was ready; unlike /health it stays 200 with a dead stage.
        return {"ready": True, "pid": os.getpid()}

    @router.get("/state")
    async def state() -> dict[str, Any]:
        return emu.state()

    @router.get("/faults")
    async def get_faults() -> dict[str, Any]:
        return emu.faults.model_dump()

    @router.post("/faults")
    async def set_faults(update: dict[str, Any]) -> JSONResponse:
        """Change some knobs (the others keep their value); answers all of them."""
        try:
            faults = await emu.apply_faults(update)
        except ValidationError as e:
            return _error_response(f"bad fault settings: {e.errors(include_url=False)}", 400)
        return JSONResponse(faults.model_dump())

    @router.post("/reset")
    async def reset(request: ResetRequest | None = None) -> dict[str, Any]:
        await emu.reset(request or ResetRequest())
        return emu.state()

    return router


def build_app(emu: Emulator) -> FastAPI:
    app = FastAPI(title="omni-sidecar emulator (vLLM-Omni 0.30 stand-in)")
    app.state.emulator = emu
    _install_error_handlers(app)

    @app.middleware("http")
    async def record_calls(request: Request, call_next: Any) -> Any:
        if request.url.path.startswith("/emulator/"):
            return await call_next(request)
        entry: dict[str, Any] = {
            "method": request.method,
            "path": request.url.path,
            "stages": None,
            "status": None,
            "t": time.time(),
            # each stage's engine steps when the call arrived: where in a window a stop landed,
            # apart from how long the server then took with it
            "steps": {str(k): v for k, v in emu.metrics.steps_run.items()},
        }
        emu.calls.append(entry)
        response = await call_next(request)
        entry["stages"] = getattr(request.state, "emulator_stages", None)
        entry["status"] = response.status_code
        return response

    @app.get("/health")
    async def health() -> Response:
        # 0.30: OmniBase.check_health raises EngineDeadError for a stage with no live replica;
        # the Omni route answers 503 {"status": "unhealthy"}. Plain vLLM: empty 200 / 503.
        dead = emu.dead_stages
        if emu.options.flavor == "vllm":
            return Response(status_code=503 if dead else 200)
        if dead:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "healthy"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        # vLLM's route; vLLM-Omni serves vLLM's version there, not its own
        return {"version": VLLM_VERSION}

    if emu.options.flavor != "vllm":
        @app.post("/v1/omni/sleep")
        async def omni_sleep() -> Response:
            # vLLM-Omni's own route (a GET answers 405 there, 404 on plain vLLM); the emulator's
            # engines have no sleep mode, which the real route answers so
            return JSONResponse({"detail": "Engine does not support sleep"}, status_code=501)

    @app.get("/metrics")
    async def metrics() -> Response:
        await _hold_metrics_reply(emu)
        return Response(emu.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": emu.options.model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm-omni" if emu.options.flavor == "omni" else "vllm",
                    "root": emu.options.model,
                    "parent": None,
                    "max_model_len": 4096,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: ChatRequest) -> JSONResponse:
        max_tokens = request.max_tokens or 8
        tokens: list[int] = []
        hops: list[tuple[StageRuntime, int]] = []
        t0 = time.monotonic()
        try:
            for stage in emu.stages:
                n = (request.num_inference_steps or 4) if stage.kind == "diffusion" else max_tokens
                reply, replica = await emu.dispatch_steps(stage, n)
                if not reply["ok"]:
                    raise RuntimeError(reply["error"])
                hops.append((stage, replica))
                if not tokens:
                    tokens = reply["result"]
        except (WorkerDead, RuntimeError) as e:
            return _error_response(f"EngineCore encountered an issue: {e}", 500)
        emu.metrics.pipeline_done(hops, time.monotonic() - t0)
        content = "".join(chr(ord("a") + t % 26) for t in tokens)
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": request.model or emu.options.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": len(tokens), "total_tokens": len(tokens) + 1},
            }
        )

    app.include_router(_emulator_router(emu))

    if emu.profiler_mounted:
        if emu.options.flavor == "omni":
            logger.warning("Profiler endpoints are enabled. This should ONLY be used for local development!")
            app.include_router(_omni_profiler_router(emu))
        else:
            app.include_router(_vllm_profiler_router(emu))
    return app
