"""Start and stop an emulator as a child process (tests, demo, benchmarks). Imports no torch and
no FastAPI: it runs ``python -m sidecar.emulator`` and waits for ``GET /health`` to answer 200.
Stop is SIGTERM, then SIGKILL of the whole process group, so stage workers never outlive it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from sidecar.errors import SidecarError


class EmulatorStartError(SidecarError):
    """The emulator process exited or never became healthy; the message carries its log tail."""

    code = "emulator_start_failed"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmulatorProcess:
    """One emulator server in a child process; a context manager (start on enter, stop on exit)."""

    def __init__(
        self,
        deploy_config: Path | str,
        *,
        flavor: str = "omni",
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 60,
        stop_grace: float = 5.0,
    ) -> None:
        self.deploy_config = Path(deploy_config)
        self.flavor = flavor
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.extra_args = list(extra_args)
        self.env = dict(env) if env is not None else None
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        fd, log = tempfile.mkstemp(prefix=f"omni-emulator-{self.port}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sidecar.emulator",
            "--deploy-config",
            str(self.deploy_config),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--flavor",
            self.flavor,
            *self.extra_args,
        ]

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        # kineto's USDT chatter says nothing about why a start failed
        kept = [ln for ln in text.splitlines() if not ln.startswith("USDT:")]
        return "\n".join(kept[-lines:])

    def start(self) -> EmulatorProcess:
        if self._proc is not None:
            return self
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # The child must import the same `sidecar` as this process, installed or not.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        with open(self.log_path, "ab") as log:
            # Own process group: stop() can kill the workers with the server in one call.
            self._proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _healthy_or_exited(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            return True
        try:
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        wait = Retrying(
            stop=stop_after_delay(self.startup_timeout),
            wait=wait_fixed(0.1),
            retry=retry_if_result(lambda done: not done),
        )
        try:
            wait(self._healthy_or_exited)
        except RetryError:
            raise EmulatorStartError(
                f"emulator did not become healthy within {self.startup_timeout:.0f}s "
                f"(log {self.log_path}):\n{self.log_tail()}"
            ) from None
        code = self._proc.poll()
        if code is not None:
            raise EmulatorStartError(
                f"emulator exited with code {code} during start-up (log {self.log_path}):\n{self.log_tail()}",
                details={"exit_code": code},
            )

    def stop(self) -> int | None:
        """SIGTERM, wait ``stop_grace`` seconds, then SIGKILL the process group. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left in the group (workers of a server that died hard) goes too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = proc.wait()
        self._wait_group_gone(proc.pid)
        return code

    @staticmethod
    def _wait_group_gone(pgid: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def __enter__(self) -> EmulatorProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
