"""Configuration: YAML parsed once into frozen, typed objects.

`load_config(path)` reads the file, substitutes `${VAR}` / `${VAR:-default}` in string values, and
validates everything with pydantic. Unknown keys, wrong types and dangling references are errors; each
error names its key path (`agents.bot.budget.usd`). Nothing is read from the environment after load.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.config_env import substitute
from gateway.config_urls import header_value, headers_map, http_url, redis_url
from gateway.config_yaml import read_yaml
from gateway.errors import ConfigError


def _not_a_bool(value: Any) -> Any:
    # YAML's `true` is not a count or an amount (pydantic would read it as 1)
    if isinstance(value, bool):
        raise ValueError("a number is expected, not true or false")  # noqa: TRY004 - pydantic wants ValueError
    return value


_Number = BeforeValidator(_not_a_bool)
# finite only: `.inf` as a budget or a price passes every comparison and breaks the arithmetic later
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False), _Number]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False), _Number]
PosInt = Annotated[int, Field(gt=0), _Number]
Port = Annotated[int, Field(ge=0, le=65535), _Number]

Dialect = Literal["openai", "vllm", "vllm-legacy", "llamacpp", "ollama", "sglang", "none"]
Tier = Literal["read", "write", "dangerous"]
_M = TypeVar("_M", bound=BaseModel)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Listen(Frozen):
    host: str = "127.0.0.1"
    port: Port = 8080


class Admin(Frozen):
    host: str = "127.0.0.1"
    port: Port = 9464
    token: str | None = None  # when set, admin endpoints other than /healthz require `Bearer <token>`

    @field_validator("token")
    @classmethod
    def _check_token(cls, value: str | None) -> str | None:
        # an empty token (`${ADMIN_TOKEN:-}` with the variable unset) would leave the admin API open
        # without a word; a presented token is read without surrounding blanks, so one with them locks all out
        if value is not None and not value:
            raise ValueError("is empty: set a token, or leave `token` out for an admin API without one")
        if value is not None and value != value.strip():
            raise ValueError("has leading or trailing blanks, which a presented token never has")
        return value


class Timeouts(Frozen):
    """Seconds. There is deliberately no total timeout: it would cut long healthy streams."""

    connect: PosFloat = 10
    first_byte: PosFloat = 120
    idle: PosFloat = 60


LOCAL_URL = "local://outlines"
"""`base_url` of an in-process provider: not a network address (aiohttp refuses the scheme at once)."""


class Provider(Frozen):
    """An upstream. `type` is the wire protocol tollgate speaks to it. `type: outlines` in YAML is an
    OpenAI-wire provider served in-process (`engine: outlines`, gateway/local.py): it needs `model`
    (a saved transformers model directory with its tokenizer) and takes no `base_url`."""

    type: Literal["openai", "anthropic"]
    base_url: str
    api_key: str | None = None
    passthrough_auth: bool = False
    structured_outputs: Dialect | None = None  # default: openai for type openai, none for anthropic
    timeouts: Timeouts = Timeouts()
    max_output_tokens: PosInt = 32768  # output limit used when a model's own limit is unknown
    engine: Literal["http", "outlines"] = "http"  # set by `type: outlines`, never written by hand
    model: str | None = None  # outlines: model directory, relative to the config file
    device: str = "cpu"  # outlines: torch device
    max_new_tokens: PosInt = 512  # outlines: tokens generated when the request sets no max_tokens

    @model_validator(mode="before")
    @classmethod
    def _outlines(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "engine" in data:
            raise ValueError("engine: unknown key (write type: outlines for a local model)")
        if data.get("type") != "outlines":
            return data
        if "base_url" in data:
            raise ValueError("base_url: type outlines runs the model in-process and takes no base_url")
        return {**data, "type": "openai", "engine": "outlines", "base_url": LOCAL_URL}

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        # a field validator, so the error names `providers.<name>.base_url`
        if value == LOCAL_URL:
            return value
        return http_url(value, base=True, credentials="set api_key")

    @field_validator("api_key")
    @classmethod
    def _check_key(cls, value: str | None) -> str | None:
        # sent in a header: a line break (a key read from a file or secret with its newline) would make
        # every call a 400 that blames the client
        return value if value is None else header_value(value)

    @property
    def dialect(self) -> Dialect:
        if self.structured_outputs is not None:
            return self.structured_outputs
        if self.engine == "outlines":
            return "vllm"
        return "openai" if self.type == "openai" else "none"


class McpServer(Frozen):
    url: str
    # names checked first (`headers_map`), so a value's error names `mcp_servers.<name>.headers.<header>`
    headers: dict[str, Annotated[str, AfterValidator(header_value)]] = {}
    timeouts: Timeouts = Timeouts()

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return http_url(value, base=False, credentials="put an Authorization header in headers")

    @field_validator("headers", mode="before")
    @classmethod
    def _check_headers(cls, value: Any) -> Any:
        return headers_map(value)


class Price(Frozen):
    input_per_mtok: NonNegFloat
    output_per_mtok: NonNegFloat
    max_output_tokens: PosInt | None = None
    # USD per 1,000 searches the provider runs and bills apart; unset: genai-prices' fee for the model
    web_search_per_k: NonNegFloat | None = None
    file_search_per_k: NonNegFloat | None = None


class StateFile(Frozen):  # the keys of `state` that name the state file (by default the ledger's too)
    backend: Literal["memory", "sqlite", "redis"] = "sqlite"
    path: str = "tollgate.db"


class State(StateFile):
    url: str | None = None
    run_ttl_s: PosInt = 7 * 24 * 3600  # finished runs expire after this (redis)
    # redis: a reservation older than this is charged in full (the process that made it is presumed dead)
    reservation_lease_s: PosInt = 3600

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        # what redis-py's from_url takes and the store can use; checked here so the error names
        # `state.url`, not a failed start or a failed call
        return value if value is None else redis_url(value)

    @model_validator(mode="after")
    def _check_url(self) -> State:
        if self.backend == "redis" and not self.url:
            raise ValueError("backend redis needs url (redis://host:port/db)")
        return self


class Budget(Frozen):
    usd: PosFloat | None = None
    tokens: PosInt | None = None


class Caps(Frozen):
    llm_calls: PosInt | None = None
    tool_calls: PosInt | None = None
    seconds: PosFloat | None = None


class Loop(Frozen):
    window: PosInt = 6
    max_distinct: PosInt = 3
    stall_steps: PosInt | None = None

    @model_validator(mode="after")
    def _check(self) -> Loop:
        if self.max_distinct >= self.window:
            raise ValueError("max_distinct must be smaller than window")
        return self


class Tools(Frozen):
    allow: tuple[str, ...] | None = None  # None: every tool allowed; a list: deny by default
    on_violation: Literal["reject", "drop"] = "reject"
    approval: tuple[str, ...] = ()
    tiers: dict[str, Tier] = {}
    approval_timeout_s: PosFloat = 300


class Output(Frozen):
    grammar: str | None = None
    retries: Annotated[int, Field(ge=0, le=10), _Number] = 2
    stream_check: Literal["incremental", "buffer"] = "incremental"


class GuardSpec(Frozen):
    """A custom guard: a registered name (entry point group `tollgate.guards`) or `module:Class`."""

    use: str
    options: dict[str, Any] = {}
    on_error: Literal["fail_closed", "fail_open"] = "fail_closed"


class Agent(Frozen):
    keys: tuple[str, ...] = ()
    budget: Budget = Budget()
    caps: Caps = Caps()
    loop: Loop | None = None
    tools: Tools = Tools()
    output: Output = Output()
    on_stop: Literal["error", "message"] = "error"
    guards: tuple[GuardSpec, ...] = ()
    state_failure: Literal["fail_closed", "fail_open"] = "fail_closed"


class Limits(Frozen):
    max_body_bytes: PosInt = 32 * 1024 * 1024
    # an upstream answer tollgate reads whole (a non-streamed model answer, a forwarded error body, a
    # model list): more is a 502 upstream_unavailable, so a runaway upstream cannot exhaust memory
    max_answer_bytes: PosInt = 64 * 1024 * 1024
    max_json_depth: PosInt = 64
    max_messages: PosInt = 10_000
    max_tools: PosInt = 512
    # a schema or grammar a request brings (`response_format`, `guided_*`, `x-tollgate-grammar`, a tool's
    # parameters), as JSON or grammar text, the tools' together and the output constraints' together:
    # compiling costs 3-9 s of CPU per MB (jsonschema's check, llguidance) on the worker threads every
    # request shares; more is a 400
    max_schema_bytes: PosInt = 256 * 1024
    max_header_bytes: PosInt = 16 * 1024
    max_headers: PosInt = 128
    # a request body with no byte for this long: 408 request_timeout; a connection with no request under
    # way (idle between requests, or its request head unfinished) this long: closed
    body_idle_s: PosFloat = 30


class Grammars(Frozen):
    dir: str = "grammars"


class Ledger(Frozen):
    path: str | None = None  # default: the state file (sqlite) or ./tollgate-ledger.db


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"not a regular expression: {exc}") from None
    return value


def _agent_name(value: str) -> str:
    # what `x-tollgate-agent` can name (gateway.identity): an agent no header can select would be
    # unreachable without agent keys, and its name is a label of every metric and span
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", value):
        raise ValueError(f"agent name {value!r} must be 1-64 of A-Z a-z 0-9 . _ -")
    return value


class Otel(Frozen):
    capture_content: bool = False
    # extra regexes whose matches are replaced before a span leaves; compiled here so that a bad one is
    # an error naming its key, not a failed start
    redact: tuple[Annotated[str, AfterValidator(_regex)], ...] = ()
    run_idle_s: PosFloat = 300  # a run with no step for this long ends: its root span is exported


class Config(Frozen):
    listen: Listen = Listen()
    admin: Admin = Admin()
    providers: dict[str, Provider] = {}
    models: dict[str, str] = {}
    mcp_servers: dict[str, McpServer] = {}
    pricing: dict[str, Price] = {}
    state: State = State()
    agents: dict[Annotated[str, AfterValidator(_agent_name)], Agent] = {}
    limits: Limits = Limits()
    grammars: Grammars = Grammars()
    ledger: Ledger = Ledger()
    otel: Otel = Otel()
    shutdown_grace_s: NonNegFloat = 30
    base_dir: str = "."  # directory of the config file; relative paths resolve against it

    @model_validator(mode="after")
    def _references(self) -> Config:
        for name, prov in self.providers.items():
            if (prov.engine == "outlines") != (prov.model is not None):
                message = ("type outlines needs model (a saved transformers model directory)"
                           if prov.engine == "outlines" else "only type outlines takes model")
                raise _Dangling(f"providers.{name}.model", message)
            if prov.type == "anthropic" and prov.dialect != "none":
                # the Messages API has no structured-output field of these dialects: answers are validated
                raise _Dangling(f"providers.{name}.structured_outputs", "type anthropic takes none")
            if prov.engine == "outlines" and prov.dialect not in ("vllm", "vllm-legacy"):
                # the local transport reads vLLM's fields: another dialect would generate unconstrained
                raise _Dangling(f"providers.{name}.structured_outputs", "type outlines takes vllm or vllm-legacy")
        for pattern, provider in self.models.items():
            if provider not in self.providers:
                raise _Dangling(f"models.{pattern}", f"provider {provider!r} is not defined in providers")
        seen: dict[str, str] = {}
        provider_keys = {prov.api_key for prov in self.providers.values() if prov.api_key}
        for name, agent in self.agents.items():
            for index, key in enumerate(agent.keys):
                where = f"agents.{name}.keys.{index}"
                if key in seen:
                    raise _Dangling(where, f"key already used by agent {seen[key]!r}")
                if not key:
                    raise _Dangling(where, "key is empty")
                if key != key.strip():  # a presented key is read without surrounding blanks: never matched
                    raise _Dangling(where, "key has leading or trailing blanks")
                if key in provider_keys:  # the agent would hold what tollgate keeps from it
                    raise _Dangling(where, "key is a provider's api_key; agents need keys of their own")
                seen[key] = name
            for index, pattern in enumerate(agent.tools.approval):
                if agent.tools.allow is not None and not _any_match(pattern, agent.tools.allow):
                    raise _Dangling(
                        f"agents.{name}.tools.approval.{index}", "tools in approval must also be allowed"
                    )
        return self

    def resolve(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p

    @property
    def ledger_file(self) -> Path:
        """The ledger's file: `ledger.path`, else the SQLite state file, else `tollgate-ledger.db`."""
        return _LedgerWhere(ledger=self.ledger, state=self.state).file(self.base_dir)

    @property
    def keyed(self) -> bool:
        return any(agent.keys for agent in self.agents.values())


class _LedgerWhere(Frozen):  # the keys of a config that decide its ledger's file
    ledger: Ledger = Ledger()
    state: StateFile = StateFile()

    def file(self, base_dir: str) -> Path:
        """`ledger.path`, else the SQLite state file, else `tollgate-ledger.db`, relative to `base_dir`."""
        default = self.state.path if self.state.backend == "sqlite" else "tollgate-ledger.db"
        return Path(base_dir) / (self.ledger.path or default)  # an absolute path stays itself


class _Dangling(ValueError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


def _any_match(pattern: str, allow: tuple[str, ...]) -> bool:
    from fnmatch import fnmatchcase

    return any(pattern == a or fnmatchcase(pattern, a) for a in allow)


def parse_config(data: Any, env: Mapping[str, str] | None = None, base_dir: str = ".") -> Config:
    """Validate an already-parsed YAML tree. Raises ConfigError listing (key path, message) pairs."""
    return _validated(Config, data, env, base_dir=base_dir)


def _validated(model: type[_M], data: Any, env: Mapping[str, str] | None, base_dir: str | None = None) -> _M:
    """`model` of a parsed YAML tree, `${VAR}`s substituted. Raises ConfigError of (key path, message)s."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("<root>", "the config must be a mapping")])
    try:
        data = substitute(data, os.environ if env is None else env)
        if "base_dir" in data:  # set from where the file is, never by the file itself
            raise ConfigError([("base_dir", "unknown key")])
        return model.model_validate(data if base_dir is None else {**data, "base_dir": base_dir})
    except RecursionError:
        raise ConfigError([("<root>", "the config nests too deeply")]) from None
    except ValidationError as exc:
        problems: list[tuple[str, str]] = []
        for err in exc.errors():
            ctx = err.get("ctx") or {}
            inner = ctx.get("error")
            if isinstance(inner, _Dangling):
                problems.append((inner.path, str(inner)))
                continue
            loc = ".".join(str(p) for p in err["loc"]) or "<root>"
            # `msg` only: str(exc) and err["input"] carry the offending value, which may be a literal key
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                message = "unknown key"
            problems.append((loc, message))
        raise ConfigError(problems) from None


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a YAML config file."""
    p = Path(path)
    return parse_config(read_yaml(p), env, base_dir=str(p.resolve().parent))


def ledger_file_of(path: str | Path, env: Mapping[str, str] | None = None) -> Path:
    """`Config.ledger_file` of the config file `path`, from the only keys that decide it: `ledger.path`,
    `state.backend` and `state.path` (their `${VAR}`s are substituted and need their variables). The rest
    of the file is neither substituted nor validated (`load_config` does both), so a shell without the
    provider keys a config references finds its ledger. Raises ConfigError naming the key path."""
    p = Path(path)
    data = read_yaml(p)
    if isinstance(data, dict):  # a section that is not a mapping is validated as given: its error names it
        data = {section: {k: value[k] for k in keys if k in value} if isinstance(value, dict) else value
                for section, keys in (("ledger", ("path",)), ("state", ("backend", "path")))
                if (value := data.get(section)) is not None}
    return _validated(_LedgerWhere, data, env).file(str(p.resolve().parent))


# OpenAI's model families the embedded default serves: chat, and the other paths' (embeddings, audio,
# images, moderation), fine-tunes (`ft:`) included
OPENAI_MODELS = ("gpt-*", "o1*", "o3*", "o4*", "chatgpt-*", "codex-*", "computer-use-*", "text-embedding-*",
                 "whisper-*", "tts-*", "dall-e-*", "omni-moderation-*", "text-moderation-*", "ft:*")


def default_config(env: Mapping[str, str] | None = None) -> Config:
    """The embedded default: SQLite state in the working directory, providers from the environment."""
    env = os.environ if env is None else env
    providers: dict[str, Any] = {}
    models: dict[str, str] = {}
    if env.get("OPENAI_API_KEY"):
        providers["openai"] = {
            "type": "openai",
            "base_url": env.get("OPENAI_BASE_URL_UPSTREAM", "https://api.openai.com/v1"),
            "api_key": env["OPENAI_API_KEY"],
        }
        models.update(dict.fromkeys(OPENAI_MODELS, "openai"))
    if env.get("ANTHROPIC_API_KEY"):
        providers["anthropic"] = {
            "type": "anthropic",
            "base_url": env.get("ANTHROPIC_BASE_URL_UPSTREAM", "https://api.anthropic.com"),
            "api_key": env["ANTHROPIC_API_KEY"],
        }
        models["claude-*"] = "anthropic"
    try:
        return parse_config({"providers": providers, "models": models}, env)
    except ConfigError as exc:  # the user wrote no key: name the variable that set it
        raise ConfigError([(_FROM_ENV.get(path, path), message) for path, message in exc.problems]) from None


_FROM_ENV: Final = {  # the keys of the embedded default an environment variable sets
    "providers.openai.base_url": "OPENAI_BASE_URL_UPSTREAM (providers.openai.base_url)",
    "providers.openai.api_key": "OPENAI_API_KEY (providers.openai.api_key)",
    "providers.anthropic.base_url": "ANTHROPIC_BASE_URL_UPSTREAM (providers.anthropic.base_url)",
    "providers.anthropic.api_key": "ANTHROPIC_API_KEY (providers.anthropic.api_key)",
}
