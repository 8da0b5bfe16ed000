"""Start and stop an emulator as a child process (tests, demo, benchmarks). Imports no torch and
no FastAPI: it runs ``python -m sidecar.emulator`` and waits for ``GET /emulator/ready`` to answer 200.
Stop is SIGTERM, then SIGKILL of the whole process group, so stage workers never outlive it. A log
it made itself (no ``log_path``) is deleted after a clean stop and kept, and named, otherwise.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from sidecar._process import ManagedProcess, free_port
from sidecar.errors import SidecarError

log = logging.getLogger(__name__)


class EmulatorStartError(SidecarError):
    """The emulator process exited or never became healthy; the message carries its log tail."""

    code = "emulator_start_failed"


class EmulatorProcess(ManagedProcess):
    """One emulator server in a child process; a context manager (start on enter, stop on exit)."""

    name = "emulator"
    # Ready = serving (every worker was ready). Not /health: with a dead stage it is 503, as in 0.30.
    health_path = "/emulator/ready"
    takes_fd = True  # serves on the port the launcher holds from the pick
    start_error = EmulatorStartError
    log_noise = ("USDT:",)  # kineto's chatter says nothing about why a start failed

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
        log_path: Path | str | None = None,
    ) -> None:
        self._own_log = log_path is None  # a temporary log: ours to delete after a clean stop
        if log_path is None:
            # not named by its port: a port left to pick is picked by ManagedProcess
            fd, made = tempfile.mkstemp(prefix="omni-emulator-", suffix=".log")
            os.close(fd)
            log_path = made
        super().__init__(
            host=host, port=port, log_path=Path(log_path), env=env, startup_timeout=startup_timeout,
            stop_grace=stop_grace,
        )
        self.deploy_config = Path(deploy_config)
        self.flavor = flavor
        self.extra_args = list(extra_args)
        self._http: httpx.Client | None = None

    # --- emulator-only test routes (sync; generous timeouts: a reset may respawn workers) ---

    def state(self) -> dict[str, Any]:
        """``GET /emulator/state``."""
        return self._call("GET", "/emulator/state")

    def set_faults(self, **knobs: Any) -> dict[str, Any]:
        """``POST /emulator/faults``: change some fault knobs now (names as in ``Faults``, e.g.
        ``start_500=True``, ``dead_stage=2``, ``stop_delay_s=3``); returns all of them."""
        return self._call("POST", "/emulator/faults", knobs)

    def reset(self, profiler_dirs: Mapping[int, str | Path] | None = None) -> dict[str, Any]:
        """``POST /emulator/reset``: start-up faults, idle profilers, dead workers replaced, empty
        call log; ``profiler_dirs`` points stages (by id) at new trace dirs. Returns the state."""
        body = {"profiler_dirs": {str(k): str(v) for k, v in profiler_dirs.items()}} if profiler_dirs else {}
        return self._call("POST", "/emulator/reset", body)

    @property
    def http(self) -> httpx.Client:
        """A client for this server (base URL set, 120 s timeouts), kept for the process's life:
        building one per request costs ~45 ms of CPU (SSL context, proxy lookup)."""
        if self._http is None:
            self._http = httpx.Client(base_url=self.url, timeout=120, trust_env=False)
        return self._http

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        r = self.http.request(method, path, json=body)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def kill(self) -> int | None:
        if self._http is not None:  # stop() ends here too
            self._http.close()
            self._http = None
        return super().kill()

    def stop(self, grace: float | None = None) -> int | None:
        """As ``ManagedProcess.stop``; then the temporary log goes if the server exited on SIGTERM
        (clean), and stays, named in a warning, if it had to be killed or had failed."""
        started = self._proc is not None
        code = super().stop(grace)
        if self._own_log and started:
            if code in (0, -signal.SIGTERM):
                self.log_path.unlink(missing_ok=True)
            else:
                log.warning("emulator exited with code %s; its log is kept at %s", code, self.log_path)
        return code

    @property
    def command(self) -> list[str]:
        return self.argv()

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "sidecar.emulator",
            "--deploy-config", str(self.deploy_config),
            "--host", self.host,
            "--port", str(self.port),
            "--flavor", self.flavor,
            *self.extra_args,
        ]  # fmt: skip


__all__ = ["EmulatorProcess", "EmulatorStartError", "free_port"]
