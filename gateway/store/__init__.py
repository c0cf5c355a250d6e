"""Run store backends by name; `open_store` is the only constructor the app uses."""

from __future__ import annotations

from collections.abc import Callable

from gateway.config import Config
from gateway.store.base import RunStore
from gateway.store.memory import MemoryRunStore
from gateway.store.sqlite import SqliteRunStore


def _memory(config: Config) -> RunStore:
    return MemoryRunStore()


def _sqlite(config: Config) -> RunStore:
    return SqliteRunStore.open(config.resolve(config.state.path))


def _redis(config: Config) -> RunStore:
    from gateway.store.redis import RedisRunStore

    return RedisRunStore.open(config.state.url or "", ttl_s=config.state.run_ttl_s,
                              lease_s=config.state.reservation_lease_s)


BACKENDS: dict[str, Callable[[Config], RunStore]] = {"memory": _memory, "sqlite": _sqlite, "redis": _redis}


def open_store(config: Config) -> RunStore:
    return BACKENDS[config.state.backend](config)
