"""Module-wide handles on the real packages (imports take ~10 s, so they are done once)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

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


def installed_vllm_dump(dump: dict[str, Any]) -> dict[str, Any]:
    """Our ProfilerConfig dump (the newest known vLLM's fields) as the installed vllm's class has it:
    the fields that version lacks (sidecar/versions.py) left out, each of them unset here (a config
    that set one would not load on it)."""
    import vllm

    from sidecar.versions import Release, vllm_dialect

    missing = vllm_dialect(Release.parse(vllm.__version__)).profiler_fields_missing
    assert all(dump.get(k) is None for k in missing), {k: dump.get(k) for k in missing}
    return {k: v for k, v in dump.items() if k not in missing}


@pytest.fixture(scope="session")
def vllm_profiler_config() -> type:
    return pytest.importorskip("vllm.config", reason="vllm 0.30 not installed (pip install -e '.[vllm]')").ProfilerConfig


@pytest.fixture(scope="session")
def omni_stage_config():
    return pytest.importorskip(
        "vllm_omni.config.stage_config", reason="vllm-omni 0.30 not installed (pip install -e '.[vllm]')"
    )
