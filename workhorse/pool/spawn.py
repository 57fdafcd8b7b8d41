"""Forking a child with billiard, and the real ProcessHandle.

billiard forks the child (and names it, for the log's processName) but does not wait for
it: each ``Process.start()`` polls, with waitpid, every Process started before, and would
reap a child before the supervisor has killed what is left of its group. So a child is
taken out of billiard's bookkeeping as soon as it is started, and the supervisor waits for
its children itself (``System.exited``/``System.reap``).
"""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

import billiard
from billiard import process as billiard_process

from .heart import Heart
from .ipc import FrameReader, encode
from .limits import kill_group, kill_tree
from .linux import CHILD_OOM_SCORE_ADJ, raise_oom_score_adj
from .runtime import SUPERVISOR_SIGNALS, ChildRuntime, child_main

_fork = billiard.get_context("fork")

RuntimeFactory = Callable[[int, int, int], ChildRuntime]


class ForkedProcess:
    """A forked child: its pid and the supervisor's ends of its two pipes."""

    def __init__(self, pid: int, write_fd: int, read_fd: int, heart: Heart | None = None
                 ) -> None:
        self.pid = pid
        #: The child's heartbeat (async tasks), mapped in both processes.
        self.heart = heart
        self.write_fd = write_fd
        self.read_fd = read_fd
        self._reader = FrameReader(read_fd)
        self._closed = False
        self._outbox = bytearray()
        #: Called when a frame could not be written whole (the caller watches the fd).
        self.on_pending: Callable[[], None] | None = None

    def receive(self) -> list[object]:
        """The frames the child has finished writing (never blocks)."""
        return self._reader.read()

    @property
    def at_eof(self) -> bool:
        return self._reader.eof

    def send(self, frame: object) -> None:
        """Write a frame without ever waiting for the child to read: what its pipe cannot
        take now waits here (``pending``) until ``flush`` (a child running async tasks on a
        blocked loop reads nothing; the supervisor must not wait for it)."""
        data = encode(frame)
        if self._outbox:
            self._outbox += data
            return
        try:
            written = os.write(self.write_fd, data)
        except BlockingIOError:
            written = 0
        if written < len(data):
            self._outbox += data[written:]
            if self.on_pending is not None:
                self.on_pending()

    @property
    def pending(self) -> bool:
        """Has it bytes the child's pipe could not take yet?"""
        return bool(self._outbox)

    def flush(self) -> bool:
        """Write what the pipe takes of what is pending; True once nothing is."""
        while self._outbox:
            try:
                written = os.write(self.write_fd, self._outbox)
            except BlockingIOError:
                return False
            except OSError:         # the child is gone: its exit settles its jobs
                self._outbox.clear()
                return True
            del self._outbox[:written]
        return True

    def kill_tree(self, sig: int = signal.SIGKILL) -> None:
        kill_tree(self.pid, sig)

    def kill_group(self) -> None:
        kill_group(self.pid)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.heart is not None:
                self.heart.close()
            for fd in (self.write_fd, self.read_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def fds(self) -> tuple[int, int]:
        return self.write_fd, self.read_fd


def spawn(index: int, make_runtime: RuntimeFactory, private_fds: list[int]) -> ForkedProcess:
    """Fork child ``index``. ``private_fds``: the supervisor's fds the child must close."""
    to_child_r, to_child_w = os.pipe2(os.O_CLOEXEC)
    from_child_r, from_child_w = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(from_child_r, False)
    os.set_blocking(to_child_w, False)
    runtime = make_runtime(index, to_child_r, from_child_w)
    # A number in private_fds may have been free again (the fd that listed them) and be
    # reused by these pipes: never let the child close its own ends.
    own = {to_child_r, from_child_w}
    close_in_child = [fd for fd in (*private_fds, to_child_w, from_child_r) if fd not in own]
    process = _fork.Process(target=_child_main, args=(runtime, close_in_child),
                            name=f"child-{index}", daemon=False)
    # Whatever sits in the stdio buffers now would be written twice, once by each process.
    sys.stdout.flush()
    sys.stderr.flush()
    # No signal may reach the child before it has its own handlers.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SUPERVISOR_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        os.close(to_child_r)
        os.close(from_child_w)
    _leave_to_us(process)
    try:
        os.setpgid(process.pid, process.pid)   # also done by the child; whoever is first wins
    except OSError:
        pass
    return ForkedProcess(process.pid, to_child_w, from_child_r, getattr(runtime, "heart", None))


def _leave_to_us(process: billiard.Process) -> None:
    """Take a started child out of billiard's hands: billiard would reap it (see above)."""
    billiard_process._children.discard(process)
    os.close(process.sentinel)


def _child_main(runtime: ChildRuntime, close_fds: list[int]) -> None:
    # The kernel's OOM killer should pick a child (its task is requeued) before the
    # supervisor (which holds every message): raising one's own score is always allowed.
    raise_oom_score_adj(CHILD_OOM_SCORE_ADJ)
    child_main(runtime, close_fds)
