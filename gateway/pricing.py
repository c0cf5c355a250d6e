"""Model prices: `genai-prices` data, overridden per model glob by the config's `pricing:` table.

Lookups go through genai-prices once per (provider, model) and are cached; costs are then computed
here from the cached per-token rates, because a full genai-prices calculation costs ~250 µs, too much
for every step. Tiered prices (long-context surcharges) pick the tier by the step's input tokens;
reservations use the highest tier so that the worst case is never under-reserved.

OpenAI's service tiers (`priority`, `flex`) bill other token rates. A price from genai-prices carries the
rates of every tier it lists (`ModelPrice.service_tiers`, read once with the model); a reservation is
priced at the tier the request asks for (`reserved_tier`), a settlement at the tier the answer reports
(`ModelPrice.at_tier`). A `pricing:` entry has one rate, kept for every tier and for audio tokens.

Anthropic's fast mode (`speed: "fast"`) is priced the same way, as a tier named `fast`: genai-prices lists
it as a price variant of the `speed` context (`_TIER_CONTEXTS`), the Anthropic adapter reports the speed a
request asks for as its tier and the speed its answer's `usage.speed` reports as the answer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Any, TypeVar

from gateway.call import Usage
from gateway.config import Price
from gateway.frozen_init import fast_init

_MTOK = 1_000_000

OPENAI_PREVIEW_SEARCH_FEE = 25.0 / 1000
"""USD OpenAI bills per search of the Responses API's `web_search_preview` tool on a model that does not
reason (gpt-4o, gpt-4.1, ...), and per call of a Chat Completions search model that does not reason
(`*-search-preview`), which searches on every call. OpenAI's price list; genai-prices gives every model the
`web_search` tool's $10 per 1,000 and the search models no fee at all."""
OPENAI_WEB_SEARCH_FEE = 10.0 / 1000
"""USD OpenAI bills per search of its `web_search` tool on any model, of `web_search_preview` on a reasoning
model, and per call of a reasoning search model (`gpt-5-search-api`): the floor of a fee genai-prices gives
as 0 (o1, o3-mini, gpt-4.1-nano, ...)."""

STANDARD_TIER = "default"
"""The service tier an answer reports when it was billed at the standard rates."""
_STANDARD_REQUESTS = frozenset({"", "auto", "default", "scale"})
"""Tiers a request may ask for that a reservation is priced at the standard rates: `auto` bills the
project's default tier, which tollgate cannot see, and reserving every such call at the dearest tier
(priority, ~1.7x) would halve what a budget lets most agents do. A project whose default tier is priority
must send `service_tier: "priority"` (or configure prices): its answers are settled at the priority rate
they report, above what was reserved. Any other tier asked for (`priority`, `flex`, `fast`, a new name) is
reserved at its own rates when genai-prices lists them, else at the dearest tier it lists
(`ModelPrice.for_request`): a tier tollgate does not know may cost more, never silently less. A `flex`
request is reserved at the flex rate: OpenAI serves it at flex or refuses it (429), and a settlement
follows the tier the answer reports in any case."""
_TOKEN_RATES = ("input", "output", "cache_read", "cache_write", "cache_write_1h", "input_audio", "output_audio")
"""The `ModelPrice` fields a service tier sets (the search fees and the per-call fee do not change)."""


_STANDARD_ANSWERS = frozenset({"default", "standard", "scale", "auto", "", "flex", "batch"})
"""Tiers an answer may report that bill the standard rates or less (Anthropic reports `usage.speed:
"standard"`; `flex` and `batch` are discounts): settled at the standard rates when the model lists none."""


def _dearest(tiers: dict[str, ModelPrice]) -> str:
    """The listed tier with the highest output rate (then input rate)."""
    return max(tiers, key=lambda name: (tiers[name].output.base, tiers[name].input.base))


def reserved_tier(requested: str | None) -> str:
    """The service tier a request asking for `requested` is reserved at (`_STANDARD_REQUESTS`); a name
    genai-prices does not list is resolved by `ModelPrice.for_request`."""
    return STANDARD_TIER if requested is None or requested in _STANDARD_REQUESTS else requested


@fast_init
@dataclass(frozen=True, slots=True)
class Rate:
    """USD per token, with optional tiers `(start_input_tokens, usd_per_token)`."""

    base: float
    tiers: tuple[tuple[int, float], ...] = ()

    def at(self, input_tokens: int) -> float:
        rate = self.base
        for start, tier_rate in self.tiers:
            if input_tokens > start:
                rate = tier_rate
        return rate

    @property
    def worst(self) -> float:
        return max([self.base, *(r for _, r in self.tiers)])


@fast_init
@dataclass(frozen=True, slots=True)
class ModelPrice:
    input: Rate
    output: Rate
    cache_read: Rate | None = None
    cache_write: Rate | None = None
    max_output_tokens: int | None = None
    source: str = "genai-prices"
    cache_write_1h: Rate | None = None  # a cache written for an hour (Anthropic), when priced apart
    web_search: float = 0.0  # USD per web search the provider ran
    file_search: float = 0.0  # USD per file search the provider ran (OpenAI's file_search tool)
    per_call: float = 0.0  # USD every billed call pays whatever its usage (a search model's search)
    # audio tokens (part of the input and output counts), when priced apart (OpenAI's audio models); else
    # they cost what text tokens do, as genai-prices prices them
    input_audio: Rate | None = None
    output_audio: Rate | None = None
    service_tier: str = STANDARD_TIER  # the tier whose token rates these are
    # token rates of every service tier genai-prices lists, `STANDARD_TIER` included (each a price without
    # fees, only `_TOKEN_RATES` of it count); empty: one rate for every tier (a `pricing:` entry)
    service_tiers: tuple[tuple[str, ModelPrice], ...] = field(default=(), repr=False)

    @property
    def search_fee(self) -> float:
        """Highest fee one search the provider runs can cost (what a reservation holds per search)."""
        return max(self.web_search, self.file_search)

    @property
    def worst_input(self) -> float:
        """Highest price one input token can cost (a cache write can cost more than plain input, an audio
        token more than a text one). Audio input is always assumed possible: it arrives as `input_audio`
        parts, but also as an earlier spoken answer the request names by id, so the request does not tell
        reliably; and on an audio model most input that matters is audio."""
        return self.input_rate(_ANY_TOKENS)

    def input_rate(self, tokens: int, *, cache_writes: bool = True) -> float:
        """Highest price one input token of a request billing `tokens` input tokens can cost: at the tier
        that many tokens reach (long-context rates start past a threshold), an audio token's when the model
        has audio rates (always assumed possible, as for `worst_input`), and a cache write's only when the
        request may write the cache (`cache_writes`: Anthropic writes only where a `cache_control` marks it)."""
        rates: list[Rate | None] = [self.input, self.input_audio]
        if cache_writes:
            rates += [self.cache_write, self.cache_write_1h]
        return max(rate.at(tokens) for rate in rates if rate is not None)

    def worst_output(self, audio: bool) -> float:
        """Highest price one output token can cost; `audio`: the request lets the model speak (Chat
        Completions' `modalities` lists audio). A model speaks only when asked to, so a text-only request
        to an audio model is not reserved at the audio rate (~6x on gpt-audio)."""
        if audio and self.output_audio is not None:
            return max(self.output.worst, self.output_audio.worst)
        return self.output.worst

    def at_tier(self, tier: str | None) -> ModelPrice:
        """These prices at the service tier `tier` an answer reports. One the model's prices do not list is
        billed at the standard rates when it bills them or less (`_STANDARD_ANSWERS`), any other (a new
        name) at the dearest they list: a tier tollgate does not know may cost more, never
        silently less. None (the answer does not say) or prices without tiers (a `pricing:` entry, a model
        without tiers): unchanged."""
        if tier is None or not self.service_tiers or tier == self.service_tier:
            return self
        tiers = dict(self.service_tiers)
        name = tier if tier in tiers else STANDARD_TIER if tier in _STANDARD_ANSWERS else _dearest(tiers)
        rates = tiers.get(name)
        if rates is None or name == self.service_tier:
            return self
        return replace(self, service_tier=name, **{f: getattr(rates, f) for f in _TOKEN_RATES})

    def for_request(self, tier: str) -> ModelPrice:
        """These prices for a request asking for `tier` (`reserved_tier`): its rates when listed, the
        dearest listed tier's when not (a tier tollgate does not know may cost more, never less)."""
        if not self.service_tiers or tier == STANDARD_TIER:
            return self.at_tier(tier)
        tiers = dict(self.service_tiers)
        return self.at_tier(tier if tier in tiers else _dearest(tiers))

    def cost(self, usage: Usage) -> float:
        """USD for `usage` (input tokens include cached ones, as in semconv; input and output tokens include
        audio ones, priced at the audio rates when the model has them)."""
        n = usage.input_tokens
        cached = usage.cache_read_tokens if self.cache_read is not None else 0
        written = usage.cache_creation_tokens if self.cache_write is not None else 0
        plain = max(n - cached - written, 0)
        heard = min(usage.input_audio_tokens, plain) if self.input_audio is not None else 0
        out = usage.output_tokens
        spoken = min(usage.output_audio_tokens, out) if self.output_audio is not None else 0
        total = (plain - heard) * self.input.at(n) + (out - spoken) * self.output.at(n)
        if self.input_audio is not None:
            total += heard * self.input_audio.at(n)
        if self.output_audio is not None:
            total += spoken * self.output_audio.at(n)
        if self.cache_read is not None:
            total += cached * self.cache_read.at(n)
        if self.cache_write is not None:
            hour = min(usage.cache_write_1h_tokens, written) if self.cache_write_1h is not None else 0
            total += (written - hour) * self.cache_write.at(n)
            if self.cache_write_1h is not None:
                total += hour * self.cache_write_1h.at(n)
        searches = usage.web_search_requests * self.web_search + usage.file_search_requests * self.file_search
        return total + searches + self.per_call


def _rate(value: Any) -> Rate | None:
    if value is None:
        return None
    if isinstance(value, Decimal | int | float):
        return Rate(float(value) / _MTOK)
    base = getattr(value, "base", None)
    if base is None:
        return None
    tiers = tuple((int(t.start), float(t.price) / _MTOK) for t in getattr(value, "tiers", ()))
    return Rate(float(base) / _MTOK, tiers)


_ANY_TOKENS = 2**62  # past every tier's threshold
_UNLISTED = "*unlisted"
"""The cache's name for every service tier a model's prices do not list (all priced at its dearest)."""
CACHE_MAX = 4096
"""Prices a `Pricer` keeps at most per cache. Model names come from requests: a cache full of them is
emptied (each is looked up again when next asked for) rather than left to grow."""

K = TypeVar("K")


def _remember(cache: dict[K, ModelPrice | None], key: K, price: ModelPrice | None) -> None:
    if len(cache) >= CACHE_MAX:
        cache.clear()
    cache[key] = price


class Pricer:
    """Per-model prices. `lookup` returns None when neither config nor genai-prices knows the model."""

    def __init__(self, overrides: dict[str, Price]) -> None:
        self._overrides = overrides
        self._cache: dict[tuple[str, str, bool, bool, bool, str], ModelPrice | None] = {}
        self._genai_cache: dict[tuple[str, str, bool], ModelPrice | None] = {}  # genai-prices' answers

    def lookup(
        self,
        model: str,
        provider_type: str,
        *,
        searches: bool = False,
        output_billed: bool = True,
        preview_search: bool = False,
        service_tier: str | None = None,
    ) -> ModelPrice | None:
        """`searches`: the request offers a search tool the provider bills apart, so its fees matter.
        `output_billed=False`: the call bills input only (embeddings), so a model genai-prices lists with
        an input price alone is priced, its output at 0; a call that generates needs both prices.
        `preview_search`: it offers OpenAI's `web_search_preview`, dearer on a model that does not reason.
        `service_tier`: the tier the request asks for; the price is at `reserved_tier(service_tier)`, and
        `ModelPrice.at_tier` turns it into the price of the tier its answer reports."""
        standard = self._standard(model, provider_type, searches, output_billed, preview_search)
        tier = reserved_tier(service_tier)
        if standard is None or tier == STANDARD_TIER or not standard.service_tiers:
            return standard
        # a tier the model does not list is priced like any other it does not list (the dearest): the key
        # holds one of the listed names, never the caller's string, so no request can grow the cache
        name = tier if tier in dict(standard.service_tiers) else _UNLISTED
        key = (provider_type, model, searches, output_billed, preview_search, name)
        if key not in self._cache:
            _remember(self._cache, key, standard.for_request(tier))
        return self._cache[key]

    def _standard(self, model: str, provider_type: str, searches: bool, output_billed: bool,
                  preview_search: bool) -> ModelPrice | None:
        key = (provider_type, model, searches, output_billed, preview_search, STANDARD_TIER)
        if key not in self._cache:
            price = self._find(model, provider_type, searches, output_billed)
            if price is not None and provider_type == "openai" and self._openai_model(model, price, searches,
                                                                                      preview_search):
                price = _openai_search_fees(price, model, searches=searches, preview=preview_search,
                                            per_k=self._search_per_k(model))
            _remember(self._cache, key, price)
        return self._cache[key]

    def _override(self, model: str) -> Price | None:
        override = self._overrides.get(model)
        if override is None:
            override = next((p for g, p in self._overrides.items() if fnmatchcase(model, g)), None)
        return override

    def _openai_model(self, model: str, price: ModelPrice, searches: bool, preview: bool) -> bool:
        """OpenAI's own model, whose search fees apply (not a local model a config prices on an OpenAI-wire
        provider). genai-prices is asked only for a request whose fees depend on it."""
        if not (searches or preview or searches_every_call(model)):
            return False
        return price.source == "genai-prices" or self._genai(model, "openai") is not None

    def _genai(self, model: str, provider_type: str, output_billed: bool = True) -> ModelPrice | None:
        key = (model, provider_type, output_billed)
        if key not in self._genai_cache:
            _remember(self._genai_cache, key, _from_genai_prices(model, provider_type, output_billed))
        return self._genai_cache[key]

    def _search_per_k(self, model: str) -> float | None:
        override = self._override(model)
        return None if override is None else override.web_search_per_k

    def _find(self, model: str, provider_type: str, searches: bool, output_billed: bool) -> ModelPrice | None:
        override = self._override(model)
        if override is None:
            return self._genai(model, provider_type, output_billed)
        # an override of the token prices keeps the provider's search fees unless it sets its own; they
        # are looked up only for a request that can search (genai-prices takes ~0.4 s and ~20 MB to load,
        # which a gateway whose prices all come from its config otherwise never pays)
        unset = None in (override.web_search_per_k, override.file_search_per_k)
        known = self._genai(model, provider_type) if searches and unset else None
        return ModelPrice(
            Rate(override.input_per_mtok / _MTOK),
            Rate(override.output_per_mtok / _MTOK),
            max_output_tokens=override.max_output_tokens,
            source="config",
            web_search=_per_search(override.web_search_per_k, known.web_search if known else 0.0),
            file_search=_per_search(override.file_search_per_k, known.file_search if known else 0.0),
        )


def _per_search(per_k: float | None, known: float) -> float:
    return known if per_k is None else per_k / 1000


def reasons(model: str) -> bool:
    """An OpenAI reasoning model (the o-series, gpt-5 but its chat variants), whose `web_search_preview`
    searches cost what `web_search` ones do. Any other name counts as one that does not reason: the dearer
    fee, so an unknown model is never under-reserved."""
    name = model.rsplit("/", 1)[-1].lower()
    return name.startswith(("o1", "o3", "o4", "gpt-5")) and "chat" not in name


def searches_every_call(model: str) -> bool:
    """A Chat Completions search model (`gpt-4o-search-preview`, `gpt-4o-mini-search-preview-2025-03-11`,
    `gpt-5-search-api`)."""
    name = model.rsplit("/", 1)[-1].lower()
    return "-search-preview" in name or "-search-api" in name


def _openai_search_fees(
    price: ModelPrice, model: str, *, searches: bool, preview: bool, per_k: float | None
) -> ModelPrice:
    """OpenAI's fees genai-prices lacks or gives as 0: a search model's search on every call (one: its
    answer does not say how many it ran), `web_search_preview`'s dearer fee on a model that does not
    reason, and the `web_search` fee as a floor wherever the request offers a search tool. A `pricing:`
    entry's `web_search_per_k` sets them all."""
    if per_k is not None:  # the configured fee is the fee (`_find` set `web_search` from it)
        return replace(price, per_call=per_k / 1000) if searches_every_call(model) else price
    fee = OPENAI_WEB_SEARCH_FEE if reasons(model) else OPENAI_PREVIEW_SEARCH_FEE
    if searches_every_call(model):
        price = replace(price, per_call=fee)
    if preview:
        price = replace(price, web_search=max(price.web_search, fee))
    elif searches:
        price = replace(price, web_search=max(price.web_search, OPENAI_WEB_SEARCH_FEE))
    return price


def _from_genai_prices(model: str, provider_type: str, output_billed: bool = True) -> ModelPrice | None:
    from genai_prices import Usage as GPUsage
    from genai_prices import calc_price

    try:
        calc = calc_price(GPUsage(input_tokens=1, output_tokens=1), model_ref=model, provider_id=provider_type)
    except LookupError:
        return None
    mp = calc.model_price
    price = _token_prices(mp, output_billed)
    if price is None:
        return None
    # the tiers are read with the model, once: `calc_price` per tier here, never per step
    tiers = {STANDARD_TIER: price}
    for name, context in _listed_tiers(calc.model):
        tiered = calc_price(GPUsage(input_tokens=1, output_tokens=1), model_ref=model, provider_id=provider_type,
                            price_context={context: name})
        tiers[name] = _token_prices(tiered.model_price, output_billed) or price
    return replace(price, web_search=float(getattr(mp, "web_searches_kcount", None) or 0) / 1000,
                   file_search=float(getattr(mp, "storage_searches_kcount", None) or 0) / 1000,
                   service_tiers=tuple(tiers.items()) if len(tiers) > 1 else ())


_TIER_CONTEXTS = ("service_tier", "speed")
"""The genai-prices price contexts whose variants are tiers here: OpenAI's `service_tier` (priority, flex,
fast) and Anthropic's `speed` (fast). A name is one tier whichever context lists it: no model lists the
same name in both (genai-prices 0.2.3), and were one to, the `service_tier` variant would be kept."""


def _listed_tiers(model_info: Any) -> tuple[tuple[str, str], ...]:
    """(name, context) of each tier genai-prices prices apart for a model: its variants that depend on one
    of `_TIER_CONTEXTS` alone, sorted by name."""
    found: dict[str, str] = {}
    variants = getattr(model_info, "price_variants", None) or ()
    for context in _TIER_CONTEXTS:
        for variant in variants:
            if set(variant.when) == {context} and variant.when[context] != STANDARD_TIER:
                found.setdefault(variant.when[context], context)
    return tuple(sorted(found.items()))


def _token_prices(mp: Any, output_billed: bool) -> ModelPrice | None:
    """The token rates of a genai-prices `ModelPrice` (None without an input, or a billed output, price)."""
    input_rate, output_rate = _rate(mp.input_mtok), _rate(mp.output_mtok)
    if output_rate is None and not output_billed:
        output_rate = Rate(0.0)
    if input_rate is None or output_rate is None:
        return None
    return ModelPrice(input_rate, output_rate, _rate(mp.cache_read_mtok), _rate(mp.cache_write_mtok),
                      cache_write_1h=_rate(getattr(mp, "cache_write_1h_mtok", None)),
                      input_audio=_rate(getattr(mp, "input_audio_mtok", None)),
                      output_audio=_rate(getattr(mp, "output_audio_mtok", None)))
