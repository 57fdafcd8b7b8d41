"""The workers of this broker on this host that died: what their journals say, and acting
on it (``broker.journal`` has the why).

- SQLite and Redis: ``put_back`` puts what a dead worker held back at once, through the
  channel's ``recover(owners, judge)``, each message as its journal judges it, then
  removes the journal.
- RabbitMQ gives back what a dead connection held by itself, marked redelivered:
  ``verdict`` says what one such message's loss counts as, from the journals of dead
  workers read so far (read again, at most every RESCAN_INTERVAL, when none knows it).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..protocol import Verdict
from .journal import Dead, Journal, Record, dead_journals

log = logging.getLogger("workhorse.journal")

#: How often the journals of dead workers are looked for (the broker thread's housekeeping).
LOOK_INTERVAL = 2.0
#: RabbitMQ: at most how often they are read again for a redelivery none explains.
RESCAN_INTERVAL = 0.5
#: RabbitMQ: a dead worker's journal is kept this long (its redeliveries come at once).
KEPT = 3600.0

#: A channel's ``recover``: put back what the leases of ``owners`` hold, as ``judge``
#: says of each (by delivery tag); returns how many.
Recover = Callable[[Iterable[str], Callable[[str], Verdict]], int]


class DeadWorkers:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        #: RabbitMQ: journals read so far (path -> (mtime, record, keys explained already)).
        self._read: dict[Path, tuple[float, Record, set[str]]] = {}
        self._read_at = 0.0

    def _dead(self) -> Iterator[Dead]:
        return dead_journals(self.journal.path.parent, self.journal.path)

    def put_back(self, recover: Recover) -> None:
        """SQLite, Redis: put back what each dead worker held; its journal goes once that
        is done (a broker error leaves it, for the next look)."""
        for dead in self._dead():
            record = dead.record
            assert record is not None
            recovered = recover(record.owners, record.verdict)
            dead.remove()
            if recovered:
                log.warning("recovered %d messages held by a worker that died (journal %s): "
                            "%d had started (counted as deliveries; each runs alone from now "
                            "on), the others were only held (not counted)", recovered,
                            dead.path.name, len(record.running))

    def read(self) -> None:
        """RabbitMQ: read the journals of dead workers not read yet; remove those kept past
        KEPT, and forget those removed."""
        self._read_at = time.monotonic()
        now = time.time()
        for dead in self._dead():
            try:
                mtime = os.stat(dead.path).st_mtime
            except OSError:
                continue
            if now - mtime > KEPT:
                dead.remove()
            elif dead.path not in self._read and dead.record is not None:
                self._read[dead.path] = (mtime, dead.record, set())
        for path in [p for p in self._read if not p.exists()]:
            del self._read[path]

    def verdict(self, key: str | None) -> Verdict | None:
        """RabbitMQ: what the death that gave this message back costs it, as the newest
        journal that knows it says; None if none does (it may have started elsewhere)."""
        if key is None:
            return None
        if self.journal.take_returned(key):     # our own lost connection, while only held
            return Verdict(started=False, held_loss=True)
        for attempt in range(2):
            for _, record, spent in sorted(self._read.values(), key=lambda read: -read[0]):
                if key not in spent and (key in record.arrived or key in record.started):
                    spent.add(key)
                    return record.verdict(key)
            if attempt or time.monotonic() - self._read_at < RESCAN_INTERVAL:
                return None
            self.read()
        return None
