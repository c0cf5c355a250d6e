"""Model routing: `provider/model` prefix, else exact names, else globs of the `models:` table (pure).

Only configured providers can be reached: nothing in a request can choose an upstream URL.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from gateway.config import Config, Provider
from gateway.errors import ModelNotFound
from gateway.frozen_init import fast_init


@fast_init
@dataclass(frozen=True, slots=True)
class Route:
    provider_name: str
    provider: Provider
    model: str  # the name sent upstream (prefix stripped)
    prefixed: bool  # the agent sent `provider/model`


class Router:
    def __init__(self, config: Config) -> None:
        self._providers = config.providers
        self._exact = {k: v for k, v in config.models.items() if not any(c in k for c in "*?[")}
        self._globs = [(k, v) for k, v in config.models.items() if any(c in k for c in "*?[")]
        self._cache: dict[str, Route] = {}

    def route(self, model: str) -> Route:
        cached = self._cache.get(model)
        if cached is not None:
            return cached
        route = self._resolve(model)
        if len(self._cache) < 4096:
            self._cache[model] = route
        return route

    def _resolve(self, model: str) -> Route:
        prefix, sep, rest = model.partition("/")
        if sep and prefix in self._providers and rest:
            return Route(prefix, self._providers[prefix], rest, True)
        name = self._exact.get(model)
        if name is None:
            name = next((p for g, p in self._globs if fnmatchcase(model, g)), None)
        if name is None:
            raise ModelNotFound(f"no provider serves model {model!r}; map it under `models:` or use provider/model")
        return Route(name, self._providers[name], model, False)

    def find(self, model: str) -> Route | None:
        """`route`, or None for a model no provider serves."""
        try:
            return self.route(model)
        except ModelNotFound:
            return None

    def default_for(self, provider_type: str) -> Route | None:
        """The first provider of that wire type reached over HTTP (an in-process model serves Chat
        Completions only): where a forwarded call that names no model goes."""
        for name, provider in self._providers.items():
            if provider.type == provider_type and provider.engine == "http":
                return Route(name, provider, "", False)
        return None
