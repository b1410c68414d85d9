"""URLs in messages: what may be a secret (a user, a password, a query string) never reaches an error or a log."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

HIDDEN = "<redacted>"


def redact_url(url: str) -> str:
    """``url`` as messages show it: scheme, host, port and path; a user, password, query or fragment is replaced by
    ``<redacted>``, so a reader still sees that the URL had one."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return HIDDEN
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{HIDDEN}@{host}" if "@" in parts.netloc else host
    query = HIDDEN if parts.query else ""
    fragment = HIDDEN if parts.fragment else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def scrub(text: str, url: str) -> str:
    """``text`` (an exception's message, a server's reply) with ``url`` and its secret parts redacted."""
    if redact_url(url) == url:
        return text
    parts = urlsplit(url)
    text = text.replace(url, redact_url(url))
    userinfo = parts.netloc.rpartition("@")[0]
    password = parts.password or ""
    for secret in (userinfo, parts.query, parts.fragment, password if len(password) >= 4 else ""):
        if secret:
            text = text.replace(secret, HIDDEN)
    return text
