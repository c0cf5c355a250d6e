"""`gateway.model_list`: the merged list paged as both SDKs read it (`page`); the list through a gateway
is in tests/gateway/test_routes_probe.py and test_proxy_sdk.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.model_list import page

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
