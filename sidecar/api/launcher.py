"""``SidecarProcess``: runs ``omni-sidecar serve`` as a child process on a free 127.0.0.1 port and
waits until ``GET /healthz`` answers. ``stop()`` sends SIGTERM (the sidecar stops its active
capture before exiting) and kills after a grace period; ``kill()`` is SIGKILL (crash tests).
Output goes to a log file whose tail is quoted when start-up fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from sidecar.errors import SidecarError


class SidecarStartError(SidecarError):
    """The sidecar process exited or never became healthy; the message quotes its log."""

    code = "sidecar_start_failed"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SidecarProcess:
    def __init__(
        self,
        upstream_url: str,
        deploy_config: str | Path,
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
        self.upstream_url = upstream_url
        self.deploy_config = Path(deploy_config)
        self.host = host
        self.port = port or free_port(host)
        self.state_dir = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="omni-sidecar-state-"))
        self.token_file = Path(token_file) if token_file else None
        self.flavor = flavor
        self.artifact_roots = dict(artifact_roots or {})
        self.extra_args = list(extra_args)
        self.env = env
        self.log_path = Path(log_path) if log_path else self.state_dir / f"sidecar-{self.port}.log"
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sidecar", "serve",
            "--upstream", self.upstream_url,
            "--deploy-config", str(self.deploy_config),
            "--host", self.host,
            "--port", str(self.port),
            "--state-dir", str(self.state_dir),
            "--flavor", self.flavor,
        ]  # fmt: skip
        if self.token_file:
            cmd += ["--token-file", str(self.token_file)]
        for server, local in self.artifact_roots.items():
            cmd += ["--artifact-root", f"{server}={local}"]
        return cmd + self.extra_args

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def start(self) -> SidecarProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop/kill)
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        # own session: a terminal Ctrl-C reaches the parent, which then stops us in order (SIGTERM)
        self._proc = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.kill()
            raise
        return self

    def _healthy(self) -> bool:
        if self.returncode is not None:
            raise SidecarStartError(
                f"omni-sidecar serve exited with code {self.returncode} during start-up; log {self.log_path}:\n"
                + self.log_tail(),
                details={"log": str(self.log_path), "returncode": self.returncode},
            )
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    def _wait_healthy(self) -> None:
        retrying = Retrying(
            retry=retry_if_result(lambda ok: not ok),
            stop=stop_after_delay(self.startup_timeout),
            wait=wait_fixed(0.1),
            retry_error_callback=lambda _: False,
            reraise=True,
        )
        if not retrying(self._healthy):
            raise SidecarStartError(
                f"omni-sidecar serve did not answer /healthz within {self.startup_timeout:g}s; log {self.log_path}:\n"
                + self.log_tail(),
                details={"log": str(self.log_path)},
            )

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the process to exit on its own; returns its exit code."""
        if self._proc is None:
            return None
        return self._proc.wait(timeout=timeout)

    def terminate(self) -> None:
        """Send SIGTERM without waiting (tests watch what happens next)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``grace`` seconds (the active capture is stopped first), then SIGKILL."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._close_log()
        return self._proc.returncode

    def kill(self) -> int | None:
        """SIGKILL: no shutdown hook runs (what a crash looks like)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._close_log()
        return self._proc.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["SidecarProcess", "SidecarStartError", "free_port"]
