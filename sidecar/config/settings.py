"""Sidecar settings: one pydantic-settings model read from ``OMNI_SIDECAR_*`` environment variables
(e.g. ``OMNI_SIDECAR_UPSTREAM_URL``, ``OMNI_SIDECAR_ARTIFACT_ROOTS='{"/srv/traces": "/mnt/traces"}'``)
and overridden by CLI flags. Pure data: the upstream and control layers build their objects from it.
"""

from __future__ import annotations

from pathlib import Path
import json
import os
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sidecar.errors import ArtifactRootInvalid, TokenFileUnreadable
from sidecar.errors import SettingInvalid
from sidecar.files import FileProblem, read_bounded


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    import ipaddress

    if host.lower() in LOOPBACK_NAMES or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_state_dir(upstream_url: str | None = None, port: int | None = None) -> Path:
    """``$XDG_STATE_HOME/omni-sidecar`` (else ``~/.local/state/omni-sidecar``), and for one sidecar
    the folder ``<upstream host>_<upstream port>-<sidecar port>`` in it: two sidecars on one host
    (replicas, a fleet) never share a journal by default."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "omni-sidecar"
    if upstream_url is None:
        return base
    from urllib.parse import urlsplit

    parts = urlsplit(upstream_url)
    upstream_port = parts.port or (443 if parts.scheme == "https" else 80)
    key = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{parts.hostname}_{upstream_port}")
    return base / f"{key}-{port}"


KEEP_DAYS_MAX = 365_000  # 1000 years: now minus this is still a date


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
    # inf and nan are refused in every float setting, as the CLI's float flags refuse them: no timeout,
    # duration or age is endless (an OMNI_SIDECAR_KEEP_DAYS=inf stopped start-up with a traceback)
    model_config = SettingsConfigDict(env_prefix="OMNI_SIDECAR_", extra="ignore", allow_inf_nan=False)

    # upstream
    upstream_url: str = "http://127.0.0.1:8000"
    flavor: Literal["omni", "vllm"] = "omni"
    deploy_config: Path | None = None  # the server's deploy YAML (same file `vllm serve` reads)
    platform: str = "cuda"  # which `platforms.<name>` overlay of the deploy YAML applies
    # The server's own command line (JSON text or a mapping), merged as vLLM-Omni does. With
    # flavor vllm, profiler_config alone describes the server (no deploy_config needed).
    stage_overrides: Annotated[str | dict[str, Any] | None, NoDecode] = None
    profiler_config: Annotated[str | dict[str, Any] | None, NoDecode] = None
    # `vllm serve --omni` without a deploy YAML: the pipeline's stage ids ("0,1"), each given profiler_config
    stages: Annotated[list[int] | None, NoDecode] = None
    # HTTP surface
    host: str = "127.0.0.1"
    port: int = Field(default=8092, ge=0, le=65535)
    token_file: Path | None = None  # bearer token for mutating routes (file content, stripped)
    # Host / Origin names accepted besides loopback ones (DNS rebinding, cross-site requests); "*" = any
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # state; unset = default_state_dir(upstream_url, port), one folder per sidecar
    state_dir: Path | None = None
    # upstream timeouts, seconds
    connect_timeout_s: float = Field(default=5, gt=0)
    start_timeout_s: float = Field(default=300, gt=0)
    stop_timeout_s: float = Field(default=1800, gt=0)
    probe_timeout_s: float = Field(default=5, gt=0)
    stop_budget_s: float = Field(default=1800, gt=0)  # total time stop is retried for
    # a stop ends `failed` (upstream_gone) once the server has been unreachable this long
    gone_after_s: float = Field(default=10.0, gt=0)
    # a `delay_steps` start waits this long for the server to run them (then steps_not_reached, 504),
    # and a `steps` window records this long at most
    steps_wait_s: float = Field(default=600, gt=0)
    # a `steps` window ends once its step counter has stood still (or gone unread) this long
    steps_stall_s: float = Field(default=10.0, gt=0)
    # write each `steps` window's counter reads here as a JSON fixture (tests/data/steps/)
    steps_record_dir: str | None = None
    # a `plan`, its probes included, answers within this (then plan_timeout, 504)
    plan_max_s: float = Field(default=300.0, gt=0)
    # a start scheduled (`start_at`) further ahead than this is refused (unset: any time ahead)
    start_at_max_s: float | None = Field(default=None, gt=0)
    # a request held open (`GET /v1/captures/{id}?until=started`) answers within this at most
    hold_max_s: float = Field(default=30.0, gt=0, le=30.0)  # at most HOLD_MAX_S (control/schedule.py)
    # captures
    collect_timeout_s: float = Field(default=120, ge=0)
    # An unclosed uncompressed trace is still being written until it has not changed for this
    # long (a slow export pauses between writes); bounded by collect_timeout_s.
    trace_quiet_s: float = Field(default=2.0, gt=0)
    # SERVER_PATH -> LOCAL_PATH; from the environment as JSON or as SERVER=LOCAL[,SERVER=LOCAL]
    artifact_roots: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    default_lease_s: float | None = Field(default=None, gt=0)
    max_duration_s: float | None = Field(default=None, gt=0)
    close_timeout_s: float = Field(default=60, ge=0)  # how long shutdown waits for a stop
    # history retention: finished captures beyond the newest `keep`, or older than `keep_days`, are dropped
    keep: int | None = Field(default=1000, ge=0)
    keep_days: float | None = Field(default=None, gt=0)  # at most KEEP_DAYS_MAX (_keep_days_in_range)
    # a `steps` capture that the latest plan predicts above this many MB is refused (or warned about)
    budget_mb: float | None = Field(default=None, gt=0)
    budget_action: Literal["refuse", "warn"] = "refuse"

    @field_validator("upstream_url")
    @classmethod
    def _url_has_scheme(cls, value: str) -> str:
        # "127.0.0.1:8000" parses as scheme "127.0.0.1" and every call then hangs into a 502
        from sidecar.urls import http_url, with_scheme, without_query

        url = http_url(value)
        if url is None:
            raise ValueError(
                f"--upstream {value!r} is not an http(s) URL; pass the server's URL with its scheme, "
                f"e.g. --upstream {with_scheme(value)}"
            )
        if (base := without_query(url)) is not None:
            raise ValueError(f"--upstream {value!r} has a query or a fragment, which the server's routes cannot "
                             f"follow; pass its address alone, e.g. --upstream {base}")
        return url

    @model_validator(mode="after")
    def _quiet_within_the_collect_bound(self) -> SidecarSettings:
        # Only a quiet period the user set is refused; the default is simply cut short by the bound.
        if "trace_quiet_s" in self.model_fields_set and self.trace_quiet_s > self.collect_timeout_s:
            raise ValueError(
                f"trace_quiet_s {self.trace_quiet_s:g} is longer than collect_timeout_s {self.collect_timeout_s:g}: "
                "no trace could ever be called cut off before the bound; set OMNI_SIDECAR_TRACE_QUIET_S at most "
                "OMNI_SIDECAR_COLLECT_TIMEOUT_S (or raise the collect timeout)"
            )
        return self

    @model_validator(mode="after")
    def _state_dir_per_sidecar(self) -> SidecarSettings:
        if self.state_dir is None:
            self.state_dir = default_state_dir(self.upstream_url, self.port)
        return self

    @field_validator("artifact_roots", mode="before")
    @classmethod
    def _roots_from_pairs(cls, value: object) -> object:
        # Accept the flag's SERVER=LOCAL form (a string or list of them) besides a mapping.
        if isinstance(value, str):
            if value.lstrip().startswith("{"):
                return json.loads(value)
            value = [p for p in value.split(",") if p.strip()]
        if isinstance(value, (list, tuple)):
            roots: dict[str, str] = {}
            for server, local in (parse_artifact_root(str(p)) for p in value):
                if roots.get(server, local) != local:  # the last one silently won
                    raise ArtifactRootInvalid(
                        f"--artifact-root {server} is given twice, as {roots[server]} and as {local}: a server path "
                        "is mounted in one place here; keep the one that holds its traces",
                        key="artifact_roots",
                    )
                roots[server] = local
            return roots
        return value

    @field_validator("stages", mode="before")
    @classmethod
    def _stages_from_csv(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        try:
            return [int(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--stages {value!r} is not a comma-separated list of stage ids, e.g. --stages 0,1") from None

    @field_validator("keep_days")
    @classmethod
    def _keep_days_in_range(cls, value: float | None) -> float | None:
        # the journal drops captures finished before now - keep_days: a date before year 1 cannot be
        # made, and start-up failed with an OverflowError traceback
        if value is not None and value > KEEP_DAYS_MAX:
            raise ValueError(f"--keep-days {value:g} is more than {KEEP_DAYS_MAX:,} days (1000 years); leave it "
                             "unset to keep finished captures whatever their age")
        return value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _hosts_from_csv(cls, value: object) -> object:
        return [h.strip() for h in value.split(",") if h.strip()] if isinstance(value, str) else value

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts_are_names(cls, value: list[str]) -> list[str]:
        # A URL (or a name with a path) never equals a request's Host name: every client using it
        # would be refused 403 host_not_allowed, with nothing said at start-up.
        for host in value:
            name = host.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
            if host != "*" and (host != name or not name or any(c in host for c in ' "<>\\{}|^`')):
                example = f" (e.g. --allowed-host {name})" if name and name != host else ""
                raise ValueError(f"--allowed-host {host!r} is not a host name: give the name clients reach the "
                                 f"sidecar by, without scheme or path{example}; '*' accepts any")
        return value

    def check_exposure(self, token: str | None) -> None:
        """A sidecar reachable beyond loopback must require a bearer token on mutating routes."""
        if token is None and not is_loopback(self.host):
            raise SettingInvalid(
                f"--host {self.host} listens beyond loopback without a token: anyone who can reach it could "
                "start captures. Pass --token-file FILE (e.g. `openssl rand -hex 32 > token`), or bind "
                "--host 127.0.0.1",
                key="host",
            )

    def token_file_note(self) -> str | None:
        """A warning where ``token_file`` can be read by other users of this host (group or world
        bits), who could then read the token: ``serve`` prints it at start. None otherwise."""
        if self.token_file is None:
            return None
        try:
            mode = Path(self.token_file).expanduser().stat().st_mode & 0o777
        except OSError:
            return None  # reading it says what is wrong with it
        if not mode & 0o077:
            return None
        return (f"--token-file {self.token_file} can be read by other users of this host (mode {mode:03o}), who can "
                f"then start and stop captures: `chmod 600 {self.token_file}` (a Kubernetes secret volume: "
                "defaultMode: 0400)")

    def read_token(self) -> str | None:
        """The bearer token from ``token_file`` (None when not configured), by :func:`read_token_file`."""
        return None if self.token_file is None else read_token_file(self.token_file)


# What a bearer token may be (the one rule: the server at start, the CLI and the client): printable
# ASCII without whitespace (what every HTTP client can send in a header), at most TOKEN_MAX_BYTES.
TOKEN_MAX_BYTES = 4096
# A token file is read up to this: a token, a trailing newline and some slack, never a whole large file.
TOKEN_FILE_MAX_BYTES = TOKEN_MAX_BYTES + 1024


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a bearer token, or None when it can."""
    if not token:
        return "is empty"
    if len(token) > TOKEN_MAX_BYTES:
        return f"is {len(token)} characters long, above the limit of {TOKEN_MAX_BYTES}"
    bad = next((c for c in token if not "!" <= c <= "~"), None)
    if bad is not None:
        kind = "whitespace" if bad.isspace() else "not printable ASCII"
        return (f"has {bad!r} ({kind}) at position {token.index(bad) + 1}: a token is printable ASCII without "
                "spaces or line breaks inside (what an HTTP header can carry)")
    return None


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace, e.g. a trailing newline, stripped), read
    with a size bound from a regular file only; ``TokenFileUnreadable`` naming the file and the fix."""
    shown = str(path)
    make = f"e.g. `openssl rand -hex 32 > {shown}`"

    def refuse(why: str, fix: str) -> TokenFileUnreadable:
        return TokenFileUnreadable(f"--token-file {shown} {why}; {fix}", key="token_file", details={"file": shown})

    try:
        raw = read_bounded(Path(path).expanduser(), TOKEN_FILE_MAX_BYTES)
    except FileProblem as exc:
        if exc.kind == "missing":
            raise refuse("does not exist", f"create it ({make}) or drop the flag") from None
        if exc.kind == "unopenable":
            raise refuse(exc.why, f"make it readable for this user (uid {os.getuid()}) or drop the flag") from None
        if exc.what == "a folder":
            raise refuse("is a folder, not a file", f"pass the path of the file that holds the token ({make})") from None
        if exc.kind == "not_a_file":
            raise refuse(f"is not a regular file ({exc.what})", f"write the token into a regular file ({make}) and pass that") from None
        if exc.kind == "too_large":
            raise refuse(f"is larger than {TOKEN_FILE_MAX_BYTES} bytes: no token file is that large (a token is at most "
                         f"{TOKEN_MAX_BYTES} bytes)", f"pass the file that holds only the token ({make})") from None
        raise refuse(exc.why, "check the file, or drop the flag") from None
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise refuse(f"holds a byte that is not ASCII (0x{raw[exc.start]:02x} at byte {exc.start + 1}): a token is "
                     "printable ASCII", f"write a new token into it ({make})") from None
    if not token:
        raise refuse("is empty", "write a token into it or drop the flag")
    why = token_problem(token)
    if why is not None:
        raise refuse(f"holds a token that {why}", f"write a new token into it ({make})")
    return token
