"""One MCP `tools/call` as `gateway.mcp_calls` decides and records it: what it asked, what was decided
before and after it ran, and what the agent got."""

from __future__ import annotations

import dataclasses
from typing import Any

from gateway.approvals import Approval
from gateway.call import Call
from gateway.errors import GatewayError
from gateway.http1_wire import Sending
from gateway.idempotency import Outcome, WriteLease
from gateway.jsonrpc import Message
from gateway.mcp_flights import Flight
from gateway.mcp_transport import McpRequest
from gateway.store.base import RunState
from guards.base import Decision, StepContext
from otel.spans import StepSpan


@dataclasses.dataclass(slots=True)
class ToolStep:
    mcp: McpRequest
    message: Message
    call: Call
    qualified: str
    arguments: dict[str, Any]
    ctx: StepContext
    started: float
    recorded: bool = False  # the step is in the run's list (before its answer reached the agent)
    outcome: Outcome | None = None  # the response message the agent got (for duplicates)
    record: bool = False  # the outcome is a final result worth replaying
    span: StepSpan | None = None  # the MCP client span, once the call is forwarded
    response: dict[str, Any] | None = None  # the server's JSON-RPC response, as it answered
    unguarded: bool = False  # the run store is down and the policy says `state_failure: fail_open`
    approved_by: str | None = None  # who approved a call parked for approval (the ledger's audit trail)
    lease: WriteLease | None = None  # a write-tier call: its claim in the run store, when it holds one
    ran: bool = False  # the server answered a final result: the tool ran
    flight: Flight = dataclasses.field(default_factory=Flight)  # what the handler and this execution share
    writes: bool = False  # a `write` or `dangerous` tool: idempotent, and runs on when its client leaves
    approval: Approval | None = None  # the call's approval, once parked
    approved_run: RunState | None = None  # the run as read once the approval wait ended (its root for the span)
    sending: Sending | None = None  # set when the call is forwarded: whether it may have reached the server
    unknown: bool = False  # cut after it was sent and before its answer: it may have run
    not_run: bool = False  # the server's answer says the tool did not run (a JSON-RPC error, a 4xx, input needed)
    carried: bool = False  # its count went to an identical retry (once, however the call ended)
    replayed: bool = False  # answered with the recorded result of an identical call (it did not run now)
    replayed_refusal: str | None = None  # replayed, a refusal: its code (`approval_denied`, ...)
    lost: GatewayError | None = None  # the server's stream ended without a response to the call
    decisions: list[Decision] = dataclasses.field(default_factory=list)  # the guards', for the span and metrics

    @property
    def sent(self) -> bool:
        """The server may have the request (a transport that cannot tell says so)."""
        return self.sending is not None and self.sending.started is not False
