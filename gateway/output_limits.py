"""Output limits of models whose limit is below the providers' default, and of those above it (pure, no I/O).

When an agent sends no output limit, or one its budget cannot pay, tollgate sends the limit the budget
pays for, capped by the model's limit: a `pricing:` entry's `max_output_tokens`, else this table, else the
provider's `max_output_tokens` (32,768 by default). genai-prices lists no output limits, and a limit above
the model's own is a 400 from the provider ("max_tokens is too large"): OpenAI's gpt-4o family accepts at
most 16,384, so every call of an agent that left the limit to tollgate failed. Only models below the
default are listed there; a model with a larger limit keeps the default, which it accepts. A compaction
takes no limit at all, so it is held at the model's whole limit: `LARGER_LIMITS` lists those above the
default (`whole_limit`).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Final

__all__ = ["KNOWN_LIMITS", "LARGER_LIMITS", "known_limit", "whole_limit"]

KNOWN_LIMITS: Final[dict[str, int]] = {
    # first match wins: specific snapshots before their family (OpenAI's model pages)
    "gpt-4o-2024-05-13": 4_096,
    "gpt-4o*": 16_384,  # gpt-4o, gpt-4o-mini, their audio, search and realtime variants
    "chatgpt-4o*": 16_384,
    "gpt-5-chat*": 16_384,
    "gpt-5.*-chat*": 16_384,  # gpt-5.1-chat-latest, gpt-5.2-chat-latest, ...
    "gpt-4-turbo*": 4_096,
    "gpt-4-*-preview": 4_096,
    "gpt-4": 8_192,
    "gpt-4-0613": 8_192,
    "gpt-3.5-turbo*": 4_096,
}
"""Output limits by model name glob (the name sent upstream, lower case)."""

LARGER_LIMITS: Final[dict[str, int]] = {
    # OpenAI's model pages; first match wins, after `KNOWN_LIMITS` (gpt-5-chat is lower)
    "gpt-5-pro*": 272_000,
    "gpt-5.*-pro*": 272_000,
    "gpt-5*": 128_000,
    "codex-mini*": 100_000,
    "o1-mini*": 65_536,
    "o1-preview*": 32_768,
    "o1*": 100_000,
    "o3*": 100_000,
    "o4-mini*": 100_000,
    "gpt-4.1*": 32_768,
}
"""Output limits above the providers' default, for what tollgate cannot send a limit to: a compaction
(`/v1/responses/compact`) takes none, so it is reserved at the model's whole limit (`whole_limit`)."""


def _first_match(table: dict[str, int], model: str) -> int | None:
    name = model.lower()
    return next((limit for pattern, limit in table.items() if fnmatchcase(name, pattern)), None)


@lru_cache(maxsize=1024)  # model names come from requests: bounded
def known_limit(model: str) -> int | None:
    """The output limit of `model` when `KNOWN_LIMITS` lists it (below the providers' default), or None."""
    return _first_match(KNOWN_LIMITS, model)


@lru_cache(maxsize=1024)
def whole_limit(model: str, default: int) -> int:
    """The most output `model` can emit when no limit is sent: its known limit, else `default`."""
    return known_limit(model) or _first_match(LARGER_LIMITS, model) or default
