"""URLs as shown to people: a password in one is never printed or logged."""
from __future__ import annotations


def redact(url: str) -> str:
    """``scheme://user:***@host/...`` for a URL with a password; any other text as is."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in credentials else url
