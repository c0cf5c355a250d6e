"""Recorded results of side-effecting tool calls, so a repeat does not touch the world twice.

Keys are `(run_id, epoch, key)`: the key is the call's fingerprint (tool name + canonical arguments)
or the explicit idempotency key the caller sent; the epoch changes when the run is reset, so a reset
run starts with nothing recorded. Concurrent duplicates share one execution: the first caller leads
(`begin` returns a fresh future it must `finish`), the others await the leader's outcome.

The run store remembers which keys were executed (the pipeline pushes them to the run's
`tool_writes` list); this cache holds the result bodies, in this process only, bounded by entries and
bytes with least-recently-used eviction.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import orjson

Key = tuple[str, int, str]
Outcome = dict[str, Any]  # a JSON-RPC response message (its id is replaced when replayed)
WRITES_LIST = "tool_writes"
WRITES_KEEP = 1000


class ResultCache:
    def __init__(self, *, max_entries: int = 4096, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._done: OrderedDict[Key, tuple[Outcome, int]] = OrderedDict()
        self._inflight: dict[Key, asyncio.Future[Outcome]] = {}
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0

    def recorded(self, key: Key) -> Outcome | None:
        """The recorded final result of `key`, or None."""
        entry = self._done.get(key)
        if entry is None:
            return None
        self._done.move_to_end(key)
        return entry[0]

    def begin(self, key: Key) -> tuple[bool, asyncio.Future[Outcome]]:
        """(True, future) for the leader, who must call `finish`; (False, the leader's future) for a
        concurrent duplicate, which awaits it (shielded: a follower going away must not cancel it)."""
        future = self._inflight.get(key)
        if future is not None:
            return False, future
        future = self._inflight[key] = asyncio.get_running_loop().create_future()
        return True, future

    def finish(self, key: Key, outcome: Outcome, *, record: bool) -> None:
        """Hand the outcome to the waiting duplicates; keep it for later repeats when `record`."""
        future = self._inflight.pop(key, None)
        if future is not None and not future.done():
            future.set_result(outcome)
        if record:
            size = len(orjson.dumps(outcome))
            if size > self._max_bytes:
                return
            old = self._done.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._done[key] = (outcome, size)
            self._bytes += size
            while len(self._done) > self._max_entries or self._bytes > self._max_bytes:
                _, (_, dropped) = self._done.popitem(last=False)
                self._bytes -= dropped
