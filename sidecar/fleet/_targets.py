"""Targets: one replica to profile (a sidecar URL, or an upstream server driven in-process) and
the parsing of target lists, refused before anything is sent (``FleetInvalid``)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from sidecar.errors import TargetDuplicate, TargetInvalid, TargetsEmpty
from sidecar.urls import http_url, without_query

Flavor = Literal["omni", "vllm"]


class TargetKind(str, Enum):
    sidecar = "sidecar"  # an `omni-sidecar serve` in front of the server (HTTP API)
    upstream = "upstream"  # the vLLM-Omni server itself, driven in-process by a CaptureController
    ray = "ray"  # the server driven by a CaptureController in a Ray actor on its node (sidecar/fleet/_ray.py)


def _normalize_url(url: str) -> str:
    normal = http_url(url)
    if normal is None:
        text = str(url).strip()
        raise TargetInvalid(
            f"target {text!r} is not an http(s) URL; write e.g. sidecar=http://10.0.0.5:8092 "
            "or upstream=http://10.0.0.5:8091",
            details={"target": text},
        )
    if (base := without_query(normal)) is not None:
        raise TargetInvalid(f"target {str(url).strip()!r} has a query or a fragment, which no route can follow; "
                            f"write its address alone, e.g. {base}", details={"target": str(url).strip()})
    return normal


class Target(BaseModel):
    """One replica to profile. Build with :meth:`sidecar`, :meth:`upstream` or :meth:`parse`.

    String form (CLI, config files): ``sidecar=URL`` or ``upstream=URL``; a bare URL is a sidecar.
    Upstream targets need the server's deploy YAML (what the controller validates stages against
    and where it looks for traces).
    """

    model_config = ConfigDict(frozen=True)

    kind: TargetKind
    url: str
    token: str | None = Field(default=None, repr=False, exclude=True)
    deploy_config: Path | None = None
    flavor: Flavor = "omni"
    platform: str = "cuda"

    @classmethod
    def sidecar(cls, url: str, token: str | None = None) -> Target:
        return cls(kind=TargetKind.sidecar, url=_normalize_url(url), token=token)

    @classmethod
    def upstream(
        cls, url: str, deploy_config: str | Path, *, flavor: Flavor = "omni", platform: str = "cuda"
    ) -> Target:
        if flavor not in ("omni", "vllm"):
            raise TargetInvalid(f"flavor must be 'omni' or 'vllm', got {flavor!r}")
        if deploy_config is None:
            raise TargetInvalid(
                f"upstream target {url} needs the server's deploy YAML (deploy_config=..., or "
                "--deploy-config on the CLI)",
                details={"target": url},
            )
        return cls(
            kind=TargetKind.upstream,
            url=_normalize_url(url),
            deploy_config=Path(deploy_config),
            flavor=flavor,
            platform=platform,
        )

    @classmethod
    def ray(cls, url: str, *, flavor: Flavor = "vllm") -> Target:
        """A server whose controller runs on its node in a Ray actor: built in code (the verl
        integration), driven by a ``Fleet(..., drivers=RayNodes(...))`` that places it."""
        if flavor not in ("omni", "vllm"):
            raise TargetInvalid(f"flavor must be 'omni' or 'vllm', got {flavor!r}")
        return cls(kind=TargetKind.ray, url=_normalize_url(url), flavor=flavor)

    @classmethod
    def parse(
        cls,
        text: str | Target,
        *,
        deploy_config: str | Path | None = None,
        flavor: Flavor = "omni",
        platform: str = "cuda",
        token: str | None = None,
    ) -> Target:
        """``sidecar=URL`` | ``upstream=URL`` | ``URL`` (a sidecar). ``deploy_config``/``flavor``
        apply to upstream targets, ``token`` to sidecar targets."""
        if isinstance(text, Target):
            return text
        if not isinstance(text, str):
            raise TargetInvalid(
                f"a target is a Target or a string like sidecar=http://h:8092, got {type(text).__name__}",
            )
        raw = text.strip()
        kind, sep, url = raw.partition("=")
        if not sep or "://" in kind:  # a bare URL (a query string may hold '=' too)
            kind, url = "sidecar", raw
        kind = kind.strip().lower()
        if kind == "sidecar":
            return cls.sidecar(url, token=token)
        if kind == "upstream":
            return cls.upstream(url, deploy_config, flavor=flavor, platform=platform)  # type: ignore[arg-type]
        raise TargetInvalid(
            f"unknown target kind {kind!r} in {raw!r}; write sidecar=URL or upstream=URL",
            details={"target": raw},
        )

    @property
    def name(self) -> str:
        return f"{self.kind.value}={self.url}"

    def __str__(self) -> str:
        return self.name


def server_key(url: str) -> str:
    u = httpx.URL(url)
    host = (u.host or "").lower()
    if host in ("localhost", "::1"):
        host = "127.0.0.1"
    port = u.port or (443 if u.scheme == "https" else 80)
    return f"{host}:{port}{u.path.rstrip('/')}"


def parse_targets(
    targets: Iterable[str | Target] | str,
    *,
    deploy_config: str | Path | None = None,
    flavor: Flavor = "omni",
    platform: str = "cuda",
    token: str | None = None,
) -> list[Target]:
    """Targets from objects or strings (a comma-separated string too). Refuses an empty list and
    duplicates (the same server twice would be started twice: the second start of vLLM-Omni opens
    an empty session folder)."""
    if isinstance(targets, str):
        targets = [t for t in targets.split(",") if t.strip()]
    elif isinstance(targets, (bytes, Target)) or not isinstance(targets, Iterable):
        raise TargetInvalid(
            f"targets must be a list of replicas (URLs such as sidecar=http://10.0.0.5:8092, or Target objects) "
            f"or one comma-separated string of them, got {targets!r}", details={"targets": repr(targets)},
        )
    parsed = [
        Target.parse(t, deploy_config=deploy_config, flavor=flavor, platform=platform, token=token) for t in targets
    ]
    if not parsed:
        raise TargetsEmpty(
            "the target list is empty; name at least one replica, e.g. sidecar=http://10.0.0.5:8092",
        )
    seen: dict[str, Target] = {}
    dupes: list[str] = []
    for t in parsed:
        key = server_key(t.url)
        if key in seen:
            dupes.append(f"{seen[key].name} and {t.name}")
        else:
            seen[key] = t
    if dupes:
        raise TargetDuplicate(
            f"the same server is listed more than once: {'; '.join(dupes)}; list each replica once",
            details={"duplicates": dupes},
        )
    return parsed
