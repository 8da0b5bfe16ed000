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

log = logging.getLogger(__name__)

_CAPTURE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# Tokens that must never reach disk or an API reply: HF tokens, bearer headers, key=value secrets.
_SECRET_PATTERNS = [
    re.compile(r"\bhf_[A-Za-z0-9]{16,}\b"),
    re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(
        r"(?i)\b([A-Z0-9_]*(?:TOKEN|API_KEY|APIKEY|SECRET|PASSWORD|PASSWD))(['\"]?\s*[=:]\s*)(['\"]?)[^\s'\",}]+"
    ),
    re.compile(r"\bsk-[A-Za-z0-9]{16,}\b"),
]


_SECRET_ENV = re.compile(r"(?i)(TOKEN|API_?KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL)")


def env_secret_values() -> list[str]:
    """Values of secret-named environment variables (HF_TOKEN, ...), longest first."""
    values = {v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= 8}
    return sorted(values, key=len, reverse=True)


def scrub_secrets(text: str, values: list[str] | None = None) -> str:
    """Replace anything that looks like a credential, and the values of secret-named
    environment variables (or ``values`` when given), with ``***``."""
    for secret in env_secret_values() if values is None else values:
        if secret in text:
            text = text.replace(secret, "***")
    text = _SECRET_PATTERNS[0].sub("***", text)
    text = _SECRET_PATTERNS[1].sub(lambda m: f"{m.group(1)} ***", text)
    text = _SECRET_PATTERNS[2].sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}***", text)
    return _SECRET_PATTERNS[3].sub("***", text)


def _scrub(value: Any, values: list[str]) -> Any:
    if isinstance(value, str):
        return scrub_secrets(value, values)
    if isinstance(value, dict):
        return {k: _scrub(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, values) for v in value]
    return value


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
        values = env_secret_values()
        data = _scrub(capture.model_dump(mode="json"), values)
        if extra:
            data["_recovery"] = _scrub(extra, values)
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
