"""The run store: durable per-run state, changed only through atomic operations.

Every backend implements `RunStore`. The arithmetic lives once, in `gateway.store.logic`, as pure
functions over a `RunState`; the memory and SQLite backends run them on the event loop without
awaiting (SQLite, which owns its file, writes the run through before the call returns), and the Redis
backend runs the same steps in Lua scripts, so an operation is atomic across every replica that shares
the store.

Counters (`usd`, `tokens`, `input_tokens`, `output_tokens`, `llm_calls`, `tool_calls`, ...) each have a
used and a reserved amount. A reservation holds amounts of several counters at once; settling it
moves the real amounts to used and releases the rest. A run's `epoch` changes on reset, so a
reservation made before a reset settles into nothing instead of corrupting the fresh run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from gateway.frozen_init import fast_init

UNREPORTED_USAGE: Final = "unreported_usage"
"""A run's used counter: the settlements that charged tokens without provider-reported usage (a cut
stream, a timeout, a reservation whose process is gone: what it held). The run's token totals are then
no provider's count."""


@fast_init
@dataclass(frozen=True, slots=True)
class Claim:
    """Reserve `fixed + per_unit * units` of `counter`, keeping used + reserved <= `limit`.

    `code` is the stop reason when the limit cannot be met even at the request's `min_units`.
    """

    counter: str
    fixed: float
    per_unit: float = 0.0
    limit: float | None = None
    code: str = ""


@fast_init
@dataclass(frozen=True, slots=True)
class ReserveRequest:
    """All claims of one step, granted together or not at all.

    `units` (output tokens) is maximised within [min_units, max_units] so that every claim fits; when
    the claims cannot pay for `max_units`, at most `clamp_units` (the model's output limit) are granted.
    `refuse_only`: a budget claim (one sized by the request: `per_unit` > 0) that cannot fit refuses this
    request alone (`Denial.held`) and stops nothing (a re-ask: tollgate's own request, bigger than the
    agent's); a count (`caps.llm_calls`) that cannot fit stops the run as for any request.
    """

    claims: tuple[Claim, ...]
    min_units: int = 0
    max_units: int = 0
    clamp_units: int | None = None
    refuse_only: bool = False


@fast_init
@dataclass(frozen=True, slots=True)
class Add:
    """Add `amount` to counter `counter`; exceeding `limit` stops the run with `code`."""

    counter: str
    amount: float
    limit: float | None = None
    code: str = ""


@fast_init
@dataclass(frozen=True, slots=True)
class Push:
    """Append `values` to the run's history list `key`, keeping the last `keep`.

    With `distinct_limit`, the push is also a claim, judged atomically with the others of its
    operation: when the list would then hold `keep` values of at most `distinct_limit` distinct
    ones (a loop), the run is stopped with `code` and `detail` and nothing of the operation is
    applied. Guards judge their snapshot of the run; this holds when steps of one run, on several
    gateways, write their histories between one another's reads."""

    key: str
    values: tuple[str, ...]
    keep: int
    distinct_limit: int | None = None
    code: str = ""
    detail: str = ""


@fast_init
@dataclass(frozen=True, slots=True)
class Reservation:
    id: str
    run_id: str
    epoch: int
    units: int
    amounts: Mapping[str, float]


@fast_init
@dataclass(frozen=True, slots=True)
class Denial:
    """A claim that did not fit, or the run was already stopped. The run is stopped with `reason`,
    unless `held`: the claim fits what the run has spent, and only the reservations of its steps in
    flight (which may settle lower) stand in the way. Then this step is refused and the run goes on."""

    reason: str
    detail: str
    held: bool = False


@fast_init
@dataclass(frozen=True, slots=True)
class WriteClaim:
    """What `RunStore.claim_write` found for a side-effecting tool call of a run.

    `state`: "claimed" (the caller holds the call now and must finish or release it), "running" (another
    caller holds a live claim on it), or "done" (it ran; `result` is the recorded result body, None when
    the body was not kept)."""

    state: str
    result: bytes | None = None


RootClaim = tuple[int, float | None]
"""A run epoch's root span to export (`RunStore.claim_root`): its segment, and its start (Unix seconds; None
for the run's own start)."""

RunsCursor = tuple[float, str]
"""A position in the listing order of runs: (`updated_at`, with 0 for a run that has none; `run_id`)."""


@fast_init
@dataclass(frozen=True, slots=True)
class RunsPage:
    """One page of `RunStore.runs_page`. `next`: the position of the page's last run when more runs
    follow it (pass it as `after` for the next page), else None."""

    runs: list[RunState]
    next: RunsCursor | None


@dataclass(slots=True)
class RunState:
    run_id: str
    agent: str
    epoch: int = 1
    status: str = "active"
    stop_reason: str | None = None
    stop_detail: str | None = None
    started_at: float | None = None
    updated_at: float | None = None
    used: dict[str, float] = field(default_factory=dict)
    reserved: dict[str, float] = field(default_factory=dict)
    lists: dict[str, list[str]] = field(default_factory=dict)
    open: dict[str, dict[str, Any]] = field(default_factory=dict)  # reservation id -> amounts
    steps: list[dict[str, Any]] = field(default_factory=list)
    # the epoch's `invoke_agent` root spans (`logic.claim_root`), kept with the run so that every process
    # sharing the store exports each of them once: how many were exported, whether the last one ended
    # the epoch for good (a stop or a reset), the run's `updated_at` when it was claimed (a run whose
    # `updated_at` moved since has news for the next one), and when it ended (where the next one starts)
    roots: int = 0
    roots_final: bool = False
    roots_mark: float | None = None
    roots_end: float | None = None
    # what `RunStore.reset` answers only (never stored): the epoch it ended, as it was then (its steps
    # included), with that epoch's final root when the reset claimed it
    ended: tuple[RunState, RootClaim] | None = None

    @property
    def stopped(self) -> bool:
        return self.status == "stopped"

    def root_segment(self, *, step: bool = True) -> int:
        """The root (`otel.runs.run_ids` segment) a span of the run goes under: a step's, the one to be
        exported next, unless the epoch's roots ended for good (then the last one); a call that is no
        step of the run (it writes nothing the next root would report), the last one exported."""
        if self.roots and (self.roots_final or not step):
            return self.roots - 1
        return self.roots

    def view(self) -> dict[str, Any]:
        """The run as the admin API shows it (DESIGN section 2)."""
        return {
            "run_id": self.run_id,
            "agent": self.agent,
            "status": self.status,
            "stop_reason": self.stop_reason,
            "stop_detail": self.stop_detail,
            "spent_usd": round(self.used.get("usd", 0.0), 10),
            "reserved_usd": round(self.reserved.get("usd", 0.0), 10),
            "input_tokens": int(self.used.get("input_tokens", 0)),
            "output_tokens": int(self.used.get("output_tokens", 0)),
            "reserved_tokens": round(self.reserved.get("tokens", 0.0)),
            "llm_calls": int(self.used.get("llm_calls", 0)),
            "tool_calls": int(self.used.get("tool_calls", 0)),
            "started_at": self.started_at,
            "updated_at": self.updated_at,
            "steps": list(self.steps),
        }


class RunStore(Protocol):
    """Atomic operations on runs. Implementations: memory, sqlite, redis."""

    async def get(self, run_id: str, *, steps: bool = True, reservations: bool = True) -> RunState | None:
        """The run, or None. `steps=False` may leave `steps` empty, `reservations=False` may leave `open`
        empty (the guards read neither; the amounts the open reservations hold stay in `reserved`)."""
        ...

    async def reserve(
        self, run_id: str, agent: str, request: ReserveRequest, now: float
    ) -> Reservation | Denial: ...

    async def settle(self, reservation: Reservation, actual: Mapping[str, float], now: float) -> None: ...

    async def add(
        self, run_id: str, agent: str, counter: str, amount: float, *, limit: float | None, code: str, now: float
    ) -> Denial | None: ...

    async def push(self, run_id: str, agent: str, key: str, values: Sequence[str], keep: int) -> list[str]: ...

    async def apply(
        self, run_id: str, agent: str, adds: Sequence[Add], pushes: Sequence[Push], now: float,
        *, in_flight: bool = False, epoch: int | None = None,
    ) -> Denial | None:
        """All of a step's counter additions and history pushes in one atomic operation. The first add
        that would exceed its limit stops the run and nothing of the operation is applied. A stopped run
        refuses any add, unless `in_flight` (the answer of a step admitted before the stop): then only a
        breach is refused, with the run's own reason (`logic.apply`). `epoch`: the run's epoch the
        effects were judged on; when a reset has ended it, nothing is applied and RunReset is raised."""
        ...

    async def take(self, run_id: str, key: str, value: str) -> bool: ...

    async def stop(
        self, run_id: str, agent: str, reason: str, detail: str, now: float, *, epoch: int | None = None
    ) -> Denial:
        """Stop the run (sticky until reset) and answer the stop it holds: the first stop wins, so a run
        another step stopped meanwhile keeps, and answers, its own reason. `epoch`: the run's epoch the
        stop was judged on; when a reset has ended it, the fresh run is not stopped and RunReset is
        raised (atomically with the check)."""
        ...

    async def record_step(self, run_id: str, agent: str, step: Mapping[str, Any], now: float) -> int:
        """Keep the step in the run's list (creating the run) and answer the epoch it is filed under:
        `step["epoch"]` when given (the epoch it ran under; left out of the list if a reset ended that
        epoch since), else the run's current one (a step refused before it read the run, whose trace
        is the current epoch's)."""
        ...

    async def reset(self, run_id: str, now: float) -> RunState | None:
        """Start the run afresh under its next epoch (`logic.reset`) and answer it, or None when there is no
        such run. Its `ended`: the epoch the reset ended, as it was (steps included), and that epoch's
        final root, when the reset claimed it atomically with the reset (`logic.claim_root`): the caller
        exports it with that epoch's totals."""
        ...

    async def claim_root(
        self, run_id: str, epoch: int, *, final: bool, stopped: bool = False, upto: float | None = None,
        now: float,
    ) -> RootClaim | None:
        """Atomically, across every process sharing the store: decide whether the run epoch's next root
        span is exported now, by the caller (`logic.claim_root`): (segment, its start: None for the run's
        own start) when it is, else None (another process claimed it, nothing happened since the last
        one, the epoch ended or changed, or the run is gone)."""
        ...

    async def list_runs(self, limit: int = 100) -> list[RunState]: ...

    async def runs_page(self, after: RunsCursor | None, limit: int) -> RunsPage:
        """Up to `limit` (>= 1) runs, each with its steps, in listing order: least recently updated first
        (a run without `updated_at` counts as 0), then by run id (compared as UTF-8 bytes); the first
        ones, or those after the position `after`. Paging is stable under concurrent updates: a run
        updated while a client pages moves to the end of the order, so it comes in a later page (again,
        if it was listed already, with its new state) and is never skipped; a run created meanwhile
        comes in a later page. `next` is set exactly when a run followed the page when it was read (a run
        that expired meanwhile may leave the next page empty). A store may read all the runs of the
        cursor's `updated_at` to find where the page starts."""
        ...

    # -- side-effecting tool calls (`write`/`dangerous` tiers): at most one execution per key ------------
    # Entries are per `(run_id, epoch, key)`: a reset run (new epoch) starts with nothing claimed or
    # recorded. A run keeps at most `keep` entries (the oldest are dropped first) and they expire with it.

    async def claim_write(
        self, run_id: str, agent: str, epoch: int, key: str, token: str, *, lease_s: float, keep: int, now: float
    ) -> WriteClaim:
        """Atomically, across every process sharing the store: claim the call for `token` until
        `now + lease_s` when nobody holds it, its holder's lease ran out (a crashed holder), or `token`
        holds it already; else answer that it is "running" or "done" (with its recorded result)."""
        ...

    async def renew_write(self, run_id: str, epoch: int, key: str, token: str, *, until: float) -> bool:
        """Extend `token`'s live or lapsed claim to `until`; False when `token` no longer holds the call
        (released, recorded, or taken over after its lease ran out). Never creates a claim."""
        ...

    async def finish_write(
        self, run_id: str, agent: str, epoch: int, key: str, token: str, result: bytes | None, *, keep: int,
        now: float,
    ) -> None:
        """The call ran: mark it "done" with `result` (None: ran, result not kept), whoever holds it. A call
        already done keeps its first result."""
        ...

    async def release_write(self, run_id: str, epoch: int, key: str, token: str) -> None:
        """The call did not run: drop `token`'s claim (if it still holds it) so the next caller runs it."""
        ...

    def runs_updated(self, after: float, before: float, page: int = 1000) -> AsyncIterator[list[RunState]]:
        """Every run last updated in (`after`, `before`], least recently updated first (ties by run id),
        in pages of `page` runs (more where a page ends among runs of one time, which a store may take
        whole so that none is skipped), each run with its steps. What a page shows is read when it is asked
        for: a run updated meanwhile may show its new `updated_at`, or come in a later page. Reads only
        the runs of the window (the idle-run sweep asks for those that went idle since its last sweep)."""
        ...

    async def idle_swept(self) -> float | None:
        """How far the idle-run sweeps of every process that used this store have looked (the largest
        `set_idle_swept`), or None: where a restarted process's first sweep starts, however long it was
        down."""
        ...

    async def set_idle_swept(self, upto: float) -> None:
        """Every run last updated at or before `upto` was judged by an idle-run sweep. Only a larger value
        than the one kept counts (replicas sweep the same runs, each at its own pace)."""
        ...

    async def close(self) -> None: ...
