"""Output limits of the models whose limit is below the providers' default (pure, no I/O).

When an agent sends no output limit, or one its budget cannot pay, tollgate sends the limit the budget
pays for, capped by the model's limit: a `pricing:` entry's `max_output_tokens`, else this table, else the
provider's `max_output_tokens` (32,768 by default). genai-prices lists no output limits, and a limit above
the model's own is a 400 from the provider ("max_tokens is too large"): OpenAI's gpt-4o family accepts at
most 16,384, so every call of an agent that left the limit to tollgate failed. Only models below the
default are listed; a model with a larger limit keeps the default, which it accepts.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Final

__all__ = ["KNOWN_LIMITS", "known_limit"]

KNOWN_LIMITS: Final[dict[str, int]] = {
    # first match wins: specific snapshots before their family (OpenAI's model pages)
    "gpt-4o-2024-05-13": 4_096,
    "gpt-4o*": 16_384,  # gpt-4o, gpt-4o-mini, their audio, search and realtime variants
    "chatgpt-4o*": 16_384,
    "gpt-5-chat*": 16_384,
    "gpt-4-turbo*": 4_096,
    "gpt-4-*-preview": 4_096,
    "gpt-4": 8_192,
    "gpt-4-0613": 8_192,
    "gpt-3.5-turbo*": 4_096,
}
"""Output limits by model name glob (the name sent upstream, lower case)."""


@lru_cache(maxsize=1024)  # model names come from requests: bounded
def known_limit(model: str) -> int | None:
    """The output limit of `model` when `KNOWN_LIMITS` lists it (below the providers' default), or None."""
    name = model.lower()
    return next((limit for pattern, limit in KNOWN_LIMITS.items() if fnmatchcase(name, pattern)), None)
