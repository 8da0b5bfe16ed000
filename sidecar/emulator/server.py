"""Run the emulator: load the deploy file the way vLLM-Omni 0.30 does (refusing what it refuses),
spawn one worker per stage replica, wait until all are ready, then serve HTTP under uvicorn.
Workers are shut down when the server stops; they also die with this process on SIGKILL.
"""

from __future__ import annotations

import logging
import sys
import time

from sidecar.config.models import DeployConfig, StageKind
from sidecar.emulator.launcher import EmulatorStartError
from sidecar.emulator.options import EmulatorOptions
from sidecar.emulator.worker import StageRuntime, WorkerDead, WorkerHandle, WorkerSpec
from sidecar.errors import ConfigError
from sidecar.errors import NoStages

logger = logging.getLogger("sidecar.emulator")


def load_deploy(options: EmulatorOptions) -> DeployConfig:
    """The deploy file as the real 0.30 server reads it; only what it refuses is refused."""
    from sidecar.config.deploy import load_deploy_config

    deploy = load_deploy_config(options.deploy_config, platform="cuda")
    refusals = [f for f in deploy.findings if f.is_error or f.code == "legacy_schema"]
    if refusals:
        raise ConfigError.relay(
            refusals[0].code,
            f"vLLM-Omni 0.30 refuses this deploy file: {refusals[0].message}",
            where=refusals[0].where,
        )
    if not deploy.stages:
        raise NoStages(f"{deploy.path}: no stages (add a top-level `stages:` list)")
    return deploy


def _stage_kind(stage_id: int, kind: StageKind, options: EmulatorOptions) -> str:
    if stage_id in options.diffusion_stages or kind is StageKind.diffusion:
        return "diffusion"
    return "llm"  # DESIGN.md §5: every stage is an LLM stage unless told otherwise


def plan_stages(deploy: DeployConfig, options: EmulatorOptions) -> list[StageRuntime]:
    stages = deploy.stages[:1] if options.flavor == "vllm" else deploy.stages
    runtimes: list[StageRuntime] = []
    for stage in stages:
        kind = "llm" if options.flavor == "vllm" else _stage_kind(stage.stage_id, stage.kind, options)
        cfg = stage.profiler_config.model_dump() if stage.profiler_config else None
        replicas = 1 if options.flavor == "vllm" else max(1, stage.num_replicas)
        workers = [
            WorkerHandle(
                WorkerSpec(
                    stage_id=stage.stage_id,
                    kind=kind,
                    profiler_config=cfg,
                    replica=r,
                    rank=0,
                    flavor=options.flavor,
                    step_ms=options.step_ms,
                    gzip_delay_s=options.gzip_delay_s,
                    die_after_start=options.fault_dead_stage == stage.stage_id,
                    die_after_profile_start=options.fault_die_after_start == stage.stage_id,
                )
            )
            for r in range(replicas)
        ]
        runtimes.append(StageRuntime(stage.stage_id, kind, stage.profiler, workers))
    return runtimes


def _shutdown(stages: list[StageRuntime]) -> None:
    for stage in stages:
        for worker in stage.workers:
            worker.shutdown()


def serve(options: EmulatorOptions) -> None:
    """Block serving until SIGINT/SIGTERM. Raises ``SidecarError`` for a refused deploy file."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    deploy = load_deploy(options)
    stages = plan_stages(deploy, options)
    t0 = time.monotonic()
    try:
        for stage in stages:  # spawn all first: their torch imports overlap
            for worker in stage.workers:
                worker.start()
        # FastAPI and uvicorn load while the workers import torch.
        import uvicorn

        from sidecar.emulator.app import Emulator, build_app

        deadline = time.monotonic() + options.startup_timeout_s
        for stage in stages:
            for worker in stage.workers:
                worker.wait_ready(deadline)
    except WorkerDead as e:
        _shutdown(stages)
        raise EmulatorStartError(str(e)) from None
    logger.info(
        "emulator: %d stage worker(s) ready in %.1fs (flavor %s, stages %s)",
        sum(len(s.workers) for s in stages),
        time.monotonic() - t0,
        options.flavor,
        [f"{s.stage_id}:{s.kind}:{s.profiler}" for s in stages],
    )
    emu = Emulator(deploy, options, stages)
    app = build_app(emu)
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level="warning",
        timeout_graceful_shutdown=2,
        access_log=False,
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        _shutdown(stages)
    if not server.started:
        raise EmulatorStartError(f"could not serve on {options.host}:{options.port} (port in use?)")
