"""Per-key (run id) coordination inside one process: a lock kept only while someone holds or waits for
it, and a write mark that tells whether a key's history changed since it was read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class KeyedLocks:
    """`hold(key)` serialises the holders of one key in this process; keys are independent. The table
    holds a key only while it is in use, so it never grows with the runs that came and went."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            users = self._locks[key][1] - 1
            if users:
                self._locks[key] = (lock, users)
            else:
                del self._locks[key]


class WriteMarks:
    """A version per key, moved by `bump` whenever this process writes the key's history: a reader that
    kept the version of its snapshot knows, without reading the store again, whether a write of this
    process came after it. Bounded: past `limit` keys the table starts afresh under a new generation,
    so a version read before that never equals one read after."""

    def __init__(self, limit: int = 65536) -> None:
        self._limit = limit
        self._generation = 0
        self._counts: dict[str, int] = {}

    def version(self, key: str) -> tuple[int, int]:
        return self._generation, self._counts.get(key, 0)

    def bump(self, key: str) -> None:
        if key not in self._counts and len(self._counts) >= self._limit:
            self._counts.clear()
            self._generation += 1
        self._counts[key] = self._counts.get(key, 0) + 1
