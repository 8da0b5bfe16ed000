"""Run the emulator: load the deploy file the way vLLM-Omni 0.30 does (refusing what it refuses),
spawn one worker per stage replica, wait until all are ready, then serve HTTP under uvicorn.
Workers are shut down when the server stops; they also die with this process on SIGKILL.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from sidecar._process import serve_uvicorn
from sidecar.config.models import DeployConfig, StageKind
from sidecar.emulator.launcher import EmulatorStartError
from sidecar.emulator.options import EmulatorOptions
from sidecar.emulator.worker import (
    ProcessWorker,
    StageRuntime,
    ThreadWorker,
    WorkerDead,
    WorkerHandle,
    WorkerSpec,
    worker_context,
)
from sidecar.errors import ConfigError
from sidecar.errors import NoStages, StageUnknown

logger = logging.getLogger("sidecar.emulator")


def load_deploy(options: EmulatorOptions) -> DeployConfig:
    """The deploy file as the real 0.30 server reads it; only what it refuses is refused."""
    from sidecar.config.deploy import load_deploy_config

    deploy = load_deploy_config(
        options.deploy_config,
        platform="cuda",
        stage_overrides=options.stage_overrides,
        profiler_config=options.profiler_config,
    )
    refusals = [f for f in deploy.findings if f.is_error or f.code == "legacy_schema"]
    if refusals:
        raise ConfigError.relay(
            refusals[0].code,
            f"vLLM-Omni 0.30 refuses this deploy file: {refusals[0].message}",
            where=refusals[0].where,
        )
    if not deploy.stages:
        raise NoStages(f"{deploy.path}: no stages (add a top-level `stages:` list)")
    ids = sorted(s.stage_id for s in deploy.stages)
    named = {"--diffusion-stages": options.diffusion_stages, "--idle-after-request": list(options.idle_after_request),
             "--fault-dead-stage": [options.fault_dead_stage], "--fault-die-after-start": [options.fault_die_after_start]}
    for option, stages in named.items():
        unknown = [s for s in stages if s is not None and s not in ids]
        if unknown:  # else the option would do nothing, and a test relying on it would prove nothing
            raise StageUnknown(f"{option} names stage {unknown[0]}, which {deploy.path} does not have "
                               f"(its stages: {', '.join(map(str, ids))})", details={"option": option, "stage": unknown[0]})
    return deploy


def _stage_kind(stage_id: int, kind: StageKind, options: EmulatorOptions) -> str:
    if stage_id in options.diffusion_stages or kind is StageKind.diffusion:
        return "diffusion"
    return "llm"  # docs/design.md §5: every stage is an LLM stage unless told otherwise


def plan_stages(deploy: DeployConfig, options: EmulatorOptions) -> list[StageRuntime]:
    stages = deploy.stages[:1] if options.flavor == "vllm" else deploy.stages
    torch_profiler = any(s.profiler == "torch" for s in stages)
    ctx = worker_context(options.worker_start, torch_profiler) if options.workers == "process" else None
    instance_id = str(time.time_ns())  # plain vLLM's VllmConfig.instance_id, one per server
    runtimes: list[StageRuntime] = []
    for stage in stages:
        kind = "llm" if options.flavor == "vllm" else _stage_kind(stage.stage_id, stage.kind, options)
        cfg = stage.profiler_config.model_dump() if stage.profiler_config else None
        replicas = 1 if options.flavor == "vllm" else max(1, stage.num_replicas)
        workers: list[WorkerHandle] = []
        for r in range(replicas):
            spec = WorkerSpec(
                stage_id=stage.stage_id,
                kind=kind,
                profiler_config=cfg,
                replica=r,
                rank=0,  # every replica is rank 0 of its own engine
                flavor=options.flavor,
                step_ms=options.step_ms,
                idle_after=options.idle_after_request.get(stage.stage_id, 0) if kind == "llm" else 0,
                gzip_delay_s=options.gzip_delay_s,
                backend="torch" if ctx is not None else "synthetic",
                instance_id=instance_id,
                platform=options.platform,
            )
            workers.append(ProcessWorker(spec, ctx) if ctx is not None else ThreadWorker(spec))
        runtimes.append(StageRuntime(stage.stage_id, kind, stage.profiler, workers, cfg))
    return runtimes


def _start_all(stages: list[StageRuntime], errors: list[BaseException]) -> None:
    try:
        for stage in stages:
            for worker in stage.workers:
                worker.start()
    except BaseException as e:  # reported by the main thread
        errors.append(e)


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
        # Start the workers in a thread (with a forkserver, the first start waits for its torch
        # import) while FastAPI and uvicorn load here.
        errors: list[BaseException] = []
        starting = threading.Thread(target=_start_all, args=(stages, errors), name="start-workers")
        starting.start()
        import uvicorn  # noqa: F401  (loaded here, beside the workers' start)

        from sidecar.emulator.app import Emulator, build_app

        starting.join()
        if errors:
            raise WorkerDead(f"a stage worker could not be started: {errors[0]!r}")

        deadline = time.monotonic() + options.startup_timeout_s
        for stage in stages:
            for worker in stage.workers:
                worker.wait_ready(deadline)
    except WorkerDead as e:
        _shutdown(stages)
        raise EmulatorStartError(str(e)) from None
    logger.info(
        "emulator: %d stage worker(s) ready in %.1fs (flavor %s, %s workers%s, stages %s)",
        sum(len(s.workers) for s in stages),
        time.monotonic() - t0,
        options.flavor,
        options.workers,
        f" via {options.worker_start}" if options.workers == "process" else "",
        [f"{s.stage_id}:{s.kind}:{s.profiler}" for s in stages],
    )
    emu = Emulator(deploy, options, stages)
    for stage in stages:  # --fault-dead-stage: the stage's workers die once start-up is done
        if stage.stage_id == options.fault_dead_stage:
            for worker in stage.workers:
                logger.warning("fault injected (--fault-dead-stage %s): %s worker killed", stage.stage_id, worker.label)
                worker.kill()
    app = build_app(emu)
    try:
        server = serve_uvicorn(app, host=options.host, port=options.port, fd=options.fd, log_level="warning",
                               timeout_graceful_shutdown=2, access_log=False)
    finally:
        _shutdown(stages)
    if not server.started:
        raise EmulatorStartError(f"could not serve on {options.host}:{options.port} (port in use?)")
