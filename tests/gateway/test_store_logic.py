"""Pure run-state transitions (`gateway.store.logic`): the arithmetic every backend runs atomically."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from gateway.errors import RunReset
from gateway.store import logic
from gateway.store.base import Add, Claim, Denial, Push, Reservation, ReserveRequest, RunState

NOW = 100.0
_ids = itertools.count(1)


def fresh() -> RunState:
    return RunState(run_id="run-1", agent="bot")


def req(*claims: Claim, min_units: int = 0, max_units: int = 0) -> ReserveRequest:
    return ReserveRequest(tuple(claims), min_units, max_units)


def reserve(state: RunState, request: ReserveRequest, now: float = NOW) -> Reservation | Denial:
    return logic.reserve(state, request, now, f"r{next(_ids)}")


def granted(result: Reservation | Denial) -> Reservation:
    assert isinstance(result, Reservation), result
    return result


# -- reserve ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("claims", "used", "min_units", "max_units", "units"),
    [
        ((), {}, 16, 500, 500),  # nothing limited: everything asked for
        ((Claim("tokens", 100, 1.0, None),), {}, 16, 500, 500),  # unlimited claim
        ((Claim("tokens", 100, 1.0, 1000.0),), {}, 16, 500, 500),  # fits whole
        ((Claim("tokens", 100, 1.0, 400.0),), {}, 16, 500, 300),  # clamped to what fits
        ((Claim("tokens", 100, 1.0, 400.0),), {"tokens": 250.0}, 16, 500, 50),  # after spend
        ((Claim("tokens", 100, 1.0, 400.0),), {"tokens": 284.0}, 16, 500, 16),  # exactly the minimum
        ((Claim("usd", 0.001, 4e-6, 0.003),), {}, 16, 1000, 500),  # $0.002 of output at $4/Mtok
        # every claim must fit: the tightest wins
        ((Claim("tokens", 100, 1.0, 400.0), Claim("usd", 0.001, 4e-6, 0.003)), {}, 16, 1000, 300),
        ((Claim("tokens", 100, 1.0, 10_000.0), Claim("usd", 0.001, 4e-6, 0.0012)), {}, 16, 1000, 50),
        # a fixed-only claim does not limit units when it fits
        (
            (Claim("llm_calls", 1.0, 0.0, 3.0), Claim("tokens", 10, 2.0, 110.0)),
            {"llm_calls": 2.0},
            0,
            500,
            50,
        ),
        ((Claim("tokens", 100, 1.0, 400.0),), {}, 0, 0, 0),  # max_units 0 (no output asked)
    ],
    ids=[
        "no-claims",
        "unlimited",
        "fits",
        "clamped",
        "after-spend",
        "exact-min",
        "usd",
        "tightest-tokens",
        "tightest-usd",
        "fixed-and-per-unit",
        "zero-units",
    ],
)
def test_reserve_grants_the_most_units_that_fit_every_claim(
    claims: tuple[Claim, ...], used: dict[str, float], min_units: int, max_units: int, units: int
) -> None:
    state = fresh()
    state.used.update(used)
    grant = granted(reserve(state, req(*claims, min_units=min_units, max_units=max_units)))
    assert grant.units == units
    assert grant.run_id == "run-1" and grant.epoch == 1
    for claim in claims:
        amount = claim.fixed + claim.per_unit * units
        assert grant.amounts[claim.counter] == pytest.approx(amount)
        assert state.reserved[claim.counter] == pytest.approx(amount)
        if claim.limit is not None:
            assert (
                state.used.get(claim.counter, 0.0) + state.reserved[claim.counter] <= claim.limit + logic.EPS
            )
    assert state.open[grant.id]["amounts"] == grant.amounts
    assert state.started_at == NOW and state.updated_at == NOW


@pytest.mark.parametrize(
    ("claims", "used", "min_units", "reason", "detail"),
    [
        (
            (Claim("tokens", 100, 1.0, 400.0, "token_budget_exhausted"),),
            {"tokens": 285.0},
            16,
            "token_budget_exhausted",
            "tokens limit 400 would be exceeded: 115 left, this step needs at least 116",
        ),
        (
            (Claim("usd", 0.01, 1e-6, 0.005, "budget_exhausted"),),
            {},
            0,
            "budget_exhausted",
            "usd limit 0.005 would be exceeded: 0.005 left, this step needs at least 0.01",
        ),
        (
            (Claim("llm_calls", 1.0, 0.0, 3.0, "llm_call_cap"),),
            {"llm_calls": 3.0},
            16,
            "llm_call_cap",
            "llm_calls limit 3 would be exceeded: 0 left, this step needs at least 1",
        ),
        # reserved amounts count against the limit like used ones
        (
            (Claim("llm_calls", 1.0, 0.0, 3.0, "llm_call_cap"),),
            {"reserved:llm_calls": 3.0},
            0,
            "llm_call_cap",
            "llm_calls limit 3 would be exceeded: 0 left",
        ),
        # without a code the stop is named after the counter
        ((Claim("widgets", 1.0, 0.0, 0.5),), {}, 0, "widgets_limit", "widgets limit 0.5 would be exceeded"),
        # the first claim that cannot fit names the stop, even after a claim that fits
        (
            (
                Claim("tokens", 1, 1.0, 10**6, "token_budget_exhausted"),
                Claim("usd", 1.0, 0.0, 0.5, "budget_exhausted"),
            ),
            {},
            0,
            "budget_exhausted",
            None,
        ),
    ],
    ids=["tokens-below-min", "usd-fixed-too-big", "llm-cap", "reserved-counts", "no-code", "second-claim"],
)
def test_a_claim_that_cannot_fit_stops_the_run(
    claims: tuple[Claim, ...], used: dict[str, float], min_units: int, reason: str, detail: str | None
) -> None:
    state = fresh()
    for key, value in used.items():
        if key.startswith("reserved:"):
            state.reserved[key.removeprefix("reserved:")] = value
        else:
            state.used[key] = value
    before_reserved = dict(state.reserved)
    denial = reserve(state, req(*claims, min_units=min_units, max_units=500))
    assert isinstance(denial, Denial) and denial.reason == reason
    if detail is not None:
        assert denial.detail.startswith(detail)
    assert (state.status, state.stop_reason, state.stop_detail) == ("stopped", reason, denial.detail)
    assert state.reserved == before_reserved and state.open == {}  # nothing held for a denied step


def test_a_stop_is_sticky() -> None:
    state = fresh()
    reserve(state, req(Claim("usd", 1.0, 0.0, 0.5, "budget_exhausted")))
    for later in (req(), req(Claim("usd", 0.0, 0.0, 100.0, "budget_exhausted")), req(Claim("x", 0.0))):
        denial = reserve(state, later)
        assert isinstance(denial, Denial) and denial.reason == "budget_exhausted"
    add = logic.add(state, "tool_calls", 1.0, None, "tool_call_cap", NOW)
    assert isinstance(add, Denial) and add.reason == "budget_exhausted"
    assert "tool_calls" not in state.used
    logic.stop(state, "loop_detected", "later stop", NOW + 1)
    assert state.stop_reason == "budget_exhausted"  # the first stop wins
    assert state.open == {} and state.reserved == {}


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 33, 100])
@pytest.mark.parametrize(
    ("fixed", "per_unit", "units"),
    [
        (0.001234, 3e-6, 777),  # USD: input bound + output at realistic per-token prices
        (1200 * 2.5e-6, 10e-6, 4096),
        (0.1, 0.0, 0),  # a flat price per call
        (1000.0, 1.0, 250),  # tokens
    ],
    ids=["usd-a", "usd-b", "flat", "tokens"],
)
@pytest.mark.parametrize("settle_each", [False, True], ids=["held", "settled"])
def test_a_budget_for_exactly_n_calls_grants_exactly_n(
    n: int, fixed: float, per_unit: float, units: int, settle_each: bool
) -> None:
    limit = n * (fixed + per_unit * units)
    state = fresh()
    request = req(
        Claim("usd", fixed, per_unit, limit, "budget_exhausted"), min_units=min(16, units), max_units=units
    )
    grants: list[Reservation] = []
    for _ in range(n + 5):
        result = reserve(state, request)
        if isinstance(result, Denial):
            break
        grants.append(result)
        if settle_each:  # settled at the reservation (no usage reported): spend moves to used
            logic.settle(state, result, result.amounts, NOW)
    assert len(grants) == n
    assert [g.units for g in grants] == [units] * n
    assert isinstance(result, Denial) and result.reason == "budget_exhausted"
    assert state.used.get("usd", 0.0) + state.reserved.get("usd", 0.0) <= limit + logic.EPS
    if settle_each or per_unit == 0:
        assert state.stop_reason == "budget_exhausted" and not result.held
        return
    # held by the steps in flight, not spent: this step is refused, the run goes on
    assert result.held and not state.stopped
    assert "held by" in result.detail and "retry once they settle" in result.detail
    for grant in grants:  # they settle at their reservations: now it is spent, and the run stops
        logic.settle(state, grant, grant.amounts, NOW)
    result = reserve(state, request)
    assert isinstance(result, Denial) and not result.held and state.stop_reason == "budget_exhausted"


def test_a_limit_already_spent_stops_the_run_even_when_another_is_held() -> None:
    """USD is spent, tokens are only held: no settlement can bring USD back, so the run stops on it."""
    state = fresh()
    usd = Claim("usd", 0.0, 0.001, 1.0, "budget_exhausted")
    tokens = Claim("tokens", 0.0, 1.0, 1000.0, "token_budget_exhausted")
    state.used["usd"] = 0.99
    state.reserved["tokens"] = 1000.0
    state.open["r0"] = {"amounts": {"tokens": 1000.0}, "at": NOW}
    denial = reserve(state, req(tokens, usd, min_units=16, max_units=100))
    assert isinstance(denial, Denial) and not denial.held
    assert (denial.reason, state.stop_reason) == ("budget_exhausted", "budget_exhausted")


def test_a_held_budget_that_settles_lower_grants_again() -> None:
    """Two steps in flight hold the whole budget; one settles at a tenth: the next step fits again."""
    state = fresh()
    request = req(Claim("usd", 0.0, 1.0, 100.0, "budget_exhausted"), min_units=16, max_units=50)
    first, second = granted(reserve(state, request)), granted(reserve(state, request))
    refused = reserve(state, request)
    assert isinstance(refused, Denial) and refused.held and not state.stopped
    assert refused.detail.startswith("usd limit 100: 100 is held by 2 step(s) in flight")
    logic.settle(state, first, {"usd": 5.0}, NOW)
    assert granted(reserve(state, request)).units == 45
    logic.settle(state, second, {"usd": 50.0}, NOW)


def test_started_at_is_the_first_step() -> None:
    state = fresh()
    granted(reserve(state, req(), now=5.0))
    granted(reserve(state, req(), now=9.0))
    assert (state.started_at, state.updated_at) == (5.0, 9.0)


# -- settle and recover ----------------------------------------------------------------------------


def held_run() -> tuple[RunState, Reservation]:
    state = fresh()
    grant = granted(
        reserve(
            state,
            req(
                Claim("usd", 0.002, 0.0, 1.0),
                Claim("tokens", 1250, 0.0, None),
                Claim("llm_calls", 1.0, 0.0, 5.0),
            ),
        )
    )
    return state, grant


def test_settle_moves_actual_amounts_to_used_and_releases_the_rest() -> None:
    state, grant = held_run()
    logic.settle(
        state, grant, {"usd": 0.0005, "tokens": 300.0, "llm_calls": 1.0, "output_tokens": 40.0}, NOW + 1
    )
    assert state.used == {"usd": 0.0005, "tokens": 300.0, "llm_calls": 1.0, "output_tokens": 40.0}
    assert state.reserved == {"usd": 0.0, "tokens": 0.0, "llm_calls": 0.0}
    assert state.open == {} and state.updated_at == NOW + 1


def test_expire_charges_only_reservations_older_than_the_lease() -> None:
    state = fresh()
    old = granted(reserve(state, req(Claim("tokens", 100, 1.0, 10_000.0), max_units=400), now=NOW))
    new = granted(reserve(state, req(Claim("tokens", 100, 1.0, 10_000.0), max_units=200), now=NOW + 50))
    assert logic.expire(state, NOW + 10, NOW + 60) == 1
    # charged what it held, its tokens split as a settlement without usage splits them
    assert state.used == {"tokens": 500.0, "output_tokens": 400.0, "input_tokens": 100.0, "unreported_usage": 1.0}
    assert list(state.open) == [new.id] and state.reserved == {"tokens": 300.0}
    logic.settle(state, old, {"tokens": 1.0}, NOW + 61)  # the expired one settles into nothing
    assert state.used["tokens"] == 500.0
    assert logic.expire(state, NOW + 100, NOW + 100) == 1 and state.reserved == {"tokens": 0.0}


def test_an_expired_reservation_of_several_choices_charges_every_choices_output() -> None:
    """`n` = 3 claims 3 tokens per output unit: a crash charges 3 x 200 output tokens, the rest input."""
    state = fresh()
    granted(reserve(state, req(Claim("tokens", 100, 3.0, 10_000.0), max_units=200), now=NOW))
    assert logic.expire(state, NOW + 10, NOW + 10) == 1
    # charged what it held: no provider's count, so the run's root says "charged" (`unreported_usage`)
    assert state.used == {"tokens": 700.0, "output_tokens": 600.0, "input_tokens": 100.0, "unreported_usage": 1.0}


def test_a_record_without_output_counts_its_units() -> None:
    """Open records written before `output` was kept (a store file of an older release)."""
    record = {"amounts": {"tokens": 500.0, "usd": 0.1}, "at": NOW, "units": 400}
    assert logic.charged(record) == {"tokens": 500.0, "usd": 0.1, "output_tokens": 400.0, "input_tokens": 100.0,
                                     "unreported_usage": 1.0}


def test_settle_is_idempotent() -> None:
    state, grant = held_run()
    actual = {"usd": 0.001, "tokens": 500.0, "llm_calls": 1.0}
    logic.settle(state, grant, actual, NOW)
    once = logic.to_dict(fresh_copy(state))
    logic.settle(state, grant, actual, NOW + 5)
    logic.settle(state, grant, {"usd": 99.0}, NOW + 6)
    assert logic.to_dict(state) == once


def fresh_copy(state: RunState) -> RunState:
    return logic.from_dict(orjson.loads(orjson.dumps(logic.to_dict(state))))


def test_settle_of_an_unknown_reservation_is_a_no_op() -> None:
    state, _ = held_run()
    before = logic.to_dict(fresh_copy(state))
    logic.settle(state, Reservation("nope", "run-1", 1, 0, {"usd": 1.0}), {"usd": 1.0}, NOW)
    assert logic.to_dict(state) == before


def test_a_stale_epoch_after_reset_settles_into_nothing() -> None:
    state, grant = held_run()
    logic.reset(state, NOW + 1)
    assert state.epoch == 2 and state.reserved == {} and state.open == {}
    fresh_grant = granted(reserve(state, req(Claim("usd", 0.002, 0.0, 1.0))))
    fresh_grant_id = fresh_grant.id
    logic.settle(state, grant, {"usd": 0.5, "tokens": 1000.0, "llm_calls": 1.0}, NOW + 2)
    assert state.used == {}  # the old step's spend does not land on the fresh run
    assert state.reserved == {"usd": pytest.approx(0.002)} and list(state.open) == [fresh_grant_id]
    # even a reservation id that exists again in the new epoch is refused by epoch
    state.open[grant.id] = {"amounts": {"usd": 0.0}, "at": NOW}
    logic.settle(state, grant, {"usd": 0.5}, NOW + 3)
    assert state.used == {}


def test_recover_settles_open_reservations_at_their_amount() -> None:
    state = fresh()
    first = granted(reserve(state, req(Claim("usd", 0.002, 0.0, 1.0), Claim("llm_calls", 1.0))))
    second = granted(reserve(state, req(Claim("usd", 0.003, 0.0, 1.0), Claim("llm_calls", 1.0))))
    done = granted(reserve(state, req(Claim("usd", 0.004, 0.0, 1.0))))
    logic.settle(state, done, {"usd": 0.001}, NOW)
    assert logic.recover(state, NOW + 10) == 2
    assert state.used["usd"] == pytest.approx(0.002 + 0.003 + 0.001)  # never zero for an unseen answer
    assert state.used["llm_calls"] == 2.0
    assert state.reserved["usd"] == pytest.approx(0.0) and state.open == {}
    assert logic.recover(state, NOW + 11) == 0
    # the process that held them cannot settle them a second time
    logic.settle(state, first, {"usd": 0.0}, NOW + 12)
    logic.settle(state, second, {"usd": 0.0}, NOW + 12)
    assert state.used["usd"] == pytest.approx(0.006)


# -- add, push, take, stop, record_step ------------------------------------------------------------


@pytest.mark.parametrize(
    ("used", "reserved", "amount", "limit", "code", "result", "total"),
    [
        (0.0, 0.0, 1.0, None, "tool_call_cap", None, 1.0),
        (2.0, 0.0, 1.0, 3.0, "tool_call_cap", None, 3.0),  # exactly at the limit
        (3.0, 0.0, 1.0, 3.0, "tool_call_cap", "tool_call_cap", 3.0),  # over: stops, adds nothing
        (1.0, 0.0, 3.0, 3.0, "tool_call_cap", "tool_call_cap", 1.0),
        (1.0, 2.0, 1.0, 3.0, "tool_call_cap", "tool_call_cap", 1.0),  # reserved counts
        (0.1 + 0.2, 0.0, 0.7, 1.0, "c", None, 1.0),  # rounding does not stop an exact fit
        (3.0, 0.0, 1.0, 3.0, "", "tool_calls_limit", 3.0),  # no code: named after the counter
    ],
    ids=["unlimited", "exact", "over", "over-by-many", "reserved", "float-exact", "default-code"],
)
def test_add(
    used: float,
    reserved: float,
    amount: float,
    limit: float | None,
    code: str,
    result: str | None,
    total: float,
) -> None:
    state = fresh()
    state.used["tool_calls"], state.reserved["tool_calls"] = used, reserved
    denial = logic.add(state, "tool_calls", amount, limit, code, NOW)
    if result is None:
        assert denial is None and not state.stopped
    else:
        assert isinstance(denial, Denial) and denial.reason == result
        assert state.stop_reason == result and "tool_calls limit" in denial.detail
    assert state.used["tool_calls"] == pytest.approx(total)


def test_add_starts_the_run_clock() -> None:
    state = fresh()
    assert logic.add(state, "tool_calls", 1.0, None, "", 7.0) is None
    assert state.started_at == 7.0


@pytest.mark.parametrize(
    ("existing", "values", "keep", "expected"),
    [
        (None, ["a"], 3, ["a"]),
        (["a", "b"], ["c"], 3, ["a", "b", "c"]),
        (["a", "b", "c"], ["d"], 3, ["b", "c", "d"]),
        (["a"], ["b", "c", "d", "e"], 2, ["d", "e"]),
        (["a"], [], 5, ["a"]),
        (["a", "b"], ["c"], 1, ["c"]),
    ],
)
def test_push_keeps_the_last_values(
    existing: list[str] | None, values: list[str], keep: int, expected: list[str]
) -> None:
    state = fresh()
    if existing is not None:
        state.lists["k"] = list(existing)
    out = logic.push(state, "k", values, keep)
    assert out == expected and state.lists["k"] == expected
    out.append("mutated")
    assert state.lists["k"] == expected  # the returned list is a copy


@pytest.mark.parametrize(
    ("existing", "value", "taken", "left"),
    [
        (["a", "b"], "a", True, ["b"]),
        (["a", "b", "a"], "a", True, ["b", "a"]),  # one at a time
        (["a"], "z", False, ["a"]),
        ([], "a", False, []),
        (None, "a", False, None),
    ],
)
def test_take(existing: list[str] | None, value: str, taken: bool, left: list[str] | None) -> None:
    state = fresh()
    if existing is not None:
        state.lists["proposed"] = list(existing)
    assert logic.take(state, "proposed", value) is taken
    assert state.lists.get("proposed") == left


def test_stop_first_wins() -> None:
    state = fresh()
    logic.stop(state, "loop_detected", "first", 1.0)
    logic.stop(state, "time_cap", "second", 2.0)
    assert (state.status, state.stop_reason, state.stop_detail, state.updated_at) == (
        "stopped",
        "loop_detected",
        "first",
        1.0,
    )
    assert state.stopped


@pytest.mark.parametrize(("judged", "refused"), [(None, False), (2, False), (1, True), (3, True)])
def test_a_stop_or_effects_judged_on_another_epoch_change_nothing(judged: int | None, refused: bool) -> None:
    """`epoch`: the one the caller judged (None: not checked). Another epoch: RunReset, nothing written."""
    state = fresh()
    state.epoch = 2
    adds, pushes = [Add("tool_calls", 1.0, None, "")], [Push("calls", ("a",), 6)]
    if refused:
        with pytest.raises(RunReset):
            logic.stop(state, "loop_detected", "judged", 1.0, epoch=judged)
        with pytest.raises(RunReset):
            logic.apply(state, adds, pushes, 1.0, epoch=judged)
        assert (state.status, state.used, state.lists, state.updated_at) == ("active", {}, {}, None)
    else:
        assert logic.apply(state, adds, pushes, 1.0, epoch=judged) is None
        assert logic.stop(state, "loop_detected", "judged", 1.0, epoch=judged) == Denial("loop_detected", "judged")
        assert (state.status, state.used, state.lists) == ("stopped", {"tool_calls": 1.0}, {"calls": ["a"]})


def test_record_step_keeps_the_last_steps_as_copies() -> None:
    state = fresh()
    step: dict[str, Any] = {"n": 0}
    logic.record_step(state, step, 1.0)
    step["n"] = "mutated"
    assert state.steps == [{"n": 0}]
    for n in range(1, logic.MAX_STEPS + 10):
        logic.record_step(state, {"n": n}, float(n))
    assert len(state.steps) == logic.MAX_STEPS
    assert [s["n"] for s in state.steps] == list(range(10, logic.MAX_STEPS + 10))
    assert state.updated_at == float(logic.MAX_STEPS + 9)


def test_reset_clears_everything_but_identity() -> None:
    state, _ = held_run()
    logic.push(state, "calls", ["a"], 6)
    logic.record_step(state, {"n": 1}, NOW)
    logic.stop(state, "loop_detected", "x", NOW)
    logic.reset(state, NOW + 1)
    assert (state.run_id, state.agent, state.epoch, state.status, state.stop_reason, state.stop_detail) == (
        "run-1",
        "bot",
        2,
        "active",
        None,
        None,
    )
    assert (state.started_at, state.updated_at) == (None, NOW + 1)
    assert state.used == state.reserved == state.open == state.lists == {} and state.steps == []
    granted(reserve(state, req(Claim("llm_calls", 1.0, 0.0, 1.0))))  # usable again


# -- serialisation ---------------------------------------------------------------------------------


def busy_run() -> RunState:
    state, grant = held_run()
    logic.settle(state, grant, {"usd": 0.001, "tokens": 10.0}, NOW)
    granted(reserve(state, req(Claim("usd", 0.002, 0.0, 1.0))))
    logic.push(state, "calls", ["f1", "f2"], 6)
    logic.record_step(state, {"operation": "chat", "cost_usd": 0.001}, NOW)
    logic.stop(state, "loop_detected", "detail", NOW + 3)
    return state


@pytest.mark.parametrize("through_json", [False, True], ids=["dict", "json"])
def test_to_dict_from_dict_round_trip(through_json: bool) -> None:
    state = busy_run()
    data = logic.to_dict(state)
    if through_json:
        data = orjson.loads(orjson.dumps(data))
    copy = logic.from_dict(data)
    assert copy == state
    copy.used["usd"] = 99.0
    copy.lists["calls"].append("x")
    copy.reserved.clear()
    assert state.used["usd"] != 99.0 and state.lists["calls"] == ["f1", "f2"] and state.reserved


def test_from_dict_defaults() -> None:
    state = logic.from_dict({"run_id": "r", "agent": "a"})
    assert state == RunState(run_id="r", agent="a")


def test_view_is_the_admin_shape() -> None:
    view = busy_run().view()
    assert set(view) >= {
        "run_id",
        "agent",
        "status",
        "stop_reason",
        "spent_usd",
        "reserved_usd",
        "input_tokens",
        "output_tokens",
        "reserved_tokens",
        "llm_calls",
        "tool_calls",
        "started_at",
        "steps",
    }
    assert (view["status"], view["stop_reason"], view["llm_calls"]) == ("stopped", "loop_detected", 0)
    assert view["spent_usd"] == pytest.approx(0.001) and view["reserved_usd"] == pytest.approx(0.002)
    assert view["steps"] == [{"operation": "chat", "cost_usd": 0.001}]


# -- claim_root: which invoke_agent root is exported, once, whoever asks -----------------------------


def claim(state: RunState, *, final: bool = False, stopped: bool = False, upto: float | None = None,
          now: float = NOW, epoch: int = 1) -> tuple[int, float | None] | None:
    return logic.claim_root(state, epoch, final=final, stopped=stopped, upto=upto, now=now)


def test_an_idle_claim_exports_each_segment_once_and_only_after_news() -> None:
    state = fresh()
    logic.record_step(state, {}, 10.0)
    assert state.root_segment() == 0 and state.root_segment(step=False) == 0
    assert claim(state, upto=20.0, now=30.0) == (0, None)  # the run's first root: from its own start
    assert claim(state, upto=20.0, now=31.0) is None  # claimed: a second sweep exports nothing
    assert claim(state, upto=40.0, now=41.0) is None  # idle again with nothing new since
    assert state.root_segment() == 1 and state.root_segment(step=False) == 0  # a step opens the next root
    logic.record_step(state, {}, 50.0)
    assert claim(state, upto=45.0, now=60.0) is None  # busy again since the window the sweep read
    assert claim(state, upto=55.0, now=61.0) == (1, 30.0)  # starts where the previous root ended
    assert (state.roots, state.roots_final, state.roots_mark, state.roots_end) == (2, False, 50.0, 61.0)


def test_a_stop_ends_the_epochs_roots_for_good_and_later_steps_go_under_its_root() -> None:
    state = fresh()
    logic.record_step(state, {}, 10.0)
    assert claim(state, upto=20.0, now=30.0) == (0, None)
    logic.stop(state, "llm_call_cap", "cap", 40.0)
    assert claim(state, upto=50.0, now=50.0) is None  # a sweep leaves a stopped run to its stop
    assert claim(state, final=True, stopped=True, now=41.0) == (1, 30.0)
    assert claim(state, final=True, stopped=True, now=42.0) is None  # another process, or a later refusal
    assert state.root_segment() == state.root_segment(step=False) == 1  # under the root that carries the stop


def test_a_stop_after_an_idle_root_is_news_even_with_nothing_written_since() -> None:
    """A step admitted before the idle export (a long stream) may stop the run: its stop is still news."""
    state = fresh()
    logic.record_step(state, {}, 10.0)
    assert claim(state, upto=20.0, now=30.0) == (0, None)
    assert claim(state, final=True, stopped=True, now=31.0) == (1, 30.0)


def test_a_reset_of_a_run_with_nothing_new_exports_nothing_and_the_new_epoch_starts_afresh() -> None:
    state = fresh()
    logic.record_step(state, {}, 10.0)
    assert claim(state, upto=20.0, now=30.0) == (0, None)
    assert claim(state, final=True, now=31.0) is None  # the reset's claim: nothing since the idle root
    assert state.roots_final and state.root_segment() == 0  # a late step of the epoch: under that root
    logic.reset(state, 32.0)
    assert (state.roots, state.roots_final, state.roots_mark, state.roots_end) == (0, False, None, None)
    assert claim(state, upto=40.0, now=41.0, epoch=1) is None  # the former epoch's: nothing to claim
    assert claim(state, upto=40.0, now=41.0, epoch=2) == (0, None)


def test_the_roots_survive_a_round_trip_and_a_run_written_before_them_reads_as_none_exported() -> None:
    state = fresh()
    logic.record_step(state, {}, 10.0)
    claim(state, upto=20.0, now=30.0)
    again = logic.from_dict(orjson.loads(orjson.dumps(logic.to_dict(state))))
    assert (again.roots, again.roots_final, again.roots_mark, again.roots_end) == (1, False, 10.0, 30.0)
    older = {k: v for k, v in logic.to_dict(state).items() if not k.startswith("roots")}
    assert logic.from_dict(older).roots == 0
