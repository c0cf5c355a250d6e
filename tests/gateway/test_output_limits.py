"""`gateway.output_limits`: the output limits of models below the providers' default (pure)."""

from __future__ import annotations

import pytest

from gateway.output_limits import KNOWN_LIMITS, known_limit, whole_limit


@pytest.mark.parametrize(("model", "limit"), [
    ("gpt-4o-mini", 16_384), ("gpt-4o", 16_384), ("gpt-4o-2024-08-06", 16_384), ("GPT-4o-mini-2024-07-18", 16_384),
    ("gpt-4o-2024-05-13", 4_096), ("gpt-4o-mini-search-preview", 16_384), ("chatgpt-4o-latest", 16_384),
    ("gpt-4-turbo", 4_096), ("gpt-4-0125-preview", 4_096), ("gpt-4", 8_192), ("gpt-3.5-turbo-0125", 4_096),
    ("gpt-5-chat-latest", 16_384), ("gpt-5.2-chat-latest", 16_384),
    # at or above the providers' default, or unknown: the default applies
    ("gpt-4.1", None), ("gpt-5", None), ("o3", None), ("claude-sonnet-4-5", None), ("llama-3.1-70b", None),
])
def test_known_limits(model: str, limit: int | None) -> None:
    assert known_limit(model) == limit


def test_every_known_limit_is_below_the_providers_default() -> None:
    """Only models the default would make fail are listed: a larger limit would only raise reservations."""
    assert all(limit < 32_768 for limit in KNOWN_LIMITS.values())


@pytest.mark.parametrize(("model", "limit"), [
    ("gpt-5", 128_000), ("gpt-5-mini-2025-08-07", 128_000), ("gpt-5-chat-latest", 16_384), ("o3", 100_000),
    ("o1-mini", 65_536), ("gpt-4.1-mini", 32_768), ("gpt-4o", 16_384), ("llama-3.1-70b", 32_768),
    ("gpt-5-pro", 272_000), ("gpt-5.2-pro-2025-12-11", 272_000), ("gpt-5.1-chat-latest", 16_384),
    ("o1-preview", 32_768),
])
def test_a_compaction_is_held_at_the_models_whole_limit(model: str, limit: int) -> None:
    """What `/v1/responses/compact` reserves (it takes no limit): the model's known one, else the default."""
    assert whole_limit(model, 32_768) == limit
