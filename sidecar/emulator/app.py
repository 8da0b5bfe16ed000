"""The emulator's HTTP surface: vLLM-Omni 0.30's ``/start_profile`` / ``/stop_profile`` (or plain
vLLM 0.30's), ``/health``, ``/v1/models``, a minimal ``/v1/chat/completions``, and the
emulator-only ``GET /emulator/state`` for tests. Torch never runs here; workers do the work.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from sidecar.config.models import DeployConfig
from sidecar.emulator.options import EmulatorOptions
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


class Emulator:
    """Everything the routes need: the stages in deploy order, the options, the call log."""

    def __init__(self, deploy: DeployConfig, options: EmulatorOptions, stages: list[StageRuntime]) -> None:
        self.deploy = deploy
        self.options = options
        self.stages = stages
        self.calls: list[dict[str, Any]] = []
        # Held for a whole control call: the real orchestrator dispatches no new request while
        # it is busy with one (DESIGN.md §3 "new requests are not dispatched meanwhile").
        self.control = asyncio.Lock()

    @property
    def profiler_mounted(self) -> bool:
        return any(s.profiler is not None for s in self.stages)

    async def collective_profile(self, is_start: bool, stage_ids: list[int] | None) -> None:
        """The orchestrator's ``collective_rpc("profile")``: positional stage ids, invalid ones
        skipped with a warning, stages then replicas one after another, no timeout."""
        if stage_ids is None:
            targets = list(self.stages)
        else:
            targets = []
            for lid in stage_ids:
                if not (0 <= lid < len(self.stages)):
                    logger.warning("[Orchestrator] collective_rpc: ignoring invalid stage_id %s", lid)
                    continue
                targets.append(self.stages[lid])
        dead: list[WorkerDead] = []
        async with self.control:
            for stage in targets:
                for worker in stage.workers:
                    try:
                        reply = await worker.call("profile", is_start=is_start)
                    except WorkerDead as e:
                        # The orchestrator's loop goes on to the next stage and replica whatever one
                        # of them did (orchestrator.py `_handle_collective_rpc`), so the stages after
                        # a dead one are still started/stopped; the failure surfaces once all are done.
                        logger.warning("[StagePool] collective_rpc failed: stage=%s replica=%s method=profile: %s",
                                       stage.stage_id, worker.spec.replica, e)
                        dead.append(e)
                        continue
                    if not reply["ok"]:
                        # StagePool.collective_rpc swallows worker errors into {"supported": False}.
                        logger.warning(
                            "[StagePool] collective_rpc failed: stage=%s replica=%s method=profile: %s",
                            stage.stage_id,
                            worker.spec.replica,
                            reply["error"],
                        )
        if dead:
            # Emulator choice, not 0.30 (see docs/emulator.md): 0.30's StagePool swallows this too
            # and answers SUCCESS; the emulator lets it escape so the failure is visible (HTTP 500).
            raise dead[0]

    async def dispatch_steps(self, stage: StageRuntime, n: int) -> dict[str, Any]:
        """Hand one request's steps to a stage, once no control call is in progress."""
        async with self.control:
            worker = stage.next_worker()
        return await worker.call("steps", n=n)

    def state(self) -> dict[str, Any]:
        return {
            "flavor": self.options.flavor,
            "stages": {str(s.stage_id): s.state() for s in self.stages},
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


def _omni_profiler_router(emu: Emulator) -> APIRouter:
    router = APIRouter()
    opts = emu.options

    @router.post("/start_profile")
    async def start_profile(raw_request: Request, request: ProfileRequest | None = None) -> JSONResponse:
        stages = request.stages if request else None
        raw_request.state.emulator_stages = stages
        logger.info("Starting profiler for stages: %s", stages if stages else "all")
        try:
            if opts.fault_start_500:
                raise RuntimeError("injected fault (--fault-start-500)")
            await emu.collective_profile(True, stages)
        except Exception as e:
            logger.error("Failed to start profiler: %s", e)
            raise HTTPException(status_code=500, detail=f"Failed to start profiler: {e}") from None
        logger.info("Profiler started.")
        return JSONResponse(content={"status": "SUCCESS"})

    @router.post("/stop_profile")
    async def stop_profile(raw_request: Request, request: ProfileRequest | None = None) -> JSONResponse:
        stages = request.stages if request else None
        raw_request.state.emulator_stages = stages
        logger.info("Stopping profiler for stages: %s", stages if stages else "all")
        try:
            await emu.collective_profile(False, stages)
        except Exception as e:
            logger.error("Failed to stop profiler: %s", e)
            raise HTTPException(status_code=500, detail=f"Failed to stop profiler: {e}") from None
        if opts.fault_stop_delay_s:
            await asyncio.sleep(opts.fault_stop_delay_s)
        if opts.fault_hang_stop:
            logger.warning("fault injected (--fault-hang-stop): this stop never replies")
            await asyncio.Event().wait()
        logger.info("Profiler stopped.")
        return JSONResponse(content={"status": "SUCCESS"})

    return router


def _vllm_profiler_router(emu: Emulator) -> APIRouter:
    """vllm/entrypoints/serve/profile/api_router.py: no body, empty 200, all workers."""
    router = APIRouter()
    opts = emu.options

    @router.post("/start_profile")
    async def start_profile(raw_request: Request) -> Response:
        if opts.fault_start_500:
            raise HTTPException(status_code=500, detail="Failed to start profiler: injected fault (--fault-start-500)")
        await _vllm_profile(emu, True)
        return Response(status_code=200)

    @router.post("/stop_profile")
    async def stop_profile(raw_request: Request) -> Response:
        await _vllm_profile(emu, False)
        if opts.fault_stop_delay_s:
            await asyncio.sleep(opts.fault_stop_delay_s)
        if opts.fault_hang_stop:
            await asyncio.Event().wait()
        return Response(status_code=200)

    return router


async def _vllm_profile(emu: Emulator, is_start: bool) -> None:
    action = "start" if is_start else "stop"
    try:
        async with emu.control:
            for stage in emu.stages:
                for worker in stage.workers:
                    reply = await worker.call("profile", is_start=is_start)
                    if not reply["ok"]:
                        raise RuntimeError(reply["error"])
    except Exception as e:
        raise HTTPException(status_code=500, detail=f"Failed to {action} profiler: {e}") from None


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
        }
        emu.calls.append(entry)
        response = await call_next(request)
        entry["stages"] = getattr(request.state, "emulator_stages", None)
        entry["status"] = response.status_code
        return response

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

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
        try:
            for stage in emu.stages:
                n = (request.num_inference_steps or 4) if stage.kind == "diffusion" else max_tokens
                reply = await emu.dispatch_steps(stage, n)
                if not reply["ok"]:
                    raise RuntimeError(reply["error"])
                if not tokens:
                    tokens = reply["result"]
        except (WorkerDead, RuntimeError) as e:
            return _error_response(f"EngineCore encountered an issue: {e}", 500)
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

    @app.get("/emulator/state")
    async def emulator_state() -> dict[str, Any]:
        """Emulator-only introspection for tests (a real server has no such route)."""
        return emu.state()

    if emu.profiler_mounted:
        if emu.options.flavor == "omni":
            logger.warning("Profiler endpoints are enabled. This should ONLY be used for local development!")
            app.include_router(_omni_profiler_router(emu))
        else:
            app.include_router(_vllm_profiler_router(emu))
    return app
