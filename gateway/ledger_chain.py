"""The ledger's hash chain: table schema, canonical entry hash, and `verify`.

Kept apart from the writer (gateway/ledger.py) so that verifying needs nothing but a file: the CLI's
`tollgate ledger verify` and tests use this module alone. entry_hash = sha256 of the canonical JSON
(sorted keys, separators "," and ":", UTF-8, non-ASCII kept) of every column but entry_hash, prev_hash
included; the first row's prev_hash is GENESIS (64 zeros); ids run 1, 2, 3, ... without gaps.

The canonical JSON is defined as `json.dumps(fields, sort_keys=True, separators=(",", ":"),
ensure_ascii=False)` (`canonical_json`). `canonical_row` builds the same text without a dict or the
encoder's machinery (~5x faster) for the types the writer produces: int id, finite float ts, str
fields, str or None reason. It escapes strings with the very function json.dumps uses
(`json.encoder.encode_basestring`) and formats numbers with int/float repr, as json.dumps does; a test
holds it byte-identical over tricky values. Any other value goes through `canonical_json`.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.frozen_init import fast_init

GENESIS = "0" * 64
COLUMNS = ("id", "ts", "agent", "run_id", "operation", "model", "input_hash", "decision", "reason",
           "detail", "prev_hash", "entry_hash")
SCHEMA = (
    ("CREATE TABLE IF NOT EXISTS ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL,"
     " agent TEXT NOT NULL, run_id TEXT NOT NULL, operation TEXT NOT NULL, model TEXT NOT NULL,"
     " input_hash TEXT NOT NULL, decision TEXT NOT NULL, reason TEXT, detail TEXT NOT NULL,"
     " prev_hash TEXT NOT NULL, entry_hash TEXT NOT NULL)"),
    "CREATE INDEX IF NOT EXISTS ledger_run_id ON ledger (run_id, id)",
    *(f"CREATE TRIGGER IF NOT EXISTS ledger_no_{op.lower()} BEFORE {op} ON ledger"
      " BEGIN SELECT RAISE(ABORT, 'ledger is append-only'); END" for op in ("UPDATE", "DELETE")),
)
SELECT = f"SELECT {', '.join(COLUMNS)} FROM ledger"
INSERT = f"INSERT INTO ledger ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


NO_TABLE = "the file has no ledger table"  # `VerifyResult.reason` of an ok result: an empty chain, said so


@fast_init
@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Outcome of `verify`. `rows`: rows that verified before the first bad one (all when ok). `head`:
    the entry_hash of the last of them (GENESIS when none): the chain proves the rows present unaltered
    and unbroken, and only a head recorded elsewhere shows rows gone from its end or the whole table
    dropped (as the run store's file without a `ledger` table verifies as an empty chain; its `reason` is
    then `NO_TABLE`, so a wrong file or a dropped table is not read as an intact, empty ledger).

    Not ok, either the chain is broken (`tampered`: `first_bad_id` names the first bad row, `reason` says
    how), or the file could not be read (`unreadable`: missing, not a SQLite database, locked past the
    busy timeout, an I/O error; `reason` says which, and no row is named: none was found bad)."""

    ok: bool
    rows: int
    first_bad_id: int | None
    reason: str | None
    head: str = GENESIS
    unreadable: bool = False

    @property
    def tampered(self) -> bool:
        return not self.ok and not self.unreadable


def input_hash(data: bytes | str) -> str:
    """The sha256 hex digest of a step's inputs: what the ledger stores instead of the content."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def canonical_json(fields: dict[str, Any]) -> str:
    """The reference canonical JSON of a row's hashed fields (every column but entry_hash)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def entry_hash(row: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of every column but entry_hash (prev_hash included). Raises
    TypeError or ValueError for values JSON cannot carry (or UTF-8 cannot encode)."""
    id_, ts, reason = row["id"], row["ts"], row["reason"]
    text = (row["agent"], row["run_id"], row["operation"], row["model"], row["input_hash"],
            row["decision"], row["detail"], row["prev_hash"])
    if (type(id_) is int and type(ts) is float and math.isfinite(ts)
            and (reason is None or type(reason) is str) and all(type(v) is str for v in text)):
        canonical = canonical_row(id_, ts, *text[:6], reason, *text[6:])
    else:
        canonical = canonical_json({k: row[k] for k in COLUMNS if k != "entry_hash"})
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def canonical_row(id_: int, ts: float, agent: str, run_id: str, operation: str, model: str,
                  input_hash: str, decision: str, reason: str | None, detail: str, prev_hash: str) -> str:
    """`canonical_json` of one row given as values, byte-identical for exactly these types (int id,
    finite float ts, str fields, str or None reason); the caller guarantees them."""
    enc = _encode_str
    return (
        f'{{"agent":{enc(agent)},"decision":{enc(decision)},"detail":{enc(detail)},"id":{_int_repr(id_)},'
        f'"input_hash":{enc(input_hash)},"model":{enc(model)},"operation":{enc(operation)},'
        f'"prev_hash":{enc(prev_hash)},"reason":{"null" if reason is None else enc(reason)},'
        f'"run_id":{enc(run_id)},"ts":{_float_repr(ts)}}}')


# What json.dumps itself calls for a str (ensure_ascii=False), an int and a float: same bytes by
# construction. Keys above are written in sorted order (a test compares with canonical_json).
_encode_str = json.encoder.encode_basestring
_int_repr, _float_repr = int.__repr__, float.__repr__


def connect(path: str | Path, *, readonly: bool = False, busy_timeout_s: float = 10.0) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit: BEGIN IMMEDIATE) that waits up to
    `busy_timeout_s` for a lock, usable from any one thread at a time; `readonly` opens with mode=ro and
    never creates."""
    target, uri = (f"{Path(path).resolve().as_uri()}?mode=ro", True) if readonly else (str(path), False)
    conn = sqlite3.connect(target, uri=uri, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    return conn


def enable_wal(conn: sqlite3.Connection, *, attempts: int = 100, pause_s: float = 0.05) -> None:
    """Switch to WAL. Two processes opening a new file at once can make the switch fail with
    "database is locked" without SQLite's busy handler being consulted, so retry a bounded time."""
    for attempt in range(attempts):
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(pause_s)  # startup only, never on the request path


def verify(path: str | Path, *, busy_timeout_s: float = 10.0) -> VerifyResult:
    """Re-hash the chain in `path` and name the first bad row: a changed field (hash mismatch), a broken
    link (prev_hash), a deleted row (id gap, reported at the next row) or rows cut from the end (reported
    as the first missing id). No ledger table: an empty, good chain (a file cannot tell a dropped table
    from a ledger kept in another file: `VerifyResult.head`). A file that cannot be read is `unreadable`,
    never a bad row.

    Read-only and in one read transaction: the rows and the id sequence are one snapshot, so rows a
    gateway appends meanwhile are neither judged nor missed, and a gateway writing the (WAL) file is never
    blocked. A lock another program holds (a backup, a rollback-journal copy) is waited for up to
    `busy_timeout_s`."""
    if not Path(path).is_file():
        return VerifyResult(False, 0, None, f"no such file: {path}", unreadable=True)
    count, expected_id, prev = 0, 1, GENESIS
    try:
        conn = connect(path, readonly=True, busy_timeout_s=busy_timeout_s)
    except sqlite3.Error as exc:
        return VerifyResult(False, 0, None, f"cannot open: {exc}", unreadable=True)
    # text that is not UTF-8 (the gateway writes only UTF-8: an edit or damage) is read, not an error, so
    # the row it is in fails its hash and is named
    conn.text_factory = lambda raw: raw.decode("utf-8", "surrogateescape")
    try:
        conn.execute("BEGIN")  # deferred: the first read takes the snapshot both reads below share
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='ledger'").fetchone():
            return VerifyResult(True, 0, None, NO_TABLE)
        for values in conn.execute(f"{SELECT} ORDER BY id"):
            row = dict(zip(COLUMNS, values, strict=True))
            problem = _row_problem(row, expected_id, prev)
            if problem is not None:
                return VerifyResult(False, count, row["id"], problem, prev)
            count, expected_id, prev = count + 1, row["id"] + 1, row["entry_hash"]
        seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'ledger'").fetchone()
        if seq is not None and type(seq[0]) is not int:  # SQLite writes an integer: an edit
            return VerifyResult(False, count, expected_id, "the id sequence holds a value of the wrong type", prev)
        if seq is not None and seq[0] >= expected_id:
            missing = f"rows {expected_id}..{seq[0]} missing at the end"
            return VerifyResult(False, count, expected_id, missing, prev)
        return VerifyResult(True, count, None, None, prev)
    except sqlite3.Error as exc:  # "file is not a database", "database is locked" (after the wait), I/O
        locked = f" (waited {busy_timeout_s:g} s)" if "locked" in str(exc) else ""
        return VerifyResult(False, count, None, f"{exc}{locked}", prev, unreadable=True)
    finally:
        conn.close()


def _row_problem(row: dict[str, Any], expected_id: int, prev: str) -> str | None:
    if row["id"] != expected_id:
        return f"id gap: rows {expected_id}..{row['id'] - 1} missing"
    if row["prev_hash"] != prev:
        return "broken link: prev_hash differs from the previous row's entry_hash"
    try:
        recomputed = entry_hash(row)
    except (TypeError, ValueError):  # raw edits can store a blob or NaN where text or a number was
        return "a field holds a value of the wrong type"
    if row["entry_hash"] != recomputed:
        return "entry_hash mismatch: a field of this row was changed"
    return None
