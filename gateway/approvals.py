"""Human approval of parked tool calls: an in-process queue and its admin routes.

A tool call that matches `tools.approval` is parked: `ApprovalQueue.request` records it as pending and
the caller awaits `wait`, which ends when a human decides (`POST /admin/approvals/{id}` with
`{"decision": "approve"|"deny", "by": "<who>"}`), when `approval_timeout_s` passes (status
`timed_out`, a denial), when the waiting request is cancelled (status `denied`: its client went away
or sent `notifications/cancelled`), or at shutdown (status `denied`): `deny_after_grace` denies what is
still pending when the grace period, in which humans can still decide, ends, so each waiting call is
answered `approval_denied` before its connection closes (a dropped connection is retried by the SDKs,
against the next process). A decision is final: deciding twice is an error. Records stay listed
(newest last) until `keep` newer ones push them out; pending records are never pushed out.

The queue lives in the process (`gw.services["approvals"]`): a parked call waits on the sidecar that
holds its connection, so the decision must reach that sidecar's admin port.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import orjson
from aiohttp import web

from gateway.errors import GatewayError
from gateway.request_body import read_body
from gateway.runtime import Gateway

Status = Literal["pending", "approved", "denied", "timed_out"]
STATUSES: frozenset[str] = frozenset(get_args(Status))
DECISIONS: dict[str, Status] = {"approve": "approved", "deny": "denied"}
MAX_BY = 200
SERVICE = "approvals"


class UnknownApproval(KeyError):
    """No approval with this id (never existed, or pushed out of the history)."""


class AlreadyDecided(ValueError):
    """The approval was decided before (by a human, the timeout or shutdown)."""


@dataclass(slots=True)
class Approval:
    """One parked tool call and what became of it. `arguments` is the parsed JSON the call carried."""

    id: str
    run_id: str
    agent: str
    tool: str
    arguments: Any
    requested_at: float
    status: Status = "pending"
    decided_by: str | None = None
    decided_at: float | None = None
    cancel_key: Hashable = field(default=None, repr=False)  # the request a client may cancel
    _done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def view(self) -> dict[str, Any]:
        """The record as `GET /admin/approvals` lists it."""
        return {
            "id": self.id, "run_id": self.run_id, "agent": self.agent, "tool": self.tool,
            "arguments": self.arguments, "requested_at": self.requested_at, "status": self.status,
            "decided_by": self.decided_by, "decided_at": self.decided_at,
        }


class ApprovalQueue:
    """Pending and decided approvals of this process. Not thread-safe: use it from the event loop."""

    def __init__(self, *, keep: int = 1000, clock: Callable[[], float] = time.time) -> None:
        self._items: OrderedDict[str, Approval] = OrderedDict()
        self._keep = keep
        self._clock = clock

    def request(self, run_id: str, agent: str, tool: str, arguments: Any, *, cancel_key: Hashable = None) -> Approval:
        """Park a call: a new pending record. `cancel_key` names the request, for `cancel`."""
        item = Approval(uuid.uuid4().hex, run_id, agent, tool, arguments, self._clock(), cancel_key=cancel_key)
        self._items[item.id] = item
        self._trim()
        return item

    def cancel(self, cancel_key: Hashable) -> int:
        """Deny what is parked for a request its client cancelled (nobody approves a call that can no
        longer run); how many were pending."""
        found = [a for a in self._items.values() if a.status == "pending" and a.cancel_key == cancel_key]
        for item in found:
            self._finish(item, "denied", "tollgate (the client cancelled the request)")
        return len(found)

    def deny_pending(self, by: str) -> int:
        """Deny every pending record (`by` says why); how many there were."""
        found = self.list("pending")
        for item in found:
            self._finish(item, "denied", by)
        return len(found)

    async def wait(self, item: Approval, timeout_s: float) -> Approval:
        """Wait for the decision; after `timeout_s` the record becomes `timed_out`. A cancelled wait
        (the caller went away) denies the record, so nobody approves a call that can no longer run."""
        try:
            async with asyncio.timeout(timeout_s):
                await item._done.wait()
        except TimeoutError:
            self._finish(item, "timed_out", "tollgate (timeout)")
        except asyncio.CancelledError:
            self._finish(item, "denied", "tollgate (caller went away)")
            raise
        return item

    def decide(self, approval_id: str, decision: str, by: str) -> Approval:
        """Record a human's decision. Raises UnknownApproval, AlreadyDecided, or ValueError for a
        decision other than approve/deny."""
        status = DECISIONS.get(decision) if isinstance(decision, str) else None
        if status is None:
            raise ValueError('decision must be "approve" or "deny"')
        item = self._items.get(approval_id)
        if item is None:
            raise UnknownApproval(approval_id)
        if item.status != "pending":
            raise AlreadyDecided(f"approval {approval_id} was already decided: {item.status} by {item.decided_by}")
        self._finish(item, status, by)
        return item

    def list(self, status: str | None = None) -> list[Approval]:
        return [a for a in self._items.values() if status is None or a.status == status]

    def _finish(self, item: Approval, status: Status, by: str) -> None:
        if item.status != "pending":
            return
        item.status, item.decided_by, item.decided_at = status, by, self._clock()
        item._done.set()

    def _trim(self) -> None:
        excess = len(self._items) - self._keep
        for key in [k for k, a in self._items.items() if a.status != "pending"][: max(excess, 0)]:
            del self._items[key]


def queue_of(gw: Gateway) -> ApprovalQueue:
    """The process's queue, `gw.services["approvals"]`, created on first use."""
    queue = gw.services.get(SERVICE)
    if not isinstance(queue, ApprovalQueue):
        queue = gw.services[SERVICE] = ApprovalQueue()
    return queue


async def deny_after_grace(gw: Gateway, grace_s: float) -> None:
    """At shutdown: after `grace_s` (humans may still decide meanwhile), deny what is still parked, so
    each waiting call is answered `approval_denied` while the server still waits for its handler."""
    await asyncio.sleep(grace_s)
    queue = gw.services.get(SERVICE)
    if isinstance(queue, ApprovalQueue):
        queue.deny_pending("tollgate (shutdown: nobody decided within the grace period)")


# -- admin routes ----------------------------------------------------------------------------------------


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _error(status: int, code: str, message: str) -> web.Response:
    return _json({"error": {"code": code, "message": message}}, status)


def routes(gateway_of: Callable[[web.Request], Gateway | None]) -> list[web.RouteDef]:
    """`GET /admin/approvals[?status=pending]` and `POST /admin/approvals/{id}`. `gateway_of` finds
    the gateway of the proxy app the admin app belongs to (None: not ready)."""

    async def list_approvals(request: web.Request) -> web.Response:
        gw = gateway_of(request)
        status = request.query.get("status")
        if status is not None and status not in STATUSES:  # a misspelt filter must not read as "none"
            return _error(400, "invalid_request", f"status must be one of {', '.join(sorted(STATUSES))}")
        items = queue_of(gw).list(status) if gw is not None else []
        return _json({"approvals": [a.view() for a in items]})

    async def decide(request: web.Request) -> web.Response:
        gw = gateway_of(request)
        if gw is None:
            return _error(503, "not_ready", "gateway not ready")
        queue = queue_of(gw)
        try:
            limits = gw.config.limits.model_copy(update={"max_body_bytes": request.client_max_size})
            body = orjson.loads(await read_body(request, limits))  # decoded, and bounded as the admin API is
        except GatewayError as exc:
            return _error(exc.status, exc.code, exc.message)
        except orjson.JSONDecodeError:
            return _error(400, "invalid_request", "body must be JSON")
        if not isinstance(body, dict):
            return _error(400, "invalid_request", 'body must be {"decision": "approve"|"deny", "by": "<who>"}')
        by = body.get("by")
        if not isinstance(by, str) or not by.strip() or len(by) > MAX_BY:
            return _error(400, "invalid_request", f'"by" must name who decides (1-{MAX_BY} characters)')
        decision = body.get("decision")
        if not isinstance(decision, str) or decision not in DECISIONS:
            return _error(400, "invalid_request", '"decision" must be "approve" or "deny"')
        try:
            item = queue.decide(request.match_info["approval_id"], decision, by.strip())
        except UnknownApproval:
            return _error(404, "not_found", "no such approval")
        except AlreadyDecided as exc:
            return _error(400, "already_decided", str(exc))
        return _json(item.view())

    return [
        web.get("/admin/approvals", list_approvals),
        web.post("/admin/approvals/{approval_id}", decide),
    ]
