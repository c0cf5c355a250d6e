"""Stage `identify`: who is calling (agent and policy) and which run the step belongs to (pure)."""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from gateway.config import Agent, Config, Limits
from gateway.errors import InvalidApiKey, InvalidRequest
from gateway.frozen_init import fast_init

RUN_ID_HEADER = "x-tollgate-run-id"
AGENT_HEADER = "x-tollgate-agent"
RUN_ID_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}\Z")  # \Z: `$` would admit a final newline
_AGENT = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")
DEFAULT_POLICY = Agent()


@fast_init
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
        self._keys = [(key.encode("utf-8", "surrogateescape"), name) for name, agent in config.agents.items() for key in agent.keys]

    def agent_for_key(self, token: str | None) -> str | None:
        # header text is decoded with surrogateescape: encode it back the same way, never raise
        presented = (token or "").encode("utf-8", "surrogateescape")
        found: str | None = None
        for key, name in self._keys:
            # compare every key, always: the time taken does not tell which key matched
            if hmac.compare_digest(key, presented) and found is None:
                found = name
        return found

    def identify(self, headers: Mapping[str, str]) -> Identity:
        check_headers(headers, self._config.limits)
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


def check_headers(headers: Mapping[str, str], limits: Limits) -> None:
    """`limits.max_headers` and `limits.max_header_bytes` (names + values + separators, as on the wire).

    The HTTP server refuses a single field or request line over `max_header_bytes`, and more than
    `max_headers` fields, before routing (a 400 in JSON both formats read: see `gateway.runner`); this
    catches what the parser lets through, a total over the limit, with a 400 in the caller's format."""
    count = len(headers)
    if count > limits.max_headers:
        raise InvalidRequest(f"{count} request headers exceed the limit of {limits.max_headers}")
    total = 0
    for key, value in headers.items():
        # aiohttp decodes header bytes as UTF-8 (surrogateescape): ASCII strings have one byte a char
        total += len(key) + 4 + (len(value) if value.isascii() else len(value.encode("utf-8", "surrogateescape")))
    if total > limits.max_header_bytes:
        raise InvalidRequest(f"request headers of {total} bytes exceed the limit of {limits.max_header_bytes}")


def run_id_from(headers: Mapping[str, str], agent: str) -> str:
    run_id = requested_run_id(headers)
    if run_id is None:
        return f"{agent}:default"
    if not RUN_ID_RE.match(run_id):
        raise InvalidRequest(f"invalid run id {run_id[:40]!r}: use 1-128 of A-Z a-z 0-9 . _ : @ / + = -")
    return run_id


def requested_run_id(headers: Mapping[str, str]) -> str | None:
    """The run id the request names, unchecked: `x-tollgate-run-id`, else the W3C `baggage` entry
    `tollgate.run_id` (several `baggage` lines are one list, as W3C Baggage says)."""
    run_id = headers.get(RUN_ID_HEADER)
    if run_id is not None:
        return run_id
    for line in header_values(headers, "baggage"):
        found = _from_baggage(line)
        if found is not None:
            return found
    return None


def header_values(headers: Mapping[str, str], name: str) -> tuple[str, ...]:
    """Every copy of a header field: a multidict (aiohttp's request headers) keeps repeated lines, a
    plain Mapping has at most one."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return tuple(getall(name, ()))
    value = headers.get(name)
    return () if value is None else (value,)


def _from_baggage(baggage: str) -> str | None:
    if not baggage:
        return None
    for member in baggage.split(","):
        key, sep, value = member.partition("=")
        if sep and key.strip() == "tollgate.run_id":
            return unquote(value.split(";", 1)[0].strip())
    return None
