"""What a forked child must do with the connections it inherited: nothing, ever.

A sqlite3 connection closed in a forked copy of its process can take the database's
write-ahead log with it: the copy's close sees no other connection of its own, checkpoints
and unlinks the -wal file that the parent is still writing to, and committed rows vanish
for every new reader. Sockets are safer but still shared. So an object that notices it now
lives in another process hands its old connection here, to be kept alive (never collected,
never closed) until the process ends with os._exit, and opens a new one.

That new connection is not wholly the child's own: SQLite keeps one record per file per
process (its locks, its mapping of the -shm file), found by inode, and the child finds the
one it inherited. So a child's connection to a file its parent had open when it forked
relies on the parent's lock on that file's -shm; if the parent closes its last connection
to the file, the next process to open it sees no one attached, truncates the -shm under
the child (SIGBUS there) and rebuilds it (writes lost). A parent that forks must keep its
connections open while such children live.
"""
from __future__ import annotations

_inherited: list[object] = []


def abandon(connection: object | None) -> None:
    """Keep ``connection`` referenced for the life of this process, so it is never closed."""
    if connection is not None:
        _inherited.append(connection)
