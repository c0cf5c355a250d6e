"""Redis run store: one run state shared by many gateway processes (one sidecar per agent, one Redis).

Contracts:
* Every write operation is ONE Lua script (`gateway.store.redis_scripts`), the twin of its function in
  `gateway.store.logic` (same order of checks, same EPS, the sticky first stop, epochs, idempotent
  settle), run with EVALSHA (re-registered automatically after a Redis restart). Redis runs a script
  without interleaving other commands, so N processes hold a limit exactly as one process does.
* Layout: a hash per run, `<prefix>run:<run_id>` (fields in `redis_scripts`), its steps in a list
  `<prefix>steps:<run_id>` (so the hot path's `get(steps=False)` reads one small hash); a sorted set
  `<prefix>runs` of run ids by `updated_at` for `list_runs`, `runs_page` and `runs_updated`
  (`gateway.store.redis_index`), pruned lazily of expired runs; `<prefix>idle_swept`, how far the idle-run sweeps of every process have looked.
* Expiry: a stopped run expires `ttl_s` after its last write (stop, a later step record, ...); an active
  run expires `idle_ttl_s` after its last write (default: 30 days, never less than `ttl_s`; 0 = never).
  Every call writes, so a run in use never expires; an abandoned one does not stay forever.
* Failure: any Redis error (refused, timed out, reset, OOM, ...) raises `StateUnavailable` (503
  `state_unavailable`), never a silent allow. Connect timeout 1 s; a whole call (queueing, reconnecting)
  gives up after 2 s. A command written is never sent again (a retried reserve could reserve twice); a
  connection Redis closed while idle is replaced before a command is written on it
  (`gateway.store.redis_link`). `open()` does not connect: a gateway can start while Redis is down.
* At first use the store warns once when Redis' settings could lose runs (`redis_link.warn_if_lossy`).
* Side-effecting tool calls (`claim_write` and the rest) keep their claims and recorded results in two
  keys of their own per run (`gateway.store.redis_writes`), so the hot path's `get` never reads them.
* A settle that failed is kept (bounded) and replayed by a background task (a growing pause between
  rounds, at most `REPLAY_PAUSE_MAX_S`; it ends when nothing is left, `close` cancels it), before this
  store's next call, and at `close`; also after errors of a Redis that cannot write for now (READONLY,
  NOREPLICAS, ...). A reserve whose answer was lost is released at zero (the step never went upstream):
  settle is idempotent, so a replay that already happened is a no-op. Every id settled, released or
  expired stays in `<prefix>released:<run_id>` for at least the lease: a reserve of one is refused (a
  late reserve never holds a budget), and a settle of one charges nothing again.
* A settle of a reservation this store granted within its lease, whose run Redis lost meanwhile
  (FLUSHALL, a restart without its data), charges its usage to the run as it is now (created afresh).
* Reservations of a process that died stay charged against the budget (as SQLite's crash recovery
  charges them) until the run is reset or expires, or until their lease (`lease_s`,
  `state.reservation_lease_s`) runs out: a reserve then charges them in full (`logic.expire`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

import orjson
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import RunReset, StateUnavailable
from gateway.store import logic
from gateway.store.base import (
    Add,
    Denial,
    Push,
    Reservation,
    ReserveRequest,
    RootClaim,
    RunsCursor,
    RunsPage,
    RunState,
    WriteClaim,
)
from gateway.store.redis_index import RunIndex, run_key, steps_key
from gateway.store.redis_link import Granted, fresh_pool, lost_run_agent, replay_ended, warn_if_lossy
from gateway.store.redis_scripts import decode_reply, opt_float, scripts
from gateway.store.writes import field

T = TypeVar("T")
MAX_UNSETTLED = 10_000  # settles kept for replay while Redis is away; beyond, the oldest stay reserved
REPLAY_BATCH = 64
REPLAY_PAUSE_S, REPLAY_PAUSE_MAX_S = 0.1, 5.0  # the background replay's pauses between rounds (doubling)
# Linux retransmits what a closed socket had not delivered for ~925 s (tcp_retries2 = 15): a reserve
# can land that late, so its tombstone lives at least that long (and at least the lease)
TOMBSTONE_MIN_S = 930
_IDLE_DEFAULT_S = 30 * 24 * 3600
# `set_idle_swept`: the idle-run sweeps' mark only moves forward (replicas sweep at their own pace)
_RAISE_MARK = """
local kept = tonumber(redis.call('GET', KEYS[1]))
if kept == nil or tonumber(ARGV[1]) > kept then redis.call('SET', KEYS[1], ARGV[1]) end
return 0
"""
# errors of a Redis that cannot write for now (a replica after failover, too few replicas, a full disk,
# busy with a script or loading): what failed then succeeds later
_PASSING_CODES = ("NOREPLICAS", "MISCONF", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "LOADING")
log = logging.getLogger(__name__)


def _passing(exc: RedisError) -> bool:
    return isinstance(exc, ReadOnlyError | OutOfMemoryError) or str(exc).startswith(_PASSING_CODES)


def _judged(run_id: str, epoch: int | None, reply: list[Any]) -> list[Any]:
    """A `stop` / `apply` script's reply, RunReset when it found `epoch` ended (`reset_since`)."""
    if reply[0] == "reset" and epoch is not None:
        raise RunReset(run_id, epoch, int(reply[1]))
    return reply


class RedisRunStore:
    def __init__(
        self, client: Redis, ttl_s: int, idle_s: int, prefix: str, where: str, deadline: float, slots: int,
        lease_s: int = 3600,
    ) -> None:
        self._client = client
        self._lease = float(lease_s)
        self._tombstone_s = max(int(lease_s), TOMBSTONE_MIN_S)
        self._deadline = deadline
        # FIFO admission to the pool's connections: redis-py's own blocking pool costs more per call and
        # lets a waiter starve past its timeout under a burst
        self._slots = asyncio.Semaphore(slots)
        self._ttl = str(int(ttl_s))
        self._idle = str(int(idle_s))
        self._prefix = prefix
        self._index = f"{prefix}runs"
        self._runs = RunIndex(client, prefix, self._guard)
        self._where = where
        self._scripts: dict[str, AsyncScript] = {n: client.register_script(s) for n, s in scripts().items()}
        self._mark = client.register_script(_RAISE_MARK)
        self._owner = uuid.uuid4().hex[:12]  # reservation ids never collide across processes
        self._seq = 0
        # reservation id -> (run_id, settle arguments): settles to replay once Redis answers again
        self._unsettled: OrderedDict[str, tuple[str, list[Any]]] = OrderedDict()
        self._replayer: asyncio.Task[None] | None = None  # replays `_unsettled` while it is not empty
        self._checked = False  # Redis' durability settings read (once, at first use)

    @classmethod
    def open(
        cls,
        url: str,
        *,
        ttl_s: int = 7 * 24 * 3600,
        idle_ttl_s: int | None = None,
        prefix: str = "tollgate:",
        connect_timeout_s: float = 1.0,
        op_timeout_s: float = 2.0,
        max_connections: int = 32,
        lease_s: int = 3600,
    ) -> RedisRunStore:
        """A store on `url` (redis://, rediss://, unix://). Synchronous and lazy: connects on first use.

        At most `max_connections` connections; more concurrent calls queue for one, so a burst of requests
        does not open a connection each. `op_timeout_s` bounds a whole call, queueing included."""
        parts = urlsplit(url)
        where = parts.hostname or parts.path or url.split("@")[-1]  # never echo a password
        if parts.port:
            where = f"{where}:{parts.port}"
        try:
            pool = fresh_pool(
                url,
                max_connections=max_connections,
                socket_connect_timeout=connect_timeout_s,
                socket_timeout=op_timeout_s,
            )
        except ValueError as exc:
            raise StateUnavailable(f"bad redis url for the run store ({where}): {exc}") from None
        idle = _IDLE_DEFAULT_S if idle_ttl_s is None else idle_ttl_s
        if idle:
            idle = max(idle, ttl_s)
        return cls(Redis.from_pool(pool), ttl_s, idle, prefix, where, op_timeout_s, max_connections, lease_s)

    # -- plumbing ------------------------------------------------------------------------------------

    async def _guard(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run `fn` on a connection slot within the deadline; any Redis failure is StateUnavailable.
        A call cut off by the deadline has its connection dropped by redis-py (no misread replies)."""
        try:
            async with asyncio.timeout(self._deadline), self._slots:
                if not self._checked:
                    await self._check_durability()
                return await fn()
        except TimeoutError:  # the builtin one, from asyncio.timeout (redis-py raises its own below)
            raise StateUnavailable(
                f"run state store (redis at {self._where}) unavailable: no answer within {self._deadline:g} s"
            ) from None
        except (RedisError, OSError) as exc:
            raise StateUnavailable(
                f"run state store (redis at {self._where}) unavailable: {type(exc).__name__}: {exc}"
            ) from None

    async def _check_durability(self) -> None:
        """Once per store (`redis_link.warn_if_lossy`); a check cut short (Redis away) is made again at the
        next call, and concurrent first calls check once."""
        self._checked = True
        try:
            await warn_if_lossy(self._client, self._where)
        except BaseException:
            self._checked = False
            raise

    def _keys(self, run_id: str) -> list[str]:
        """Every script's KEYS (`gateway.store.redis_scripts`): a run's writes expire with it."""
        prefix = self._prefix
        return [run_key(prefix, run_id), self._index, steps_key(prefix, run_id), f"{prefix}writes:{run_id}",
                f"{prefix}writeorder:{run_id}", f"{prefix}released:{run_id}"]

    async def _eval(self, name: str, run_id: str, agent: str, args: list[Any]) -> Any:
        script = self._scripts[name]
        return await script(keys=self._keys(run_id), args=[run_id, agent, self._ttl, self._idle, orjson.dumps(args)])

    async def _call(self, name: str, run_id: str, agent: str, args: list[Any]) -> Any:
        """Run one operation's script, after replaying settles an outage left behind."""

        async def run() -> Any:
            if self._unsettled:
                await self._replay()
            return await self._eval(name, run_id, agent, args)

        return await self._guard(run)

    async def _call_writes(
        self, name: str, run_id: str, agent: str, args: list[Any], body: bytes | None = None
    ) -> Any:
        """`_call` for the scripts of `redis_writes`: the run's keys plus its two keys of tool writes."""
        script = self._scripts[name]
        keys = self._keys(run_id)
        argv: list[Any] = [run_id, agent, self._ttl, self._idle, orjson.dumps(args)]
        if body is not None:
            argv.append(body)

        async def run() -> Any:
            if self._unsettled:
                await self._replay()
            return await script(keys=keys, args=argv)

        return await self._guard(run)

    async def _replay(self) -> None:
        """Settle what failed to settle earlier, oldest first, a bounded batch per call (the caller's
        deadline covers it). Trouble that passes (no connection, a server that refuses writes for now)
        stops the replay (and the caller's operation); any other error drops that entry, since retrying
        cannot help."""
        for _ in range(REPLAY_BATCH):
            if not self._unsettled:
                return
            rid, (run_id, args) = next(iter(self._unsettled.items()))
            try:
                await self._eval("settle", run_id, "", args)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                raise
            except RedisError as exc:
                if _passing(exc):
                    raise
            self._unsettled.pop(rid, None)

    @property
    def unsettled(self) -> int:
        """How many settles wait for replay."""
        return len(self._unsettled)

    async def replay_unsettled(self) -> int:
        """Settle now what an outage left unsettled (the background replay and `close` do); how many are
        still unsettled. Raises nothing but bugs (StateUnavailable ends the attempt)."""
        try:
            while self._unsettled:
                before = len(self._unsettled)
                await self._guard(self._replay)
                if len(self._unsettled) == before:
                    break
        except StateUnavailable:
            pass
        return len(self._unsettled)

    def _keep_unsettled(self, run_id: str, rid: str, args: list[Any]) -> None:
        """Keep a settle for replay and make sure the background replay runs (an idle gateway must not
        hold a shared budget until the lease runs out)."""
        self._unsettled[rid] = (run_id, args)
        while len(self._unsettled) > MAX_UNSETTLED:
            self._unsettled.popitem(last=False)
        if self._replayer is None or self._replayer.done():
            self._replayer = asyncio.get_running_loop().create_task(self._replay_loop(), name="redis-replay")
            self._replayer.add_done_callback(replay_ended)

    async def _replay_loop(self) -> None:
        """Replay until nothing is left: a round at once, then after each round Redis did not take all
        of, a pause that doubles up to `REPLAY_PAUSE_MAX_S`. Ends when `_unsettled` is empty."""
        pause = REPLAY_PAUSE_S
        while await self.replay_unsettled():
            await asyncio.sleep(pause)
            pause = min(pause * 2, REPLAY_PAUSE_MAX_S)

    async def replayed(self) -> int:
        """Wait for the background replay to end (nothing left, or `close`); how many are left."""
        if self._replayer is not None:
            await asyncio.wait({self._replayer})
        return len(self._unsettled)

    # -- RunStore ------------------------------------------------------------------------------------

    async def get(self, run_id: str, *, steps: bool = True, reservations: bool = True) -> RunState | None:
        """The run (one script: run and steps are one snapshot); `steps=False` leaves the steps out."""
        reply = await self._guard(lambda: self._eval("get", run_id, "", [steps]))
        return None if reply is None else decode_reply(reply)

    async def reserve(
        self, run_id: str, agent: str, request: ReserveRequest, now: float
    ) -> Reservation | Denial:
        self._seq += 1
        rid = f"{self._owner}-{self._seq}"
        claims = [
            [c.counter, float(c.fixed), float(c.per_unit), opt_float(c.limit), c.code] for c in request.claims
        ]
        try:
            reply = orjson.loads(
                await self._call(
                    "reserve",
                    run_id,
                    agent,
                    [float(now), rid, int(request.min_units), int(request.max_units), claims,
                     request.clamp_units, float(now) - self._lease, self._tombstone_s, request.refuse_only],
                )
            )
        except (StateUnavailable, asyncio.CancelledError):
            # the grant may have happened with its answer lost, or its reserve may still land: release it
            # at zero (a tombstone if nothing is there yet) as soon as Redis answers. Cancelled too: the
            # caller (a handler whose client left) will never settle what it did not get
            self._keep_unsettled(run_id, rid, [None, rid, float(now), [], self._tombstone_s, None])
            raise
        if reply[0] == "deny":
            return Denial(reply[1], reply[2], held=len(reply) > 3 and reply[3] == "held")
        amounts = {reply[i]: float(reply[i + 1]) for i in range(3, len(reply), 2)}
        return Granted(rid, run_id, int(reply[1]), int(reply[2]), amounts, agent, float(now))

    async def settle(self, reservation: Reservation, actual: Mapping[str, float], now: float) -> None:
        """`RunStore.settle`; a `Granted` reservation whose run Redis lost charges `actual` to the run
        created afresh (`redis_ops._SETTLE`)."""
        agent = lost_run_agent(reservation, now, self._lease)
        args = [reservation.epoch, reservation.id, float(now), [[c, float(a)] for c, a in actual.items()],
                self._tombstone_s, agent]
        try:
            await self._call("settle", reservation.run_id, "", args)
        except (StateUnavailable, asyncio.CancelledError):
            # cancelled too (a handler whose client left, with the settle maybe on the wire): nobody else
            # settles it, and a replay never charges twice
            self._keep_unsettled(reservation.run_id, reservation.id, args)
            raise

    async def add(
        self,
        run_id: str,
        agent: str,
        counter: str,
        amount: float,
        *,
        limit: float | None,
        code: str,
        now: float,
    ) -> Denial | None:
        reply = orjson.loads(
            await self._call(
                "add", run_id, agent, [counter, float(amount), opt_float(limit), code, float(now)]
            )
        )
        return Denial(reply[1], reply[2]) if reply[0] == "deny" else None

    async def push(self, run_id: str, agent: str, key: str, values: Sequence[str], keep: int) -> list[str]:
        items: list[str] = orjson.loads(
            await self._call("push", run_id, agent, [key, int(keep), list(values)])
        )
        return items

    async def apply(
        self, run_id: str, agent: str, adds: Sequence[Add], pushes: Sequence[Push], now: float,
        *, in_flight: bool = False, epoch: int | None = None,
    ) -> Denial | None:
        if not adds and not pushes:
            return None  # nothing to do: no round trip, and no empty run created (as SQLite)
        args = [
            float(now),
            [[a.counter, float(a.amount), opt_float(a.limit), a.code] for a in adds],
            [[p.key, int(p.keep), list(p.values), -1 if p.distinct_limit is None else int(p.distinct_limit),
              p.code, p.detail] for p in pushes],
            in_flight,
            -1 if epoch is None else int(epoch),
        ]
        reply = _judged(run_id, epoch, orjson.loads(await self._call("apply", run_id, agent, args)))
        return Denial(reply[1], reply[2]) if reply[0] == "deny" else None

    async def take(self, run_id: str, key: str, value: str) -> bool:
        return bool(await self._call("take", run_id, "", [key, value]))

    async def stop(
        self, run_id: str, agent: str, reason: str, detail: str, now: float, *, epoch: int | None = None
    ) -> Denial:
        args = [reason, detail, float(now), -1 if epoch is None else int(epoch)]
        reply = _judged(run_id, epoch, orjson.loads(await self._call("stop", run_id, agent, args)))
        return Denial(reply[1], reply[2])

    async def record_step(self, run_id: str, agent: str, step: Mapping[str, Any], now: float) -> int:
        encoded = orjson.dumps(dict(step)).decode()
        epoch = step.get("epoch")
        return int(await self._call("record_step", run_id, agent,
                         [encoded, float(now), logic.MAX_STEPS, -1 if epoch is None else int(epoch)]))

    async def reset(self, run_id: str, now: float) -> RunState | None:
        reply = await self._call("reset", run_id, "", [float(now)])
        return None if reply is None else decode_reply(reply)

    async def claim_root(
        self, run_id: str, epoch: int, *, final: bool, stopped: bool = False, upto: float | None = None,
        now: float,
    ) -> RootClaim | None:
        reply = await self._call("claim_root", run_id, "",
                                 [int(epoch), final, stopped, opt_float(upto), float(now)])
        if reply is None:
            return None
        segment, start = orjson.loads(reply)
        return int(segment), None if start is None else float(start)

    async def claim_write(
        self, run_id: str, agent: str, epoch: int, key: str, token: str, *, lease_s: float, keep: int, now: float
    ) -> WriteClaim:
        reply = await self._call_writes("claim_write", run_id, agent,
                                        [field(epoch, key), token, float(now + lease_s), int(keep), float(now)])
        state = reply[0].decode()
        return WriteClaim(state, bytes(reply[1]) if len(reply) > 1 else None)

    async def renew_write(self, run_id: str, epoch: int, key: str, token: str, *, until: float) -> bool:
        return bool(await self._call_writes("renew_write", run_id, "", [field(epoch, key), token, float(until)]))

    async def finish_write(
        self, run_id: str, agent: str, epoch: int, key: str, token: str, result: bytes | None, *, keep: int,
        now: float,
    ) -> None:
        await self._call_writes("finish_write", run_id, agent, [field(epoch, key), token, int(keep)], result)

    async def release_write(self, run_id: str, epoch: int, key: str, token: str) -> None:
        await self._call_writes("release_write", run_id, "", [field(epoch, key), token])

    async def list_runs(self, limit: int = 100) -> list[RunState]:
        return await self._runs.list_runs(limit)

    async def runs_page(self, after: RunsCursor | None, limit: int) -> RunsPage:
        return await self._runs.runs_page(after, limit)

    def runs_updated(self, after: float, before: float, page: int = 1000) -> AsyncIterator[list[RunState]]:
        return self._runs.runs_updated(after, before, page)

    async def idle_swept(self) -> float | None:
        value = await self._guard(partial(self._client.get, f"{self._prefix}idle_swept"))
        return None if value is None else float(value)

    async def set_idle_swept(self, upto: float) -> None:
        await self._guard(partial(self._mark, keys=[f"{self._prefix}idle_swept"], args=[repr(float(upto))]))

    async def close(self) -> None:
        """Stop the background replay, replay what is left once more, and close the pool."""
        if self._replayer is not None:
            self._replayer.cancel()
            await asyncio.wait({self._replayer})
        left = await self.replay_unsettled()
        if left:
            log.warning("run store closing with %d settlement(s) Redis did not take: their reservations "
                        "stay open until the run expires or is reset", left)
        await self._client.aclose()
