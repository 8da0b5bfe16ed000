"""The controller's knobs (:class:`ControlSettings`): bounds on collecting, stopping, leases,
``steps`` windows and plans. A misspelt knob is an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from sidecar.config.settings import SidecarSettings


class ControlSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt knob is an error, not silently ignored

    collect_timeout_s: float = Field(default=120, ge=0)  # bound on waiting for gzip after the stop
    # An unclosed plain .json is still being written until unchanged this long (within the bound).
    trace_quiet_s: float = Field(default=2.0, gt=0)
    poll_s: float = Field(default=0.05, gt=0)  # how often a pending gzip is looked at
    artifact_roots: dict[str, str] = Field(default_factory=dict)  # SERVER_PATH -> LOCAL_PATH
    default_lease_s: float | None = Field(default=None, gt=0)
    max_duration_s: float | None = Field(default=None, gt=0)
    close_timeout_s: float = Field(default=60, ge=0)  # how long close() waits for a stop
    # A rollback runs inside start(); a dead stage 500s every stop, so it gets its own short budget.
    rollback_budget_s: float = Field(default=30, gt=0)
    summarize: bool = True  # cache a trace summary after completion when sidecar.analysis has one
    keep: int | None = Field(default=None, ge=0)  # finished captures kept in history (None: all)
    keep_days: float | None = Field(default=None, gt=0)  # finished captures older than this are dropped
    # Clock skew allowed between the server's stamps (folder epoch, file ns) and this process.
    clock_skew_s: float = Field(default=2.0, ge=0)
    # A stop ends ``failed`` once the server has been unreachable this long (probed every
    # ``gone_poll_s``) instead of waiting out the stop budget.
    gone_after_s: float = Field(default=10.0, gt=0)
    gone_poll_s: float = Field(default=1.0, gt=0)
    # Server-side torch_profiler_dirs another server also writes into (-> who), e.g. set by the
    # fleet when the user overrides the ``profiler_dir_shared`` refusal: those stages are
    # ``ambiguous``, never ``ok``.
    shared_profiler_dirs: dict[str, str] = Field(default_factory=dict)
    # ``steps`` windows: how often the server's /metrics step counter is read while one runs, and
    # how long a ``delay_steps`` start waits for the server to run them.
    steps_poll_s: float = Field(default=0.02, gt=0)
    steps_wait_s: float = Field(default=600, gt=0)
    # A ``steps`` window every stage's server caps: its stop waits this long at most for a stage
    # whose count stands still short of its window (on the real vLLM-Omni server the downstream
    # stage's stood 2.5 s in the first window after the server's start).
    steps_stall_s: float = Field(default=10.0, gt=0)
    # Where every ``steps`` window's counter reads are written as a JSON fixture (None: nowhere): the
    # steps policy's unit tests replay windows recorded on the real servers (tests/data/steps/).
    steps_record_dir: str | None = None
    # The most a ``plan`` (its probes included) may take; it says so in its answer.
    plan_max_s: float = Field(default=300.0, gt=0)
    # A start scheduled (``start_at``) further ahead than this is refused (None: any time ahead;
    # the capture holds the slot until then, and a stop cancels it).
    start_at_max_s: float | None = Field(default=None, gt=0)
    window_metrics: bool = True  # scrape /metrics at start and stop and keep the difference
    # A ``steps`` capture planned (``plan``) above this many MB is refused (or only noted: warn).
    budget_mb: float | None = Field(default=None, gt=0)
    budget_action: Literal["refuse", "warn"] = "refuse"

    @classmethod
    def from_settings(cls, settings: SidecarSettings) -> ControlSettings:
        return cls(
            collect_timeout_s=settings.collect_timeout_s,
            trace_quiet_s=settings.trace_quiet_s,
            artifact_roots=dict(settings.artifact_roots),
            default_lease_s=settings.default_lease_s,
            max_duration_s=settings.max_duration_s,
            close_timeout_s=settings.close_timeout_s,
            keep=settings.keep,
            keep_days=settings.keep_days,
            budget_mb=settings.budget_mb,
            budget_action=settings.budget_action,
            gone_after_s=settings.gone_after_s,
            steps_wait_s=settings.steps_wait_s,
            steps_stall_s=settings.steps_stall_s,
            steps_record_dir=settings.steps_record_dir,
            plan_max_s=settings.plan_max_s,
            start_at_max_s=settings.start_at_max_s,
        )


__all__ = ["ControlSettings"]
