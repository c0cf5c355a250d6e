"""The local model's failures through a running gateway (gateway/local.py): what the caller sent is a
400 charged nothing, a failure of the worker thread a 502, and a call that never reached the model (it
waited for the model's lock, then timed out or its client left) is charged nothing. The tiny model is
test_local.py's."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any, Literal

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.local import OutlinesTransport
from tests.conftest import GatewayFactory, Harness
from tests.gateway.test_local import _client, model_dir, needs_local

__all__ = ["model_dir"]  # the module-scoped fixture, shared with test_local.py

pytestmark = needs_local

# a Gemma-style template: no system role
REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "go"}]
BUDGET = {"budget": {"tokens": 100_000}, "output": {"retries": 0}}


async def _local(gateway_factory: GatewayFactory, path: Path, **provider: Any) -> Harness:
    return await gateway_factory(providers={"local": {"type": "outlines", "model": str(path), **provider}},
                                 models={"local-*": "local"}, agents={"default": BUDGET})


def _transport(h: Harness) -> OutlinesTransport:
    transport = h.gateway.transports["local"]
    assert isinstance(transport, OutlinesTransport)
    return transport


def _charged(run: dict[str, Any]) -> tuple[int, int, int]:
    return run["input_tokens"], run["output_tokens"], run["reserved_tokens"]


class _ObservedLock(asyncio.Lock):
    """The model's lock, telling the test when a request queues behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.queued = asyncio.Event()

    async def acquire(self) -> Literal[True]:
        if self.locked():
            self.queued.set()
        return await super().acquire()


class _BrokenTokenizer:
    """The model's tokenizer, but encoding fails (a tokenizer's bug, not the caller's)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a tokenizer bug")


@pytest.fixture
def refusing_model(model_dir: Path, tmp_path: Path) -> Path:
    path = Path(shutil.copytree(model_dir, tmp_path / "refusing"))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": REFUSING_TEMPLATE}))
    return path


@pytest.mark.parametrize("stream", [False, True])
async def test_a_template_refusal_is_a_400_charged_nothing(gateway_factory: GatewayFactory, refusing_model: Path,
                                                           stream: bool) -> None:
    h = await _local(gateway_factory, refusing_model)
    async with _client(h, "tmpl") as c:
        ok = await c.chat.completions.create(model="local-tiny", messages=USER, max_tokens=4)
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="local-tiny", max_tokens=200, stream=stream, messages=[
                {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert info.value.code == "invalid_request" and "System role not supported" in info.value.message
    run = await h.settled("tmpl", 1)
    assert ok.usage is not None
    assert _charged(run) == (ok.usage.prompt_tokens, ok.usage.completion_tokens, 0)
    # refused while its prompt is counted, before its step: nothing reserved, no step (the span and the
    # ledger row say it was refused)
    assert [s["error"] for s in run["steps"]] == [None] and run["llm_calls"] == 1


async def test_a_temperature_too_cold_to_sample_decodes_greedily(gateway_factory: GatewayFactory,
                                                                  model_dir: Path) -> None:
    h = await _local(gateway_factory, model_dir)
    async with _client(h, "cold") as c:
        answers = [await c.chat.completions.create(model="local-tiny", messages=USER, max_tokens=8,
                                                   temperature=t) for t in (1e-300, 1e-45, 0)]
    assert len({a.choices[0].message.content for a in answers}) == 1  # greedy: one answer


async def test_a_failed_generation_is_a_502_and_releases_the_model(gateway_factory: GatewayFactory,
                                                                    model_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    h = await _local(gateway_factory, model_dir)
    hf_model = _transport(h)._model.model

    def broken(**kwargs: Any) -> Any:
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    async with _client(h, "crash") as c:
        monkeypatch.setattr(hf_model, "generate", broken)
        with pytest.raises(openai.APIStatusError) as info:
            await c.chat.completions.create(model="local-tiny", messages=USER, max_tokens=50)
        monkeypatch.undo()
        after = await c.chat.completions.create(model="local-tiny", messages=USER, max_tokens=3)
    assert (info.value.status_code, info.value.code) == (502, "upstream_unavailable")
    assert after.choices[0].finish_reason in ("stop", "length")  # the lock was released
    run = await h.settled("crash", 2)
    assert run["steps"][0]["error"] == "upstream_unavailable"
    assert run["output_tokens"] >= 50 and run["reserved_tokens"] == 0  # the model ran: charged its reservation


async def test_a_prompt_that_cannot_be_prepared_is_a_502_charged_nothing(gateway_factory: GatewayFactory,
                                                                         model_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    h = await _local(gateway_factory, model_dir)
    transport = _transport(h)
    monkeypatch.setattr(transport, "_tokenizer", _BrokenTokenizer(transport._tokenizer))
    async with _client(h, "prep") as c:
        with pytest.raises(openai.APIStatusError) as info:
            await c.chat.completions.create(model="local-tiny", messages=USER, max_tokens=50)
    assert (info.value.status_code, info.value.code) == (502, "upstream_unavailable")
    async with h.session.get(f"{h.admin_url}/admin/runs/prep") as resp:
        assert resp.status == 404  # it failed while its prompt was counted: nothing was reserved or charged


async def test_a_call_that_timed_out_waiting_for_the_model_is_charged_nothing(gateway_factory: GatewayFactory,
                                                                              model_dir: Path) -> None:
    h = await _local(gateway_factory, model_dir, timeouts={"first_byte": 0.2})
    lock = _transport(h)._lock
    await lock.acquire()  # a generation in progress
    try:
        async with _client(h, "queued") as c:
            with pytest.raises(openai.APIStatusError) as info:
                await c.chat.completions.create(model="local-tiny", messages=USER, max_tokens=400)
    finally:
        lock.release()
    assert (info.value.status_code, info.value.code) == (504, "upstream_timeout")
    assert _charged(await h.settled("queued")) == (0, 0, 0)


async def test_a_client_that_left_while_queued_is_charged_nothing(gateway_factory: GatewayFactory,
                                                                  model_dir: Path) -> None:
    h = await _local(gateway_factory, model_dir)
    lock = _transport(h)._lock = _ObservedLock()
    await lock.acquire()
    try:
        body = {"model": "local-tiny", "messages": USER, "max_tokens": 400}
        headers = {"Authorization": "Bearer k", "x-tollgate-run-id": "left"}
        async with aiohttp.ClientSession() as session:
            call = asyncio.ensure_future(session.post(f"{h.url}/v1/chat/completions", json=body, headers=headers))
            await lock.queued.wait()
            call.cancel()  # the client leaves: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await call
        run = await h.settled("left")
    finally:
        lock.release()
    assert run["steps"][0]["error"] == "client_disconnected"
    assert _charged(run) == (0, 0, 0)


async def test_a_call_without_max_tokens_under_a_budget_holds_max_new_tokens(gateway_factory: GatewayFactory,
                                                                            model_dir: Path) -> None:
    """The model generates `max_new_tokens` when a request sets no max_tokens; under a budget the call
    was granted (and held) the 32,768 of an unknown model's output limit instead."""
    h = await _local(gateway_factory, model_dir, max_new_tokens=16)
    async with _client(h, "unset") as c:
        raw = await c.chat.completions.with_raw_response.create(model="local-tiny", messages=USER)
    assert raw.headers["x-tollgate-max-tokens"] == "16"
    assert (raw.parse().usage.completion_tokens or 0) <= 16


async def test_a_chat_template_s_own_tokens_are_held_before_the_call(gateway_factory: GatewayFactory,
                                                                      model_dir: Path, tmp_path: Path) -> None:
    """The input bound was the body's size: a template that adds a long preamble made one call spend
    2,835 tokens of a 1,000-token budget after reserving 85. The templated prompt is counted first."""
    path = Path(shutil.copytree(model_dir, tmp_path / "verbose"))
    config_file = path / "tokenizer_config.json"
    preamble = "You are a helpful assistant. " * 200
    template = ("{{ '" + preamble + "' }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": template}))
    h = await gateway_factory(providers={"local": {"type": "outlines", "model": str(path)}},
                              models={"local-*": "local"}, agents={"default": {"budget": {"tokens": 1000}}})
    async with _client(h, "verbose") as c:
        with pytest.raises(openai.PermissionDeniedError) as info:
            await c.chat.completions.create(model="local-tiny", messages=USER, max_tokens=4)
    assert info.value.code == "token_budget_exhausted"
    run = await h.run("verbose")
    assert _charged(run) == (0, 0, 0)  # refused before the model read anything


async def test_an_explicit_null_limit_does_not_hide_the_other(gateway_factory: GatewayFactory, model_dir: Path) -> None:
    """`max_completion_tokens: null` hid `max_tokens: 5`: the budget held 5 tokens and the model generated
    `max_new_tokens`. The model reads the limits as the reservation does."""
    h = await _local(gateway_factory, model_dir, max_new_tokens=64)
    body = {"model": "local-tiny", "messages": USER, "max_tokens": 5, "max_completion_tokens": None, "seed": 1}
    async with h.session.post(f"{h.url}/v1/chat/completions", json=body,
                              headers={"x-tollgate-run-id": "nullmax"}) as resp:
        data = await resp.json()
    assert resp.status == 200 and data["usage"]["completion_tokens"] <= 5, data
    async with h.session.get(f"{h.url}/v1/models/local/whatever") as resp:  # the id as asked for
        assert resp.status == 200 and (await resp.json())["id"] == "local/whatever"
