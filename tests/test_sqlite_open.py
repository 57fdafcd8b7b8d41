"""Many processes opening one new SQLite file at the same moment (a worker's children on
their first task): none of them may fail with "database is locked"."""
from __future__ import annotations

import pytest

from workhorse.backends.sqlite import SQLiteBackend
from workhorse.transport.store import Store


def _open_and_write(kind: str, path: str, barrier, index: int, errors) -> None:
    barrier.wait(10)
    try:
        if kind == "results":
            SQLiteBackend(f"sqlite:///{path}").store_result(f"t{index}", index, "SUCCESS")
        else:
            Store(__import__("pathlib").Path(path)).put("q", "{}")
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        errors.put(repr(exc))


@pytest.mark.parametrize("kind", ["results", "broker"])
def test_simultaneous_first_opens_all_succeed(tmp_path, kind, fork_ctx):
    ctx = fork_ctx
    errors = ctx.Queue()
    for attempt in range(5):        # the race is a matter of timing: give it several chances
        path = str(tmp_path / f"{kind}-{attempt}.sqlite3")
        barrier = ctx.Barrier(8)
        procs = [ctx.Process(target=_open_and_write, args=(kind, path, barrier, i, errors))
                 for i in range(8)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        assert all(p.exitcode == 0 for p in procs)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == []
