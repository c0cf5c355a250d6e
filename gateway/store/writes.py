"""Claims and recorded results of a run's side-effecting tool calls, as pure in-memory transitions.

The memory backend keeps one `WriteBook` per run; the Redis backend's scripts (`redis_writes`) and the
SQLite backend's table (`sqlite_writes`) are twins of these transitions. An entry is named
`"<epoch>:<key>"` (`field`), so a reset run (new epoch) never sees the entries of its former epoch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from gateway.store.base import WriteClaim

CLAIMED, RUNNING, DONE = "claimed", "running", "done"
MAX_RESULT_BYTES = 64 * 1024 * 1024
"""Recorded result bodies a store keeps across all its runs (memory, SQLite; Redis expires them with their
run). Past it the oldest lose their body but stay done: a repeat is refused `duplicate_tool_call`, never
run again."""


def field(epoch: int, key: str) -> str:
    """The name of an entry: its key under the run's epoch."""
    return f"{epoch}:{key}"


@dataclass(slots=True)
class WriteEntry:
    token: str  # the holder of the claim, or the finisher of a done entry
    until: float  # the claim's lease ends then (wall clock); unused once done
    done: bool = False
    result: bytes | None = None


class WriteBook:
    """The write entries of one run, oldest first, at most `keep` of them (`RunStore.claim_write`)."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: OrderedDict[str, WriteEntry] = OrderedDict()

    def claim(self, name: str, token: str, until: float, keep: int, now: float) -> WriteClaim:
        entry = self.entries.get(name)
        if entry is None:
            self._insert(name, WriteEntry(token, until), keep)
            return WriteClaim(CLAIMED)
        if entry.done:
            return WriteClaim(DONE, entry.result)
        if entry.token == token or entry.until <= now:  # its holder's lease ran out: presumed dead
            entry.token, entry.until = token, until
            return WriteClaim(CLAIMED)
        return WriteClaim(RUNNING)

    def renew(self, name: str, token: str, until: float) -> bool:
        entry = self.entries.get(name)
        if entry is None or entry.done or entry.token != token:
            return False
        entry.until = until
        return True

    def finish(self, name: str, token: str, result: bytes | None, keep: int) -> WriteEntry | None:
        """The entry now holding `result`, or None (no result, or the first result stands)."""
        entry = self.entries.get(name)
        if entry is None:
            entry = WriteEntry(token, 0.0, True, result)
            self._insert(name, entry, keep)
        elif not entry.done:  # the first result stands
            entry.token, entry.done, entry.result = token, True, result
        else:
            return None
        return entry if result is not None else None

    def release(self, name: str, token: str) -> bool:
        entry = self.entries.get(name)
        if entry is None or entry.done or entry.token != token:
            return False
        del self.entries[name]
        return True

    def _insert(self, name: str, entry: WriteEntry, keep: int) -> None:
        self.entries[name] = entry
        while len(self.entries) > max(keep, 1):
            self.entries.popitem(last=False)


class Bodies:
    """The result bodies a store recorded, oldest first, at most `limit` bytes of them across runs: past
    it the oldest entry's body goes (the entry stays done). An entry its run dropped meanwhile still
    counts until it ages out, so the bound holds on what is held, never above it."""

    __slots__ = ("_bytes", "_limit", "_order")

    def __init__(self, limit: int = MAX_RESULT_BYTES) -> None:
        self._order: deque[tuple[WriteEntry, int]] = deque()
        self._bytes = 0
        self._limit = limit

    def add(self, entry: WriteEntry) -> None:
        size = len(entry.result or b"")
        self._order.append((entry, size))
        self._bytes += size
        while self._bytes > self._limit and self._order:
            old, old_size = self._order.popleft()
            self._bytes -= old_size
            old.result = None
