"""The one rule for a URL a user gives (the server, a sidecar, a fleet target): http or https with a
host, and no query or fragment (``without_query``). ``127.0.0.1:8000`` without its scheme would
otherwise reach nothing (httpx refuses it, or reads the host as a scheme) and be reported as a server
that does not answer."""

from __future__ import annotations

from urllib.parse import urlsplit


def http_url(text: str) -> str | None:
    """``text`` stripped of blanks and a trailing ``/`` where it is an http(s) URL with a host, else None."""
    value = str(text).strip()
    try:
        parts = urlsplit(value)
        host = parts.hostname
    except ValueError:  # a bracketed host that is no IPv6 address, a port out of range...
        return None
    if parts.scheme not in ("http", "https") or not host:
        return None
    return value.rstrip("/")


def without_query(url: str) -> str | None:
    """``url`` without its query and fragment where it has either (a ``?`` or ``#`` alone too), else
    None. A base URL takes neither: every call appends its route to it, and ``host:8000?x=1/healthz``
    reaches no route, so such a URL is refused naming this one."""
    parts = urlsplit(url)
    if not (parts.query or parts.fragment or "?" in url or "#" in url):
        return None
    return parts._replace(query="", fragment="").geturl().rstrip("/?#")


def with_scheme(text: str, default: str = "127.0.0.1:8000") -> str:
    """How ``text`` reads with its scheme, for the message that asks for it."""
    return "http://" + (str(text).strip().split("://")[-1] or default)
