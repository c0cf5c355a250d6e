"""`gateway.mcp_step.ToolStep.sent`: whether the server may have the call's request, as its transport said
(not forwarded: no; a transport that cannot tell: it may)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.http1_wire import Sending
from gateway.mcp_step import ToolStep


def step(sending: Sending | None) -> ToolStep:
    none: Any = None  # the fields `sent` does not read
    return ToolStep(none, none, none, "files/read_file", {}, none, 0.0, sending=sending)


def sending(started: bool | None) -> Sending:
    out = Sending()
    out.started = started
    return out


@pytest.mark.parametrize(("given", "sent"), [
    (None, False),  # never forwarded
    (sending(False), False),  # the transport wrote nothing
    (sending(True), True),
    (sending(None), True),  # a transport that cannot tell: it may have
])
def test_sent(given: Sending | None, sent: bool) -> None:
    assert step(given).sent is sent
