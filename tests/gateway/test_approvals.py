"""The approval queue: a client's cancellation denies what it parked; odd decisions are refused."""

from __future__ import annotations

import asyncio

import pytest

from gateway.approvals import ApprovalQueue


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
