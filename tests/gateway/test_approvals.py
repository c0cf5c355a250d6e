"""The approval queue: a client's cancellation denies what it parked; odd decisions are refused."""

from __future__ import annotations

import asyncio
import gzip
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from gateway.approvals import ApprovalQueue, deny_after_grace
from tests.conftest import GatewayFactory


async def test_a_cancelled_request_denies_only_what_it_parked() -> None:
    queue = ApprovalQueue()
    mine = queue.request("r", "bot", "files/rm", {"path": "a"}, cancel_key=("r", "s1", "41"))
    other = queue.request("r", "bot", "files/rm", {"path": "b"}, cancel_key=("r", "s2", "41"))
    waiter = asyncio.create_task(queue.wait(mine, 5))
    await asyncio.sleep(0)
    assert queue.cancel(("r", "s1", "41")) == 1
    assert (await waiter).status == "denied" and mine.decided_by == "tollgate (the client cancelled the request)"
    assert other.status == "pending"
    assert queue.cancel(("r", "s1", "41")) == 0  # decided already: nothing left to cancel
    assert queue.decide(other.id, "approve", "alice").status == "approved"


@pytest.mark.parametrize("decision", [["approve"], {"approve": True}, None, 1, "Approve"])
def test_a_decision_that_is_not_approve_or_deny_is_refused(decision: object) -> None:
    queue = ApprovalQueue()
    item = queue.request("r", "bot", "files/rm", {})
    with pytest.raises(ValueError, match="approve"):
        queue.decide(item.id, decision, "alice")  # type: ignore[arg-type]
    assert item.status == "pending"


async def test_when_the_shutdown_grace_ends_what_is_still_parked_is_denied_and_its_waiter_answered() -> None:
    queue = ApprovalQueue()
    decided = queue.request("r", "bot", "files/rm", {"path": "a"})
    queue.decide(decided.id, "approve", "alice")
    parked = queue.request("r", "bot", "files/rm", {"path": "b"})
    waiter = asyncio.create_task(queue.wait(parked, 60))
    gw: Any = SimpleNamespace(services={"approvals": queue})
    await deny_after_grace(gw, 0)
    assert (await waiter).status == "denied" and "shutdown" in (parked.decided_by or "")
    assert decided.status == "approved" and decided.decided_by == "alice"  # a decision is final
    assert queue.deny_pending("again") == 0


async def test_a_shutdown_without_any_approval_creates_no_queue() -> None:
    gw: Any = SimpleNamespace(services={})
    await deny_after_grace(gw, 0)
    assert gw.services == {}


async def test_a_decision_sent_compressed_is_read_as_sent(gateway_factory: GatewayFactory) -> None:
    """The server no longer decodes bodies for handlers (tollgate does, `gateway.request_body`): a
    gzip decision read as raw bytes was "body must be JSON"."""
    h = await gateway_factory()
    decision = orjson.dumps({"decision": "approve", "by": "ops"})
    for data, headers in ((decision, {}), (gzip.compress(decision), {"Content-Encoding": "gzip"})):
        async with h.session.post(f"{h.admin_url}/admin/approvals/nope", data=data,
                                  headers={"Content-Type": "application/json", **headers}) as resp:
            assert resp.status == 404, await resp.text()  # read, then: no such approval
    async with h.session.post(f"{h.admin_url}/admin/approvals/nope", data=b"\x1f\x8b junk",
                              headers={"Content-Encoding": "gzip"}) as resp:
        assert resp.status == 400 and "cannot be decoded" in await resp.text()
