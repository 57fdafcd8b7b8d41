"""A forked child never uses or closes the SQLite connections it inherited."""
from __future__ import annotations

import os
import sqlite3

from workhorse import App, forksafe


def test_a_child_abandons_inherited_connections_and_opens_its_own(tmp_path):
    app = App("forksafe", result_backend=f"sqlite:///{tmp_path / 'r.sqlite3'}",
              state_dir=str(tmp_path))
    app.configure()
    app.backend.store_result("parent", 1, "SUCCESS")
    inherited_backend = app.backend
    inherited_conn = inherited_backend.conn
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report what it finds, then leave without cleanup
        os.close(read)
        backend = app.backend
        ok = (backend is not inherited_backend
              and inherited_backend in forksafe._inherited
              and backend.conn is not inherited_conn)
        backend.store_result("child", 2, "SUCCESS")
        os.write(write, b"ok" if ok else b"bad")
        os._exit(0)
    os.close(write)
    assert os.read(read, 10) == b"ok"
    os.waitpid(pid, 0)
    os.close(read)
    # The parent's connection was never closed by the child, and sees the child's write.
    assert inherited_conn.execute("select count(*) from task_results").fetchone() == (2,)
    assert isinstance(inherited_conn, sqlite3.Connection)
    app.close()
