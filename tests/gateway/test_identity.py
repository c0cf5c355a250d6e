"""gateway/identity.py: who is calling and which run (DESIGN section 3), and the header limits.

The constant-time comparison of agent keys (`Identifier.agent_for_key`) is tested in test_security.py."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from gateway.config import Agent, Budget, Limits, parse_config
from gateway.errors import InvalidApiKey, InvalidRequest
from gateway.identity import DEFAULT_POLICY, Identifier, Identity, bearer, check_headers, run_id_from

RUN_RULE = "use 1-128 of A-Z a-z 0-9 . _ : @ / + = -"


def headers(**fields: str) -> CIMultiDict[str]:
    return CIMultiDict((k.replace("_", "-"), v) for k, v in fields.items())


# -- bearer ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "token"),
    [
        ({}, None),
        ({"Authorization": "Bearer k1"}, "k1"),
        ({"authorization": "bearer k1"}, "k1"),  # the scheme is case-insensitive
        ({"Authorization": "BEARER   k1  "}, "k1"),
        ({"Authorization": "Bearer k1", "x-api-key": "k2"}, "k1"),  # Authorization first
        ({"Authorization": "Basic dXNlcjpwYXNz", "x-api-key": "k2"}, "k2"),  # not a bearer: x-api-key
        ({"Authorization": "Bearer ", "x-api-key": "k2"}, "k2"),  # an empty token: x-api-key
        ({"Authorization": "Bearer    "}, None),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, None),
        ({"Authorization": "Bearerk1"}, None),
        ({"X-Api-Key": "  k2 "}, "k2"),
        ({"x-api-key": ""}, None),
        ({"Authorization": "", "x-api-key": "k2"}, "k2"),
    ],
)
def test_bearer(fields: dict[str, str], token: str | None) -> None:
    assert bearer(CIMultiDict(fields)) == token


# -- identify ----------------------------------------------------------------------------------------

KEYED: dict[str, Any] = {
    "bot": {"keys": ["key-bot-1", "key-bot-2"], "budget": {"usd": 2.0}},
    "ops": {"keys": ["key-ops"], "on_stop": "message"},
    "nokey": {"caps": {"llm_calls": 3}},  # reachable by no key
}
UNKEYED: dict[str, Any] = {"bot": {"budget": {"usd": 2.0}}, "ops": {"on_stop": "message"}}


def identifier(agents: dict[str, Any]) -> Identifier:
    return Identifier(parse_config({"agents": agents}, env={}))


@pytest.mark.parametrize(
    ("fields", "agent", "run_id"),
    [
        ({"Authorization": "Bearer key-bot-1"}, "bot", "bot:default"),
        ({"Authorization": "Bearer key-bot-2"}, "bot", "bot:default"),  # every key of the agent
        ({"x-api-key": "key-ops"}, "ops", "ops:default"),  # Anthropic's header
        # the agent header cannot name another agent once a key identified the caller
        ({"Authorization": "Bearer key-bot-1", "x-tollgate-agent": "ops"}, "bot", "bot:default"),
        ({"x-api-key": "key-ops", "x-tollgate-run-id": "run-9"}, "ops", "run-9"),
    ],
)
def test_identify_by_agent_key(fields: dict[str, str], agent: str, run_id: str) -> None:
    ident = identifier(KEYED).identify(CIMultiDict(fields))
    config = parse_config({"agents": KEYED}, env={})
    assert ident == Identity(agent, config.agents[agent], run_id)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"x-tollgate-agent": "bot"},  # the agent header names nobody once keys are configured
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer key-bot-1x"},
        {"Authorization": "Bearer key-bot"},
        {"Authorization": "Basic key-bot-1"},
        {"x-api-key": "KEY-OPS"},
        {"Authorization": "Bearer wrong", "x-api-key": "key-ops"},  # a wrong bearer is not rescued
    ],
)
def test_identify_refuses_unknown_or_missing_keys(fields: dict[str, str]) -> None:
    with pytest.raises(InvalidApiKey) as info:
        identifier(KEYED).identify(CIMultiDict(fields))
    assert (info.value.status, info.value.code) == (401, "invalid_api_key")
    assert info.value.message == "unknown or missing agent key"


@pytest.mark.parametrize(
    ("fields", "agent", "policy"),
    [
        ({}, "default", DEFAULT_POLICY),
        ({"x-tollgate-agent": ""}, "default", DEFAULT_POLICY),
        ({"x-tollgate-agent": "bot"}, "bot", Agent(budget=Budget(usd=2.0))),
        ({"X-Tollgate-Agent": "ops"}, "ops", Agent(on_stop="message")),
        ({"x-tollgate-agent": "stranger"}, "stranger", DEFAULT_POLICY),  # unconfigured: default policy
        ({"x-tollgate-agent": "a.b_c-D9"}, "a.b_c-D9", DEFAULT_POLICY),
        ({"x-tollgate-agent": "a" * 64}, "a" * 64, DEFAULT_POLICY),
        ({"x-tollgate-agent": "bot", "Authorization": "Bearer anything"}, "bot",
         Agent(budget=Budget(usd=2.0))),
    ],
)
def test_identify_without_agent_keys(fields: dict[str, str], agent: str, policy: Agent) -> None:
    ident = identifier(UNKEYED).identify(CIMultiDict(fields))
    assert ident == Identity(agent, policy, f"{agent}:default")


@pytest.mark.parametrize("name", ["a" * 65, "bad agent", "bot/x", "bot:1", "b\u00f6t", "bot;", "*", "bot\n"])
def test_identify_refuses_a_malformed_agent_header(name: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        identifier(UNKEYED).identify(CIMultiDict({"x-tollgate-agent": name}))
    assert info.value.message == "invalid x-tollgate-agent header: use 1-64 of A-Z a-z 0-9 . _ -"


def test_identify_checks_header_limits_before_the_key() -> None:
    config = parse_config({"agents": KEYED, "limits": {"max_headers": 2}}, env={})
    fields = CIMultiDict([("Authorization", "Bearer wrong"), ("a", "1"), ("b", "2")])
    with pytest.raises(InvalidRequest, match="^3 request headers exceed the limit of 2$"):
        Identifier(config).identify(fields)


# -- run_id_from -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "run_id"),
    [
        ({}, "bot:default"),
        ({"x-tollgate-run-id": "run-1"}, "run-1"),
        ({"X-Tollgate-Run-Id": "a.b_c:d@e/f+g=h-1"}, "a.b_c:d@e/f+g=h-1"),
        ({"x-tollgate-run-id": "r" * 128}, "r" * 128),
        ({"baggage": "tollgate.run_id=from-bag"}, "from-bag"),
        ({"x-tollgate-run-id": "from-header", "baggage": "tollgate.run_id=from-bag"}, "from-header"),
        ({"baggage": "userId=alice, tollgate.run_id=r2;ttl=60, other=x"}, "r2"),  # properties dropped
        ({"baggage": "  tollgate.run_id  =  r3  "}, "r3"),
        ({"baggage": "tollgate.run_id=run%2F7%3Ab"}, "run/7:b"),  # values are percent-decoded
        ({"baggage": "tollgate.run_id=first,tollgate.run_id=second"}, "first"),
        ({"baggage": "userId=alice"}, "bot:default"),
        ({"baggage": "tollgate.run_idx=r, xtollgate.run_id=r"}, "bot:default"),
        ({"baggage": "tollgate.run_id"}, "bot:default"),  # no value
        ({"baggage": ""}, "bot:default"),
    ],
)
def test_run_id_from(fields: dict[str, str], run_id: str) -> None:
    assert run_id_from(CIMultiDict(fields), "bot") == run_id


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        ({"x-tollgate-run-id": ""}, ""),
        ({"x-tollgate-run-id": "run 1"}, "run 1"),
        ({"x-tollgate-run-id": "run;1"}, "run;1"),
        ({"x-tollgate-run-id": "r\u00e9"}, "r\u00e9"),
        ({"x-tollgate-run-id": "r" * 129}, "r" * 40),  # too long; the message shows 40 characters
        ({"baggage": "tollgate.run_id=a%20b"}, "a b"),
        ({"baggage": "tollgate.run_id="}, ""),
        ({"baggage": "tollgate.run_id=a%0D%0Ab"}, "a\r\nb"),
        ({"baggage": "tollgate.run_id=abc%0A"}, "abc\n"),  # a final newline too (`$` admitted it)
        ({"x-tollgate-run-id": "abc\n"}, "abc\n"),
        ({"x-tollgate-run-id": "bad id", "baggage": "tollgate.run_id=good"}, "bad id"),  # no fallback
    ],
)
def test_malformed_run_id_is_invalid_request(fields: dict[str, str], shown: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        run_id_from(CIMultiDict(fields), "bot")
    assert info.value.status == 400
    assert info.value.message == f"invalid run id {shown!r}: {RUN_RULE}"


# -- check_headers -----------------------------------------------------------------------------------


def size(fields: list[tuple[str, str]]) -> int:
    """Bytes as on the wire: name, ': ', value, CRLF."""
    return sum(len(k) + 4 + len(v.encode("utf-8", "surrogateescape")) for k, v in fields)


FIELDS = [("Host", "gw"), ("Authorization", "Bearer k"), ("x-a", "\u00e9t\u00e9"), ("x-b", "\udcff")]


def test_header_size_counts_bytes_not_characters() -> None:
    assert size(FIELDS) == (4 + 4 + 2) + (13 + 4 + 8) + (3 + 4 + 5) + (3 + 4 + 1)


@pytest.mark.parametrize(
    ("fields", "max_bytes", "max_headers", "error"),
    [
        ([], 1, 1, None),
        (FIELDS, size(FIELDS), 4, None),  # both limits exactly met
        (FIELDS, size(FIELDS) - 1, 4,
         f"request headers of {size(FIELDS)} bytes exceed the limit of {size(FIELDS) - 1}"),
        (FIELDS, size(FIELDS), 3, "4 request headers exceed the limit of 3"),
        ([("x", "1")] * 3, 1000, 2, "3 request headers exceed the limit of 2"),  # repeated fields count
        ([("x", "1")] * 3, 17, 3, "request headers of 18 bytes exceed the limit of 17"),
        ([("x", "\u00e9")], 6, 1, "request headers of 7 bytes exceed the limit of 6"),  # 2 bytes, 1 char
    ],
)
def test_check_headers(fields: list[tuple[str, str]], max_bytes: int, max_headers: int,
                       error: str | None) -> None:
    limits = Limits(max_header_bytes=max_bytes, max_headers=max_headers)
    if error is None:
        check_headers(CIMultiDict(fields), limits)
        return
    with pytest.raises(InvalidRequest) as info:
        check_headers(CIMultiDict(fields), limits)
    assert (info.value.status, info.value.code, info.value.message) == (400, "invalid_request", error)


def test_default_header_limits() -> None:
    limits = Limits()
    assert (limits.max_headers, limits.max_header_bytes) == (128, 16 * 1024)
    check_headers(CIMultiDict([(f"x-{i}", "v") for i in range(128)]), limits)
    with pytest.raises(InvalidRequest):
        check_headers(CIMultiDict([(f"x-{i}", "v") for i in range(129)]), limits)
    with pytest.raises(InvalidRequest):
        check_headers(headers(x_big="v" * (16 * 1024)), limits)
