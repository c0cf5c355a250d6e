"""`gateway.model_list`: the merged list paged as both SDKs read it (`page`), each model once; more of the
list through a gateway is in tests/gateway/test_routes_probe.py and test_proxy_sdk.py."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from gateway.config import parse_config
from gateway.model_list import local_models, page
from tests.conftest import GatewayFactory
from tests.fakes.upstream import FakeProvider

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


async def test_a_model_two_providers_list_is_listed_once_and_sdk_paging_ends(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str]
) -> None:
    """A primary and a backup provider both list `gpt-4o-mini`: the merged list has it once, as the
    provider calls of it go to (`backup` here, by `models:`), in the place of its first entry. Paging by
    `after_id` went round in a circle (`ids.index` found the first copy): the Anthropic SDK's
    `models.list(limit=1)` never ended."""
    fake_url = fake[1]
    both = {name: {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": f"sk-{name}-123456789"}
            for name in ("primary", "backup")}
    h = await gateway_factory(providers=both, models={"gpt-4o-mini": "backup", "gpt-*": "primary"})
    h.fake.models = [{"id": "gpt-4o", "object": "model", "owned_by": "x"},
                     {"id": "gpt-4o-mini", "object": "model", "owned_by": "x"}]
    listed = []
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as client:
        async for model in client.models.list(limit=1):
            listed.append(model)
            if len(listed) > 10:  # the merged list has 2: going round in a circle
                break
    assert [m.id for m in listed] == ["gpt-4o", "gpt-4o-mini"]
    async with h.session.get(f"{h.url}/v1/models") as resp:
        data = (await resp.json())["data"]
    assert [(m["id"], m["provider"]) for m in data] == [("gpt-4o", "primary"), ("gpt-4o-mini", "backup")]
