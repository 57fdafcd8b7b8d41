"""URLs as shown to people (a password in one is never printed or logged); the failover
form of a broker URL (``amqp://h1//;amqp://h2//``, tried in that order); Redis's other
names (Valkey) and its Sentinel lists (``sentinel://h1:26379;sentinel://h2:26379``)."""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit


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


#: Schemes that name a Redis server by another name: Valkey is wire-compatible (kombu and
#: redis-py do not know the scheme).
REDIS_ALIASES = {"valkey": "redis", "valkeys": "rediss"}
#: A list of Redis Sentinels (Celery's form, ``sentinel://h1:26379;sentinel://h2:26379``).
SENTINEL = "sentinel"
SENTINEL_PORT = 26379


def scheme_of(url: str) -> str:
    """The scheme of a URL (of the first URL of a failover list); '' if it has none."""
    first = alternatives(url)[0] if alternatives(url) else url
    return first.split("://", 1)[0] if "://" in first else ""


def as_redis(url: str) -> str:
    """``valkey://`` and ``valkeys://`` (each URL of a list) as the ``redis://`` and
    ``rediss://`` they are on the wire; any other URL as it is."""
    parts = []
    for part in alternatives(url) or [url]:
        scheme, sep, rest = part.partition("://")
        parts.append(f"{REDIS_ALIASES.get(scheme, scheme)}{sep}{rest}")
    return ";".join(parts)


def split_master_name(url: str) -> tuple[str, str | None]:
    """A sentinel list without workhorse's ``?master_name=`` query at its end, and that
    name (None if the URL gives none)."""
    head, sep, query = url.rpartition("?")
    if not sep:
        return url, None
    found = None
    kept = []
    for pair in query.split("&"):
        key, _, value = pair.partition("=")
        if key == "master_name" and value:
            found = value
        elif pair:
            kept.append(pair)
    return (head + ("?" + "&".join(kept) if kept else "")), found


@dataclass(frozen=True)
class Sentinels:
    """What a ``sentinel://`` list gives: the sentinels, and the master's database and
    password (from the first URL, as kombu and Celery read them)."""

    addresses: tuple[tuple[str, int], ...]
    db: int
    password: str | None


def sentinels(url: str) -> Sentinels:
    addresses = []
    db, password = 0, None
    for i, part in enumerate(alternatives(split_master_name(url)[0])):
        parsed = urlsplit(part)
        if parsed.scheme != SENTINEL or not parsed.hostname:
            raise ValueError(f"{redact(part)}: expected sentinel://host:port")
        addresses.append((parsed.hostname, parsed.port or SENTINEL_PORT))
        if i == 0:
            path = parsed.path.strip("/")
            db = int(path) if path.isdigit() else 0
            password = unquote(parsed.password) if parsed.password else None
    return Sentinels(tuple(addresses), db, password)
