"""gateway/routing.py: model name -> configured provider (`provider/model` prefix, exact names, globs)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import Config, parse_config
from gateway.errors import ModelNotFound
from gateway.routing import Route, Router

PROVIDERS: dict[str, dict[str, Any]] = {
    "openai": {"type": "openai", "base_url": "http://openai.test/v1", "api_key": "sk-o"},
    "anthropic": {"type": "anthropic", "base_url": "http://anthropic.test", "api_key": "sk-a"},
    "local": {"type": "openai", "base_url": "http://local.test/v1"},
}
MODELS = {
    "gpt-*": "openai",
    "claude-*": "anthropic",
    "gpt-4o": "local",  # an exact name beats the glob listed before it
    "llama-?b": "local",
    "m[0-9]": "local",
    "meta-llama/*": "local",  # a slash that is not a provider prefix
    "o1*": "openai",
}


def config(providers: dict[str, dict[str, Any]] | None = None,
           models: dict[str, str] | None = None) -> Config:
    return parse_config({"providers": PROVIDERS if providers is None else providers,
                         "models": MODELS if models is None else models}, env={})


@pytest.fixture
def router() -> Router:
    return Router(config())


@pytest.mark.parametrize(
    ("model", "provider_name", "upstream_model", "prefixed"),
    [
        ("gpt-4o-mini", "openai", "gpt-4o-mini", False),  # glob
        ("gpt-4o", "local", "gpt-4o", False),  # exact beats glob
        ("claude-3-5-haiku-latest", "anthropic", "claude-3-5-haiku-latest", False),
        ("llama-7b", "local", "llama-7b", False),  # `?` is one character
        ("m5", "local", "m5", False),  # `[0-9]` class
        ("o1", "openai", "o1", False),  # `*` matches nothing too
        ("o1-preview", "openai", "o1-preview", False),
        ("meta-llama/Llama-3-8B", "local", "meta-llama/Llama-3-8B", False),  # unknown prefix: sent whole
        ("openai/claude-x", "openai", "claude-x", True),  # an explicit provider beats the table
        ("local/gpt-4o-mini", "local", "gpt-4o-mini", True),
        ("anthropic/anything", "anthropic", "anything", True),  # needs no `models:` entry
        ("openai/a/b", "openai", "a/b", True),  # only the first segment is the prefix
        ("anthropic/openai/x", "anthropic", "openai/x", True),
    ],
)
def test_route(router: Router, model: str, provider_name: str, upstream_model: str, prefixed: bool) -> None:
    route = router.route(model)
    assert route == Route(provider_name, config().providers[provider_name], upstream_model, prefixed)
    assert route.provider.base_url == PROVIDERS[provider_name]["base_url"]


@pytest.mark.parametrize(
    "model",
    [
        "mistral-large",  # nothing matches
        "GPT-4o",  # names and globs are case-sensitive
        "Claude-3",
        "llama-70b",  # `?` is exactly one character
        "m10",
        "xgpt-4o",  # globs match the whole name
        "gpt",
        "openai/",  # a prefix with nothing after it
        "/gpt-4o",  # an empty prefix
        "nope/gpt-4o",  # an unconfigured provider is not a prefix, and the whole name is unmapped
        "OpenAI/gpt-4o",  # provider names are case-sensitive
        "",
    ],
)
def test_unmapped_model_is_model_not_found(router: Router, model: str) -> None:
    with pytest.raises(ModelNotFound) as info:
        router.route(model)
    assert info.value.status == 404
    assert info.value.code == "model_not_found"
    assert info.value.message == (
        f"no provider serves model {model!r}; map it under `models:` or use provider/model"
    )


@pytest.mark.parametrize(
    ("models", "model", "provider_name"),
    [
        ({"gpt-*": "openai", "gpt-4*": "local"}, "gpt-4o", "openai"),  # overlapping globs: first listed
        ({"gpt-4*": "local", "gpt-*": "openai"}, "gpt-4o", "local"),
        ({"gpt-4*": "local", "gpt-*": "openai"}, "gpt-3.5", "openai"),
        ({"*": "local", "gpt-4o": "openai"}, "gpt-4o", "openai"),  # exact wins whatever the order
        ({"*": "local"}, "anything-at-all", "local"),
        ({"gpt-[!4]*": "local"}, "gpt-3.5", "local"),  # negated class
    ],
)
def test_glob_precedence(models: dict[str, str], model: str, provider_name: str) -> None:
    assert Router(config(models=models)).route(model).provider_name == provider_name


def test_prefix_beats_an_exact_entry_of_the_same_name() -> None:
    router = Router(config(models={"openai/gpt-4o": "local"}))
    assert router.route("openai/gpt-4o") == Route("openai", config().providers["openai"], "gpt-4o", True)


def test_no_models_table_only_prefixes_route() -> None:
    router = Router(config(models={}))
    assert router.route("local/x").provider_name == "local"
    with pytest.raises(ModelNotFound):
        router.route("gpt-4o")


def test_no_providers_nothing_routes() -> None:
    router = Router(config(providers={}, models={}))
    for model in ("gpt-4o", "openai/gpt-4o"):
        with pytest.raises(ModelNotFound):
            router.route(model)


def test_routes_are_cached_and_misses_are_not(router: Router) -> None:
    first = router.route("gpt-4o-mini")
    assert router.route("gpt-4o-mini") is first
    assert router.route("openai/gpt-4o-mini") is not first
    for _ in range(2):  # a miss raises every time, it is never cached as a route
        with pytest.raises(ModelNotFound):
            router.route("mistral-large")


def test_cache_is_bounded_and_routing_stays_correct() -> None:
    router = Router(config(models={"*": "local"}))
    for i in range(5000):
        router.route(f"model-{i}")
    assert len(router._cache) == 4096
    assert router.route("model-4999") == Route("local", config().providers["local"], "model-4999", False)


@pytest.mark.parametrize(
    ("providers", "provider_type", "expected"),
    [
        (PROVIDERS, "openai", "openai"),  # the first provider of that type
        (PROVIDERS, "anthropic", "anthropic"),
        ({"local": PROVIDERS["local"], "openai": PROVIDERS["openai"]}, "openai", "local"),
        ({"local": PROVIDERS["local"]}, "anthropic", None),
        ({}, "openai", None),
        (PROVIDERS, "outlines", None),
    ],
)
def test_default_for(providers: dict[str, dict[str, Any]], provider_type: str, expected: str | None) -> None:
    cfg = config(providers=providers, models={})
    route = Router(cfg).default_for(provider_type)
    if expected is None:
        assert route is None
    else:
        assert route == Route(expected, cfg.providers[expected], "", False)
