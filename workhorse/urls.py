"""URLs as shown to people (a password in one is never printed or logged), and the
failover form of a broker URL: ``amqp://h1//;amqp://h2//``, tried in that order."""
from __future__ import annotations


def alternatives(url: str) -> list[str]:
    """The URLs of a failover list (``a;b;c``), in order; a plain URL is a list of one."""
    return [part.strip() for part in url.split(";") if part.strip()]


def redact(url: str) -> str:
    """``scheme://user:***@host/...`` for a URL with a password (each URL of a failover
    list); any other text as is."""
    if ";" in url:
        return ";".join(redact(part) for part in alternatives(url))
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in credentials else url
