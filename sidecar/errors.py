"""Errors and findings are data: a stable ``code``, a message for humans that names the fix,
and where it applies the file, line, column and key. Every layer raises these; the HTTP surface
maps codes to status codes in one table (``sidecar.api.errors``) and the CLI prints them.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict


class Severity(str, Enum):
    error = "error"
    warning = "warning"


class Where(BaseModel):
    """A place in an input file (1-based line and column, as editors show them)."""

    model_config = ConfigDict(frozen=True)

    file: str | None = None
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        parts = [self.file or "<input>"]
        if self.line is not None:
            parts.append(str(self.line))
            if self.column is not None:
                parts.append(str(self.column))
        return ":".join(parts)


class Finding(BaseModel):
    """One verdict of a validation rule: refused (error) or allowed with a caveat (warning)."""

    model_config = ConfigDict(frozen=True)

    code: str
    severity: Severity
    message: str
    stage_id: int | None = None
    key: str | None = None
    where: Where | None = None

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.error

    def __str__(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        stage = f"stage {self.stage_id}: " if self.stage_id is not None else ""
        return f"{prefix}{self.severity.value}[{self.code}]: {stage}{self.message}"


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose.

    ``code`` is stable (clients switch on it); ``message`` says what went wrong and what to do.
    """

    code: str = "sidecar_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        details: dict[str, Any] | None = None,
        where: Where | None = None,
        key: str | None = None,
        findings: list[Finding] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details: dict[str, Any] = dict(details or {})
        self.where = where
        self.key = key
        self.findings: list[Finding] = list(findings or [])

    def __str__(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        return f"{prefix}{self.message}"

    def to_dict(self) -> dict[str, Any]:
        details = dict(self.details)
        if self.where is not None:
            details.setdefault("file", self.where.file)
            details.setdefault("line", self.where.line)
            details.setdefault("column", self.where.column)
        if self.key is not None:
            details.setdefault("key", self.key)
        if self.findings:
            details["findings"] = [f.model_dump(mode="json") for f in self.findings]
        return {"code": self.code, "message": self.message, "details": details}


# --- config layer -------------------------------------------------------------------------


class ConfigError(SidecarError):
    """An input file (deploy YAML, verl config, stage profile) is unreadable or invalid."""

    code = "config_invalid"


class ConfigUnreadable(ConfigError):
    """The file cannot be read or parsed at all (missing, not YAML, wrong top-level type)."""

    code = "config_unreadable"


class ValidationFailed(ConfigError):
    """Validation produced at least one error finding; ``findings`` holds all of them."""

    code = "validation_failed"


# --- request / stage selection ------------------------------------------------------------


class StageSelectionError(SidecarError):
    """A requested stage list is empty, has duplicates, names unknown or unprofiled stages.

    Codes: ``stages_empty``, ``stage_duplicate``, ``stage_unknown``, ``stage_not_profiled``,
    ``stage_not_torch``.
    """

    code = "stage_selection_invalid"


class StageNotCuda(StageSelectionError):
    """An nsys capture names a stage that is not ``profiler: cuda`` (or the deploy has none)."""

    code = "stage_not_cuda"
    http_status = 422


# --- upstream -----------------------------------------------------------------------------


class UpstreamError(SidecarError):
    """The vLLM-Omni server refused or failed a call (``upstream_failed``)."""

    code = "upstream_failed"


class UpstreamUnreachable(UpstreamError):
    """No connection could be made; the request was never delivered."""

    code = "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    """The request was sent but no reply came in time: its effect is unknown."""

    code = "upstream_timeout"


class UpstreamNotReady(UpstreamError):
    """The server is not healthy, or its profiler endpoints are not mounted."""

    code = "upstream_not_ready"


# --- captures -----------------------------------------------------------------------------


class CaptureError(SidecarError):
    code = "capture_error"


class CaptureActive(CaptureError):
    """Another capture is running on the same upstream; ``details['active_id']`` names it."""

    code = "capture_active"


class CaptureNotFound(CaptureError):
    code = "capture_not_found"


class CaptureStateError(CaptureError):
    """The capture is in a state where this action makes no sense (e.g. stop when completed)."""

    code = "capture_state"


class ArtifactNotFound(CaptureError):
    """A requested file is not one of the capture's artifacts (or escapes its folders)."""

    code = "artifact_not_found"


class CaptureStopPending(CaptureActive):
    """The previous capture's stop has not been answered by the server (it may still be writing
    traces); the slot stays taken until the server answers or is shown gone. ``details``:
    ``active_id``, ``stop_requested_at``, ``upstream``."""

    code = "capture_stop_pending"
    http_status = 409


# --- analysis -----------------------------------------------------------------------------


class TraceError(SidecarError):
    """A trace file cannot be summarised (empty, truncated, not a Chrome trace)."""

    code = "trace_invalid"


# --- surfaces -----------------------------------------------------------------------------


class AuthError(SidecarError):
    code = "unauthorized"


class FleetError(SidecarError):
    """A fan-out failed on at least one target; ``details['targets']`` has each outcome."""

    code = "fleet_failed"


class FleetInvalid(SidecarError):
    """A fan-out or rollout-hook request is invalid before anything is sent (targets, steps,
    ranks, a stage list some target cannot take); ``details`` name the offending items."""

    code = "fleet_invalid"
