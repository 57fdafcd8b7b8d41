"""A child's heartbeat: a few bytes of memory shared with the supervisor.

A child running async tasks counts its event loop's turns here (a beat every
``BEAT_INTERVAL``), and names the job whose code runs on the loop right now (its seq; 0
between steps). The supervisor reads both without a word from the child: a count that stops
moving is a blocked loop, and the job named then is the one that blocks it; read after the
child died, it is the job whose code was running as it died. No frame, no lock: one writer,
and a torn read only delays the verdict by a check.
"""
from __future__ import annotations

import mmap
import struct

#: How often a child's event loop beats while it runs async tasks.
BEAT_INTERVAL = 0.1

_FIELDS = struct.Struct("=QQ")      # beats, running seq
_RUNNING = struct.Struct("=Q")


class Heart:
    """Made by the supervisor before the fork, so both processes map the same page."""

    def __init__(self) -> None:
        self._memory = mmap.mmap(-1, mmap.PAGESIZE)     # anonymous and shared

    # -- the child's side
    def beat(self) -> None:
        beats, running = _FIELDS.unpack_from(self._memory)
        _FIELDS.pack_into(self._memory, 0, beats + 1, running)

    def running(self, seq: int) -> None:
        """The code of job ``seq`` runs on the loop now (0: none does)."""
        _RUNNING.pack_into(self._memory, _RUNNING.size, seq)

    # -- the supervisor's side
    def read(self) -> tuple[int, int]:
        """(beats so far, the seq of the job whose code runs now or 0)."""
        beats, running = _FIELDS.unpack_from(self._memory)
        return beats, running

    def close(self) -> None:
        self._memory.close()
