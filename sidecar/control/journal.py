"""Capture journal: one JSON file per capture under ``<state_dir>/captures/<id>.json``, written
atomically (temp file, fsync, ``os.replace``, fsync of the folder), so history and a capture left
active survive a crash. Secrets are scrubbed from every string before it is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sidecar.control.models import Capture
from sidecar.scrub import Scrubber

log = logging.getLogger(__name__)

_CAPTURE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress_oserror():
            os.unlink(tmp)
        raise
    # The rename itself must be durable too, or a crash can bring back the old file.
    with _suppress_oserror():
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)


class JournalEntry:
    """A capture as journaled, with the controller's private recovery data (``extra``)."""

    __slots__ = ("capture", "extra")

    def __init__(self, capture: Capture, extra: dict[str, Any] | None = None) -> None:
        self.capture = capture
        self.extra = extra or {}


class CaptureJournal:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir).expanduser()
        self.dir = self.state_dir / "captures"

    def path(self, capture_id: str) -> Path:
        if not _CAPTURE_ID.match(capture_id):
            raise ValueError(f"not a capture id: {capture_id!r}")
        return self.dir / f"{capture_id}.json"

    def write(self, capture: Capture, extra: dict[str, Any] | None = None) -> None:
        scrubber = Scrubber()  # the environment is read once per write, not per string
        data = scrubber.data(capture.model_dump(mode="json"))
        if extra:
            data["_recovery"] = scrubber.data(extra)
        atomic_write_text(self.path(capture.id), json.dumps(data, indent=1, sort_keys=True))

    def load(self) -> list[JournalEntry]:
        """Every readable capture, oldest first. Unreadable files are set aside (renamed
        ``*.corrupt``) with a warning instead of stopping the sidecar."""
        if not self.dir.is_dir():
            return []
        out: list[JournalEntry] = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
                extra = data.pop("_recovery", None) if isinstance(data, dict) else None
                out.append(JournalEntry(Capture.model_validate(data), extra))
            except (OSError, ValueError, ValidationError) as exc:
                log.warning("journal: %s is unreadable (%s); set aside as %s.corrupt", p, exc, p.name)
                with _suppress_oserror():
                    os.replace(p, p.with_suffix(".json.corrupt"))
        out.sort(key=lambda e: e.capture.created_at)
        return out

    # Summaries are cached beside the journal, not in it: they can be large and are recomputable.
    def summary_path(self, capture_id: str) -> Path:
        self.path(capture_id)  # validates the id
        return self.state_dir / "summaries" / f"{capture_id}.json"
