"""A capture's notes as facts: a code and its figures (:class:`Note`), worded in one place.

Everything the controller wants a reader to know that is not an error is a :class:`Note`;
``Capture.notes`` (the prose the API, CLI and page show) is :func:`word` of each. Tests and
programs read the codes and figures; only this module words them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from sidecar.versions import server_version


class Note(BaseModel):
    code: str
    stage_id: int | None = None
    figures: dict[str, Any] = Field(default_factory=dict)

    @property
    def text(self) -> str:
        return word(self)


def note(code: str, stage_id: int | None = None, **figures: Any) -> Note:
    return Note(code=code, stage_id=stage_id, figures=figures)


def _ago(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if abs(seconds) < 10 else f"{seconds:.1f} s"


def ends_text(ends: dict[Any, int]) -> str:
    """Each stage's own end of a window: ``22`` where every stage ends alike, else ``22 (stage 0) and 25 (stage 1)``."""
    alike = set(ends.values())
    return f"{alike.pop()}" if len(alike) == 1 else " and ".join(
        f"{n} (stage {sid})" for sid, n in sorted(ends.items(), key=lambda kv: int(kv[0])))


def _stage(label: str) -> str:
    return f"stage {label}" if label else "the engine"


# A counted window whose reads came further apart than this says so in its note: the count ran past
# the steps by what the engines ran between two reads (13 ms a read on the real two-stage server
# alone, up to 5 s beside another server's start).
SLOW_READ_S = 0.5


def _steps_ended(f: dict[str, Any]) -> str:
    by, steps, counted = f["ended_by"], f["steps_asked"], f["counted"]
    if by == "server" and f.get("bound") == "per_capture":
        return (f"the server ended the window itself after the {steps} steps this capture's start asked for "
                f"(max_iterations {steps} in the start's body, no deploy cap); the stop followed at {counted} steps "
                f"counted, once each stage had counted its end + {f['margin']}: the server holds a window open "
                "until a stop, and refuses the next start without one")
    if by == "server":
        return (f"the stop was sent at {counted} steps counted, past the {steps} asked: every stage's server ends its own "
                f"window after {ends_text(f['ends'])} engine iterations (max_iterations), so the stop waited until each "
                f"stage had counted its own end + {f['margin']} steps past its count at the start's answer: a stop "
                "sent sooner could cut a window short, one sent later changes nothing")
    if by == "steps":
        gap = f.get("read_gap_s") or 0.0
        slow = (f" The server's /metrics answered slowly (up to {gap:.1f}s between two reads: a busy server, or a "
                "machine short of CPU), and what its engines ran meanwhile counted at once."
                if counted > steps and gap >= SLOW_READ_S else "")
        return (f"the sidecar counted {counted} of the {steps} steps asked and sent the stop (a best-effort count from "
                "the read before the start was sent: steps run while the start reached the stages count though a "
                "trace may not hold them, and the engines step on while the stop travels, so a trace may hold fewer "
                f"or more; each stage's steps_traced says how many).{slow} For exactly {steps}, let the server end the "
                + ("window: leave steps_bound out (this server ends a steps window itself, per capture)"
                   if f.get("per_capture") else
                   f"window: restart it with the profiler config `omni-sidecar render --steps {steps}` writes"))
    still = f"{f['still_s']:.1f}s"
    if by == "stage_stalled":
        behind = ", ".join(f"{_stage(s)} had counted {f['per_stage'].get(s, 0) - f['heads'].get(s, 0)}"
                           for s in f["behind"])
        return (f"the stop was sent with {behind} past the start's answer and none more for {still}, while the others "
                "had ended their windows (a stage runs only on what reaches it): its trace may hold fewer steps")
    if by == "stalled":
        return (f"the window ended after {counted} of the {steps} steps asked: the server's step counter stood still "
                f"for {still} (no requests reached these stages); send load while a steps window runs, or ask for "
                "duration_s")
    if by == "unreadable":
        return (f"the window ended after {counted} of the {steps} steps asked: no read of the server's /metrics came "
                f"back for {still}; the count is unknown past that")
    if by == "counter_reset":
        return (f"the window ended after {counted} steps: an engine's step counter went back (the server restarted): "
                "its profiler is gone with it; check the server log")
    return (f"the window ended after {counted} of the {steps} steps asked: it ran the longest a steps window may run "
            f"({f['max_s']:g}s, steps_wait_s)")


def _steps_traced(f: dict[str, Any], sid: int | None) -> str:
    n, asked = f["steps_traced"], f["steps_asked"]
    text = (f"stage {sid}: the trace holds {n} engine steps, {asked} {'was' if asked == 1 else 'were'} asked "
            f"({n - asked:+d})")
    if f.get("idle_iterations"):
        text += (f"; {f['idle_iterations']} of the {f['iterations']} iterations it recorded were idle (nothing "
                 "scheduled: between requests, or a stage waiting for another's output)"
                 + (", and the server's max_iterations counts them" if f.get("capped") else ""))
    return text


def _server_bound(f: dict[str, Any], sid: int | None) -> str:
    steps, mi, di = f["steps"], f["max_iterations"], f["delay_iterations"]
    skip = f", after skipping the first {di} (delay_iterations: {di})" if di > 0 else ""
    if f["how"] == "delay":
        return (f"stage {sid}: the server starts recording {di} engine iterations into each window (delay_iterations: "
                f"{di}, fixed at its start): the trace holds about {max(steps - di, 0)} of the {steps} steps asked")
    if f["how"] == "ends_first":
        return (f"stage {sid}: the server records up to {mi} engine iterations per window (max_iterations: {mi}{skip}); "
                f"this window's {steps} steps end it first")
    tail = (f" of the {steps} steps asked; for more, restart the server with a larger max_iterations "
            f"(omni-sidecar render --steps {steps})" if f["end"] < steps else " steps, however late the stop lands")
    return (f"stage {sid}: the server stops its own profiler after {mi} engine iterations (max_iterations: {mi}, fixed "
            f"at its start{skip}; idle iterations count): the trace holds at most {mi}{tail}")


def _idle_render(f: dict[str, Any]) -> str:
    idle = {int(s): v for s, v in f["idle"].items()}
    caps = {int(s): v for s, v in f["caps"].items()}
    flags = " ".join(f"--idle {s}={i}/{n}" for s, (i, n) in sorted(idle.items()))
    capped = ", ".join(f"{caps[s]} on stage {s}" for s in sorted(caps))
    many = len(idle) > 1
    return (f"for {f['steps']} steps on {'those stages' if many else f'stage {next(iter(idle))}'} too, give "
            f"{'each' if many else 'it'} the iterations it idles: restart the server with the profiler config "
            f"`omni-sidecar render --steps {f['steps']} {flags}` writes (max_iterations {capped})")


def _server_version(f: dict[str, Any]) -> str:
    version = server_version(f)
    return version.describe() if version is not None else f"server: {f}"


def _start_options(f: dict[str, Any]) -> str:
    parts = []
    if f.get("max_iterations") is not None:
        delay = f" after {f['delay_iterations']}" if f.get("delay_iterations") else ""
        parts.append(f"to end the window itself after exactly {f['max_iterations']} engine steps{delay} "
                     "(per-capture bound: no deploy cap needed)")
    if f.get("profile_prefix"):
        parts.append(f"to start every file name of this window with {f['profile_prefix']}_ (this capture's files "
                     "are told apart by name from any other's in the folder)")
    if f.get("profiler_kwargs"):
        opts = ", ".join(f"{k}={'on' if v else 'off'}" for k, v in sorted(f["profiler_kwargs"].items()))
        parts.append(f"to record this window with the torch options {opts} (profiler_kwargs, this capture only)")
    return "the start asked the server " + " and ".join(parts)


def _version_unknown(f: dict[str, Any]) -> str:
    if f.get("version"):
        return (f"{f['what']} {f['version']} is not in the sidecar's table of versions (sidecar/versions.py): it is "
                f"treated as {f['assumed']}, the nearest known")
    return f"the server did not say its {f['what']} version (GET /version): it is treated as {f['assumed']}"


def _window_capped(f: dict[str, Any], sid: int | None) -> str:
    cap, delay = f["max_iterations"], f["delay_iterations"]
    skip = f" after skipping {delay}" if delay > 0 else ""
    keys = ", ".join(k for k in (f"max_iterations {cap}" if cap > 0 else "", f"delay_iterations {delay}" if delay > 0 else "") if k)
    if cap > 0:
        return (f"stage {sid} records at most {cap} engine iterations{skip} from the start, however long the window "
                f"({keys} in its deploy; idle iterations count): under load its trace holds only the window's first steps")
    return (f"stage {sid} skips its first {delay} engine iterations from the start ({keys} in its deploy; idle "
            "iterations count): its trace leaves out the window's first steps")


_WORDS: dict[str, Callable[[dict[str, Any], int | None], str]] = {
    "text": lambda f, _: str(f.get("text", "")),
    "budget_over": lambda f, _: (
        f"{f['steps']} steps on stages {f['stages']} are predicted at {f['predicted_mb']:.1f} MB (stop "
        f"{f['predicted_stop_s']:.1f}s), above the budget of {f['budget_mb']:g} MB; ask for at most {f['max_steps']} "
        "steps, or lighter profiler flags on the server (torch_profiler_with_stack / record_shapes off), or raise "
        "OMNI_SIDECAR_BUDGET_MB"),
    "server_bound": _server_bound,
    "window_capped": lambda f, sid: _window_capped(f, sid),
    "folder_second_wait": lambda f, _: (
        f"start waited {f['wait_s']:.2f}s for the next second: a session folder of this capture's stages is named "
        f"with second {f['second']} (the previous window's), and a start in that second would reuse its name"),
    "start_at_late": lambda f, _: (
        f"start_at was {_ago(f['late_s'])} past when the capture was ready: its start was sent at once"),
    "stop_unconfirmed": lambda f, _: (
        f"the server did not confirm the stop of stages {f['stages']} ({f['why']}): they may still be recording. The "
        "next start on this server sends the stop again first, and is refused if the server does not answer it"),
    "stopped_first": lambda f, _: (
        f"stages {f['stages']} were stopped first: the stop of capture {f['after']} was not confirmed by the server, "
        "and a start on a stage still recording would take its old window into this capture's trace"),
    "files_changed": lambda f, _: (
        f"files changed since the verdict: {', '.join(f['files'])} (another size, time or inode, or gone): the verdict "
        "describes them as they were when checked; what is on disk now may be another window's (a later start that "
        "reused the session folder name) or rewritten"),
    "steps_ended": lambda f, _: _steps_ended(f),
    "steps_not_counted": lambda f, _: f"the steps the traces hold are not counted: {f['why']}",
    "steps_traced": _steps_traced,
    "idle_fed_too_little": lambda f, sid: (
        f"stage {sid} idled {f['idle_iterations']} of its {f['iterations']} iterations, more than "
        f"{f['max_share']:.0%}: it is fed too little for a window counted in steps (more requests at once feed it; "
        "docs/captures.md)"),
    "idle_ends_first": lambda f, sid: (
        f"stage {sid} idled {f['idle_iterations']} of its {f['iterations']} iterations (nothing scheduled: between "
        f"requests), and it ends the window first: its cap stays at the steps + {f['idle_margin']} (render --idle "
        f"gives a stage that ends later the iterations it idles), so for {f['steps']} steps on it send more requests "
        "at once"),
    "idle_render": lambda f, _: _idle_render(f),
    "server_version": lambda f, _: _server_version(f),
    "version_unknown": lambda f, _: _version_unknown(f),
    "profiler_not_mounted": lambda f, _: (
        f"{f['why']}; until then no capture can run there (the config checked here may be the one that gives it a "
        "profiler)"),
    "version_mismatch": lambda f, _: (
        f"vLLM-Omni {f['omni'] or '(none made for it)'} runs on vLLM {f['vllm']}: vLLM-Omni must match vLLM's "
        f"major.minor (it warns of this in its own log only); fix: {f['fix']}"),
    "start_options": lambda f, _: _start_options(f),
    # written by sidecars before the stop of unconfirmed windows moved before the start; still in journals
    "session_reopened": lambda f, _: (
        f"the server answered the start with 409 (a profiling session still open): it was this sidecar's own, "
        f"capture {f['previous']}'s, whose stop the server never answered; the sidecar stopped it (stages "
        f"{f['stages']}) and started this capture again"),
}


def word(n: Note) -> str:
    """The one place a note becomes prose."""
    words = _WORDS.get(n.code)
    if words is None:  # a note from a newer sidecar's journal: its code and figures as they are
        return f"{n.code}: {n.figures}"
    try:
        return words(n.figures, n.stage_id)
    except (KeyError, TypeError, ValueError):
        return f"{n.code}: {n.figures}"


__all__ = ["Note", "ends_text", "note", "word"]
