"""`repeated_key`: the watched names some object of a request repeats, exactly (table and property
tests against the standard parser's own pairs), and the 400 a running gateway answers for one."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.duplicate_keys import COMMON, WATCHED, repeated_key
from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, anthropic_message, openai_completion


@pytest.mark.parametrize(("raw", "expected"), [
    (b'{"model":"gpt-4o-mini","max_tokens":5}', None),
    (b'{"model":"a","max_tokens":100000,"max_tokens":5}', "max_tokens"),
    (b'{"model":"a","model":"b"}', "model"),
    (b'{"model":"a","messages":[{"role":"user","content":"x"}],"tools":[],"tools":[{"type":"function"}]}', "tools"),
    (b'{"thinking":{"type":"enabled","budget_tokens":2000,"budget_tokens":1}}', "budget_tokens"),
    (b'{"tools":[{"type":"web_search_20250305","max_uses":1,"max_uses":99}]}', "max_uses"),
    (b'{"model":"a","max_\\u0074okens":9,"max_tokens":5}', "max_tokens"),  # a key spelled with an escape
    # the name twice, but in different objects or as a string value: no object repeats it
    (b'{"messages":[{"role":"user","content":"model"},{"role":"user","content":"model"}],"model":"a"}', None),
    (b'{"tools":[{"parameters":{"properties":{"n":{}}}},{"parameters":{"properties":{"n":{}}}}],"n":1}', None),
    (b'{"metadata":{"a":1,"a":2}}', None),  # a name tollgate does not read: forwarded as sent
    (b'{"content":"caf\\u00e9","model":"a"}', None),  # an escape outside any key
    (b'{"model":"a","stream":true,"stream":false}', "stream"),
    # a refused value first, an accepted one last: input tollgate cannot bound, background work, other
    # models, a hosted MCP server, a compaction, a pricier speed
    (b'{"model":"a","input":"x","previous_response_id":"resp_1","previous_response_id":null}', "previous_response_id"),
    (b'{"model":"a","input":"x","conversation":"conv_1","conversation":null}', "conversation"),
    (b'{"model":"a","input":"x","background":true,"background":false}', "background"),
    (b'{"model":"a","mcp_servers":[{"type":"url","url":"https://m"}],"mcp_servers":[]}', "mcp_servers"),
    (b'{"model":"a","fallbacks":"default","fallbacks":[]}', "fallbacks"),
    (b'{"model":"a","context_management":{"edits":[{"type":"compact"}],"edits":[]}}', "edits"),
    (b'{"model":"a","speed":"fast","speed":"standard"}', "speed"),
    # a tool's name: the allow-list judged the last, an upstream keeping the first would show the model
    # another tool; many names in different objects are the common case and need no parse
    (b'{"tools":[{"type":"function","function":{"name":"shell","name":"read_file"}}]}', "name"),
    (b'{"tools":[{"name":"shell","input_schema":{},"name":"read_file"}]}', "name"),
    (b'{"tools":[{"type":"function","function":{"name":"a"}},{"type":"function","function":{"name":"b"}}]}', None),
    (b'{"messages":[{"role":"user","name":"x","content":"\\"name\\""},{"role":"user","name":"y"}]}', None),
    (b'{"metadata":{"a":{"name":1},"a":{"name":2}}}', None),  # a name lost in an unwatched repeat
])
def test_repeated_key_table(raw: bytes, expected: str | None) -> None:
    orjson.loads(raw)  # every case is a body orjson accepts
    assert repeated_key(raw) == expected


def reference(raw: bytes) -> set[str]:
    """Every watched name some object repeats, by the standard parser's pairs."""
    found: set[str] = set()

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [name for name, _ in pairs]
        found.update(n for n in names if names.count(n) > 1 and (n in WATCHED or n == COMMON))
        return dict(pairs)

    json.loads(raw, object_pairs_hook=hook)
    return found


NAMES = st.sampled_from(["model", "max_tokens", "n", "tools", "role", "content", "a", "max_uses", "name"])
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), NAMES, st.text(max_size=3))


@st.composite
def objects(draw: st.DrawFn, depth: int = 3) -> str:
    """A JSON object's text, which may repeat names (a dict cannot)."""
    pairs = draw(st.lists(st.tuples(NAMES, values(depth - 1) if depth else LEAVES.map(json.dumps)), max_size=4))
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}"


def values(depth: int) -> st.SearchStrategy[str]:
    return st.one_of(LEAVES.map(json.dumps), objects(depth), st.lists(objects(depth), max_size=2).map(
        lambda items: "[" + ",".join(items) + "]"))


@settings(max_examples=400, deadline=None)
@given(objects())
def test_repeated_key_agrees_with_the_standard_parser(text: str) -> None:
    raw = text.encode()
    found = reference(raw)
    got = repeated_key(raw, orjson.loads(raw))
    assert (got is None) == (not found) and (got is None or got in found)


TRICKY = st.sampled_from(['":', '" :', 'a\\', '\\":', "name", "x:y", '"name":', "é"])


@st.composite
def spelled(draw: st.DrawFn, text: str) -> str:
    """`text` as a JSON string, each quote, colon and backslash spelled plainly or as a `\\u` escape."""
    out = []
    for char in text:
        if char in '"\\':
            out.append(draw(st.sampled_from([f"\\{char}", f"\\u{ord(char):04x}"])))
        elif char == ":":
            out.append(draw(st.sampled_from([":", "\\u003a", "\\u003A"])))
        elif ord(char) > 127:
            out.append(draw(st.sampled_from([char, f"\\u{ord(char):04x}"])))
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


@st.composite
def written(draw: st.DrawFn, depth: int = 3) -> str:
    """A JSON object's text as agents' libraries may write it: any spacing around colons and commas,
    strings holding quotes, colons and backslashes in any spelling, names repeated or not."""
    space = st.sampled_from(["", " ", "\n  ", "\t"])
    count = draw(st.integers(0, 4))
    pairs = []
    for _ in range(count):
        key = draw(spelled(draw(st.one_of(NAMES, TRICKY))))
        if depth and draw(st.booleans()):
            value = draw(written(depth - 1))
        else:
            value = draw(st.one_of(LEAVES.map(json.dumps), TRICKY.flatmap(spelled)))
        pairs.append(f"{draw(space)}{key}{draw(space)}:{draw(space)}{value}{draw(space)}")
    return "{" + ",".join(pairs) + "}"


@settings(max_examples=1500, deadline=None)
@given(written())
def test_repeated_key_agrees_with_the_standard_parser_however_the_body_is_written(text: str) -> None:
    """The key count that spares most bodies a second parse is exact whatever the spacing and the
    spelling of quotes and colons inside strings (a count off by one would hide a repeat)."""
    raw = text.encode()
    found = reference(raw)
    got = repeated_key(raw, orjson.loads(raw))
    assert (got is None) == (not found) and (got is None or got in found)


def test_a_body_written_as_the_sdks_write_it_needs_no_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The openai and anthropic SDKs write compact JSON with UTF-8 as is, as orjson does: a body equal
    to orjson's writing of it kept every key, known without the escape search or the colon counts."""
    from gateway import duplicate_keys

    class Refused:
        def search(self, raw: bytes) -> None:
            raise AssertionError("scanned a body the SDKs wrote")

    monkeypatch.setattr(duplicate_keys, "_ESCAPED_COLON", Refused())
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "café: \"x\"\u001b"}],
            "tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}]}
    sent = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()  # httpx's `json=`
    assert repeated_key(sent, orjson.loads(sent)) is None
    with pytest.raises(AssertionError, match="scanned"):  # any other writing is checked the exact way
        repeated_key(json.dumps(body).encode(), body)
    twice = b'{"model":"a","max_tokens":9,"max_tokens":5}'
    monkeypatch.undo()
    assert repeated_key(twice, orjson.loads(twice)) == "max_tokens"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions",
     b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"max_tokens":100000,"max_tokens":5}'),
    ("/v1/messages",
     (b'{"model":"claude-3-5-haiku-latest","max_tokens":100000,"max_tokens":5,'
      b'"messages":[{"role":"user","content":"hi"}]}')),
    ("/v1/responses", b'{"model":"gpt-4o-mini","input":"hi","max_output_tokens":100000,"max_output_tokens":16}'),
])
async def test_a_running_gateway_refuses_a_repeated_key_in_the_callers_format(
    gateway_factory: GatewayFactory, path: str, body: bytes
) -> None:
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 1.0}}})
    h.fake.queue(Reply(body=anthropic_message("x") if path == "/v1/messages" else openai_completion("x")))
    hdrs = {"x-tollgate-run-id": "dup", "x-tollgate-agent": "bot", "content-type": "application/json"}
    async with h.session.post(h.url + path, data=body, headers=hdrs) as resp:
        status, answer = resp.status, await resp.json()
    assert status == 400 and "repeats the key" in answer["error"]["message"]
    if path == "/v1/messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    else:
        assert answer["error"]["code"] == "invalid_request" and answer["error"]["param"].startswith("max_")
    assert h.fake.seen == []  # nothing went upstream
    fine = body.replace(b',"max_tokens":5', b"").replace(b',"max_output_tokens":16', b"")
    async with h.session.post(h.url + path, data=fine, headers=hdrs) as resp:
        assert resp.status == 200, await resp.text()
    view = await h.settled("dup")
    assert view["reserved_usd"] == 0 and len(h.fake.seen) == 1


async def test_a_tool_named_twice_is_refused_not_shown_to_the_model(gateway_factory: GatewayFactory) -> None:
    """The allow-list judges the last `name` orjson keeps; forwarded as sent, an upstream keeping the first
    would offer the model `shell`. Two tools each named once go through untouched."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["read_file"]}}})
    h.fake.queue(Reply(body=openai_completion("x")))
    tool = b'{"type":"function","function":{"name":"shell","parameters":{},"name":"read_file"}}'
    body = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"tools":[' + tool + b"]}"
    hdrs = {"x-tollgate-run-id": "dup-tool", "content-type": "application/json"}
    async with h.session.post(h.url + "/v1/chat/completions", data=body, headers=hdrs) as resp:
        status, answer = resp.status, await resp.json()
    assert status == 400 and answer["error"]["param"] == "name" and h.fake.seen == []
    fine = body.replace(b'"name":"shell",', b"")
    async with h.session.post(h.url + "/v1/chat/completions", data=fine, headers=hdrs) as resp:
        assert resp.status == 200, await resp.text()
    assert h.fake.seen[0].body == fine  # forwarded as sent
