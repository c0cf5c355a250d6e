"""Local constrained decoding (provider `type: outlines`, gateway/local.py) through a running gateway.

The model is a randomly initialised 2-layer GPT-2 and the tokenizer a byte-level BPE trained here on
synthetic text: nothing is downloaded. A random model emits random tokens, so every valid answer is
the constraint's doing. The agent gets `retries: 0`: an answer that broke its constraint would be a
422, not a quiet re-ask.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.config import parse_config
from gateway.errors import ConfigError, InvalidRequest
from gateway.local import OutlinesTransport, _Streamer
from gateway.local_wire import parse_request
from grammars.compile import compile_constraint
from grammars.spec import ConstraintSpec
from tests.conftest import GatewayFactory, Harness

HAVE_LOCAL = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "outlines"))
needs_local = pytest.mark.skipif(
    not HAVE_LOCAL, reason="the local extra is not installed (torch, transformers, outlines): pip install -e '.[dev]'"
)

# The issue's 10-field schema; strings and arrays are bounded so that a random model, which closes a
# string only by chance, finishes within max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email", "maxLength": 32},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 20},
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["FR", "DE", "US"]},
            },
            "required": ["street", "city", "zip", "country"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0, "maximum": 10000},
                    "created_at": {"type": "string", "format": "date-time"},
                },
                "required": ["sku", "qty", "price", "created_at"],
                "additionalProperties": False,
            },
        },
        "nickname": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
    },
    "required": ["id", "name", "age", "email", "score", "active", "role", "tags", "address", "orders"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{3}-[0-9]{4}( [a-z]{2,6})?"
LARK = r"""
start: cmd ("; " cmd)~0..2
cmd: move | say
move: "move " DIR " " NUMBER
say: "say " WORD
DIR: "north" | "south" | "east" | "west"
NUMBER: /[1-9][0-9]{0,2}/
WORD: /[a-z]{1,8}/
"""
MSG: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Answer in the requested format."}, {"role": "user", "content": "Go."}]
N = 20
# A random model ends a string or a number only by chance (120 answers measured: mean 330 tokens, max
# 483), so the context and max_tokens leave room for the tail.
CONTEXT, JSON_MAX_TOKENS = 4096, 3000


def _corpus() -> Iterator[str]:
    rng = random.Random(0)
    for i in range(200):
        yield json.dumps({"id": f"{rng.getrandbits(32):08x}-1c2d-4e5f-8a9b-{rng.getrandbits(48):012x}",
                          "name": rng.choice(["Ada", "Bob", "Cy"]), "age": rng.randint(0, 99), "tags": ["a", "b"],
                          "active": i % 2 == 0, "nickname": None, "score": rng.random() * 100})
        yield f"system: answer.\nuser: go.\nassistant: ABC-{rng.randint(1000, 9999)} move north {i}; say hi"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer trained here and a random 2-layer GPT-2 (270k parameters), saved as a model dir."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    torch.set_num_threads(1)  # measured: a model this small runs 25% faster on one thread than on two
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    hf_tok: Any = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",  # type: ignore[no-untyped-call]
                                          bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(hf_tok), n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=hf_tok.eos_token_id, eos_token_id=hf_tok.eos_token_id)
    path = tmp_path_factory.mktemp("tiny-gpt2")
    model: Any = GPT2LMHeadModel(config)
    model.eval().save_pretrained(path)
    hf_tok.save_pretrained(path)
    return path


async def _local(gateway_factory: GatewayFactory, model_dir: Path) -> Harness:
    return await gateway_factory(
        providers={"local": {"type": "outlines", "model": str(model_dir)}}, models={"local-*": "local"},
        agents={"default": {"output": {"retries": 0}}},
    )


def _client(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run})


async def _gather(c: openai.AsyncOpenAI, **kwargs: Any) -> list[Any]:
    """N requests at once (they queue on the model's lock), seeds 0..N-1 so a failure replays."""
    calls = [c.chat.completions.create(model="local-tiny", messages=MSG, seed=i, **kwargs) for i in range(N)]
    return list(await asyncio.gather(*calls))


@needs_local
async def test_json_schema_every_output_valid(gateway_factory: GatewayFactory, model_dir: Path) -> None:
    h = await _local(gateway_factory, model_dir)
    validator = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    rf: Any = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    pings: list[float] = []

    async def ping_admin(stop: asyncio.Event) -> None:  # the event loop must stay free while torch works
        while not stop.is_set():
            start = time.perf_counter()
            async with h.session.get(f"{h.admin_url}/healthz") as resp:
                assert resp.status == 200
            pings.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)

    stop = asyncio.Event()
    pinger = asyncio.create_task(ping_admin(stop))
    start = time.perf_counter()
    async with _client(h, "json") as c:
        results = await _gather(c, response_format=rf, max_tokens=JSON_MAX_TOKENS)
    elapsed = time.perf_counter() - start
    stop.set()
    await pinger
    tokens = 0
    for r in results:
        assert r.choices[0].finish_reason == "stop"
        validator.validate(json.loads(r.choices[0].message.content or ""))
        assert r.usage is not None and r.usage.prompt_tokens > 0
        tokens += r.usage.completion_tokens
    assert len({r.choices[0].message.content for r in results}) > 1  # sampled, not one canned answer
    run = await h.run("json")
    assert run["llm_calls"] == N and run["output_tokens"] == tokens  # no re-ask; real counts settled
    assert max(pings) < 1.0, f"event loop blocked for {max(pings):.2f}s"
    print(f"\njson: {N} answers, {tokens} tokens in {elapsed:.1f}s ({elapsed / tokens * 1000:.2f} ms/token); "
          f"slowest /healthz meanwhile {max(pings) * 1000:.0f} ms")


@needs_local
async def test_regex_and_lark_every_output_valid(gateway_factory: GatewayFactory, model_dir: Path) -> None:
    h = await _local(gateway_factory, model_dir)
    lark = compile_constraint(ConstraintSpec("lark", LARK))
    async with _client(h, "grammars") as c:
        by_field = await _gather(c, extra_body={"guided_regex": REGEX}, max_tokens=64)
        by_header = await c.chat.completions.create(model="local-tiny", messages=MSG, max_tokens=64,
                                                    extra_headers={"x-tollgate-grammar": f"regex:{REGEX}"})
        lark_results = await _gather(c, extra_body={"structured_outputs": {"grammar": LARK}}, max_tokens=128)
        choice = await c.chat.completions.create(model="local-tiny", messages=MSG, max_tokens=16,
                                                 extra_body={"guided_choice": ["red", "green", "blue"]})
        gbnf = await c.chat.completions.create(model="local-tiny", messages=MSG, max_tokens=16,
                                               extra_body={"guided_grammar": 'root ::= "yes" | "no" | "maybe"'})
    for r in [*by_field, by_header]:
        assert re.fullmatch(REGEX, r.choices[0].message.content or ""), r.choices[0].message.content
    for r in lark_results:
        text = r.choices[0].message.content or ""
        assert lark.validate(text) is None, text
    assert choice.choices[0].message.content in ("red", "green", "blue")
    assert gbnf.choices[0].message.content in ("yes", "no", "maybe")
    assert (await h.run("grammars"))["llm_calls"] == 2 * N + 3


@needs_local
async def test_stream_and_refusals(gateway_factory: GatewayFactory, model_dir: Path) -> None:
    h = await _local(gateway_factory, model_dir)
    rf: Any = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    async with _client(h, "stream") as c:
        stream = await c.chat.completions.create(model="local-tiny", messages=MSG, response_format=rf,
                                                 max_tokens=JSON_MAX_TOKENS, seed=7, stream=True,
                                                 stream_options={"include_usage": True})
        parts: list[str] = []
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="local-tiny", messages=MSG, extra_body={
                "guided_json": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}})
        with pytest.raises(openai.BadRequestError) as tools:
            await c.chat.completions.create(model="local-tiny", messages=MSG, tool_choice="required", tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)
    assert len(parts) > 5 and finish == "stop"
    assert usage is not None and usage.completion_tokens > 0
    assert "uniqueItems" in info.value.message  # never an unconstrained generation
    assert "does not call tools" in tools.value.message


# -- startup and config (these need no torch) ------------------------------------------------------------


def _provider(**extra: Any) -> Any:
    config = parse_config({"providers": {"l": {"type": "outlines", "model": "m", **extra}}}, env={})
    return config.providers["l"]


def test_missing_extra_is_a_clear_startup_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "outlines", None)  # as if not installed
    with pytest.raises(ConfigError) as info:
        OutlinesTransport.load(_provider(), name="l", model_dir=tmp_path)
    [(path, message)] = info.value.problems
    assert path == "providers.l.type" and "pip install 'tollgate[local]'" in message


@needs_local
def test_missing_model_dir_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        OutlinesTransport.load(_provider(), name="l", model_dir=tmp_path / "nope")
    assert info.value.problems[0][0] == "providers.l.model"


@pytest.mark.parametrize(("provider", "path", "text"), [
    ({"type": "outlines"}, "providers.l.model", "needs model"),
    ({"type": "outlines", "model": "m", "base_url": "http://h/v1"}, "providers.l", "takes no base_url"),
    ({"type": "outlines", "model": "m", "structured_outputs": "openai"}, "providers.l.structured_outputs", "vllm"),
    ({"type": "openai", "base_url": "http://h/v1", "model": "m"}, "providers.l.model", "only type outlines"),
    ({"type": "openai"}, "providers.l.base_url", "required"),
])
def test_config_errors_name_the_key(provider: dict[str, Any], path: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"providers": {"l": provider}}, env={})
    [(where, message)] = info.value.problems
    assert where == path and text in message


def test_outlines_config_defaults() -> None:
    p = _provider()
    assert (p.engine, p.type, p.dialect, p.device, p.max_new_tokens) == ("outlines", "openai", "vllm", "cpu", 512)
    assert _provider(structured_outputs="vllm-legacy").dialect == "vllm-legacy"


# -- the wire and the streamer, without a model -----------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_regex": 3}, "guided_regex"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": True}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": {"a": "b"}}, "stop"),
])
def test_requests_the_local_model_cannot_honour_are_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(json.dumps(body).encode())
    assert info.value.param == param


def test_structured_outputs_wins_over_response_format() -> None:
    job = parse_request(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "[0-9]+"},
        "temperature": 0, "stop": "x", "max_completion_tokens": 9,
    }).encode())
    assert job.spec is not None and (job.spec.kind, job.spec.source) == ("regex", "[0-9]+")
    assert (job.messages, job.sampling, job.stop, job.max_new) == (
        [{"role": "user", "content": "hi"}], {"do_sample": False}, ("x",), 9)


@pytest.mark.parametrize(("temperature", "sampled"), [(0, False), (1e-300, False), (1e-6, False), (1e-5, True),
                                                     (0.7, True)])
def test_a_temperature_too_cold_to_sample_is_greedy(temperature: float, sampled: bool) -> None:
    job = parse_request(json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": temperature}).encode())
    assert job.sampling["do_sample"] is sampled


class _CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class _Ids(list[int]):
    def reshape(self, *shape: int) -> _Ids:
        return self

    def tolist(self) -> list[int]:
        return list(self)


def test_streamer_holds_back_a_possible_stop_string_and_cuts_at_it() -> None:
    sent: list[str] = []
    streamer = _Streamer(_CharTokenizer(), ("END",), sent.append)
    streamer.put(_Ids([0]))  # the prompt
    for ch in "abE":
        streamer.put(_Ids([ord(ch)]))
    assert "".join(sent) == "ab"  # "E" may start "END"
    for ch in "xEND!":
        streamer.put(_Ids([ord(ch)]))
    streamer.end()
    assert "".join(sent) == "abEx" and streamer.text(final=True) == ("abEx", True)


@needs_local
async def test_models_list_names_the_local_model(gateway_factory: GatewayFactory, model_dir: Path) -> None:
    h = await gateway_factory(providers={"local": {"type": "outlines", "model": str(model_dir)}},
                              models={"local-tiny": "local", "local-*": "local"})
    async with _client(h, "list") as c:
        listed = [m.id async for m in c.models.list()]
        retrieved = await c.models.retrieve("local-tiny")  # it was a 400: answered here, not forwarded
    assert listed == ["local-tiny"]
    assert (retrieved.id, retrieved.owned_by) == ("local-tiny", "local")
