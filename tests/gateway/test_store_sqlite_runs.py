"""`gateway.store.sqlite_runs`: a run's row and its copies carry every field the run has (a field left out
of the copy is one a snapshot, a rollback or a reset silently loses), and nothing a transition could
reach through the copy."""

from __future__ import annotations

import orjson

from gateway.store import logic
from gateway.store.base import RunState
from gateway.store.sqlite_runs import copy_run, run_row


def full_run() -> RunState:
    state = RunState("run-1", "bot", epoch=3, status="stopped", stop_reason="llm_call_cap", stop_detail="cap",
                     started_at=1.5, updated_at=9.25, used={"usd": 0.5}, reserved={"usd": 0.1},
                     lists={"request": ["a", "b"]},
                     open={"r1": {"amounts": {"usd": 0.1}, "at": 2.0, "units": 5, "output": 5.0}},
                     steps=[{"n": 1}], roots=2, roots_final=True, roots_mark=9.25, roots_end=10.0)
    for name in RunState.__dataclass_fields__:  # every field is set to something other than its default
        assert getattr(state, name) != RunState.__dataclass_fields__[name].default or name == "ended", name
    return state


def test_a_copy_carries_every_stored_field_but_the_steps_and_shares_no_container() -> None:
    state = full_run()
    copy = copy_run(state)
    assert {**logic.to_dict(copy), "steps": None} == {**logic.to_dict(state), "steps": None}
    assert copy.steps == [] and copy.ended is None  # the steps live in their own table
    copy.used["usd"], copy.lists["request"][0] = 9.0, "z"
    copy.open["r1"]["amounts"]["usd"] = 9.0
    assert state.used["usd"] == 0.5 and state.lists["request"][0] == "a" and state.open["r1"]["amounts"]["usd"] == 0.1


def test_a_rollback_copy_shares_the_open_entries_and_a_snapshot_may_leave_them_out() -> None:
    state = full_run()
    assert copy_run(state, shared_open=True).open["r1"] is state.open["r1"]
    assert copy_run(state, reservations=False).open == {}


def test_a_row_holds_the_whole_run_as_json() -> None:
    state = full_run()
    run_id, agent, updated_at, blob = run_row(state)
    assert (run_id, agent, updated_at) == ("run-1", "bot", 9.25)
    assert logic.to_dict(logic.from_dict(orjson.loads(blob))) == logic.to_dict(state)
