"""Lazy re-exports for package ``__init__`` files (PEP 562): a name is imported from its module on
first use, so importing a package (or one light submodule of it, e.g. ``sidecar.control.models``)
does not pull the heavy rest (the controller, the analysis pool, httpx). One rule, used by
``sidecar``, ``sidecar.control`` and ``sidecar.analysis``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any],
                 modules: Mapping[str, Iterable[str]]) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` of ``package``: ``modules`` maps each module to the public names
    it defines. A resolved name is kept in ``namespace`` (the package's globals), so it is looked
    up once. An unknown name raises ``AttributeError``, which lets ``from package import submodule``
    fall through to the import of the submodule."""
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return sorted(exports), __getattr__
