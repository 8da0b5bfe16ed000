"""A server run as a child process on 127.0.0.1 (the emulator, the sidecar): spawn it in its own
process group with output to a log file, wait until its health route answers 200 (tenacity),
and stop it with SIGTERM then SIGKILL of the whole group. A failed start raises the subclass's
error with the log tail. Imports neither torch nor FastAPI.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # typing.Self is 3.11+; the package supports 3.10
    from typing_extensions import Self

import httpx
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from sidecar._child import child_env
from sidecar.errors import SidecarError


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: the OS picks) and listening, to hand to a child."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def inherited_socket(fd: int) -> socket.socket:
    """The listening socket a launcher handed over as ``fd`` (see ``ManagedProcess``), its family and
    type read from the descriptor, kept from this server's own children."""
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    return sock


def serve_uvicorn(app: Any, *, host: str, port: int, fd: int | None, **config: Any) -> Any:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM, on ``fd`` (a listening socket a launcher
    handed over, see ``ManagedProcess``) or else bound to ``host:port``. Returns the server (its
    ``started`` says whether it ever served)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **config))
    if fd is None:
        server.run()
    else:
        server.run(sockets=[inherited_socket(fd)])
    return server


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ManagedProcess:
    """One server in a child process; a context manager (start on enter, stop on exit).
    Subclasses set ``name``, ``health_path`` and ``start_error`` and provide ``argv()``."""

    name: ClassVar[str] = "server"  # how messages call it
    health_path: ClassVar[str] = "/health"
    start_error: ClassVar[type[SidecarError]] = SidecarError
    log_noise: ClassVar[tuple[str, ...]] = ()  # log line prefixes that never explain a failed start
    # The child serves on a listening socket it is handed (``--fd N``): ours do. A server that cannot
    # (vLLM) gets the picked port released just before it is spawned, and must bind it itself.
    takes_fd: ClassVar[bool] = False

    def __init__(
        self,
        *,
        host: str,
        port: int | None,
        log_path: Path,
        env: Mapping[str, str] | None,
        startup_timeout: float,
        stop_grace: float,
    ) -> None:
        self.host = host
        # A port left to pick is bound here, listening, and handed to the child as an open socket
        # (``--fd``, where ``takes_fd``): from the pick to the child's exit no other process can take
        # it. Picked and released, it was taken meanwhile by a server that answered the health check
        # too: a default-group run had one test's emulator served by another test's.
        self._picked = not port
        self._listener: socket.socket | None = None if port else listening_socket(host)
        self.port = port if port else int(self._listener.getsockname()[1])  # type: ignore[union-attr]
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self._proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        kept = [ln for ln in text.splitlines() if not ln.startswith(self.log_noise)] if self.log_noise else text.splitlines()
        return "\n".join(kept[-lines:])

    # A server that binds a picked port itself (not ``takes_fd``) may find it taken: the child exits
    # with EADDRINUSE and a fresh port is tried.
    PORT_ATTEMPTS: ClassVar[int] = 3

    def start(self) -> Self:
        for attempt in range(1, self.PORT_ATTEMPTS + 1):
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                return self._start_once()
            except SidecarError:
                lost = self._picked and not self.takes_fd and attempt < self.PORT_ATTEMPTS and self._lost_port(offset)
                if not lost:
                    raise
                self._proc = None
                self.port = free_port(self.host)
        raise AssertionError("unreachable")

    def _lost_port(self, offset: int) -> bool:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                text = fh.read().decode(errors="replace")
        except OSError:
            return False
        return "address already in use" in text.lower()

    def _start_once(self) -> Self:
        if self._proc is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = child_env({**(self.env or {}), "PYTHONUNBUFFERED": "1"})
        argv, fds = self.argv(), ()
        if not self.takes_fd:
            self._close_listener()  # the child binds the port itself
        elif self._picked:
            # held since the pick; started again after a stop, bound again (refused if another took it)
            try:
                self._listener = self._listener or listening_socket(self.host, self.port)
            except OSError as e:
                raise self.start_error(f"{self.name} cannot listen on {self.host}:{self.port} again: {e}",
                                       details={"port": self.port}) from None
            fds = (self._listener.fileno(),)
            argv += ["--fd", str(fds[0])]
        try:
            with open(self.log_path, "ab") as log:
                # Own process group: a terminal Ctrl-C reaches only the parent, which then stops us in
                # order, and stop() can kill the server's own children with it in one call.
                self._proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    start_new_session=True, pass_fds=fds,
                )  # fmt: skip
        finally:
            self._close_listener()  # the child holds it now; ours would keep the port listening
            # (connections hanging) after the child exits
        try:
            self._wait_healthy()
        except BaseException:
            self.kill()
            raise
        return self

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _healthy_or_exited(self, http: httpx.Client) -> bool:
        if self.returncode is not None:
            return True
        try:
            return http.get(f"{self.url}{self.health_path}").status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_healthy(self) -> None:
        # One client for the whole wait: ``httpx.get`` builds a client (an SSL context, proxy
        # lookup) per call, ~45 ms of CPU each, which polling every 50 ms takes from the child.
        wait = Retrying(
            stop=stop_after_delay(self.startup_timeout),
            wait=wait_fixed(0.05),
            retry=retry_if_result(lambda done: not done),
        )
        try:
            with httpx.Client(timeout=2.0, trust_env=False) as http:
                wait(self._healthy_or_exited, http)
        except RetryError:
            raise self.start_error(
                f"{self.name} did not answer {self.health_path} within {self.startup_timeout:g}s "
                f"(log {self.log_path}):\n{self.log_tail()}",
                details={"log": str(self.log_path)},
            ) from None
        code = self.returncode
        if code is not None:
            raise self.start_error(
                f"{self.name} exited with code {code} during start-up (log {self.log_path}):\n{self.log_tail()}",
                details={"log": str(self.log_path), "exit_code": code, "returncode": code},
            )

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the process to exit on its own; returns its exit code."""
        return self._proc.wait(timeout=timeout) if self._proc is not None else None

    def terminate(self) -> None:
        """Send SIGTERM without waiting (tests watch what happens next)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def stop(self, grace: float | None = None) -> int | None:
        """SIGTERM, wait up to ``grace`` seconds (default ``stop_grace``) for a clean exit, then
        SIGKILL whatever is left of the process group. Returns the exit code."""
        self._close_listener()  # never started: the port it held is free again
        if self._proc is None:
            return None
        self.terminate()
        try:
            self._proc.wait(self.stop_grace if grace is None else grace)
        except subprocess.TimeoutExpired:
            pass
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL the process group: no shutdown hook runs (what a crash looks like)."""
        proc = self._proc
        if proc is None:
            return None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = proc.wait()
        _wait_group_gone(proc.pid)
        return code

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _wait_group_gone(pgid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


__all__ = ["ManagedProcess", "free_port"]
