"""Each supported vLLM's own ``ProfilerConfig``, without installing it: ``vllm/config/profiler.py``
copied verbatim out of each wheel into tests/data/vllm_profiler/<major.minor>.py
(tools/vllm-profiler-configs.sh), executed here under a stand-in ``vllm`` package that holds only
what that file imports: ``vllm.config.utils.config`` (vLLM's decorator, the same three lines: a
pydantic dataclass whose extra keys are forbidden), ``CompileFactors`` (0.34), ``init_logger`` (with its ``*_once``) and
``safe_hash``. The stand-in lives in a private module namespace and never in ``sys.modules`` past the
load, so an installed vllm is untouched."""

from __future__ import annotations

import hashlib
import logging
import sys
import types
from pathlib import Path
from typing import Any

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_profiler"
VERSIONS = tuple(sorted((p.stem for p in DATA.glob("*.py")), key=lambda v: tuple(int(x) for x in v.split("."))))


def _config(cls: Any = None, *, config: ConfigDict | None = None, **kwargs: Any) -> Any:
    merged = ConfigDict(extra="forbid")  # vllm/config/utils.py: "Extra fields are forbidden by default"
    if config is not None:
        merged.update(config)

    def decorator(c: Any) -> Any:
        return dataclass(c, config=merged, **kwargs)

    return decorator if cls is None else decorator(cls)


class _Logger(logging.LoggerAdapter):  # vllm.logger's warning_once / info_once: logged each time here
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)

    def info_once(self, *args: Any, **kwargs: Any) -> None:
        self.info(*args, **kwargs)


def _stand_in() -> dict[str, types.ModuleType]:
    mods = {name: types.ModuleType(name) for name in
            ("vllm", "vllm.config", "vllm.config.utils", "vllm.logger", "vllm.utils", "vllm.utils.hashing")}
    mods["vllm.config.utils"].config = _config  # type: ignore[attr-defined]
    mods["vllm.config.utils"].CompileFactors = dict[str, object]  # type: ignore[attr-defined]
    mods["vllm.logger"].init_logger = lambda name: _Logger(logging.getLogger(name), {})  # type: ignore[attr-defined]
    mods["vllm.utils.hashing"].safe_hash = lambda data, usedforsecurity=True: hashlib.sha256(data)  # type: ignore[attr-defined]
    return mods


def load(version: str) -> type:
    """``ProfilerConfig`` of vLLM ``version`` (major.minor), from its own file."""
    source = (DATA / f"{version}.py").read_text()
    name = f"_vllm_profiler_{version.replace('.', '_')}"
    module = types.ModuleType(name)
    module.__file__ = str(DATA / f"{version}.py")
    saved = {k: sys.modules.get(k) for k in _stand_in()}
    sys.modules.update(_stand_in())
    sys.modules[name] = module  # pydantic resolves the file's annotations through its module
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module.ProfilerConfig
