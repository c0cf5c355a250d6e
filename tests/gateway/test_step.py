"""gateway/step.py: the per-request state and the summary the admin API lists under a run."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.call import Answer, Call, ToolCall, Usage
from gateway.config import Agent, Provider
from gateway.identity import Identity
from gateway.providers.openai_chat import OpenAIChat
from gateway.routing import Route
from gateway.step import Step


def step(**fields: Any) -> Step:
    provider = Provider(type="openai", base_url="http://127.0.0.1:1/v1")
    made = Step(OpenAIChat(), Identity("bot", Agent(), "run-1"), Call("openai", "chat", "gpt-4o-mini", stream=True),
                Route("fake", provider, "gpt-4o-mini", False), {}, b"{}")
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def test_identity_shortcuts() -> None:
    made = step()
    assert (made.run_id, made.agent) == ("run-1", "bot")
    assert made.decisions == [] and made.violations == [] and made.extra == {}
    assert step().decisions is not made.decisions  # each step owns its lists


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"decision": "allow", "stop_reason": None, "input_tokens": None, "output_tokens": None,
              "tool_calls": [], "status": 0, "cost_usd": 0.0}),
        # what the run was charged over every attempt (a re-asked step's two), not the last answer's usage
        ({"answer": Answer(usage=Usage(12, 3), tool_calls=(ToolCall("1", "ls", "{}"), ToolCall("2", "cat", "{}"))),
          "status": 200, "cost_usd": 0.1, "attempts": 2, "reasks": 1,
          "spent": {"usd": 0.123456789012345, "input_tokens": 12.0, "output_tokens": 3.0}},
         {"decision": "allow", "input_tokens": 12, "output_tokens": 3, "tool_calls": ["ls", "cat"],
          "status": 200, "cost_usd": 0.123456789, "attempts": 2, "reasks": 1}),
        ({"stop_reason": "budget_exhausted", "status": 403, "error_type": "budget_exhausted"},
         {"decision": "stop", "stop_reason": "budget_exhausted", "status": 403, "error": None}),
        # a stream cut for its grammar answered 200 and then an error event: an error, as in the ledger
        ({"error_type": "output_nonconforming", "status": 200},
         {"decision": "error", "stop_reason": None, "error": "output_nonconforming"}),
        ({}, {"error": None}),
        ({"answer": Answer(text="hi")}, {"input_tokens": None, "output_tokens": None, "tool_calls": []}),
    ],
)
def test_summary(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    summary = step(**fields).summary()
    assert {k: summary[k] for k in expected} == expected
    assert (summary["operation"], summary["model"], summary["provider"], summary["stream"]) == (
        "chat", "gpt-4o-mini", "fake", True)
    assert summary["duration_ms"] >= 0
    assert "epoch" not in summary


def test_summary_carries_the_run_epoch_when_known() -> None:
    made = step()
    made.extra["epoch"] = 3
    assert made.summary()["epoch"] == 3
    assert made.summary()["at"] == made.started_wall
