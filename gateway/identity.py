"""Stage `identify`: who is calling (agent and policy) and which run the step belongs to (pure)."""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from gateway.config import Agent, Config
from gateway.errors import InvalidApiKey, InvalidRequest

RUN_ID_HEADER = "x-tollgate-run-id"
AGENT_HEADER = "x-tollgate-agent"
RUN_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_AGENT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
DEFAULT_POLICY = Agent()


@dataclass(frozen=True, slots=True)
class Identity:
    agent: str
    policy: Agent
    run_id: str


def bearer(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get("x-api-key")
    return key.strip() if key else None


class Identifier:
    """Resolves identity per DESIGN section 3. Agent keys are compared in constant time."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._keys = [(key.encode(), name) for name, agent in config.agents.items() for key in agent.keys]

    def agent_for_key(self, token: str | None) -> str | None:
        presented = (token or "").encode()
        found: str | None = None
        for key, name in self._keys:
            # compare every key, always: the time taken does not tell which key matched
            if hmac.compare_digest(key, presented) and found is None:
                found = name
        return found

    def identify(self, headers: Mapping[str, str]) -> Identity:
        if self._keys:
            agent = self.agent_for_key(bearer(headers))
            if agent is None:
                raise InvalidApiKey("unknown or missing agent key")
        else:
            agent = headers.get(AGENT_HEADER) or "default"
            if not _AGENT.match(agent):
                raise InvalidRequest(f"invalid {AGENT_HEADER} header: use 1-64 of A-Z a-z 0-9 . _ -")
        policy = self._config.agents.get(agent, DEFAULT_POLICY)
        return Identity(agent, policy, run_id_from(headers, agent))


def run_id_from(headers: Mapping[str, str], agent: str) -> str:
    run_id = headers.get(RUN_ID_HEADER)
    if run_id is None:
        run_id = _from_baggage(headers.get("baggage"))
    if run_id is None:
        return f"{agent}:default"
    if not RUN_ID_RE.match(run_id):
        raise InvalidRequest(f"invalid run id {run_id[:40]!r}: use 1-128 of A-Z a-z 0-9 . _ : @ / + = -")
    return run_id


def _from_baggage(baggage: str | None) -> str | None:
    if not baggage:
        return None
    for member in baggage.split(","):
        key, sep, value = member.partition("=")
        if sep and key.strip() == "tollgate.run_id":
            return unquote(value.split(";", 1)[0].strip())
    return None
