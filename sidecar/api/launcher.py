"""``SidecarProcess``: runs ``omni-sidecar serve`` as a child process on a free 127.0.0.1 port and
waits until ``GET /healthz`` answers. ``stop()`` sends SIGTERM (the sidecar stops its active
capture before exiting) and kills after a grace period; ``kill()`` is SIGKILL (crash tests).
Output goes to a log file whose tail is quoted when start-up fails.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sidecar._process import ManagedProcess, free_port
from sidecar.errors import SidecarError


class SidecarStartError(SidecarError):
    """The sidecar process exited or never became healthy; the message quotes its log."""

    code = "sidecar_start_failed"


class SidecarProcess(ManagedProcess):
    name = "omni-sidecar serve"
    health_path = "/healthz"
    takes_fd = True  # serves on the port the launcher holds from the pick
    start_error = SidecarStartError

    def __init__(
        self,
        upstream_url: str,
        deploy_config: str | Path | None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        state_dir: str | Path | None = None,
        token_file: str | Path | None = None,
        flavor: str = "omni",
        artifact_roots: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        state = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="omni-sidecar-state-"))
        log = Path(log_path) if log_path else state / "sidecar.log"
        # A long grace: on SIGTERM the sidecar first stops its active capture upstream. A port left
        # to pick is picked and held by ManagedProcess (the child gets the listening socket).
        super().__init__(host=host, port=port, log_path=log, env=env, startup_timeout=startup_timeout, stop_grace=30.0)
        self.upstream_url = upstream_url
        self.deploy_config = Path(deploy_config) if deploy_config is not None else None
        self.state_dir = state
        self.token_file = Path(token_file) if token_file else None
        self.flavor = flavor
        self.artifact_roots = dict(artifact_roots or {})
        self.extra_args = list(extra_args)

    def command(self) -> list[str]:
        return self.argv()

    def argv(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sidecar", "serve",
            "--upstream", self.upstream_url,
            "--host", self.host,
            "--port", str(self.port),
            "--state-dir", str(self.state_dir),
            "--flavor", self.flavor,
        ]  # fmt: skip
        if self.deploy_config is not None:  # plain vLLM: --profiler-config in extra_args instead
            cmd += ["--deploy-config", str(self.deploy_config)]
        if self.token_file:
            cmd += ["--token-file", str(self.token_file)]
        for server, local in self.artifact_roots.items():
            cmd += ["--artifact-root", f"{server}={local}"]
        return cmd + self.extra_args

    def start(self) -> SidecarProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        return super().start()


__all__ = ["SidecarProcess", "SidecarStartError", "free_port"]
