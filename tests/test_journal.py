"""The worker's journal (``broker.journal``): what it records, what a reader makes of a dead
worker's journal, and that it never says "held" of a message that may have started: a
journal it cannot write is emptied (every loss then counts as a delivery), a line cut
short is ignored, a journal from an earlier boot is not trusted."""
from __future__ import annotations

import errno
import fcntl
import os
import signal
from pathlib import Path

import pytest

from workhorse.broker import journal as journal_module
from workhorse.broker.journal import Journal, dead_journals, parse
from workhorse.protocol import (
    HELD_LOSSES_HEADER,
    SUSPECT_HEADER,
    Verdict,
    after_loss,
    carried_held_losses,
)

pytestmark = pytest.mark.timeout(30)


def make(directory: Path, held_now=lambda: ()) -> Journal:
    return Journal.create(directory, "w@test", held_now)


def text(journal: Journal) -> str:
    return journal.path.read_text()


# -- reading
def test_a_journal_without_its_header_says_nothing():
    assert parse("") is None
    assert parse("S 1:abc\n") is None


def test_a_line_cut_short_by_a_death_mid_write_is_ignored():
    """The write it belonged to never returned: the job it announced never reached a child."""
    record = parse("W 1 boot 7\nO p1\nS 1:a\nS 2:b")
    assert record is not None
    assert record.started == {"1:a"}


def test_only_what_ran_when_the_worker_died_is_a_start():
    record = parse("W 1 boot 7\nO p1\nS 1:a\nS 2:b\nE 2:b\n")
    assert record is not None and record.owners == ["p1"]
    assert record.verdict("1:a") == Verdict(started=True, held_loss=False)
    # over before the death: what is lost is a settlement, not a start
    assert record.verdict("2:b") == Verdict(started=False, held_loss=True)
    assert record.verdict("3:c") == Verdict(started=False, held_loss=True)


def test_a_death_while_looking_at_a_message_held_before_counts_for_it_alone():
    record = parse("W 1 boot 7\nR x\nr\nR y\n")
    assert record is not None and record.reading == "y"
    assert record.verdict("y").held_loss
    assert not record.verdict("x").held_loss and not record.verdict("x").started
    assert parse("W 1 boot 7\nR y\nr\n").reading is None       # done looking: all count


def test_a_held_loss_is_counted_in_the_headers_and_a_start_makes_a_suspect_for_good():
    headers = after_loss({"id": "t", HELD_LOSSES_HEADER: 2},
                         Verdict(started=False, held_loss=True))
    assert carried_held_losses(headers) == 3 and SUSPECT_HEADER not in headers
    headers = after_loss({"id": "t"}, Verdict(started=True, held_loss=False))
    assert headers[SUSPECT_HEADER] == 1 and carried_held_losses(headers) == 0
    # only held at a later death: still a suspect (it was running at an earlier one)
    headers = after_loss(headers, Verdict(started=False, held_loss=True))
    assert headers[SUSPECT_HEADER] == 1 and carried_held_losses(headers) == 1


# -- writing
def test_a_start_is_in_the_file_when_started_returns(tmp_path):
    journal = make(tmp_path)
    journal.ended("1:a")            # waits for the next record
    assert "E 1:a" not in text(journal)
    journal.started("2:b")
    lines = text(journal).splitlines()
    assert lines[0].startswith("W 1 ") and lines[1] == f"O {journal.owner}"
    assert lines[2:] == ["E 1:a", "S 2:b"]
    journal.close(remove=True)
    assert not journal.path.exists()


def test_the_journal_is_locked_while_its_worker_lives(tmp_path):
    journal = make(tmp_path)
    fd = os.open(journal.path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert list(dead_journals(tmp_path)) == []
    journal.close(remove=False)


def _die_after_starting(directory: str, ready) -> None:  # type: ignore[no-untyped-def]
    journal = Journal.create(Path(directory), "victim@test", lambda: ())
    journal.owned("abcd1234")
    journal.started("1:abcd1234xx")
    ready.set()
    signal.pause()


def test_a_worker_killed_outright_leaves_a_journal_anyone_may_take(tmp_path, fork_ctx):
    ready = fork_ctx.Event()
    process = fork_ctx.Process(target=_die_after_starting, args=(str(tmp_path), ready))
    process.start()
    try:
        assert ready.wait(10)
        assert list(dead_journals(tmp_path)) == []          # alive: locked
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        found = []
        for dead in dead_journals(tmp_path):
            assert dead.record is not None
            found.append((dead.record.owners[-1], dead.record.started))
            dead.remove()
        assert found == [("abcd1234", {"1:abcd1234xx"})]
        assert list(tmp_path.iterdir()) == []
    finally:
        if process.is_alive():
            process.kill()


def test_a_journal_from_an_earlier_boot_is_removed_unread(tmp_path):
    journal = make(tmp_path)
    journal.started("1:a")
    path = journal.path
    journal.close(remove=False)
    path.write_text(path.read_text().replace(journal_module.boot_id(), "another-boot"))
    assert list(dead_journals(tmp_path)) == []
    assert not path.exists()


def test_a_journal_that_cannot_be_written_is_emptied_and_written_whole_later(
        tmp_path, monkeypatch):
    """A full disk: the start must not be recorded as missing with "held" left standing,
    so the file is emptied (it then says nothing: every loss counts as a delivery)."""
    held = [("1:a", False, True, False), ("2:b", False, False, False)]
    journal = make(tmp_path, lambda: held)
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(journal_module.os, "write", full)
    journal.started("1:a")
    assert not journal.valid and text(journal) == ""
    journal.started("3:c")                      # nothing is written while it is not whole
    monkeypatch.setattr(journal_module.os, "write", real_write)
    journal.started("4:d")
    assert text(journal) == ""
    monkeypatch.setattr(journal_module, "RETRY_AFTER", 0.0)
    journal._retry_at = 0.0
    journal.flush()                             # rewritten whole from what is held now
    assert journal.valid
    assert text(journal).splitlines()[2:] == ["S 1:a"]
    journal.started("5:e")
    assert text(journal).splitlines()[-1] == "S 5:e"
    journal.close(remove=True)


def test_a_short_write_counts_as_a_failed_one(tmp_path, monkeypatch):
    journal = make(tmp_path)
    monkeypatch.setattr(journal_module.os, "write", lambda fd, data: 3)
    journal.started("1:a")
    assert not journal.valid
    assert text(journal) == ""
    journal.close(remove=True)


def test_a_journal_that_grows_is_rewritten_with_only_what_is_held(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "COMPACT_AT", 200)
    held = [("7:x", False, True, True)]
    journal = make(tmp_path, lambda: held)
    inode = journal.path.stat().st_ino
    for n in range(20):
        journal.started(f"{n}:key")
    journal.flush()
    assert journal.path.stat().st_ino != inode
    assert text(journal).splitlines()[1:] == [f"O {journal.owner}", "S 7:x", "E 7:x"]
    assert list(dead_journals(tmp_path)) == []      # the new file is locked too
    journal.close(remove=True)


def test_a_reader_that_opened_the_file_before_a_rewrite_leaves_it_alone(tmp_path,
                                                                          monkeypatch):
    """The old file is renamed over, then unlocked: a reader that had it open finds, once
    it has the lock, that the path names another file, and does not take it for dead."""
    journal = make(tmp_path, lambda: ())
    old = os.open(journal.path, os.O_RDONLY)
    journal.rewrite()
    try:
        fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)    # the old file's lock is free
        assert os.fstat(old).st_ino != journal.path.stat().st_ino
        assert list(dead_journals(tmp_path)) == []
    finally:
        os.close(old)
        journal.close(remove=True)
