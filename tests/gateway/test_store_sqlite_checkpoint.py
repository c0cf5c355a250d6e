"""WAL checkpoints on their own thread: the loop's connections never checkpoint, the log stays bounded
under a steady stream of commits, and closing leaves an empty log."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from gateway.store.sqlite_checkpoint import Checkpointer, no_autocheckpoint


def _writer(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=5000")
    no_autocheckpoint(conn)
    conn.execute("CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v BLOB)")
    return conn


def _wal(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_connections_leave_checkpoints_to_the_thread(tmp_path: Path) -> None:
    conn = _writer(tmp_path / "s.db")
    assert conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
    for i in range(3000):  # ~12 MB of frames: SQLite's own 1,000-page checkpoint would have run
        conn.execute("INSERT OR REPLACE INTO t VALUES (?, ?)", (i % 10, b"x" * 3000))
    assert _wal(tmp_path / "s.db") > 8_000_000
    conn.close()


def test_the_log_stays_bounded_under_steady_commits(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    conn = _writer(path)
    checkpointer = Checkpointer(path, interval_s=0.01, restart_frames=200)
    checkpointer.start()
    stop = threading.Event()
    largest = 0

    def write() -> None:
        i = 0
        while not stop.wait(0.0002):  # a commit every ~0.3 ms, as the loop makes them under load
            conn.execute("INSERT OR REPLACE INTO t VALUES (?, ?)", (i % 10, b"x" * 3000))
            i += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(100):
            stop.wait(0.02)
            largest = max(largest, _wal(path))
    finally:
        stop.set()
        writer.join()
    assert checkpointer.checkpoints > 10
    # restart_frames (~800 KB) plus what commits between two rounds add; without RESTART rounds the
    # log grows for as long as the commits go on (two seconds here: tens of MB)
    assert largest < 8_000_000
    rows = conn.execute("SELECT count(*) FROM t").fetchone()
    conn.close()
    checkpointer.close()
    assert rows == (10,)
    assert _wal(path) == 0  # the last round truncates the log


def test_close_without_start(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    _writer(path).close()
    Checkpointer(path).close()


async def test_the_store_and_its_ledger_checkpoint_off_the_loop(tmp_path: Path) -> None:
    from gateway.ledger import Ledger
    from gateway.store.sqlite import SqliteRunStore

    store = SqliteRunStore.open(tmp_path / "state.db")
    ledger = Ledger.open(tmp_path / "state.db", on_loop=True)
    try:
        assert store._conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
        assert ledger._writer.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
        assert store._checkpointer._thread.is_alive()
    finally:
        await ledger.close()
        await store.close()
    assert not store._checkpointer._thread.is_alive()


def test_a_long_reader_never_makes_writers_wait(tmp_path: Path) -> None:
    import time

    path = tmp_path / "s.db"
    conn = _writer(path)
    reader = sqlite3.connect(str(path), isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM t").fetchall()  # holds a snapshot: the log cannot restart
    checkpointer = Checkpointer(path, interval_s=0.01, restart_frames=50)
    checkpointer.start()
    slowest = 0.0
    try:
        for i in range(300):
            started = time.perf_counter()
            conn.execute("INSERT OR REPLACE INTO t VALUES (?, ?)", (i % 10, b"x" * 3000))
            slowest = max(slowest, time.perf_counter() - started)
            time.sleep(0.001)
    finally:
        reader.execute("COMMIT")
        reader.close()
        conn.close()
        checkpointer.close()
    assert slowest < 0.2  # a RESTART waiting for the reader held the writers' lock for its 1 s timeout


def test_a_removed_file_is_not_recreated(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    _writer(path).close()
    checkpointer = Checkpointer(path, interval_s=0.01)
    checkpointer.start()
    for suffix in ("", "-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    checkpointer.close()
    assert not path.exists()
