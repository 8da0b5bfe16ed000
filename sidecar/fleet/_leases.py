"""What a fleet holds and what it sweeps (docs/fleet.md, "When the fleet process dies").

Every capture a fleet starts carries its key in its label (``... [fleet:KEY]``) and, where the
target takes one, a lease. :class:`Leases` keeps the windows the fleet holds (from a start to its
stop), renews each lease every third of it, and sweeps: it lists a target's captures and stops every
one still starting or active that carries the key and that the fleet does not hold (a start that
landed after its deadline, a window whose stop was lost). A target it cannot list is named with what
ends a capture left there. The fan-out itself (start, stop, reads) is ``sidecar/fleet/_fleet.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

from sidecar.control.models import LABEL_MAX, Capture, CaptureState, StopReason
from sidecar.errors import TargetNoAnswer
from sidecar.fleet._drivers import Driver
from sidecar.fleet._results import (
    FleetCapture,
    Sweep,
    TargetOutcome,
    TargetResult,
    error_of,
)
from sidecar.fleet._targets import Target, TargetKind

log = logging.getLogger("sidecar.fleet")

R = TypeVar("R")
_KEYED = re.compile(r"\[fleet:([A-Za-z0-9_.-]{1,64})\]$")
_LIVE = (CaptureState.starting, CaptureState.active)


_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # what a fleet key is (the label's mark above)


def key_problem(key: object) -> str | None:
    """What makes ``key`` no fleet key (None: nothing)."""
    if isinstance(key, str) and _KEY.fullmatch(key):
        return None
    return f"key must be 1-64 letters, digits, '_', '.' or '-', got {key!r}"


def keyed_label(label: str | None, key: str) -> str:
    """The label a fleet's capture carries: the caller's, then ``[fleet:KEY]`` (what its sweep
    looks for on every target), within the API's bound on a label."""
    mark = f"[fleet:{key}]"
    if not label:
        return mark
    return f"{label[:LABEL_MAX - len(mark) - 1]} {mark}"


def key_of(label: str | None) -> str | None:
    """The fleet key a capture's label carries, or None."""
    found = _KEYED.search(label or "")
    return found.group(1) if found else None


async def within(deadline: float | None, aw: Awaitable[R], what: str, budget_s: float) -> R:
    """``aw`` bounded by ``deadline`` (loop time; ``None``: unbounded), else ``TargetNoAnswer``."""
    if deadline is None:
        return await aw
    try:
        # wait_for, not asyncio.timeout_at: the package supports Python 3.10
        return await asyncio.wait_for(aw, max(deadline - asyncio.get_running_loop().time(), 0.0))
    except asyncio.TimeoutError:  # on 3.10 not the builtin TimeoutError
        raise TargetNoAnswer(f"no answer to {what} within {budget_s:g}s") from None


def swept_text(sw: Sweep) -> str:
    parts = []
    if sw.stopped:
        parts.append(f"stopped {', '.join(sw.stopped)}, still live with this fleet's key")
    if sw.error is not None:
        parts.append(f"could not sweep it ({sw.error.code}: {sw.error.message}); what ends a capture left there: "
                     f"{sw.ends_by}")
    return "; ".join(parts)


def with_sweep(out: dict[str, TargetResult], swept: dict[str, Sweep]) -> dict[str, TargetResult]:
    return {n: r if n not in swept else r.model_copy(update={"sweep": swept[n]}) for n, r in out.items()}


class Leases:
    """The windows a fleet holds (target -> capture id and lease), renewed every third of their
    lease until their stop, and the sweep of its key. ``drivers`` / ``driver`` / ``each`` are the
    fleet's (its targets' drivers, the one of a name, its bounded fan-out); ``timeout_s`` bounds
    each call on a target."""

    def __init__(self, key: str, *, lease_s: float | None, state_dir: Path | None, timeout_s: float,
                 drivers: Callable[[], dict[str, Driver]], driver: Callable[[str], Driver],
                 each: Callable[..., Awaitable[list[Any]]]) -> None:
        self.key, self.lease_s, self.state_dir, self.timeout_s = key, lease_s, state_dir, timeout_s
        self._drivers, self._driver, self._each = drivers, driver, each
        self._held: dict[str, tuple[str, float | None]] = {}
        self._renewal: asyncio.Task[None] | None = None

    # --- the windows held -------------------------------------------------------------------

    def hold(self, fc: FleetCapture, lease_s: float | None) -> None:
        """Hold ``fc``'s windows: each renewed every third of its lease until its stop."""
        for name, r in fc.targets.items():
            if r.outcome is TargetOutcome.started and r.capture_id:
                self._held[name] = (r.capture_id, lease_s)
        if lease_s is not None and (self._renewal is None or self._renewal.done()):
            self._renewal = asyncio.ensure_future(self._renew())

    def drop(self, name: str, capture_id: str) -> None:
        """``capture_id`` on ``name`` is being stopped: no longer held, no longer renewed."""
        if self._held.get(name, ("",))[0] == capture_id:
            del self._held[name]

    def kept(self) -> set[str]:
        return {cid for cid, _ in self._held.values()}

    def release_all(self) -> None:
        self._held.clear()
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None

    async def _renew(self) -> None:
        """Every held window's lease renewed every third of it (one heartbeat fan-out per round)."""
        while True:
            leases = [lease for _, lease in self._held.values() if lease is not None]
            if not leases:
                return
            await asyncio.sleep(min(leases) / 3)
            held = [(n, cid) for n, (cid, lease) in self._held.items() if lease is not None]
            deadline = asyncio.get_running_loop().time() + self.timeout_s

            async def beat(item: tuple[str, str]) -> None:
                name, cid = item
                try:
                    await within(deadline, self._driver(name).heartbeat(cid), "a heartbeat", self.timeout_s)
                except Exception as exc:  # a missed renewal is not fatal: the next comes a third of a lease later
                    log.debug("lease renewal of %s on %s failed: %s", cid, name, exc)

            await self._each(held, beat)

    # --- the sweep --------------------------------------------------------------------------

    def ends_by(self, t: Target) -> str:
        """What ends a capture of this fleet on ``t`` that the fleet cannot stop itself."""
        if t.kind is TargetKind.upstream:
            if self.state_dir is None:
                return ("nothing but a stop by hand: this fleet journals no upstream capture (no state_dir); "
                        f"POST /stop_profile to {t.url}")
            return f"the next fleet opened over state dir {self.state_dir}, whose journal it is in"
        if self.lease_s is None:
            return "its duration, if it was given one: it has no lease; `omni-sidecar fleet stop` stops it"
        return f"its lease: it stops itself at most {self.lease_s:g}s after this fleet's last renewal"

    async def sweep(self, keep: Collection[str], names: Collection[str] | None = None) -> dict[str, Sweep]:
        """Each target of ``names`` (default: every one) swept, keeping the capture ids ``keep``;
        the targets with something to say."""
        drivers = self._drivers()
        listed: Sequence[str] = list(drivers) if names is None else [n for n in drivers if n in names]
        results = await self._each(listed, lambda n: self.sweep_one(n, keep))
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res
        return {n: res for n, res in zip(listed, results) if isinstance(res, Sweep)}

    async def listed(self, d: Driver) -> list[Capture]:
        """What the target says: its newest captures (one read)."""
        return await within(asyncio.get_running_loop().time() + self.timeout_s, d.captures(),
                            "a list of its captures", self.timeout_s)

    async def sweep_one(self, name: str, keep: Collection[str], listed: list[Capture] | None = None) -> Sweep | None:
        """One target's sweep: its captures still starting or active with this fleet's key, other
        than ``keep``, each sent a stop (``listed``: the target's captures, read already)."""
        d = self._drivers()[name]
        if listed is None:
            try:
                listed = await self.listed(d)
            except Exception as exc:
                return Sweep(error=error_of(exc), ends_by=self.ends_by(d.target))
        found = [c for c in listed if c.state in _LIVE and c.id not in keep and key_of(c.label) == self.key]
        if not found:
            return None
        out = Sweep()
        loop = asyncio.get_running_loop()
        for c in found:
            try:
                await within(loop.time() + self.timeout_s, d.stop(c.id, StopReason.explicit), "a stop", self.timeout_s)
                out.stopped.append(c.id)
            except Exception as exc:
                out.error, out.ends_by = error_of(exc), self.ends_by(d.target)
        log.warning("fleet %s: %s: %s", self.key, name, swept_text(out))
        return out


__all__ = ["LABEL_MAX", "Leases", "key_of", "key_problem", "keyed_label", "swept_text", "with_sweep", "within"]
