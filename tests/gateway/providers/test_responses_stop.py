"""gateway/providers/responses_stop.py: tollgate's own stop answers in OpenAI Responses form, read back by
the official SDK's types (the stream events are tested with the adapter, test_openai_responses.py)."""

from __future__ import annotations

from openai.types.responses import Response

from gateway.call import Call
from gateway.providers.responses_stop import ZERO_USAGE, response_shell, stop_item


def test_a_stop_is_a_completed_response_whose_message_says_why() -> None:
    body = response_shell(Call("openai_responses", "chat", "gpt-4o-mini"), [stop_item("time_cap", "too slow")])
    parsed = Response.model_validate(body)
    assert parsed.status == "completed" and parsed.model == "gpt-4o-mini"
    assert "time_cap" in parsed.output_text and "too slow" in parsed.output_text
    assert body["usage"] == ZERO_USAGE  # nothing billed for an answer tollgate wrote itself


def test_an_in_progress_shell_has_no_output_yet() -> None:
    body = response_shell(Call("openai_responses", "chat", "m"), [], status="in_progress")
    assert Response.model_validate(body).status == "in_progress" and body["output"] == []
