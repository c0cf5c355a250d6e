"""Provider adapters by wire protocol. The dict is the registry; add a protocol by adding a module."""

from __future__ import annotations

from gateway.providers.anthropic_messages import AnthropicMessages
from gateway.providers.base import Adapter
from gateway.providers.openai_chat import OpenAIChat
from gateway.providers.openai_responses import OpenAIResponses


def adapters() -> dict[str, Adapter]:
    return {"openai": OpenAIChat(), "anthropic": AnthropicMessages(), "openai_responses": OpenAIResponses()}
