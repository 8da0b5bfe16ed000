"""Errors and findings are data: a stable ``code``, a message for humans that names the fix,
and where it applies the file, line, column and key. One class per failure: ``code`` and
``http_status`` are class attributes, so the HTTP surface maps an error to its status by class
(the nearest one in the MRO, as Starlette does) and a new error inherits its family's status
instead of falling through to 500. The CLI prints them.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, ClassVar, TypeVar

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


_E = TypeVar("_E", bound="SidecarError")


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose.

    ``code`` is stable (clients switch on it); ``message`` says what went wrong and what to do;
    ``http_status`` is the reply status of the HTTP API. A subclass sets both class attributes
    or inherits its family's. The code of an instance is its class's, except for a relay
    (:meth:`relay`): an error that carries the code of another failure (a finding, a remote
    target's error) under its own class and status.
    """

    code: ClassVar[str] = "sidecar_error"
    http_status: ClassVar[int] = 500

    def __init__(
        self,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        where: Where | None = None,
        key: str | None = None,
        findings: list[Finding] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})
        self.where = where
        self.key = key
        self.findings: list[Finding] = list(findings or [])

    @classmethod
    def relay(cls: type[_E], code: str, message: str, **kwargs: Any) -> _E:
        """An instance of ``cls`` that reports ``code`` (the failure it relays); its status stays
        ``cls.http_status``."""
        err = cls(message, **kwargs)
        err.code = code  # type: ignore[misc]  # instance attribute shadows the class's
        return err

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


def error_classes() -> list[type[SidecarError]]:
    """Every ``SidecarError`` class defined so far (import a module to include its own), base first."""
    out: list[type[SidecarError]] = []
    pending: list[type[SidecarError]] = [SidecarError]
    while pending:
        cls = pending.pop(0)
        if cls not in out:
            out.append(cls)
            pending.extend(cls.__subclasses__())
    return out


def class_for_code(code: str) -> type[SidecarError] | None:
    """The class whose own ``code`` is ``code`` (the first defined, where families share a code)."""
    for cls in error_classes():
        if cls.__dict__.get("code") == code:
            return cls
    return None


# An error as data, for work done in another process (an analysis child, a fleet worker, a Ray
# actor): (class name, code, message, details). The name is None for a failure that is no
# SidecarError (a bug): it crosses as ``internal_error`` with its type in the message.
WireError = tuple[str | None, str, str, dict[str, Any]]


def error_to_wire(exc: BaseException) -> WireError:
    """``exc`` as data: a ``SidecarError``'s class name, code, message and details; anything else
    as no class, code ``internal_error`` and ``"<type>: <text>"``."""
    if isinstance(exc, SidecarError):
        return (type(exc).__name__, exc.code, exc.message, dict(exc.details))
    return (None, "internal_error", f"{type(exc).__name__}: {exc}", {})


def error_from_wire(data: WireError, *, fallback: type[SidecarError] = SidecarError) -> SidecarError:
    """The error ``error_to_wire`` made, to raise on this side: the same class where this module
    defines it, reporting the same code. ``fallback`` (relaying the code and message) stands in
    for a class this side lacks or that is built with other arguments, and for a bug."""
    name, code, message, details = data
    cls = globals().get(name) if name else None
    if not (isinstance(cls, type) and issubclass(cls, SidecarError)):
        cls = fallback
    try:
        return cls.relay(code, message, details=details)
    except TypeError:  # a class built with other arguments: the code and message still cross
        return fallback.relay(code, message, details=details)


# --- request / stage selection (422: the request must change) ---------------------------------


class StageSelectionError(SidecarError):
    """A requested stage list is empty, has duplicates, names unknown or unprofiled stages."""

    code = "stage_selection_invalid"
    http_status = 422


class StagesInvalid(StageSelectionError):
    """The stage list is not a list of integers."""

    code = "stages_invalid"


class StagesEmpty(StageSelectionError):
    code = "stages_empty"


class StageDuplicate(StageSelectionError):
    code = "stage_duplicate"


class StageUnknown(StageSelectionError):
    code = "stage_unknown"


class StageNotProfiled(StageSelectionError):
    code = "stage_not_profiled"


class StageNotTorch(StageSelectionError):
    code = "stage_not_torch"


# --- config layer (422: the input must change) ---------------------------------------------


class ConfigError(SidecarError):
    """An input file (deploy YAML, verl config, stage profile) or a setting is invalid."""

    code = "config_invalid"
    http_status = 422


class ConfigUnreadable(ConfigError):
    """The file cannot be read or parsed at all (missing, not YAML, wrong top-level type)."""

    code = "config_unreadable"


class ValidationFailed(ConfigError):
    """Validation produced at least one error finding; ``findings`` holds all of them."""

    code = "validation_failed"


class StageOverridesInvalid(ConfigError):
    """``--stage-overrides`` is not a JSON object of stage id -> overrides, names an unknown stage,
    or sets a bad profiler key or value (the server would refuse to start, or skip the stage)."""

    code = "stage_overrides_invalid"
    http_status = 422


class ProfilerConfigArgInvalid(ConfigError):
    """``--profiler-config`` (the server-wide JSON) is not JSON or not a valid ProfilerConfig."""

    code = "profiler_config_arg_invalid"
    http_status = 422


class DeployConfigMissing(ConfigError):
    """Neither a deploy YAML nor (for plain vLLM) a ``--profiler-config`` says what the server runs."""

    code = "deploy_config_missing"
    http_status = 422


class StagesFlagMisplaced(ConfigError):
    """``--stages`` given where the stages are already known (a deploy YAML; plain vLLM's one engine)."""

    code = "stages_flag_misplaced"
    http_status = 422


class DirPlaceholderUnknown(ConfigError):
    """``render --dir`` names a placeholder other than ``{host}`` / ``{replica}``."""

    code = "dir_placeholder_unknown"
    http_status = 422


class DirPlaceholderUnset(ConfigError):
    """``render --dir`` holds ``{replica}`` but no (valid) ``--replica N`` was given."""

    code = "dir_placeholder_unset"
    http_status = 422


class VerlRanksPastReplicas(ConfigError):
    """verl's rollout profiler ranks name replicas the job does not have."""

    code = "verl_ranks_past_replicas"
    http_status = 422


class PlatformUnknown(ConfigError):
    """``--platform`` is not one of vLLM-Omni's platform names (a typo would apply no overlay)."""

    code = "platform_unknown"
    http_status = 422


class LegacySchemaRefused(ConfigError):
    """A top-level ``stage_args:`` deploy file, which vLLM-Omni 0.30 refuses at start-up."""

    code = "legacy_schema"
    http_status = 422


class FileNotFound(ConfigUnreadable):
    code = "file_not_found"


class FileUnreadable(ConfigUnreadable):
    code = "file_unreadable"


class YamlInvalid(ConfigUnreadable):
    code = "yaml_invalid"


class ConfigEmpty(ConfigUnreadable):
    code = "config_empty"


class ConfigNotMapping(ConfigUnreadable):
    code = "config_not_mapping"


class DeployStagesInvalid(ConfigError):
    """The deploy file's top-level ``stages`` is not a list of mappings."""

    code = "stages_invalid"


class StageInvalid(ConfigError):
    code = "stage_invalid"


class StageIdMissing(ConfigError):
    code = "stage_id_missing"


class StageIdInvalid(ConfigError):
    code = "stage_id_invalid"


class StageIdDuplicate(ConfigError):
    code = "stage_id_duplicate"


class ProfilerConfigInvalid(ConfigError):
    code = "profiler_config_invalid"


class PlatformsInvalid(ConfigError):
    code = "platforms_invalid"


class BaseConfigInvalid(ConfigError):
    code = "base_config_invalid"


class BaseConfigMissing(ConfigError):
    code = "base_config_missing"


class BaseConfigCycle(ConfigError):
    code = "base_config_cycle"


class NumReplicasInvalid(ConfigError):
    code = "num_replicas_invalid"


class StageKindInvalid(ConfigError):
    code = "stage_kind_invalid"


class NoStages(ConfigError):
    code = "no_stages"


class ProfileUnknown(ConfigError):
    code = "profile_unknown"


class ProfileInvalid(ConfigError):
    code = "profile_invalid"


class ProfileUnreadable(ConfigUnreadable):
    """A stage profile file cannot be parsed (same code as an invalid one; exit 2 in the CLI)."""

    code = "profile_invalid"


class ProfileDirMissing(ConfigError):
    code = "profile_dir_missing"


class VerlInterpolation(ConfigError):
    code = "verl_interpolation"


class VerlConfigInvalid(ConfigError):
    code = "verl_config_invalid"


class VerlRoleInvalid(ConfigError):
    code = "verl_role_invalid"


class HookConfigInvalid(ConfigError):
    code = "hook_config_invalid"


class VerlVersionUnknown(ConfigError):
    """The installed verl is not in the table of versions the hook was checked against
    (config/verl.py ``KNOWN_VERL``); refused with ``omni_sidecar.strict``, else warned once."""

    code = "verl_version_unknown"


class VerlTrainerNotFound(ConfigError):
    """The rollout hook found no verl trainer, or several, for the agent-loop manager it built."""

    code = "verl_trainer_not_found"


class ArtifactRootInvalid(ConfigError):
    code = "artifact_root_invalid"


class TokenFileUnreadable(ConfigError):
    """A ``--token-file`` that cannot be read, or that holds no usable token (the rule:
    ``sidecar.config.settings.token_problem``)."""

    code = "token_file_unreadable"


class TokenInvalid(ConfigError):
    """A bearer token given to a client that no HTTP header can carry (non-ASCII, whitespace
    inside, empty, too long): refused when the client is built, not on its first call."""

    code = "token_invalid"


class SettingInvalid(ConfigError):
    """A flag or ``OMNI_SIDECAR_*`` value is out of range or malformed (e.g. a URL without scheme)."""

    code = "setting_invalid"


class StateDirUnusable(ConfigError):
    """The ``--state-dir`` cannot be created or written: no history, no recovery; refuse to start."""

    code = "state_dir_unusable"


class JournalUnwritable(StateDirUnusable):
    """A start's first journal record could not be written (the state dir broke while the sidecar
    ran): nothing is sent upstream, since a crash then would leave the server recording with no
    record to recover it from. 503: the sidecar, not the request, is at fault."""

    code = "journal_unwritable"
    http_status = 503


class StateDirLocked(ConfigError):
    """Another live sidecar owns the ``--state-dir`` (its lock file names the pid): two sidecars on
    one journal would recover, and so stop, each other's captures; refuse to start."""

    code = "state_dir_locked"
    http_status = 409


class StageNotCuda(StageSelectionError):
    """An nsys capture names a stage that is not ``profiler: cuda`` (or the deploy has none)."""

    code = "stage_not_cuda"
    http_status = 422


# --- upstream (502/503: the server behind us failed or is not there) -------------------------


class UpstreamError(SidecarError):
    """The vLLM-Omni server refused or failed a call (``upstream_failed``)."""

    code = "upstream_failed"
    http_status = 502


class UpstreamUnreachable(UpstreamError):
    """No connection could be made; the request was never delivered."""

    code = "upstream_unreachable"
    http_status = 503


class UpstreamTimeout(UpstreamError):
    """The request was sent but no reply came in time: its effect is unknown."""

    code = "upstream_timeout"


class UpstreamNotHttp(UpstreamError):
    """What answered at the upstream address is not an HTTP server (another service on that port):
    no profiler can have started there, and asking again will not change it."""

    code = "upstream_not_http"


class MetricsUnavailable(UpstreamError):
    """The server's ``/metrics`` could not be read (not served, failed, not Prometheus text)."""

    code = "metrics_unavailable"


class UpstreamNotReady(UpstreamError):
    """The server is not healthy, or its profiler endpoints are not mounted."""

    code = "upstream_not_ready"
    http_status = 503


class UpstreamSessionActive(UpstreamError):
    """The server refused a start with 409: a profiling session of its own is still open (vLLM
    0.32 on keeps one from a start to a stop, also after its ``max_iterations`` ended the window)."""

    code = "upstream_session_active"
    http_status = 409


# --- captures (409: the capture's state forbids it) --------------------------------------------


class CaptureError(SidecarError):
    code = "capture_error"
    http_status = 409


class CaptureActive(CaptureError):
    """Another capture is running on the same upstream; ``details['active_id']`` names it."""

    code = "capture_active"


class CaptureNotFound(CaptureError):
    code = "capture_not_found"
    http_status = 404


class CaptureIdAmbiguous(CaptureError):
    """A capture id prefix matches more than one capture; the message lists them."""

    code = "capture_id_ambiguous"
    http_status = 422


class CaptureStateError(CaptureError):
    """The capture is in a state where this action makes no sense (e.g. stop when completed)."""

    code = "capture_state"


class CaptureNotTerminal(CaptureStateError):
    """The capture is still live; its summary exists once it is terminal."""

    code = "capture_not_terminal"


class StageSetMismatch(CaptureError):
    """A stop names a different stage set than the live capture's (it would leave stages recording)."""

    code = "stage_set_mismatch"


class ArtifactNotFound(CaptureError):
    """A requested file is not one of the capture's artifacts (or escapes its folders)."""

    code = "artifact_not_found"
    http_status = 404


class SummaryUnavailable(CaptureError):
    """No trace to summarise, or no summarizer installed."""

    code = "summary_unavailable"
    http_status = 404


class SidecarClosing(CaptureError):
    """The sidecar is shutting down: no new capture."""

    code = "sidecar_closing"
    http_status = 503


class WindowInvalid(CaptureError):
    """``duration_s`` / ``lease_s`` out of range (not finite, not > 0, above the limit)."""

    code = "window_invalid"
    http_status = 422


class DurationInvalid(WindowInvalid):
    code = "duration_invalid"


class LeaseInvalid(WindowInvalid):
    code = "lease_invalid"


class EngineStepsInvalid(WindowInvalid):
    """A capture's ``steps`` / ``delay_steps`` (engine steps) not a whole number in range."""

    code = "engine_steps_invalid"


class StepsUnavailable(CaptureError):
    """A ``steps`` window needs the server's engine-step counter, and its ``/metrics`` has none."""

    code = "steps_unavailable"
    http_status = 422


class StartCancelled(CaptureError):
    """A scheduled start (``start_at``) was stopped before its time: nothing reached the server."""

    code = "start_cancelled"
    http_status = 409


class StepsNotReached(CaptureError):
    """A ``delay_steps`` start waited its bound and the server did not run that many steps."""

    code = "steps_not_reached"
    http_status = 504


class BudgetExceeded(CaptureError):
    """A ``steps`` capture whose planned size is above the sidecar's budget (``budget_action: refuse``)."""

    code = "budget_exceeded"
    http_status = 422


class PlanInvalid(CaptureError):
    """A plan's bounds out of range."""

    code = "plan_invalid"
    http_status = 422


class StepsUnbounded(CaptureError):
    """A ``steps`` window on stages whose server cannot end it itself (no ``max_iterations`` cap):
    the sidecar's stop would land late by what the engines step while it travels."""

    code = "steps_unbounded"
    http_status = 422


class ProfileNotPerCapture(CaptureError):
    """A stage profile asked for one capture where the server cannot take it per capture (its
    start body has no ``profiler_kwargs``: vLLM before 0.33, every vLLM-Omni), or a preset that is
    no set of torch options (``nsys``): the deploy's profiler_config is the way, by restart. The
    request was valid; the server it reached cannot honour it: 409."""

    code = "profile_not_per_capture"
    http_status = 409


class PlanUnmeasurable(CaptureError):
    """A plan whose probes cannot measure a window: a stage traced no engine step, too few probes
    ended ``completed``, or the shortest probe already breaks a bound. The request was valid; the
    server's state (its traffic, its flags) did not allow a measure: 409."""

    code = "plan_unmeasurable"
    http_status = 409


class PlanTimeout(CaptureError):
    """A plan that did not finish within its stated bound (``plan_max_s``)."""

    code = "plan_timeout"
    http_status = 504


class StopUnconfirmed(CaptureActive):
    """An earlier capture's stop was not confirmed by the server (a 5xx, or no answer within the
    budget), and the stop sent again before this start failed too: those stages may still be
    recording, so nothing is started. ``details``: ``stages``, ``after`` (that capture), ``upstream``."""

    code = "stop_unconfirmed"


class CaptureStopPending(CaptureActive):
    """The previous capture's stop has not been answered by the server (it may still be writing
    traces); the slot stays taken until the server answers or is shown gone. ``details``:
    ``active_id``, ``stop_requested_at``, ``upstream``."""

    code = "capture_stop_pending"
    http_status = 409


# --- analysis ------------------------------------------------------------------------------


class TraceError(SidecarError):
    """A trace file cannot be summarised (empty, truncated, not a Chrome trace)."""

    code = "trace_invalid"
    http_status = 422


class TraceTooLarge(TraceError):
    """A trace breaks a reader limit: more decompressed JSON than the cap, no event boundary within
    the event limit (one giant string or a body that is no list of events), a header too long, or
    an analysis that ran out of its worker's memory. The message names the limit."""

    code = "trace_too_large"
    http_status = 422


class SlimWindowInvalid(TraceError):
    """``slim --window`` is neither ``step:N`` nor ``START..END`` (ms), or names a missing step."""

    code = "slim_window_invalid"
    http_status = 422


# --- surfaces ------------------------------------------------------------------------------


class RequestError(SidecarError):
    """An HTTP request the API refuses before any rule runs (shape, size, type, origin)."""

    code = "http_error"
    http_status = 400


class RequestInvalid(RequestError):
    """The body or query does not match the route's schema (see /docs)."""

    code = "request_invalid"
    http_status = 422


class RouteNotFound(RequestError):
    code = "not_found"
    http_status = 404


class MethodNotAllowed(RequestError):
    code = "method_not_allowed"
    http_status = 405


class BodyTooLarge(RequestError):
    code = "body_too_large"
    http_status = 413


class MediaTypeUnsupported(RequestError):
    code = "unsupported_media_type"
    http_status = 415


class HostNotAllowed(RequestError):
    """The ``Host`` or ``Origin`` header is not on the allow-list (DNS rebinding, cross-site POSTs)."""

    code = "host_not_allowed"
    http_status = 403


class AuthError(SidecarError):
    code = "unauthorized"
    http_status = 401


class InternalError(SidecarError):
    """A bug: logged with its traceback; the client gets the shape, not the trace."""

    code = "internal_error"
    http_status = 500


class FleetError(SidecarError):
    """A fan-out failed on at least one target; ``details['targets']`` has each outcome."""

    code = "fleet_failed"
    http_status = 502


class VerlReplicaNotLaunched(FleetError):
    """A verl rollout replica chosen for profiling has no server actor (not launched yet)."""

    code = "verl_replica_not_launched"
    http_status = 503


class FleetInvalid(SidecarError):
    """A fan-out or rollout-hook request is invalid before anything is sent (targets, steps,
    ranks, a stage list some target cannot take); ``details`` name the offending items."""

    code = "fleet_invalid"
    http_status = 422


class TargetInvalid(FleetInvalid):
    code = "target_invalid"


class NotASidecar(TargetInvalid):
    """A ``sidecar=URL`` target whose server has no sidecar API (``GET /v1/stages`` is not there, or
    answers something else): most likely a vLLM server, which is an ``upstream=URL`` target."""

    code = "not_a_sidecar"


class TargetsEmpty(FleetInvalid):
    code = "targets_empty"


class TargetDuplicate(FleetInvalid):
    code = "target_duplicate"


class FleetStagesInvalid(FleetInvalid):
    code = "stages_invalid"


class FlavorsMixed(FleetInvalid):
    code = "flavors_mixed"


class StagesNotShared(FleetInvalid):
    code = "stages_not_shared"


class FleetClosed(FleetInvalid):
    code = "fleet_closed"
    http_status = 409


class StepsInvalid(FleetInvalid):
    code = "steps_invalid"


class StepsEmpty(FleetInvalid):
    code = "steps_empty"


class RanksInvalid(FleetInvalid):
    code = "ranks_invalid"


class FleetDurationInvalid(FleetInvalid):
    code = "duration_invalid"


class LabelInvalid(FleetInvalid):
    """A label (or a rollout's label prefix) each target would refuse: not text, or holding a
    control character (``control.models.label_problem``)."""

    code = "label_invalid"


class FleetResultInvalid(FleetInvalid):
    """A file given as a fleet result is not one (``fleet archive``, ``fleet timeline``)."""

    code = "fleet_result_invalid"


class BudgetInvalid(FleetInvalid):
    code = "budget_invalid"


class StartAtInvalid(FleetInvalid):
    """``start_at`` (the wall-clock time every target's start is released at) is not a time, is
    in the past, or is further ahead than the fleet allows; nothing was sent."""

    code = "start_at_invalid"
    http_status = 422


class TargetNoAnswer(FleetError):
    """A target accepted a call and did not answer it within the fan-out's budget for it."""

    code = "target_no_answer"


class StartWithheld(FleetError):
    """This target's start was prepared but never sent: another target failed before the starts
    were released together, or the fan-out was cancelled. Nothing reached this server."""

    code = "start_withheld"
    http_status = 409


class ConcurrencyInvalid(FleetInvalid):
    code = "concurrency_invalid"


class FleetKeyInvalid(FleetInvalid):
    """A fleet key (what each capture's label carries for the fleet's sweep) that is not 1-64
    letters, digits, ``_``, ``.`` or ``-``."""

    code = "fleet_key_invalid"


class KindInvalid(FleetInvalid):
    """A capture kind other than ``torch`` or ``nsys``."""

    code = "kind_invalid"


class KindUnsupported(FleetInvalid):
    """The target's controller cannot take this capture kind."""

    code = "kind_unsupported"


class ProfilerDirShared(FleetInvalid):
    """Two targets' stages write into one ``torch_profiler_dir``: their traces cannot be told
    apart. ``details['shared']`` lists each dir with its (target, stage) pairs; ``findings`` hold
    the rule's findings (``sidecar.config.sharing``)."""

    code = "profiler_dir_shared"
    http_status = 422
