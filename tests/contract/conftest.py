"""Module-wide handles on the real packages (imports take ~10 s, so they are done once)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def bundled_deploy_dir() -> Path | None:
    """vllm_omni/deploy/ without importing vllm_omni (collection must stay cheap)."""
    try:
        spec = importlib.util.find_spec("vllm_omni")
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "deploy"


@pytest.fixture(scope="session")
def vllm_profiler_config() -> type:
    return pytest.importorskip("vllm.config", reason="vllm 0.30 not installed (pip install -e '.[vllm]')").ProfilerConfig


@pytest.fixture(scope="session")
def omni_stage_config():
    return pytest.importorskip(
        "vllm_omni.config.stage_config", reason="vllm-omni 0.30 not installed (pip install -e '.[vllm]')"
    )
