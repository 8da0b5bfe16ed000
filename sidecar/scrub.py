"""Secrets never leave the sidecar: the values of secret-named environment variables (HF_TOKEN,
...), registered values (the bearer token), credentials in URLs and credential-shaped text are
replaced by ``***`` in
everything it writes (journal, error records, ``serve``'s log lines: ``ScrubLogs``) or serves
(every HTTP reply). One rule, used by all.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import Any

SECRET_ENV_NAME = re.compile(r"(?i)(TOKEN|API_?KEY|ACCESS_KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL)")
MIN_SECRET_LEN = 6  # shorter values ("1", "true") would scrub ordinary words

_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{16,}\b")
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]{8,}")
_KEY_VALUE = re.compile(
    r"(?i)\b([A-Z0-9_]*(?:TOKEN|API_KEY|APIKEY|SECRET|PASSWORD|PASSWD))(['\"]?\s*[=:]\s*)(['\"]?)[^\s'\",}]+"
)
_OPENAI_KEY = re.compile(r"\bsk-[A-Za-z0-9]{16,}\b")
# credentials in a URL (``http://user:pw@host``): the user-info part goes, the host stays
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")

# values the process knows to be secret beyond the environment (the bearer token), registered once
_REGISTERED: set[str] = set()


def register_secret(value: str | None) -> None:
    """Scrub ``value`` everywhere from now on (journal, error records, replies)."""
    if value and len(value) >= MIN_SECRET_LEN:
        _REGISTERED.add(value)


def env_secret_values() -> list[str]:
    """Values of secret-named environment variables, longest first (a secret containing another
    is replaced whole)."""
    values = {v for k, v in os.environ.items() if SECRET_ENV_NAME.search(k) and len(v) >= MIN_SECRET_LEN}
    return sorted(values | _REGISTERED, key=len, reverse=True)


def scrub_secrets(text: str, values: Iterable[str] | None = None) -> str:
    """``text`` with the known secret ``values`` (default: the environment's, read now) and anything
    credential-shaped replaced by ``***``."""
    for secret in env_secret_values() if values is None else values:
        if secret in text:
            text = text.replace(secret, "***")
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}***@", text)
    text = _HF_TOKEN.sub("***", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} ***", text)
    text = _KEY_VALUE.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}***", text)
    return _OPENAI_KEY.sub("***", text)


class Scrubber:
    """Scrubs strings anywhere in JSON-like data with the secret values known at construction
    (the environment's plus ``extra``), so a hot path does not re-read the environment per string."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        values = set(env_secret_values())
        values.update(v for v in extra if v and len(v) >= MIN_SECRET_LEN)
        self._values = sorted(values, key=len, reverse=True)

    def add(self, value: str | None) -> None:
        if value and len(value) >= MIN_SECRET_LEN and value not in self._values:
            self._values = sorted([*self._values, value], key=len, reverse=True)

    def text(self, value: str) -> str:
        return scrub_secrets(value, self._values)

    def data(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value


class ScrubLogs(logging.Filter):
    """A log handler's filter: the record's message and its string arguments scrubbed, so a token
    sent in a URL (``?token=...``, a capture id) never reaches uvicorn's access log or any other
    line. Arguments keep their places and types (uvicorn's access formatter reads them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = scrub_secrets(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(scrub_secrets(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: scrub_secrets(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True
