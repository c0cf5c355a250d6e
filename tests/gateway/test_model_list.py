"""`gateway.model_list`: the merged list paged as both SDKs read it (`page`); the list through a gateway
is in tests/gateway/test_routes_probe.py and test_proxy_sdk.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import parse_config
from gateway.model_list import local_models, page

MODELS = [{"id": f"m{i}"} for i in range(5)]


def ids(answer: dict[str, Any]) -> list[str]:
    return [m["id"] for m in answer["data"]]


@pytest.mark.parametrize(("limit", "after", "before", "expected", "more"), [
    (None, None, None, ["m0", "m1", "m2", "m3", "m4"], False),
    (2, None, None, ["m0", "m1"], True),
    (2, "m1", None, ["m2", "m3"], True),
    (2, "m3", None, ["m4"], False),
    (None, "m4", None, [], False),
    (None, "gone", None, [], False),
    (2, None, "m4", ["m2", "m3"], True),  # backwards from before_id
    (5, None, "m2", ["m0", "m1"], False),
    (None, "m0", "m3", ["m1", "m2"], False),
    (None, None, "gone", [], False),
])
def test_pages(limit: int | None, after: str | None, before: str | None, expected: list[str], more: bool) -> None:
    answer = page(MODELS, limit, after, before)
    assert ids(answer) == expected and answer["has_more"] is more and answer["object"] == "list"
    assert (answer["first_id"], answer["last_id"]) == ((expected[0], expected[-1]) if expected else (None, None))


def test_in_process_models_are_listed_by_their_exact_names() -> None:
    config = parse_config({
        "providers": {"local": {"type": "outlines", "model": "m"},
                      "openai": {"type": "openai", "base_url": "http://h/v1", "api_key": "k"}},
        "models": {"local-tiny": "local", "local-*": "local", "gpt-4o": "openai"},
    }, env={})
    assert local_models(config) == [
        {"id": "local-tiny", "object": "model", "created": 0, "owned_by": "local", "provider": "local"}]
