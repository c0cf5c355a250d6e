"""The SQLite run store's own contracts (gateway/store/sqlite.py, sqlite_lock.py, sqlite_steps.py): one
owner per state file, what is written through and what behind, memory after a failed write, a bounded
cache, step history written behind, and what a `kill -9` keeps. Behaviour shared with the other backends: test_store_backends.py."""

from __future__ import annotations

import asyncio
import logging
import signal
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.errors import StateUnavailable
from gateway.ledger import Ledger, LedgerEntry, input_hash, verify
from gateway.store import sqlite as sqlite_store
from gateway.store.base import Claim, Denial, Reservation, ReserveRequest
from gateway.store.sqlite import SqliteRunStore
from gateway.store.sqlite_lock import lock_path

REPO = Path(__file__).resolve().parents[2]
NOW = 1_000.0
CALL = ReserveRequest((Claim("usd", 0.001, 4e-6, 0.02, "budget_exhausted"), Claim("llm_calls", 1.0)), 16, 250)
PER_CALL = 0.002


def query(path: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Another connection to the file, as `sqlite3` or a backup tool would open it."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        return conn.execute(sql, args).fetchall()


@contextmanager
def refusing(path: Path, table: str, event: str = "UPDATE") -> Iterator[None]:
    """The file refuses `event` on `table` (a trigger aborts it) for the duration."""
    query(path, f"CREATE TRIGGER refuse_{table} BEFORE {event} ON {table} "
                "BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
    try:
        yield
    finally:
        query(path, f"DROP TRIGGER refuse_{table}")


async def timer_turn(delay: float) -> None:
    """Let the loop run the store's flush timer: wait on a later timer of our own (no sleeping)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_later(delay, done.set_result, None)
    await done


async def grant(store: SqliteRunStore, run_id: str = "run-1") -> Reservation:
    result = await store.reserve(run_id, "bot", CALL, NOW)
    assert isinstance(result, Reservation), result
    return result


# -- one owner per state file ----------------------------------------------------------------------


async def test_a_second_store_on_the_same_file_fails_until_the_first_closes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = SqliteRunStore.open(path)
    with pytest.raises(StateUnavailable) as caught:
        SqliteRunStore.open(path)
    message = caught.value.message
    assert str(path) in message and "already in use" in message and "Redis" in message
    with pytest.raises(StateUnavailable, match="already in use"):
        SqliteRunStore.open(tmp_path / "." / "state.db")  # another spelling of the same file
    link = tmp_path / "link.db"
    link.symlink_to(path)
    with pytest.raises(StateUnavailable, match="already in use"):
        SqliteRunStore.open(link)
    await grant(first)
    await first.close()
    await first.close()  # idempotent: never closes a descriptor twice
    second = SqliteRunStore.open(path)
    try:
        state = await second.get("run-1")
        assert state is not None and state.reserved["usd"] == 0.0  # recovered at open: charged in full
        assert state.used["usd"] == pytest.approx(PER_CALL)
    finally:
        await second.close()


_HOLDER = """
import asyncio, sys
from gateway.store.sqlite import SqliteRunStore

async def main() -> None:
    store = SqliteRunStore.open(sys.argv[1])
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # held until killed

asyncio.run(main())
"""


async def test_another_process_is_refused_and_kill9_releases_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, str(path), cwd=REPO,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert await holder.stdout.readline() == b"ready\n"
        expected = rf"already in use by another run store \(pid {holder.pid}\)"
        with pytest.raises(StateUnavailable, match=expected):
            SqliteRunStore.open(path)
    finally:
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
    store = SqliteRunStore.open(path)  # the OS dropped the dead process's lock
    await store.close()
    assert lock_path(path).exists()  # the lock file stays; only the lock on it comes and goes


async def test_the_ledger_and_plain_readers_share_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path)
    ledger = Ledger.open(path)  # the default setup: the decision ledger in the state file
    try:
        await ledger.start()
        await grant(store)
        ledger.append_nowait(LedgerEntry("bot", "run-1", "chat", "m", input_hash("x"), "allow"))
        await ledger.flush()
        assert verify(path).rows == 1
        assert [r[0] for r in query(path, "SELECT run_id FROM runs")] == ["run-1"]
    finally:
        await ledger.close()
        await store.close()


def test_a_missing_directory_names_the_state_file(tmp_path: Path) -> None:
    with pytest.raises(StateUnavailable, match=r"cannot open state file .*missing-dir/state\.db"):
        SqliteRunStore.open(tmp_path / "missing-dir" / "state.db")


# -- memory and file ---------------------------------------------------------------------------------


def file_state(path: Path, run_id: str) -> dict[str, Any]:
    [(blob,)] = query(path, "SELECT state FROM runs WHERE run_id = ?", run_id)
    return dict(orjson.loads(blob))


async def test_a_failed_write_through_leaves_memory_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        first = await grant(store)
        with refusing(path, "runs"):
            with pytest.raises(StateUnavailable, match="disk says no"):
                await store.reserve("run-1", "bot", CALL, NOW)
            with pytest.raises(StateUnavailable, match="disk says no"):
                await store.stop("run-1", "bot", "loop_detected", "x", NOW)
            state = await store.get("run-1", steps=False)  # reads still work and show the file's state
            assert state is not None and list(state.open) == [first.id] and state.status == "active"
        with refusing(path, "runs", "INSERT"):  # a new run that cannot be written does not exist
            with pytest.raises(StateUnavailable):
                await store.reserve("run-new", "bot", CALL, NOW)
            assert await store.get("run-new") is None
        # the refused reservation never happened: the budget holds exactly 10 calls
        await store.settle(first, first.amounts, NOW)
        grants = 1
        while isinstance(await store.reserve("run-1", "bot", CALL, NOW), Reservation):
            grants += 1
        assert grants == 10
    finally:
        await store.close()


async def test_a_failed_write_through_keeps_what_was_written_behind(tmp_path: Path) -> None:
    """Memory ahead of the file (a settlement and a history push waiting for the batch): a refused
    reservation takes back only itself."""
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        first = await grant(store)
        await store.settle(first, {"usd": 0.001, "llm_calls": 1.0}, NOW)
        await store.push("run-1", "bot", "calls", ["a"], 6)
        assert list(file_state(path, "run-1")["open"]) == [first.id]  # the file is behind
        with refusing(path, "runs"):
            with pytest.raises(StateUnavailable, match="disk says no"):
                await store.reserve("run-1", "bot", CALL, NOW)
            state = await store.get("run-1", steps=False)
            assert state is not None and state.open == {} and state.lists == {"calls": ["a"]}
            assert state.used["usd"] == pytest.approx(0.001)
        second = await grant(store)  # written through: carries the settlement and the push
        on_file = file_state(path, "run-1")
        assert list(on_file["open"]) == [second.id] and on_file["lists"] == {"calls": ["a"]}
        assert on_file["used"]["usd"] == pytest.approx(0.001)
    finally:
        await store.close()


async def test_settlements_and_counters_are_written_behind_stops_through(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=0.01)
    try:
        first = await grant(store)
        await store.settle(first, {"usd": 0.001, "llm_calls": 1.0}, NOW)
        assert await store.add("run-1", "bot", "tool_calls", 2.0, limit=None, code="", now=NOW) is None
        assert file_state(path, "run-1")["used"] == {}  # not yet: the batch writes it
        await timer_turn(0.05)
        assert file_state(path, "run-1")["used"] == {"usd": pytest.approx(0.001), "llm_calls": 1.0,
                                                     "tool_calls": 2.0}
        # a counter that stops the run is written before the call returns
        denial = await store.add("run-1", "bot", "tool_calls", 5.0, limit=4.0, code="tool_call_cap", now=NOW)
        assert isinstance(denial, Denial)
        assert file_state(path, "run-1")["status"] == "stopped"
    finally:
        await store.close()


async def test_a_settlement_above_its_reservation_is_written_through(tmp_path: Path) -> None:
    """A crash would charge only the reservation: a call that cost more (output beyond max_tokens) must
    not wait for the batch."""
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        within, above = await grant(store), await grant(store)
        await store.settle(within, {"usd": within.amounts["usd"] / 2, "llm_calls": 1.0}, NOW)
        assert within.id in file_state(path, "run-1")["open"]  # behind
        await store.settle(above, {"usd": above.amounts["usd"] * 3, "llm_calls": 1.0}, NOW)
        on_file = file_state(path, "run-1")
        assert on_file["open"] == {}  # through, with the earlier settlement
        assert on_file["used"]["usd"] == pytest.approx(within.amounts["usd"] / 2 + above.amounts["usd"] * 3)
    finally:
        await store.close()


async def test_refused_batches_keep_settlements_until_written(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=0.01)
    try:
        first = await grant(store)
        with refusing(path, "runs"):
            await store.settle(first, {"usd": 0.001, "llm_calls": 1.0}, NOW)  # in memory; the batch fails
            await timer_turn(0.05)
            assert list(file_state(path, "run-1")["open"]) == [first.id]
        await timer_turn(0.05)  # the timer tries again
        assert file_state(path, "run-1")["open"] == {}
    finally:
        await store.close()


@contextmanager
def commits(store: SqliteRunStore) -> Iterator[list[str]]:
    """The statements the store's connection runs that end a transaction, as they run."""
    seen: list[str] = []
    store._conn.set_trace_callback(
        lambda sql: seen.append(sql) if sql in ("COMMIT", "ROLLBACK") or sql.startswith("INSERT") else None
    )
    try:
        yield seen
    finally:
        store._conn.set_trace_callback(None)


async def test_reservations_of_one_loop_turn_share_one_write(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        await grant(store)  # the runs exist on file: later reservations are batched
        await grant(store, "run-2")
        await store.record_step("run-1", "bot", {"n": 1}, NOW)
        with commits(store) as seen:
            grants = await asyncio.gather(*(grant(store) for _ in range(6)))
        assert len(seen) == 1 and seen[0].startswith("INSERT")  # one run: one autocommit statement
        # every reservation was on file when its `reserve` returned; the step row waits for its batch
        assert set(file_state(path, "run-1")["open"]) >= {g.id for g in grants}
        assert query(path, "SELECT count(*) FROM steps") == [(0,)]
        with commits(store) as seen:
            await asyncio.gather(*(grant(store, run) for run in ("run-1", "run-2", "run-1")))
        # two runs, one transaction
        assert [s.split(" ", 1)[0] for s in seen] == ["INSERT", "INSERT", "COMMIT"]
    finally:
        await store.close()


async def test_a_refused_batch_fails_its_reservations_and_releases_them(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        first = await grant(store)
        with refusing(path, "runs"):
            results = await asyncio.gather(*(grant(store) for _ in range(3)), return_exceptions=True)
            assert all(isinstance(r, StateUnavailable) for r in results), results
        state = await store.get("run-1", steps=False)
        assert state is not None and list(state.open) == [first.id]
        assert state.reserved["usd"] == pytest.approx(first.amounts["usd"])
        await store.list_runs()  # a later batch writes memory, not the refused one
        assert list(file_state(path, "run-1")["open"]) == [first.id]
    finally:
        await store.close()


async def test_a_reservation_whose_caller_is_cancelled_is_released(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        first = await grant(store)
        waiting = asyncio.create_task(grant(store))
        await asyncio.sleep(0)  # it reserved in memory and waits for the batch
        state = await store.get("run-1", steps=False)
        assert state is not None and len(state.open) == 2
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        state = await store.get("run-1", steps=False)
        assert state is not None and list(state.open) == [first.id]
        await store.list_runs()
        assert list(file_state(path, "run-1")["open"]) == [first.id]
    finally:
        await store.close()


async def test_a_write_through_before_the_batch_answers_the_waiting_reservation(tmp_path: Path) -> None:
    """The store wrote the run itself (a stop) while a reservation waited: the reservation is on file, so
    the batch being refused afterwards (for another run's change) must not fail or release it."""
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        await grant(store)
        await grant(store, "run-2")
        waiting = asyncio.create_task(grant(store))
        await asyncio.sleep(0)
        assert await store.take("run-1", "missing", "x") is False  # no write: still waiting
        await store.stop("run-1", "bot", "loop_detected", "x", NOW)  # written through, with the reservation
        await store.add("run-2", "bot", "tool_calls", 1.0, limit=None, code="", now=NOW)  # in the batch
        with refusing(path, "runs"):
            reservation = await waiting
        assert reservation.id in file_state(path, "run-1")["open"]
        state = await store.get("run-1", steps=False)
        assert state is not None and reservation.id in state.open
    finally:
        await store.close()


async def test_a_run_with_no_step_in_flight_writes_its_reservation_at_once(tmp_path: Path) -> None:
    """Nothing to share a write with: no loop turn to wait (the latency of a lone agent's step)."""
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        first = await grant(store)
        await store.settle(first, first.amounts, NOW)
        alone = asyncio.create_task(grant(store))
        await asyncio.sleep(0)
        assert alone.done() and list(file_state(path, "run-1")["open"]) == [alone.result().id]
        batched = asyncio.create_task(grant(store))  # `alone` is still open: this one is batched
        await asyncio.sleep(0)
        assert not batched.done()
        await batched
    finally:
        await store.close()


async def test_a_run_the_file_refuses_fails_only_its_own_reservations(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        await grant(store, "good")
        await grant(store, "bad")
        query(path, "CREATE TRIGGER refuse_bad BEFORE UPDATE ON runs WHEN NEW.run_id = 'bad' "
                    "BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
        good, bad = await asyncio.gather(grant(store, "good"), grant(store, "bad"), return_exceptions=True)
        assert isinstance(good, Reservation) and good.id in file_state(path, "good")["open"]
        assert isinstance(bad, StateUnavailable)
        query(path, "DROP TRIGGER refuse_bad")
    finally:
        await store.close()


async def test_a_write_that_breaks_otherwise_still_answers_the_reservation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not the file refusing but a bug (a state that cannot be encoded): the caller gets an error,
    never an endless wait."""
    store = SqliteRunStore.open(tmp_path / "state.db", flush_after_s=3600.0)
    try:
        await grant(store)
        real = store._steps._run_row

        def broken(state: Any) -> Any:
            store._steps._run_row = real  # once
            raise TypeError("Integer exceeds 64-bit range")

        store._steps._run_row = broken
        with caplog.at_level(logging.ERROR), pytest.raises(StateUnavailable, match="TypeError"):
            await asyncio.wait_for(grant(store), 5.0)
        state = await store.get("run-1", steps=False)
        assert state is not None and len(state.open) == 1  # released
    finally:
        await store.close()


async def test_run_state_and_step_history_outages_are_logged_once_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=0.001)
    try:
        first = await grant(store)
        with caplog.at_level(logging.INFO, "gateway.store.sqlite_steps"), refusing(path, "steps", "INSERT"):
            for n in range(3):
                await store.record_step("run-1", "bot", {"n": n}, NOW)
                await timer_turn(0.005)  # the batch: its step rows are refused
                await store.settle(await grant(store), {}, NOW)  # its run is written
        assert caplog.text.count("step history not written yet") == 1
        assert "written again" not in caplog.text and "run state" not in caplog.text
        await store.settle(first, {}, NOW)
    finally:
        await store.close()


async def test_a_cancelled_reservation_keeps_its_cancellation_when_the_store_closes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    await grant(store)
    waiting = asyncio.create_task(grant(store))
    await asyncio.sleep(0)
    store._steps.write_runs()  # the batch is written; the caller goes away before it resumes
    waiting.cancel()
    await store.close()  # a shutdown in the same turn: the release cannot be written any more
    with pytest.raises(asyncio.CancelledError):
        await waiting
    again = SqliteRunStore.open(path)  # the next start charges what the file still holds open
    try:
        state = await again.get("run-1", steps=False)
        assert state is not None and state.open == {} and state.used["llm_calls"] == 2.0
    finally:
        await again.close()


async def test_nothing_waits_on_a_closed_step_log(tmp_path: Path) -> None:
    store = SqliteRunStore.open(tmp_path / "state.db")
    await store.close()
    with pytest.raises(StateUnavailable, match="closed"):
        await store._steps.wait("run-1")  # no write will ever come: fail, never hang


async def test_a_new_runs_first_reservation_is_written_through(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        with commits(store) as seen:
            reservation = await store.reserve("fresh", "bot", CALL, NOW)
            assert seen and seen[0].startswith("INSERT") and "COMMIT" not in seen  # one autocommit write
        assert isinstance(reservation, Reservation)
        assert list(file_state(path, "fresh")["open"]) == [reservation.id]
    finally:
        await store.close()


async def test_get_returns_a_deep_copy(tmp_path: Path) -> None:
    store = SqliteRunStore.open(tmp_path / "state.db")
    try:
        res = await grant(store)
        snap = await store.get("run-1", steps=False)
        assert snap is not None
        snap.open[res.id]["amounts"]["usd"] = 99.0
        snap.reserved["usd"] = 99.0
        await store.settle(res, res.amounts, NOW)
        state = await store.get("run-1")
        assert state is not None and state.used["usd"] == pytest.approx(PER_CALL)
    finally:
        await store.close()


async def test_a_snapshot_for_the_guards_leaves_the_open_reservations_out(tmp_path: Path) -> None:
    store = SqliteRunStore.open(tmp_path / "state.db")
    try:
        res = await grant(store)
        snap = await store.get("run-1", steps=False, reservations=False)
        assert snap is not None and snap.open == {}
        assert snap.reserved["usd"] == pytest.approx(res.amounts["usd"])  # what they hold still counts
        full = await store.get("run-1", steps=False)
        assert full is not None and list(full.open) == [res.id]
    finally:
        await store.close()


async def test_the_cache_is_bounded_and_reloads_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, cache_size=2)
    try:
        for run_id in ("a", "b", "c"):
            await grant(store, run_id)
        assert len(store._runs) == 2  # the bound itself is the contract under test
        # "a" was dropped from memory: its next use reads the file (where an operator edited it)
        blob = orjson.loads(query(path, "SELECT state FROM runs WHERE run_id = 'a'")[0][0])
        blob["used"]["tool_calls"] = 7.0
        query(path, "UPDATE runs SET state = ? WHERE run_id = 'a'", orjson.dumps(blob))
        state = await store.get("a", steps=False)
        assert state is not None and state.used["tool_calls"] == 7.0 and len(state.open) == 1
        # ...and every run evicted and reloaded keeps exact accounting
        for run_id in ("a", "b", "c", "a", "c", "b"):
            await grant(store, run_id)
        for run_id in ("a", "b", "c"):
            state = await store.get(run_id, steps=False)
            assert state is not None and state.reserved["usd"] == pytest.approx(3 * PER_CALL)
    finally:
        await store.close()


# -- step history, written behind ------------------------------------------------------------------


async def test_steps_are_written_by_the_timer_in_one_batch(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=0.0)
    try:
        await grant(store)
        for n in range(3):
            await store.record_step("run-1", "bot", {"n": n}, NOW + n)
        assert query(path, "SELECT count(*) FROM steps") == [(0,)]  # buffered: the loop has not turned yet
        await timer_turn(0.001)
        rows = query(path, "SELECT data FROM steps ORDER BY seq")
        assert rows == [(b'{"n":0}',), (b'{"n":1}',), (b'{"n":2}',)]
        assert query(path, "SELECT updated_at FROM runs") == [(NOW + 2,)]
    finally:
        await store.close()


async def test_steps_are_written_before_they_are_read_and_on_close(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    await store.record_step("only-steps", "bot", {"n": 1}, NOW + 5)  # a run that exists by its steps alone
    state = await store.get("only-steps")
    assert state is not None and state.steps == [{"n": 1}] and state.updated_at == NOW + 5
    await store.record_step("only-steps", "bot", {"n": 2}, NOW + 6)
    await store.record_step("other", "bot", {"n": 3}, NOW + 7)
    assert [r.run_id for r in await store.list_runs()] == ["other", "only-steps"]
    await store.record_step("other", "bot", {"n": 4}, NOW + 8)
    await store.close()
    assert query(path, "SELECT run_id, data FROM steps ORDER BY seq")[-1] == ("other", b'{"n":4}')
    assert query(path, "SELECT run_id, updated_at FROM runs ORDER BY run_id") == [
        ("only-steps", NOW + 6), ("other", NOW + 8)]


async def test_a_full_batch_is_written_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_store, "STEP_BATCH", 4)
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    try:
        for n in range(5):
            await store.record_step("run-1", "bot", {"n": n}, NOW)
        assert query(path, "SELECT count(*) FROM steps") == [(4,)]
    finally:
        await store.close()


async def test_a_run_with_unwritten_steps_survives_eviction(tmp_path: Path) -> None:
    store = SqliteRunStore.open(tmp_path / "state.db", cache_size=1, flush_after_s=3600.0)
    try:
        await grant(store, "a")
        await store.record_step("a", "bot", {"n": 1}, NOW + 10)
        await grant(store, "b")  # drops "a" from the cache before its activity time was written
        state = await store.get("a", steps=False)
        assert state is not None and state.updated_at == NOW + 10 and len(state.open) == 1
        await grant(store, "a")  # written through from the newest state, not the file's older row
        state = await store.get("a")
        assert state is not None and len(state.open) == 2 and state.steps == [{"n": 1}]
    finally:
        await store.close()


async def test_refused_steps_wait_then_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sqlite_store, "MAX_PENDING_STEPS", 3)
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=0.0)
    try:
        await grant(store)
        with refusing(path, "steps", "INSERT"):
            for n in range(3):
                await store.record_step("run-1", "bot", {"n": n}, NOW)
            with caplog.at_level(logging.WARNING, "gateway.store.sqlite_steps"):
                await timer_turn(0.001)
            assert "step history not written yet" in caplog.text
            with pytest.raises(StateUnavailable, match="disk says no"):
                await store.record_step("run-1", "bot", {"n": 3}, NOW)  # full: refused, not silently dropped
            await grant(store)  # spend does not depend on step history being written
        await timer_turn(0.001)
        assert [orjson.loads(d) for (d,) in query(path, "SELECT data FROM steps ORDER BY seq")] == [
            {"n": 0}, {"n": 1}, {"n": 2}]
    finally:
        await store.close()


async def test_close_raises_when_steps_cannot_be_written_and_still_releases(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteRunStore.open(path, flush_after_s=3600.0)
    await store.record_step("run-1", "bot", {"n": 1}, NOW)
    with refusing(path, "steps", "INSERT"), pytest.raises(StateUnavailable, match="disk says no"):
        await store.close()
    again = SqliteRunStore.open(path)
    await again.close()


# -- kill -9 -----------------------------------------------------------------------------------------

_KILLED = """
import asyncio, os, signal, sys
from gateway.store.base import Claim, ReserveRequest
from gateway.store.sqlite import SqliteRunStore

async def main() -> None:
    store = SqliteRunStore.open(sys.argv[1], flush_after_s=3600.0)
    usd = Claim("usd", 0.001, 4e-6, 0.02, "budget_exhausted")
    call = ReserveRequest((usd, Claim("llm_calls", 1.0)), 16, 250)
    for n in range(3):
        grant = await store.reserve("run-1", "bot", call, 1000.0)
        await store.settle(grant, {"usd": 0.001, "llm_calls": 1.0}, 1000.0)
        await store.record_step("run-1", "bot", {"n": n}, 1000.0)
    await store.list_runs()  # steps so far are written
    await store.record_step("run-1", "bot", {"n": 3}, 1000.0)  # buffered: may be lost
    await store.add("run-1", "bot", "tool_calls", 2.0, limit=None, code="", now=1000.0)
    last = await store.reserve("run-1", "bot", call, 1000.0)  # written through, with the add before it
    await store.stop("run-2", "bot", "loop_detected", "repeating", 1000.0)
    await store.settle(last, {"usd": 0.0001, "llm_calls": 1.0}, 1000.0)  # written behind: lost
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_kill9_keeps_every_operation_that_returned(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _KILLED, str(path), cwd=REPO)
    assert await proc.wait() == -signal.SIGKILL
    store = SqliteRunStore.open(path)
    try:
        state = await store.get("run-1")
        assert state is not None
        # 3 settled calls, the last one's reservation charged in full (its settlement was still to be
        # written: never less than reserved), the tool calls added
        assert state.used == {"usd": pytest.approx(0.003 + PER_CALL), "llm_calls": 4.0, "tool_calls": 2.0}
        assert state.open == {} and state.reserved["usd"] == 0.0
        assert state.steps[:3] == [{"n": 0}, {"n": 1}, {"n": 2}]  # the last one may or may not be there
        stopped = await store.get("run-2")
        assert stopped is not None and stopped.stop_reason == "loop_detected"
        assert isinstance(await store.reserve("run-2", "bot", CALL, NOW), Denial)
    finally:
        await store.close()
