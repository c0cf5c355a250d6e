"""`verify` on files it cannot read (not a database, locked) and on a ledger a gateway writes meanwhile."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from gateway import ledger_chain
from gateway.ledger import Ledger, LedgerEntry, input_hash, verify


def entry(i: int) -> LedgerEntry:
    return LedgerEntry(agent="bot", run_id="run-1", operation="chat", model="gpt-4o-mini",
                       input_hash=input_hash(f"inputs {i}"), decision="allow", reason=None, detail=f"step {i}")


def written(path: Path, n: int) -> Path:
    ledger = Ledger.open(path)
    for i in range(1, n + 1):
        ledger.append_nowait(entry(i))
    ledger.close_sync()
    return path


def test_a_file_that_is_not_a_database_is_unreadable_not_tampered(tmp_path: Path) -> None:
    db = tmp_path / "notes.txt"
    db.write_text("this is not a ledger\n" * 50)
    result = verify(db)
    assert (result.ok, result.unreadable, result.tampered, result.first_bad_id) == (False, True, False, None)
    assert "not a database" in (result.reason or "")


def test_a_missing_file_is_unreadable(tmp_path: Path) -> None:
    result = verify(tmp_path / "nope.db")
    assert (result.unreadable, result.tampered, result.first_bad_id) == (True, False, None)


def test_a_changed_row_is_tampered_and_named(tmp_path: Path) -> None:
    db = written(tmp_path / "t.db", 3)
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER ledger_no_update")
        conn.execute("UPDATE ledger SET detail = 'x' WHERE id = 2")
    result = verify(db)
    assert (result.ok, result.unreadable, result.tampered, result.first_bad_id) == (False, False, True, 2)


def test_a_lock_is_waited_for_a_bounded_time_then_reported_as_unreadable(tmp_path: Path) -> None:
    """A rollback-journal file another program holds exclusively: verify waits `busy_timeout_s`, then
    says it could not read the file; once the lock is gone the chain verifies."""
    db = written(tmp_path / "t.db", 2)
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")
    with closing(sqlite3.connect(db, isolation_level=None)) as holder:
        holder.execute("BEGIN EXCLUSIVE")
        result = verify(db, busy_timeout_s=0.2)
        holder.execute("ROLLBACK")
    assert (result.ok, result.unreadable, result.first_bad_id) == (False, True, None)
    assert "locked" in (result.reason or "") and "waited 0.2 s" in (result.reason or "")
    assert verify(db).rows == 2


def test_a_writer_in_the_middle_of_a_transaction_neither_blocks_nor_fails_verify(tmp_path: Path) -> None:
    db = written(tmp_path / "t.db", 2)  # WAL, as the gateway writes it
    with closing(sqlite3.connect(db, isolation_level=None)) as writer:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO ledger (ts, agent, run_id, operation, model, input_hash, decision, reason,"
                       " detail, prev_hash, entry_hash) VALUES (1, 'a', 'r', 'o', 'm', 'h', 'd', NULL, '', 'p', 'e')")
        result = verify(db, busy_timeout_s=0.1)
        writer.execute("ROLLBACK")
    assert (result.ok, result.rows) == (True, 2)


def test_rows_appended_while_verifying_are_not_taken_for_rows_cut_from_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows and the id sequence are read in one snapshot: a gateway appending while verify reads (here,
    as it judges the last row) must not make the sequence run past the rows read ("missing at the end")."""
    db = written(tmp_path / "t.db", 3)
    judge = ledger_chain._row_problem

    def judge_while_appending(row: dict[str, Any], expected_id: int, prev: str) -> str | None:
        if row["id"] == 3:
            ledger = Ledger.open(db)
            ledger.append_nowait(entry(4))
            ledger.close_sync()
        return judge(row, expected_id, prev)

    monkeypatch.setattr(ledger_chain, "_row_problem", judge_while_appending)
    result = verify(db)
    assert (result.ok, result.rows) == (True, 3), result
    monkeypatch.undo()
    assert verify(db).rows == 4


@pytest.mark.parametrize("seq", ["abc", 2.5, b"\x03"])
def test_an_id_sequence_of_the_wrong_type_is_tampered_not_a_crash(tmp_path: Path, seq: Any) -> None:
    """SQLite keeps the sequence as an integer: another value is an edit, named (it was a TypeError)."""
    db = written(tmp_path / "t.db", 3)
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'ledger'", (seq,))
    result = verify(db)
    assert (result.ok, result.tampered, result.first_bad_id) == (False, True, 4)
    assert result.reason == "the id sequence holds a value of the wrong type"
