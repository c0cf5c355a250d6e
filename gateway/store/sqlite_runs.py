"""A run as the SQLite run store keeps it: the `runs` table and its statements, a run's row, and the copy
of a run the store hands out or keeps to roll back (`gateway.store.sqlite`)."""

from __future__ import annotations

import orjson

from gateway.store import logic
from gateway.store.base import RunState

RUNS_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, agent TEXT NOT NULL, updated_at REAL, "
    "state BLOB NOT NULL)"
)
# what the store keeps beside the runs (the idle-run sweeps' mark)
META_SCHEMA = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value REAL NOT NULL)"
MARK_SWEPT = ("INSERT INTO meta (key, value) VALUES ('idle_swept', ?) "
              "ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)")
# the runs last updated in a window, in (updated_at, run_id) order from the start or after a cursor
WINDOW_FIRST = (
    "SELECT run_id, state, updated_at FROM runs WHERE updated_at > ? AND updated_at <= ? "
    "ORDER BY updated_at, run_id LIMIT ?"
)
WINDOW_NEXT = (
    "SELECT run_id, state, updated_at FROM runs WHERE (updated_at > ? OR (updated_at = ? AND run_id > ?)) "
    "AND updated_at <= ? ORDER BY updated_at, run_id LIMIT ?"
)
# `runs_page`: the listing order, a run without updated_at counting as 0 (as in the other backends)
PAGE_FIRST = "SELECT run_id, state, updated_at FROM runs ORDER BY COALESCE(updated_at, 0), run_id LIMIT ?"
PAGE_NEXT = (
    "SELECT run_id, state, updated_at FROM runs WHERE COALESCE(updated_at, 0) > ? OR "
    "(COALESCE(updated_at, 0) = ? AND run_id > ?) ORDER BY COALESCE(updated_at, 0), run_id LIMIT ?"
)
# One statement for a new run and a known one (and for a row someone deleted from outside)
WRITE_RUN = (
    "INSERT INTO runs (run_id, agent, updated_at, state) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (run_id) DO UPDATE SET updated_at = excluded.updated_at, state = excluded.state"
)


def run_row(state: RunState) -> tuple[str, str, float | None, bytes]:
    """`WRITE_RUN`'s parameters for the run: its whole state as JSON (its steps are in their own table)."""
    return state.run_id, state.agent, state.updated_at, orjson.dumps(logic.to_dict(state))


def copy_run(state: RunState, *, shared_open: bool = False, reservations: bool = True) -> RunState:
    """An independent copy, nested containers included (faster than a JSON round trip).

    `shared_open`: the open reservations' entries are shared, not copied. Safe for a copy only the store
    holds (to roll back a failed write): transitions add and remove entries, never change one.
    `reservations=False`: no open reservations at all (`RunStore.get`)."""
    return RunState(
        run_id=state.run_id,
        agent=state.agent,
        epoch=state.epoch,
        status=state.status,
        stop_reason=state.stop_reason,
        stop_detail=state.stop_detail,
        started_at=state.started_at,
        updated_at=state.updated_at,
        used=dict(state.used),
        reserved=dict(state.reserved),
        lists={k: list(v) for k, v in state.lists.items()},
        open=dict(state.open) if shared_open else {
            rid: {k: dict(v) if isinstance(v, dict) else v for k, v in held.items()}
            for rid, held in state.open.items()
        } if reservations else {},
        steps=[],
        roots=state.roots,
        roots_final=state.roots_final,
        roots_mark=state.roots_mark,
        roots_end=state.roots_end,
    )
