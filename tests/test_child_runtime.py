"""The child's runtime, in this process: what becomes of a process the task forks."""
from __future__ import annotations

import os
import sys

import pytest

from workhorse.pool.runtime import ChildRuntime


def task_body(ending: str) -> None:
    if ending == "raise":
        raise ValueError("raised in both processes")
    if ending == "sys.exit(3)":
        sys.exit(3)


@pytest.mark.parametrize("ending, status", [("return", 0), ("raise", 1), ("sys.exit(3)", 3)])
def test_a_process_forked_by_a_task_exits_as_the_task_ends_in_it(ending, status):
    runtime = ChildRuntime(None, 1, -1, -1, os.getppid(), "host")  # type: ignore[arg-type]
    runtime.pid = os.getpid()           # what setup() records in a real child
    r, w = os.pipe()
    copy = -1
    try:
        with runtime.running_task():
            copy = os.fork()
            task_body(ending)
    except (ValueError, SystemExit):
        pass
    if copy == 0:
        # The copy got past the task, where it would store and report: it must not.
        os.write(w, b"escaped")
        os._exit(99)
    os.close(w)
    _, wait_status = os.waitpid(copy, 0)
    escaped = os.read(r, 100)
    os.close(r)
    assert escaped == b""
    assert os.waitstatus_to_exitcode(wait_status) == status


def test_the_child_itself_goes_on_after_its_task():
    runtime = ChildRuntime(None, 1, -1, -1, os.getppid(), "host")  # type: ignore[arg-type]
    runtime.pid = os.getpid()
    with runtime.running_task():
        pass
    with pytest.raises(ValueError), runtime.running_task():
        task_body("raise")
