"""The decision ledger: chain integrity, tamper detection, concurrent writers, flushing, queue bounds."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import os
import sqlite3
import struct
import subprocess
import sys
import textwrap
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import StateUnavailable
from gateway.ledger import Ledger, LedgerEntry, _chunks, input_hash, verify
from gateway.ledger_chain import COLUMNS, GENESIS, NO_TABLE, SCHEMA, canonical_json, canonical_row, entry_hash

REPO = Path(__file__).resolve().parents[2]


def entry(i: int, run_id: str = "run-1", **changes: Any) -> LedgerEntry:
    fields: dict[str, Any] = {
        "agent": "support-bot", "run_id": run_id, "operation": "chat", "model": "gpt-4o-mini",
        "input_hash": input_hash(f"inputs {i}"), "decision": "stop" if i % 3 == 1 else "allow",
        "reason": "budget_exhausted" if i % 3 == 1 else None, "detail": f"step {i}",
    }
    fields.update(changes)
    return LedgerEntry(**fields)


async def filled(path: Path, n: int, **options: Any) -> None:
    ledger = Ledger.open(path, **options)
    await ledger.start()
    for i in range(1, n + 1):
        ledger.append_nowait(entry(i))
    await ledger.close()


def query(db: Path, statement: str, args: tuple[Any, ...] = ()) -> list[Any]:
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        return conn.execute(statement, args).fetchall()


def tamper(db: Path, statement: str, args: tuple[Any, ...] = ()) -> None:
    """Change the file as someone with raw access would: drop the guard triggers, then write."""
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER IF EXISTS ledger_no_update")
        conn.execute("DROP TRIGGER IF EXISTS ledger_no_delete")
        conn.execute(statement, args)


def flip_one_byte(value: Any) -> Any:
    if isinstance(value, float):
        packed = bytearray(struct.pack("<d", value))
        packed[0] ^= 1
        return struct.unpack("<d", bytes(packed))[0]
    encoded = bytearray(value.encode())
    encoded[-1] ^= 1
    return encoded.decode()


async def test_a_long_chain_verifies(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    await filled(db, 2000, batch_size=64)
    assert verify(db) == verify(db)
    result = verify(db)
    assert (result.ok, result.rows, result.first_bad_id, result.reason) == (True, 2000, None, None)
    rows = query(db, "SELECT id, prev_hash, entry_hash FROM ledger ORDER BY id")
    assert [r[0] for r in rows] == list(range(1, 2001))
    assert rows[0][1] == GENESIS
    assert all(rows[i][1] == rows[i - 1][2] for i in range(1, len(rows)))


@pytest.mark.parametrize("column", ["ts", "agent", "run_id", "operation", "model", "input_hash",
                                    "decision", "reason", "detail", "prev_hash", "entry_hash"])
@pytest.mark.parametrize("row_id", [1, 58, 121])
async def test_one_changed_byte_fails_on_exactly_that_row(tmp_path: Path, column: str, row_id: int) -> None:
    db = tmp_path / "t.db"
    await filled(db, 121, batch_size=16)
    [(value,)] = query(db, f"SELECT {column} FROM ledger WHERE id = ?", (row_id,))
    assert value is not None  # these rows carry a reason (i % 3 == 1)
    tamper(db, f"UPDATE ledger SET {column} = ? WHERE id = ?", (flip_one_byte(value), row_id))
    result = verify(db)
    assert (result.ok, result.first_bad_id, result.rows) == (False, row_id, row_id - 1)
    assert result.reason


async def test_null_reason_set_by_tamperer_is_caught(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    await filled(db, 10)
    tamper(db, "UPDATE ledger SET reason = 'x' WHERE id = 2")  # row 2 has no reason
    assert verify(db).first_bad_id == 2


@pytest.mark.parametrize("deleted, first_bad, reason", [
    (1, 2, "id gap"), (5, 6, "id gap"), (10, 10, "missing at the end"),
])
async def test_a_deleted_row_fails_at_the_next(
    tmp_path: Path, deleted: int, first_bad: int, reason: str
) -> None:
    db = tmp_path / "t.db"
    await filled(db, 10)
    tamper(db, "DELETE FROM ledger WHERE id = ?", (deleted,))
    result = verify(db)
    assert (result.ok, result.first_bad_id) == (False, first_bad)
    assert reason in (result.reason or "")


async def test_rows_cut_from_the_end_stay_visible_after_more_appends(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    await filled(db, 10)
    tamper(db, "DELETE FROM ledger WHERE id > 7")
    await filled(db, 3)  # the next ids are 11..13, not 8..10: the cut stays a gap
    result = verify(db)
    assert (result.ok, result.first_bad_id) == (False, 11)


async def test_renumbered_ids_and_rewritten_hash_are_caught(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    await filled(db, 10)
    # A tamperer who fixes the row's own hash still breaks the link of the next row.
    fields = ledger_rows(db)[3]
    fields["detail"] = "nothing happened"
    tamper(db, "UPDATE ledger SET detail = ?, entry_hash = ? WHERE id = 4",
           (fields["detail"], entry_hash(fields)))
    assert verify(db).first_bad_id == 5


@pytest.mark.parametrize("statement", [
    "UPDATE ledger SET detail = 'x' WHERE id = 1", "DELETE FROM ledger WHERE id = 1",
])
async def test_sqlite_refuses_update_and_delete(tmp_path: Path, statement: str) -> None:
    db = tmp_path / "t.db"
    await filled(db, 3)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        query(db, statement)
    assert verify(db).ok


async def test_two_ledgers_on_one_file_keep_one_chain(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    first, second = Ledger.open(db, batch_size=7), Ledger.open(db, batch_size=5)
    await first.start()
    await second.start()
    for i in range(300):
        (first if i % 2 else second).append_nowait(entry(i, run_id=f"run-{i % 2}"))
        if i % 37 == 0:
            await asyncio.gather(first.flush(), second.flush())
    await asyncio.gather(first.close(), second.close())
    result = verify(db)
    assert (result.ok, result.rows) == (True, 300)


def test_two_processes_on_one_file_keep_one_chain(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    script = textwrap.dedent("""
        import asyncio, sys
        from gateway.ledger import Ledger, LedgerEntry

        async def main() -> None:
            ledger = Ledger.open(sys.argv[1], batch_size=3)
            await ledger.start()
            for i in range(400):
                ledger.append_nowait(LedgerEntry("a", sys.argv[2], "chat", "m", "h", "allow", detail=str(i)))
                if i % 10 == 9:
                    await ledger.flush()
            await ledger.close()

        asyncio.run(main())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(db), f"proc-{n}"], cwd=REPO)
             for n in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    result = verify(db)
    assert (result.ok, result.rows) == (True, 800)
    assert query(db, "SELECT run_id, COUNT(*) FROM ledger GROUP BY run_id ORDER BY run_id") == [
        ("proc-0", 400), ("proc-1", 400)]


@pytest.mark.parametrize("start", [True, False])
async def test_close_writes_everything(tmp_path: Path, start: bool) -> None:
    db = tmp_path / "t.db"
    ledger = Ledger.open(db, batch_size=50)
    if start:
        await ledger.start()
    for i in range(1234):
        ledger.append_nowait(entry(i))
    await ledger.close()
    assert (ledger.accepted, ledger.written, ledger.lost) == (1234, 1234, 0)
    assert verify(db).rows == 1234


def test_close_sync_writes_everything(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    ledger = Ledger.open(db)
    for i in range(25):
        ledger.append_nowait(entry(i))
    ledger.close_sync()
    assert verify(db).rows == 25


async def test_flush_and_rows(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    ledger = Ledger.open(db)
    await ledger.start()
    for i in range(1, 31):
        await ledger.append(entry(i, run_id=f"run-{i % 2}", ts=1000.0 + i))
    await ledger.flush()
    assert ledger.written == 30
    assert [r["id"] for r in ledger.rows(limit=3)] == [28, 29, 30]
    odd = ledger.rows("run-1", limit=100)
    assert [r["detail"] for r in odd][:2] == ["step 1", "step 3"] and len(odd) == 15
    assert odd[0]["ts"] == 1001.0 and odd[0]["prev_hash"] == GENESIS
    assert set(odd[0]) == {"id", "ts", "agent", "run_id", "operation", "model", "input_hash", "decision",
                           "reason", "detail", "prev_hash", "entry_hash"}
    assert ledger.rows("nobody") == []
    await ledger.close()


async def test_append_waits_for_room_and_append_nowait_grows(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    ledger = Ledger.open(db, max_pending=4, hard_limit=10, batch_size=2)
    for i in range(12):  # no writer yet: past 4 the queue grows, past 10 entries are refused
        ledger.append_nowait(entry(i))
    assert (ledger.accepted, ledger.overflowed, ledger.dropped) == (10, 6, 2)
    await ledger.start()
    await asyncio.gather(*(ledger.append(entry(i)) for i in range(40)))  # waits for room, never refused
    await ledger.close()
    assert (ledger.written, ledger.dropped, ledger.lost) == (50, 2, 0)
    assert verify(db).rows == 50


async def test_a_failed_write_keeps_its_batch_and_order(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    ledger = Ledger.open(db, batch_size=4, retry_delay_s=0)
    ledger._writer.execute("PRAGMA busy_timeout = 0")
    for i in range(10):
        ledger.append_nowait(entry(i))
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    with pytest.raises(sqlite3.OperationalError):
        ledger._write_some()
    assert len(ledger._pending) == 10 and ledger.written == 0
    blocker.execute("ROLLBACK")
    blocker.close()
    await ledger.close()
    assert [r["detail"] for r in ledger_rows(db)] == [f"step {i}" for i in range(10)]
    assert verify(db).ok


async def test_close_reports_entries_it_could_not_write(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    ledger = Ledger.open(db, retry_delay_s=0)
    ledger._writer.execute("PRAGMA busy_timeout = 0")
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    for i in range(3):
        ledger.append_nowait(entry(i))
    with pytest.raises(StateUnavailable, match="3 entries"):
        await ledger.close()
    blocker.execute("ROLLBACK")
    blocker.close()
    assert (ledger.lost, ledger.write_errors) == (3, 3)


def ledger_rows(db: Path) -> list[dict[str, Any]]:
    with closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM ledger ORDER BY id")]


@pytest.mark.parametrize("changes", [
    {"agent": None}, {"run_id": 7}, {"reason": 1}, {"detail": b"bytes"}, {"ts": math.nan},
    {"ts": math.inf}, {"ts": "now"},
])
def test_malformed_entries_are_refused_at_the_caller(tmp_path: Path, changes: dict[str, Any]) -> None:
    ledger = Ledger.open(tmp_path / "t.db")
    with pytest.raises(TypeError):
        ledger.append_nowait(entry(1, **changes))
    assert ledger.accepted == 0
    ledger.close_sync()


async def test_odd_values_are_stored_and_verify(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    ledger = Ledger.open(db)
    ledger.append_nowait(entry(1, run_id="r\udcff\u00e9", detail="x" * 5000, ts=1700000000))
    ledger.append_nowait(entry(2, agent="ünïcødé 智能体", reason="loop_detected"))
    await ledger.close()
    rows = ledger_rows(db)
    assert rows[0]["run_id"] == "r?\u00e9" and len(rows[0]["detail"]) == 500
    assert rows[0]["ts"] == 1700000000.0 and rows[1]["agent"] == "ünïcødé 智能体"
    assert verify(db).ok


async def test_shares_the_run_store_file_without_touching_it(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    query(db, "CREATE TABLE runs (run_id TEXT PRIMARY KEY, spent REAL)")
    query(db, "INSERT INTO runs VALUES ('r', 1.5)")
    before = {name for (name,) in query(db, "SELECT name FROM sqlite_master")}
    await filled(db, 5)
    after = {name for (name,) in query(db, "SELECT name FROM sqlite_master")}
    assert after - before == {
        "ledger", "ledger_run_id", "ledger_no_update", "ledger_no_delete", "sqlite_sequence"}
    assert query(db, "SELECT * FROM runs") == [("r", 1.5)]
    assert verify(db).rows == 5


@pytest.mark.parametrize("setup, ok, reason", [
    ("missing", False, "no such file"), ("empty", True, None), ("other-table", True, None),
])
def test_verify_edge_files(tmp_path: Path, setup: str, ok: bool, reason: str | None) -> None:
    db = tmp_path / "t.db"
    if setup != "missing":
        query(db, "CREATE TABLE runs (x)" if setup == "other-table" else "PRAGMA user_version = 1")
    result = verify(db)
    assert (result.ok, result.rows, result.first_bad_id) == (ok, 0, None)
    assert (reason or "") in (result.reason or "")


async def test_verify_gives_the_head_hash_to_anchor_the_chain_elsewhere(tmp_path: Path) -> None:
    """The chain cannot show rows gone altogether (a dropped table verifies as an empty chain, as a run
    store's file whose ledger is kept elsewhere does): the head hash, recorded outside, does."""
    db = tmp_path / "t.db"
    await filled(db, 5)
    [(last,)] = query(db, "SELECT entry_hash FROM ledger WHERE id = 5")
    result = verify(db)
    assert (result.ok, result.rows, result.head) == (True, 5, last)
    tamper(db, "UPDATE ledger SET detail = 'x' WHERE id = 4")
    [(third,)] = query(db, "SELECT entry_hash FROM ledger WHERE id = 3")
    assert verify(db).head == third  # the head of what verified
    tamper(db, "DROP TABLE ledger")
    assert verify(db) == type(result)(True, 0, None, NO_TABLE, GENESIS)  # empty, and said so


def test_the_cli_says_a_file_has_no_ledger_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong path or a copy taken before the rows left the WAL verified as "ok: 0 ledger rows, chain
    intact", the words of an intact, empty ledger."""
    from gateway.cli import main as cli_main

    db = tmp_path / "other.db"
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TABLE notes (x)")
    assert cli_main(["ledger", "verify", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "has no ledger table" in out and "chain intact" not in out


def test_the_cli_prints_the_head_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main as cli_main

    db = tmp_path / "t.db"
    ledger = Ledger.open(db)
    for i in range(1, 4):
        ledger.append_nowait(entry(i))
    ledger.close_sync()
    assert cli_main(["ledger", "verify", "--db", str(db)]) == 0
    assert capsys.readouterr().out == f"ok: 3 ledger rows, chain intact; head hash {verify(db).head}\n"


def test_input_hash_is_a_digest_not_the_content() -> None:
    digest = input_hash('{"messages": [{"role": "user", "content": "secret"}]}')
    assert len(digest) == 64 and "secret" not in digest
    assert digest == input_hash(b'{"messages": [{"role": "user", "content": "secret"}]}')


# -- the fast canonical encoding: byte-identical to the reference json.dumps ---------------------------

TRICKY_TEXT = ["", "plain", 'quo"te', "back\\slash", "\\\"", "/slash", "tab\tnl\ncr\rbs\bff\f",
               "\x00\x01\x1f\x7f", "ünïcødé 智能体 🚀", "\u2028\u2029", "\ufeff", "é" * 600,
               "{\"a\":1}", "null", "</script>"]
TRICKY_FLOATS = [0.0, -0.0, 0.1, 1e-7, 1e22, 1e16, 123456789012345680.0, 5e-324, 1.7976931348623157e308,
                 1700000000.0, 1764480000.123456, -2.5, 1 / 3]


def reference_hash(fields: dict[str, Any]) -> str:
    """The encoder of the original writer, kept verbatim: what every existing ledger was hashed with."""
    canonical = json.dumps({k: fields[k] for k in COLUMNS if k != "entry_hash"}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def hashed_fields(values: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(COLUMNS[:-1], values, strict=True))


@pytest.mark.parametrize("text", TRICKY_TEXT)
def test_canonical_row_is_byte_identical_to_json_dumps(text: str) -> None:
    for ts in TRICKY_FLOATS:
        for reason in (None, "budget_exhausted", text):
            values = (2**53 + 1, ts, text, "run-" + text, "chat", text[:3], "ab" * 32, "allow", reason,
                      text, GENESIS)
            fields = hashed_fields(values)
            fast = canonical_row(*values)
            assert fast == canonical_json(fields)
            assert fast.encode() == json.dumps(fields, sort_keys=True, separators=(",", ":"),
                                               ensure_ascii=False).encode()
            assert entry_hash({**fields, "entry_hash": "x"}) == reference_hash(fields)


@settings(max_examples=300, deadline=None, derandomize=bool(os.environ.get("CI")))
@given(st.integers(min_value=0, max_value=2**63 - 1),
       st.floats(allow_nan=False, allow_infinity=False),
       st.lists(st.text(), min_size=7, max_size=7),
       st.none() | st.text())
def test_canonical_row_matches_json_dumps_for_any_values(
    id_: int, ts: float, text: list[str], reason: str | None
) -> None:
    values: tuple[Any, ...] = (id_, ts, *text[:6], reason, *text[6:], GENESIS)
    assert canonical_row(*values) == canonical_json(hashed_fields(values))


@pytest.mark.parametrize("changes", [
    {"id": True}, {"ts": 1700000000}, {"ts": math.inf}, {"ts": -math.inf}, {"ts": math.nan},
    {"ts": "1700000000.0"}, {"reason": 7}, {"detail": 1.5}, {"agent": None},
])
def test_entry_hash_of_odd_types_falls_back_to_the_reference(changes: dict[str, Any]) -> None:
    row = {**hashed_fields((3, 1.5, "a", "r", "chat", "m", "h", "allow", None, "d", GENESIS)), **changes}
    assert entry_hash(row) == reference_hash(row)


def test_entry_hash_refuses_what_json_or_utf8_cannot_carry() -> None:
    row = hashed_fields((3, 1.5, "a", "r", "chat", "m", "h", "allow", None, "d", GENESIS))
    with pytest.raises(TypeError):
        entry_hash({**row, "detail": b"bytes"})
    with pytest.raises(ValueError):
        entry_hash({**row, "detail": "lone \udcff surrogate"})


def test_a_ledger_written_by_the_old_encoder_verifies_and_grows(tmp_path: Path) -> None:
    """Rows hashed as the original writer did (a dict + json.dumps per row, one INSERT per row) verify,
    and the new writer extends that chain."""
    db = tmp_path / "old.db"
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        for statement in SCHEMA:
            conn.execute(statement)
        prev = GENESIS
        stamps = [ts for ts in TRICKY_FLOATS if ts]  # SQLite reads -0.0 back as 0.0; ts 0 means "now"
        for i, text in enumerate(TRICKY_TEXT * 2, start=1):
            fields = hashed_fields((i, stamps[i % len(stamps)], text, f"run-{i % 3}", "chat",
                                    "gpt-4o", input_hash(text), "stop", text or None, text[:500], prev))
            prev = reference_hash(fields)
            conn.execute(f"INSERT INTO ledger ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * 12)})",
                         (*fields.values(), prev))
    assert (verify(db).ok, verify(db).rows) == (True, 2 * len(TRICKY_TEXT))
    ledger = Ledger.open(db)
    for i in range(70):
        ledger.append_nowait(entry(i, detail=TRICKY_TEXT[i % len(TRICKY_TEXT)]))
    ledger.close_sync()
    rows = ledger_rows(db)
    assert all(r["entry_hash"] == reference_hash(r) for r in rows)
    assert (verify(db).ok, verify(db).rows) == (True, 2 * len(TRICKY_TEXT) + 70)


@pytest.mark.parametrize("rows", [1, 2, 63, 64, 65, 127, 128, 129, 512, 1000])
def test_batches_are_cut_into_few_bounded_inserts(rows: int) -> None:
    sizes = _chunks(rows)
    assert sum(sizes) == rows and all(0 < n <= 64 for n in sizes) and len(sizes) == -(-rows // 64)


def test_a_batch_costs_a_fixed_handful_of_statements(tmp_path: Path) -> None:
    """Each statement is a GIL release and retake on the worker thread: per batch, not per row."""
    ledger = Ledger.open(tmp_path / "t.db", batch_size=100)
    statements: list[str] = []
    for i in range(101):
        ledger.append_nowait(entry(i))
    ledger._write_some()  # 100 rows into an empty table: one more SELECT (the sequence)
    ledger._writer.set_trace_callback(statements.append)
    ledger._write_some()  # 1 row
    for i in range(100):
        ledger.append_nowait(entry(i))
    ledger._write_some()  # 100 rows: 64 + 36
    ledger._writer.set_trace_callback(None)
    assert [s.split()[0] for s in statements] == ["BEGIN", "SELECT", "INSERT", "COMMIT",
                                                  "BEGIN", "SELECT", "INSERT", "INSERT", "COMMIT"]
    ledger.close_sync()
    assert verify(tmp_path / "t.db").rows == 201


async def test_every_row_cut_leaves_the_next_ids_after_the_cut(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    await filled(db, 5)
    tamper(db, "DELETE FROM ledger")
    await filled(db, 2)
    rows = ledger_rows(db)
    assert [r["id"] for r in rows] == [6, 7] and rows[0]["prev_hash"] == GENESIS
    assert (verify(db).ok, verify(db).first_bad_id) == (False, 6)


@pytest.mark.parametrize("on_loop", [True, False], ids=["on-loop", "worker-thread"])
async def test_batches_are_written_where_configured(tmp_path: Path, on_loop: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`on_loop` (the run store's own file): batches are written on the event loop's thread, at most
    LOOP_BATCH rows each; otherwise on a worker thread."""
    import threading

    from gateway import ledger as ledger_module

    threads: list[int] = []
    sizes: list[int] = []
    real = Ledger._write_some

    def spy(self: Ledger) -> None:
        threads.append(threading.get_ident())
        before = self.written
        real(self)
        sizes.append(self.written - before)

    monkeypatch.setattr(Ledger, "_write_some", spy)
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, on_loop=on_loop)
    for i in range(ledger_module.LOOP_BATCH * 2 + 5):
        ledger.append_nowait(entry(i))
    await ledger.start()
    await ledger.flush()
    await ledger.close()
    loop_thread = threading.get_ident()
    assert all((t == loop_thread) == on_loop for t in threads)
    if on_loop:
        assert max(sizes) <= ledger_module.LOOP_BATCH
    assert verify(path).ok and verify(path).rows == ledger_module.LOOP_BATCH * 2 + 5


async def test_the_gateway_writes_its_ledger_on_the_loop_only_in_the_store_file(tmp_path: Path) -> None:
    from gateway.app import create_app
    from gateway.config import parse_config
    from gateway.proxy import GATEWAY

    cases = [({"state": {"backend": "sqlite", "path": "s.db"}}, True),
             ({"state": {"backend": "sqlite", "path": "s.db"}, "ledger": {"path": "l.db"}}, False),
             ({"state": {"backend": "memory"}}, False)]
    for n, (overrides, on_loop) in enumerate(cases):
        base = tmp_path / str(n)
        base.mkdir()
        config = parse_config({"providers": {"o": {"type": "openai", "base_url": "http://127.0.0.1:9/v1"}},
                               "models": {"gpt-*": "o"}, **overrides}, env={}, base_dir=str(base))
        app = create_app(config)
        ctx = app.cleanup_ctx[0](app)
        await ctx.__anext__()
        try:
            assert app[GATEWAY].services["ledger"]._on_loop is on_loop
        finally:
            with pytest.raises(StopAsyncIteration):
                await ctx.__anext__()


async def test_a_backlog_on_the_loop_lets_other_tasks_run_between_batches(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway import ledger as ledger_module

    ticks = 0
    seen: list[int] = []
    real = Ledger._write_some

    def spy(self: Ledger) -> None:
        seen.append(ticks)
        real(self)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    monkeypatch.setattr(Ledger, "_write_some", spy)
    ledger = Ledger.open(tmp_path / "ledger.db", on_loop=True)
    for i in range(ledger_module.LOOP_BATCH * 4):
        ledger.append_nowait(entry(i))
    task = asyncio.get_running_loop().create_task(ticker())
    try:
        await ledger.start()
        await ledger.flush()
    finally:
        task.cancel()
        await ledger.close()
    assert len(seen) >= 4 and all(b > a for a, b in itertools.pairwise(seen))


async def test_on_the_loop_a_locked_file_fails_the_batch_at_once(tmp_path: Path) -> None:
    """Never a wait in SQLite's busy handler on the event loop: the batch fails and is retried later."""
    import time

    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, on_loop=True)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        ledger.append_nowait(entry(1))
        started = time.monotonic()
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            ledger._write_some()
        assert time.monotonic() - started < 0.5
        other.execute("ROLLBACK")
        ledger._write_some()
        assert ledger.written == 1
    finally:
        other.close()
        ledger.close_sync()


async def test_a_flush_does_not_wait_out_the_linger(tmp_path: Path) -> None:
    """Rows linger to batch up, but a waiting `flush` (a stop's row, written before it is answered)
    has its row written at once."""
    ledger = Ledger.open(tmp_path / "l.db", linger_s=30.0, on_loop=True)
    await ledger.start()
    try:
        ledger.append_nowait(entry(0))
        await ledger.flush()  # well before the 30 s linger
        ledger.append_nowait(entry(1))
        async with asyncio.timeout(5):
            await ledger.flush()
        assert ledger.written == 2
    finally:
        await ledger.close()


HEAD_DAMAGE = {
    "sequence as text": ("UPDATE sqlite_sequence SET seq = '3x' WHERE name = 'ledger'", ()),
    "last hash as a blob": ("UPDATE ledger SET entry_hash = ? WHERE id = 3", (b"\x00" * 32,)),
    "last hash cut short": ("UPDATE ledger SET entry_hash = 'abc' WHERE id = 3", ()),
}


@pytest.mark.parametrize("damage", HEAD_DAMAGE)
async def test_a_damaged_chain_head_refuses_to_start_and_to_append_but_never_kills_the_writer(
    tmp_path: Path, damage: str
) -> None:
    """A head no writer stores (the last row's id or hash, the id sequence): the chain cannot be extended
    from it. Opening the file says so (the gateway does not start); a file damaged while the gateway runs
    keeps its rows queued and retried, as for any failed write (its writer died on a TypeError: every row
    after it was lost and every stop answered 500), until the file is repaired."""
    db = tmp_path / "t.db"
    await filled(db, 3)
    statement, args = HEAD_DAMAGE[damage]
    ledger = Ledger.open(db, retry_delay_s=0.001)
    await ledger.start()
    tamper(db, statement, args)
    ledger.append_nowait(entry(4))
    with pytest.raises(TimeoutError):  # still queued
        async with asyncio.timeout(0.2):
            await ledger.flush()
    assert ledger._writer_alive() and ledger.write_errors >= 1 and len(ledger._pending) == 1
    with pytest.raises(StateUnavailable, match="damaged .*tollgate ledger verify"):
        Ledger.open(db)
    with pytest.raises(StateUnavailable, match="1 entries could not be written"):
        await ledger.close()
    assert not verify(db).ok
