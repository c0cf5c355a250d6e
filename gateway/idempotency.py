"""Recorded results of side-effecting tool calls, so a repeat does not touch the world twice.

Keys are `(run_id, epoch, key)`: the key is the call's fingerprint (tool name + canonical arguments)
or the explicit idempotency key the caller sent; the epoch changes when the run is reset, so a reset
run starts with nothing claimed or recorded.

Two layers:
* The run store (shared by every sidecar of the run): before a call runs, its caller claims the key
  (`WriteLease.claim`, `RunStore.claim_write`: one atomic operation across processes), so of duplicates
  sent through several sidecars at once exactly one runs it; the others learn that it is running. The
  claim is a lease of `lease_for(server timeouts)` renewed while the call runs (a crashed holder's claim
  lapses after one lease, then another caller may run the call). Once it ran, its result is recorded
  there (bodies up to `MAX_RECORDED_BYTES`; at most `WRITES_KEEP` calls per run; they expire with the
  run), so a repeat through any sidecar gets it replayed.
* `ResultCache`, in this process: concurrent duplicates in one process share one execution (the first
  caller leads: `begin` returns a fresh future it must `finish`, the others await the leader's outcome),
  and recorded results are kept here too, bounded by entries and bytes with least-recently-used
  eviction, so a repeat in the same process needs no store round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any

from gateway import exact_json
from gateway.config import Timeouts
from gateway.errors import StateUnavailable
from gateway.store.base import RunStore, WriteClaim

Key = tuple[str, int, str]
Outcome = dict[str, Any]  # a JSON-RPC response message (its id is replaced when replayed)
WRITES_KEEP = 1000  # calls per run the run store keeps (the oldest are dropped first)
MAX_RECORDED_BYTES = 64 * 1024  # a larger result is not kept in the run store (this process still keeps it)
RENEWALS_PER_LEASE = 3
log = logging.getLogger(__name__)


def lease_for(timeouts: Timeouts) -> float:
    """How long a claim holds without renewal: the longest one call to the MCP server goes without a
    sign of life before tollgate gives up on it (connect, the first byte, one idle gap). Renewed every
    third of it while the call runs (approval waits and long streamed answers included), so only a
    holder that died, or lost the store for that long, loses its claim."""
    return float(timeouts.connect + timeouts.first_byte + timeouts.idle)


class WriteLease:
    """One caller's claim on a side-effecting call in the run store.

    `claim` once; when it answers "claimed", the claim is renewed in the background until the call's
    outcome is in the store: `finish` (it ran: its result is recorded) or `close` (it did not run: the
    claim is released; it may have run: it is marked done without a result, so a repeat is refused
    rather than run again). `close` must be called at the end in any case. An outcome the store fails
    to take is retried in the background, the claim renewed meanwhile, so a store blip never lets the
    claim lapse over a call that ran."""

    def __init__(self, store: RunStore, agent: str, key: Key, lease_s: float) -> None:
        self._store = store
        self._agent = agent
        self._run_id, self._epoch, self._key = key
        self._lease = lease_s
        self._token = uuid.uuid4().hex
        self._keeper: asyncio.Task[None] | None = None
        self._held = False  # claimed and its outcome not yet in the store
        self._owed: tuple[bytes | None] | None = None  # an outcome to retry: (body,) of a call that ran

    async def claim(self) -> WriteClaim:
        """Raises StateUnavailable (then nothing is held)."""
        try:
            found = await self._store.claim_write(self._run_id, self._agent, self._epoch, self._key, self._token,
                                                  lease_s=self._lease, keep=WRITES_KEEP, now=time.time())
        except BaseException:
            # cancelled or timed out, the claim may have been taken all the same: give it back (by this
            # lease's token: nothing happens when it was not taken), or a retry waits out a whole lease
            asyncio.get_running_loop().create_task(self._release_quietly())
            raise
        if found.state == "claimed":
            self._held = True
            self._keeper = asyncio.get_running_loop().create_task(self._keep())
        return found

    async def finish(self, outcome: Outcome) -> None:
        """Record the response the agent gets as the call's result (without its body when it is larger
        than `MAX_RECORDED_BYTES`). Raises StateUnavailable: the claim is still held, and `close(ran=True)`
        hands the result to the background retries."""
        body = exact_json.dumps(outcome)
        self._owed = (body if len(body) <= MAX_RECORDED_BYTES else None,)
        await self._finish(self._owed[0])

    async def close(self, *, ran: bool) -> None:
        """The call is over. Never raises: an outcome the store does not take now is retried in the
        background (the claim renewed meanwhile) until it does, or until the claim is gone."""
        if not self._held:
            self._stop()
            return
        try:
            if ran:  # it ran (or may have): its result when it was given, else done without one
                await self._finish(self._owed[0] if self._owed is not None else None)
            else:
                self._stop()
                self._held = False
                await self._store.release_write(self._run_id, self._epoch, self._key, self._token)
        except StateUnavailable:
            if ran and self._owed is None:
                self._owed = (None,)
            # a release not taken: the claim lapses after its lease (nothing ran, a retry then runs it)

    async def _finish(self, body: bytes | None) -> None:
        await self._store.finish_write(self._run_id, self._agent, self._epoch, self._key, self._token, body,
                                       keep=WRITES_KEEP, now=time.time())
        self._held, self._owed = False, None
        self._stop()

    async def _release_quietly(self) -> None:
        with contextlib.suppress(StateUnavailable):
            await self._store.release_write(self._run_id, self._epoch, self._key, self._token)

    def _stop(self) -> None:
        if self._keeper is not None and self._keeper is not asyncio.current_task():
            self._keeper.cancel()
        self._keeper = None

    async def _keep(self) -> None:
        """Every third of the lease while the claim is held: the outcome owed to the store, else a renewal."""
        while self._held:
            await asyncio.sleep(self._lease / RENEWALS_PER_LEASE)
            if self._owed is not None:
                with contextlib.suppress(StateUnavailable):
                    await self._finish(self._owed[0])
                    return
            try:
                held = await self._store.renew_write(self._run_id, self._epoch, self._key, self._token,
                                                     until=time.time() + self._lease)
            except StateUnavailable:
                continue  # the claim holds for a lease: a later try may get through
            if not held:
                log.warning("the claim on a running write tool call of run %s lapsed; another caller may have "
                            "run it too", self._run_id)
                self._held = False
                return


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
            size = len(exact_json.dumps(outcome))
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
