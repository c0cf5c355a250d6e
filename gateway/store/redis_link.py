"""The Redis run store's link to Redis: connections that never send a command on a socket Redis closed,
and the one check, at first use, that the Redis holding the runs keeps them.

Contracts:
* `fresh_pool(url, ...)`: a pool of the URL's connection class (TCP, TLS, unix socket) whose
  connections check, before each command is written, whether Redis closed them while they sat idle
  (`CLIENT KILL`, redis.conf `timeout`, a restart, a failover: its FIN or RST has reached this process)
  and reconnect first. A command whose write failed (the socket broke under it: no complete command
  reached Redis, so Redis ran nothing) is written once more on a new connection. Nothing else is ever
  retried: a command that was written and whose reply did not come may have run, and a script that
  mutates must never run twice (the pool's `Retry` stays at 0).
* `Granted`: a reservation the store granted, with its agent (`RedisRunStore.settle` recreates a run
  Redis lost only for these: the run existed when it was granted; any other names no known run).
* `durability_problems(client)`: what in Redis' configuration lets a restart or memory pressure lose
  runs (no AOF, `appendfsync no`, an eviction policy with a memory limit), as text for one warning;
  an empty list when nothing does, or when Redis refuses `CONFIG` (managed Redis services do): there is
  nothing to check then. Connection errors propagate (the caller's operation fails as it would anyway).
  `warn_if_lossy` logs them as one warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from gateway.frozen_init import fast_init
from gateway.store.base import Reservation

log = logging.getLogger("gateway.store.redis")  # the store's own logger: one place to silence or watch


@fast_init
@dataclass(frozen=True, slots=True)
class Granted(Reservation):
    """A reservation the Redis store granted, with the agent it was granted to and when."""

    agent: str = ""
    at: float = 0.0


def lost_run_agent(reservation: Reservation, now: float, lease_s: float) -> str | None:
    """The agent a settle of `reservation` charges a run Redis lost to (`redis_ops._SETTLE`): only a
    reservation this store granted within its lease (an older one may have been charged in full by a
    reserve, `logic.expire`: its settle never charges again)."""
    if isinstance(reservation, Granted) and now - reservation.at < lease_s:
        return reservation.agent
    return None


def replay_ended(task: asyncio.Task[None]) -> None:
    """Done callback of the store's background replay: an end on an error (a bug: Redis' own errors end
    a round, not the task) is logged, never lost."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("run store: the background replay of settlements failed", exc_info=exc)


def closed_by_peer(reader: asyncio.StreamReader | None) -> bool:
    """True when the other end closed the stream (its FIN read: EOF; its RST: the reader's error).
    Only what this process has already received: a peer that vanished without a word is not seen."""
    return reader is not None and (reader.at_eof() or reader.exception() is not None)


class _Fresh(AbstractConnection):
    """Mixed into a redis-py connection class (before it): `send_packed_command` is where every command
    and pipeline is written, so checking there covers them all."""

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        if self.is_connected and closed_by_peer(self._reader):
            await self.disconnect(nowait=True)  # nothing written yet: a new connection is safe
        if not self.is_connected:
            await self.connect_check_health(check_health=False)  # as redis-py does; its errors are not retried
        if not isinstance(command, str | bytes):
            command = list(command)  # written a second time when the first write fails
        try:
            await super().send_packed_command(command, check_health)
        except RedisConnectionError as exc:
            # redis-py raises a failed write `from` its OSError (a failed read, or a health check, is not):
            # the transport dropped what it had not sent, and Redis never runs an incomplete command
            if not isinstance(exc.__cause__, OSError):
                raise
            await self.connect_check_health(check_health=False)
            await super().send_packed_command(command, check_health)


class FreshConnection(_Fresh, Connection):
    """TCP (`redis://`)."""


class FreshSSLConnection(_Fresh, SSLConnection):
    """TLS (`rediss://`)."""


class FreshUnixConnection(_Fresh, UnixDomainSocketConnection):
    """A unix socket (`unix://`)."""


_FRESH: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: FreshConnection,
    SSLConnection: FreshSSLConnection,
    UnixDomainSocketConnection: FreshUnixConnection,
}


def fresh_pool(url: str, **kwargs: Any) -> ConnectionPool:
    """`ConnectionPool.from_url(url, **kwargs)` with the fresh twin of the URL's connection class and no
    retries by redis-py itself. Raises ValueError for a URL redis-py cannot read."""
    options: dict[str, Any] = dict(parse_url(url))
    base = options.pop("connection_class", Connection)
    return ConnectionPool(connection_class=_FRESH[base], retry=Retry(NoBackoff(), 0), **{**kwargs, **options})


_CONFIG = ("appendonly", "appendfsync", "save", "maxmemory", "maxmemory-policy")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def durability_problems(client: Redis) -> list[str]:
    """What lets Redis lose runs (see the module's contract); [] when nothing does or CONFIG is refused."""
    pipe = client.pipeline(transaction=False)
    for name in _CONFIG:
        pipe.config_get(name)
    try:
        replies = await pipe.execute()
    except ResponseError:  # CONFIG renamed or forbidden (managed Redis): nothing to check
        return []
    config = {_text(k): _text(v) for reply in replies for k, v in reply.items()}
    problems: list[str] = []
    if config.get("appendonly") != "yes":
        save = config.get("save", "")
        if save:
            problems.append(f"appendonly no, RDB snapshots only (save '{save}'): a restart loses every write "
                            "since the last snapshot")
        else:
            problems.append("appendonly no and no RDB snapshots (save ''): a restart loses every run")
    elif config.get("appendfsync") == "no":
        problems.append("appendfsync no: the OS decides when the log reaches the disk, so a host crash loses "
                        "the latest writes")
    policy = config.get("maxmemory-policy", "noeviction")
    if policy != "noeviction" and config.get("maxmemory", "0") != "0":
        problems.append(f"maxmemory-policy {policy} with maxmemory {config['maxmemory']}: Redis may evict runs "
                        "when memory runs short")
    return problems


async def warn_if_lossy(client: Redis, where: str) -> None:
    """Log one warning when `durability_problems` finds any."""
    problems = await durability_problems(client)
    if problems:
        log.warning(
            "run store: the Redis at %s can lose runs (%s). A run Redis loses forgets its spend and its stop, "
            "and its budget can be spent again. Keep runs in a Redis with appendonly yes (appendfsync "
            "everysec or always) and maxmemory-policy noeviction (README: Many sidecars, one budget)",
            where, "; ".join(problems))
