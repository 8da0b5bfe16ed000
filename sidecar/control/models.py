"""The capture record: what the controller journals, the API serves and the client parses.

States follow docs/design.md §5: ``starting → active → stopping → collecting →
completed | degraded | failed``. A capture's stage set is fixed at start.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, field_serializer, model_validator

from sidecar.control import filenames
from sidecar.control.notes import Note, word
from sidecar.control.outcome import Outcome, outcome_of
from sidecar.control.steps import Bound, EndedBy
from sidecar.upstream.metrics import WindowMetrics


class _Word(str, Enum):
    """A str enum that prints as its value (``ok``, not ``Verdict.ok``): what users print is a word."""

    def __str__(self) -> str:
        return str(self.value)


class CaptureState(_Word):
    starting = "starting"
    active = "active"
    stopping = "stopping"
    collecting = "collecting"
    completed = "completed"
    degraded = "degraded"
    failed = "failed"

    @property
    def terminal(self) -> bool:
        return self in (CaptureState.completed, CaptureState.degraded, CaptureState.failed)


class StopReason(_Word):
    explicit = "explicit"
    duration = "duration"  # duration_s elapsed
    lease_expired = "lease_expired"  # no heartbeat within lease_s
    shutdown = "shutdown"  # the sidecar is exiting
    stopped_on_recovery = "stopped_on_recovery"  # journal showed it active at start-up
    rollback = "rollback"  # start failed or was ambiguous; the same set was stopped
    steps = "steps"  # the server's step counter advanced by the capture's ``steps``


class Verdict(_Word):
    ok = "ok"  # every expected trace is counted (complete, readable) and records work (an op or a kernel)
    empty = "empty"  # traces are present but no op and no kernel ran in the window
    missing = "missing"  # no trace for this stage (no new session folder, or a folder without trace)
    partial = "partial"  # fewer traces than the stage expects (replicas x ranks): a replica or rank lost
    ambiguous = "ambiguous"  # the folder is another server's too, or more traces than one window writes
    # the sidecar cannot tell: the folder is not visible, nsys writes the report, a trace was still
    # being written at the collect bound, or the content check cannot run (fail closed)
    unverified = "unverified"


class CaptureKind(_Word):
    torch = "torch"  # torch profiler stages: trace files the sidecar finds and checks
    nsys = "nsys"  # ``profiler: cuda`` stages: capture ranges for an outer ``nsys profile``


class ArtifactFile(BaseModel):
    # path relative to the session folder, as the OS names it; in JSON a name that is not UTF-8 is
    # shown with \\xNN bytes and its bytes travel in name_quoted (sidecar/control/filenames.py)
    name: str
    size: int
    # Where the sidecar serves it from when it is a copy taken at collect time (a file that later
    # stops rewrite in place, e.g. plain vLLM's profiler_out_<r>.txt); None: the session folder's.
    copy_path: str | None = None
    # Its identity when the verdict was made (a read compares them: replaced since?); None in
    # records written before they were kept.
    mtime_ns: int | None = None
    inode: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _name_from_quoted(cls, data: Any) -> Any:
        if isinstance(data, dict) and "name_quoted" in data:
            data = dict(data)
            raw = data.pop("name_quoted")
            if isinstance(raw, str):  # the bytes, not the shown form, are the name
                data["name"] = filenames.unquote(raw)
        return data

    @field_serializer("name", when_used="json")
    def _shown_name(self, name: str) -> str:
        return filenames.shown(name)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def name_quoted(self) -> str | None:
        """The name's bytes percent-encoded (the download URL's path), when it is not UTF-8."""
        return filenames.quoted(self.name)


class SessionFolder(BaseModel):
    path: str  # as the server names it (under the stage's torch_profiler_dir)
    local_path: str | None = None  # where the sidecar reads it (after --artifact-root mapping)
    files: list[ArtifactFile] = Field(default_factory=list)


class StageVerdict(BaseModel):
    """What one stage wrote in a capture's window: its verdict (``ok``, ``empty``, ``missing``, ...; None
    until collecting ends), the trace session folders found, and for a verdict that is not ``ok`` the
    reason (what happened, what to do) and the rule that decided it."""

    stage_id: int
    profiler_dir: str | None = None
    verdict: Verdict | None = None  # None until collecting has finished
    sessions: list[SessionFolder] = Field(default_factory=list)
    reason: str | None = None  # for a non-ok verdict: what happened and what to do
    # the rule that decided the verdict (sidecar/control/collect.py ``Rule``: ``no_session``, ``lost``,
    # ``idle``, ...): what a program reads instead of the reason's words
    rule: str | None = None
    lost_ranks: list[int] = Field(default_factory=list)  # ``lost``: the ranks with no trace
    lost_replicas: list[int] = Field(default_factory=list)  # ``lost``: the replicas with no trace
    expected_traces: int | None = None  # replicas x ranks of the stage (None: not counted)
    found_traces: int | None = None  # complete traces of this capture that arrived
    # Engine steps that scheduled work in this stage's trace (its execute_* annotations, the most
    # of any of its files); set for ``steps`` captures, to compare with the steps asked.
    steps_traced: int | None = None
    # Seconds from the last event its trace holds to its file's last write: the server writing what
    # it recorded (at the stop, or inside the engine where the server ends the window itself:
    # max_iterations); the longest of its files. Set with ``steps_traced``, where the trace says
    # when its last event was (baseTimeNanoseconds).
    trace_write_s: float | None = None


class ErrorRecord(BaseModel):
    code: str
    message: str
    at: datetime


class ClockRecord(BaseModel):
    """A fleet's measurement of this host's clock while the capture ran (docs/fleet-clocks.md):
    this host's realtime − the fleet's, within ``error_ns``, at the fleet's ``at_ns``."""

    model_config = ConfigDict(extra="forbid")

    phase: Literal["start", "stop"]
    offset_ns: int
    error_ns: int = Field(ge=0)
    at_ns: int
    reference: str = Field(default="fleet", max_length=200)  # whose clock the offset is against


# A capture keeps at most this many clock records (a start and a stop per fleet, a few fleets).
CLOCKS_MAX = 8
# A steps window (and each plan probe) asks for at most this many engine steps.
MAX_ENGINE_STEPS = 1_000_000


LABEL_MAX = 200  # characters of a capture's label (the API's bound)


def label_problem(label: str) -> str | None:
    """What makes ``label`` no capture label (None: nothing): a label is shown in lists, tables and
    terminals, so no control characters (an escape sequence there would recolour or retitle a
    terminal), said with where the first one is. Its length is ``LABEL_MAX``, checked by the API's
    schema (and cut by a fleet that appends its key)."""
    bad = next((i for i, c in enumerate(label) if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
    if bad is None:
        return None
    return f"holds a control character ({label[bad]!r} at {bad}); a label is plain text"


class Capture(BaseModel):
    """One capture: a profiling window over some stages of one server, from its start request to its
    terminal state (``completed``, ``degraded``, ``failed``), with what ended it (``stop_reason``), a
    verdict per stage and the errors met. What ``GET /v1/captures/{id}`` returns."""

    id: str
    label: str | None = None
    upstream: str
    stages: list[int]
    kind: CaptureKind = CaptureKind.torch
    state: CaptureState = CaptureState.starting
    duration_s: float | None = None
    lease_s: float | None = None
    steps: int | None = None  # stop once the server has run this many engine steps
    delay_steps: int | None = None  # start once the server has run this many engine steps
    start_at: datetime | None = None  # a scheduled start: sent at this time (this host's clock)
    # Engine steps the server's /metrics had counted since the start was sent, when the stop was
    # sent (the last read, and the steps its rate predicts until the stop lands).
    steps_counted: int | None = None
    # what ended a ``steps`` window's recording (``server_cap``: every stage's deploy max_iterations;
    # ``count``: the sidecar's best-effort count, asked for by name) and why its stop was sent
    steps_bound: Bound | None = None
    steps_ended_by: EndedBy | None = None
    stop_reason: StopReason | None = None
    created_at: datetime
    started_at: datetime | None = None  # upstream accepted start
    last_heartbeat_at: datetime | None = None
    stop_requested_at: datetime | None = None
    stopped_at: datetime | None = None  # upstream answered stop
    finished_at: datetime | None = None  # terminal state reached
    verdicts: list[StageVerdict] = Field(default_factory=list)
    errors: list[ErrorRecord] = Field(default_factory=list)
    # What a reader should know that is not an error, as facts (a code and its figures: the start
    # waited for a fresh folder second, how a steps window ended, files replaced since the verdict);
    # ``notes`` words them (sidecar/control/notes.py).
    facts: list[Note] = Field(default_factory=list)
    clocks: list[ClockRecord] = Field(default_factory=list)  # a fleet's offsets of this host's clock
    # The server's /metrics differenced over the window (None: a record from before they were kept).
    window_metrics: WindowMetrics | None = None
    # What the server was at the start (sidecar/versions.py ServerVersion.figures: plain vLLM or
    # vLLM-Omni, their versions, what its start takes) and the per-capture options the start sent
    # (``start_options``: profile_prefix, max_iterations, delay_iterations); None: not known yet.
    server: dict[str, Any] | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def notes(self) -> list[str]:
        """The facts in words (the one place: sidecar/control/notes.py)."""
        return [word(n) for n in self.facts]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def outcome(self) -> Outcome:
        """``ok`` (the traces were checked), ``failed`` or ``unchecked`` (not yet): the one rule
        every surface reads (sidecar/control/outcome.py)."""
        return outcome_of(self)

    @model_validator(mode="before")
    @classmethod
    def _legacy_notes(cls, data: Any) -> Any:
        """A journal written before facts holds ``notes`` as prose: kept, as ``text`` facts."""
        if isinstance(data, dict) and "facts" not in data and data.get("notes"):
            data = {**data, "facts": [{"code": "text", "figures": {"text": str(t)}} for t in data["notes"]]}
        if isinstance(data, dict) and ("notes" in data or "outcome" in data):  # computed, never read back
            data = {k: v for k, v in data.items() if k not in ("notes", "outcome")}
        return data

    def fact(self, code: str) -> list[Note]:
        """This capture's notes of one code."""
        return [n for n in self.facts if n.code == code]

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def verdict(self, stage_id: int) -> StageVerdict | None:
        return next((v for v in self.verdicts if v.stage_id == stage_id), None)
