"""The sentinel: a small process that kills every child's process group when the supervisor
dies, however it dies.

A child dies with the supervisor (PR_SET_PDEATHSIG), but what its task started lives on in
the child's process group, which only a killpg reaches, and a supervisor killed outright
(SIGKILL, the OOM killer) sends none. The sentinel holds the read end of a pipe whose write
end only the supervisor has (children close it, programs they run never inherit it): the
kernel closes it when the supervisor exits, for whatever reason, and the sentinel, reading
end of file, SIGKILLs every group it was told of, then exits.

The supervisor tells it of a child's group when it forks the child, and that the group is
gone before it reaps that child, while the zombie still pins the number: the sentinel never
holds a pgid that may have been given to someone else. Cost: one 4-byte write per child
started and one per child ended, nothing per task. It is a fresh interpreter (``-I -S``,
this file only, standard library only) rather than a fork of the supervisor, which would
keep a copy of the supervisor's memory for as long as it lives.

Run as a script, this module is the sentinel; imported, it is the supervisor's end.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import struct
import subprocess
import sys

log = logging.getLogger("workhorse.supervisor")

#: One record per message: +pgid (a child's group to kill) or -pgid (gone, forget it).
_RECORD = struct.Struct("=i")
#: Signals meant for the supervisor or its job: the sentinel outlives them, and exits only
#: when the supervisor has.
_DEAF_TO = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2)
#: How long a clean stop waits for the sentinel to exit before leaving it to init.
_EXIT_WAIT = 2.0


class Sentinel:
    """The supervisor's end: start the sentinel, tell it of groups, let it go."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._write_fd: int | None = None
        self._groups: set[int] = set()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def fds(self) -> tuple[int, ...]:
        """The fd a child must not keep (or the sentinel would never see end of file)."""
        return () if self._write_fd is None else (self._write_fd,)

    def start(self) -> None:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        # The signals stay blocked in the sentinel (the mask survives exec): none can end
        # it before it has made itself deaf to them.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _DEAF_TO)
        try:
            # Its own process group: a killpg of the supervisor's (a terminal's Ctrl-C, a
            # script cleaning up its job) leaves it there to do its work.
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(read_fd)],
                pass_fds=(read_fd,), stdin=subprocess.DEVNULL, process_group=0)
        except OSError as exc:
            os.close(write_fd)
            log.warning("cannot start the sentinel (%s): processes that tasks start may "
                        "outlive a supervisor killed outright", exc)
            return
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            os.close(read_fd)
        os.set_blocking(write_fd, False)
        self._write_fd = write_fd

    def watch(self, pgid: int) -> None:
        """Kill group ``pgid`` if the supervisor dies."""
        if self._send(pgid):
            self._groups.add(pgid)

    def forget(self, pgid: int) -> None:
        """Group ``pgid`` is gone (its leader not reaped yet, so the number is still ours)."""
        if pgid in self._groups:
            self._groups.discard(pgid)
            self._send(-pgid)

    def _send(self, record: int) -> bool:
        if self._write_fd is None:
            return False
        try:
            os.write(self._write_fd, _RECORD.pack(record))
        except OSError as exc:
            log.warning("the sentinel (pid %s) is not listening (%s): processes that tasks "
                        "start may outlive a supervisor killed outright", self.pid, exc)
            self._close_pipe()
            return False
        return True

    def exited(self) -> None:
        """It died (reaped by the supervisor's loop): nobody is left to kill the groups."""
        log.warning("the sentinel (pid %s) exited: processes that tasks start may outlive a "
                    "supervisor killed outright", self.pid)
        self._close_pipe()

    def close(self) -> None:
        """Let it go: it sees end of file, kills the groups still recorded (none after a
        clean stop) and exits; reap it."""
        self._close_pipe()
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(_EXIT_WAIT)

    def _close_pipe(self) -> None:
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None


def serve(read_fd: int) -> None:
    """The sentinel itself: record groups until end of file, then kill them all."""
    for sig in _DEAF_TO:
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    pending = b""
    while data := os.read(read_fd, 4096):
        pending += data
        whole = len(pending) - len(pending) % _RECORD.size
        for (record,) in _RECORD.iter_unpack(pending[:whole]):
            if record > 0:
                groups.add(record)
            else:
                groups.discard(-record)
        pending = pending[whole:]
    for pgid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
