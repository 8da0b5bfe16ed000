"""Sidecar settings: one pydantic-settings model read from ``OMNI_SIDECAR_*`` environment variables
(e.g. ``OMNI_SIDECAR_UPSTREAM_URL``, ``OMNI_SIDECAR_ARTIFACT_ROOTS='{"/srv/traces": "/mnt/traces"}'``)
and overridden by CLI flags. Pure data: the upstream and control layers build their objects from it.
"""

from __future__ import annotations

from pathlib import Path
import json
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sidecar.errors import ArtifactRootInvalid, TokenFileUnreadable


def default_state_dir() -> Path:
    return Path.home() / ".local" / "state" / "omni-sidecar"


def parse_artifact_root(text: str) -> tuple[str, str]:
    """``SERVER_PATH=LOCAL_PATH`` (the ``--artifact-root`` flag) → ``(server, local)``."""
    server, sep, local = text.partition("=")
    if not sep or not server.strip() or not local.strip():
        raise ArtifactRootInvalid(
            f"--artifact-root {text!r} is not SERVER_PATH=LOCAL_PATH; e.g. "
            "--artifact-root /workspace/traces=/mnt/server-traces",
            key="artifact_roots",
        )
    return server.strip(), local.strip()


class SidecarSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OMNI_SIDECAR_", extra="ignore")

    # upstream
    upstream_url: str = "http://127.0.0.1:8000"
    flavor: Literal["omni", "vllm"] = "omni"
    deploy_config: Path | None = None  # the server's deploy YAML (same file `vllm serve` reads)
    platform: str = "cuda"  # which `platforms.<name>` overlay of the deploy YAML applies
    # HTTP surface
    host: str = "127.0.0.1"
    port: int = Field(default=8092, ge=0, le=65535)
    token_file: Path | None = None  # bearer token for mutating routes (file content, stripped)
    # state
    state_dir: Path = Field(default_factory=default_state_dir)
    # upstream timeouts, seconds
    connect_timeout_s: float = Field(default=5, gt=0)
    start_timeout_s: float = Field(default=300, gt=0)
    stop_timeout_s: float = Field(default=1800, gt=0)
    probe_timeout_s: float = Field(default=5, gt=0)
    stop_budget_s: float = Field(default=1800, gt=0)  # total time stop is retried for
    # captures
    collect_timeout_s: float = Field(default=120, ge=0)
    settle_s: float = Field(default=1.0, ge=0)
    # SERVER_PATH -> LOCAL_PATH; from the environment as JSON or as SERVER=LOCAL[,SERVER=LOCAL]
    artifact_roots: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    default_lease_s: float | None = Field(default=None, gt=0)
    max_duration_s: float | None = Field(default=None, gt=0)
    close_timeout_s: float = Field(default=60, ge=0)  # how long shutdown waits for a stop

    @field_validator("artifact_roots", mode="before")
    @classmethod
    def _roots_from_pairs(cls, value: object) -> object:
        # Accept the flag's SERVER=LOCAL form (a string or list of them) besides a mapping.
        if isinstance(value, str):
            if value.lstrip().startswith("{"):
                return json.loads(value)
            value = [p for p in value.split(",") if p.strip()]
        if isinstance(value, (list, tuple)):
            return dict(parse_artifact_root(str(p)) for p in value)
        return value

    def read_token(self) -> str | None:
        """The bearer token from ``token_file`` (None when not configured)."""
        if self.token_file is None:
            return None
        try:
            token = self.token_file.expanduser().read_text().strip()
        except OSError as exc:
            raise TokenFileUnreadable(
                f"cannot read --token-file {self.token_file}: {exc.strerror}; create it or drop the flag",
                key="token_file",
            ) from None
        if not token:
            raise TokenFileUnreadable(
                f"--token-file {self.token_file} is empty; write a token into it or drop the flag",
                key="token_file",
            )
        return token
