"""Lets the registry's torchvision and torchaudio (CUDA builds) import beside CPU torch, without
their compiled ops. Installed as a ``.pth`` line by tools/omni-cpu-env.sh; imports nothing heavy.

vLLM-Omni's import chain needs both to import (transformers' image utils import
``torchvision.io``; vLLM-Omni's audio code imports ``torchaudio``), but none of their compiled ops
run for a text or DDPM stage. Their extensions link ``libc10_cuda.so``, which CPU torch lacks:
- torchvision: ``_C`` fails quietly, then ``torchvision/_meta_registrations.py`` fails the import
  while registering fake kernels for ops that were never defined ("operator torchvision::nms does
  not exist"). That one module is executed as an empty one.
- torchaudio: ``_extension.utils._load_lib`` raises ``OSError`` for ``_torchaudio.so``; made to
  answer "not available" (False), the state torchaudio already handles for a build without it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

_EMPTY = "torchvision._meta_registrations"
_AUDIO_LOADER = "torchaudio._extension.utils"


class _EmptyModule(importlib.abc.Loader):
    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        module.__doc__ = "skipped by omni_cpu_platform: no torchvision ops on CPU torch"


def _tolerant(load_lib: Any) -> Any:
    def load(lib: str) -> bool:
        try:
            return load_lib(lib)
        except OSError:
            return False

    return load


class _CudaWheelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == _EMPTY:
            return importlib.machinery.ModuleSpec(name, _EmptyModule())
        if name != _AUDIO_LOADER:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            module._load_lib = _tolerant(module._load_lib)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if not any(type(f).__name__ == "_CudaWheelsFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, _CudaWheelsFinder())
