"""What a forked child must do with the connections it inherited: nothing, ever.

A sqlite3 connection closed in a forked copy of its process can take the database's
write-ahead log with it: the copy's close sees no other connection of its own, checkpoints
and unlinks the -wal file that the parent is still writing to, and committed rows vanish
for every new reader. Sockets are safer but still shared. So an object that notices it now
lives in another process hands its old connection here, to be kept alive (never collected,
never closed) until the process ends with os._exit, and opens a new one.
"""
from __future__ import annotations

_inherited: list[object] = []


def abandon(connection: object | None) -> None:
    """Keep ``connection`` referenced for the life of this process, so it is never closed."""
    if connection is not None:
        _inherited.append(connection)
