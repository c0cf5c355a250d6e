"""A local transformers model served in-process through outlines (provider `type: outlines`).

`OutlinesTransport` is a `Transport` that answers OpenAI chat-completions wire bytes (gateway/local_wire.py):
JSON, or SSE when the body says `"stream": true` (a usage chunk too when asked for). The constraint
comes from the body (`structured_outputs`, else `guided_*`, else `response_format`; the pipeline puts
the step's first constraint in `structured_outputs`) and outlines' llguidance processor applies it to
the logits, so a finished answer is always in the constraint's language. What llguidance cannot
enforce exactly (a schema keyword it lacks) is a 400, never an unconstrained generation. JSON comes
out compact. Generation runs in a worker thread, one at a time per model, so the event loop never
waits on torch. torch, transformers and outlines are imported by `load` only.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

from gateway.config import Provider, Timeouts
from gateway.errors import (
    ConfigError,
    GatewayError,
    InvalidGrammar,
    InvalidRequest,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.http1_wire import Sending
from gateway.local_wire import Job, LocalResponse, Result, answer_body, outcome, parse_request
from grammars import engine
from grammars.spec import ConstraintSpec

_GRAMMAR_CACHE = 128
_JSON_OPTIONS: Any = {"whitespace_flexible": False}  # a weak model would spend its tokens on whitespace


class OutlinesTransport:
    """A `Transport` over one local model; build it with `load`. `open` ignores method, URL, headers."""

    def __init__(self, provider: Provider, modules: dict[str, Any], model: Any, tokenizer: Any) -> None:
        self._provider, self._m, self._model, self._tokenizer = provider, modules, model, tokenizer
        self._llg_tokenizer = modules["LLGuidanceBackend"](model).llg_tokenizer
        self._context: int | None = getattr(model.model.config, "max_position_embeddings", None)
        self._lock = asyncio.Lock()  # one generation at a time per model
        self._grammars: dict[str, str | InvalidGrammar] = {}  # only touched under the lock

    @classmethod
    def load(cls, provider: Provider, *, name: str, model_dir: Path) -> OutlinesTransport:
        """Import the `local` extra, load the model directory and warm up (blocking: seconds). Raises
        ConfigError naming `providers.<name>.<key>` when the extra is missing or the model won't load."""
        try:
            import outlines
            import torch
            import transformers
            from jinja2 import TemplateError
            from outlines.backends.llguidance import LLGuidanceBackend, LLGuidanceLogitsProcessor
        except ImportError as exc:
            hint = f"type outlines needs the local extra: pip install 'tollgate[local]' (no module {exc.name})"
            raise ConfigError([(f"providers.{name}.type", hint)]) from None
        if not model_dir.is_dir():
            raise ConfigError([(f"providers.{name}.model", f"no model directory at {model_dir}")])
        transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        try:
            tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            hf_model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError([(f"providers.{name}.model", f"cannot load {model_dir}: {exc}")]) from None
        if tokenizer.eos_token_id is None:
            raise ConfigError([(f"providers.{name}.model", "the tokenizer has no eos_token")])
        try:
            hf_model = hf_model.to(provider.device).eval()
        except (RuntimeError, AssertionError) as exc:  # torch: unknown device, or built without it
            raise ConfigError([(f"providers.{name}.device", str(exc))]) from None
        modules = {"torch": torch, "transformers": transformers, "LLGuidanceBackend": LLGuidanceBackend,
                   "LLGuidanceLogitsProcessor": LLGuidanceLogitsProcessor, "TemplateError": TemplateError}
        transport = cls(provider, modules, outlines.from_transformers(hf_model, tokenizer), tokenizer)
        with warnings.catch_warnings():  # torch deprecations while llguidance's mask kernel compiles
            warnings.simplefilter("ignore", DeprecationWarning)
            job = Job("", [{"role": "user", "content": "hi"}], ConstraintSpec("regex", "[0-9]"), max_new=1)
            transport._run(job, _Gate(threading.Event()), lambda error: None, lambda text: None)
        return transport

    async def open(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeouts: Timeouts,
        sending: Sending | None = None,
    ) -> LocalResponse:
        """Answer a chat-completions body. Raises InvalidRequest (400) for what the local model cannot
        honour; UpstreamTimeout when the answer (or, streaming, its start) takes over `first_byte`;
        UpstreamUnavailable (502) when the worker thread failed. `sending.started` (and an error's
        `request_sent`) stays False until the model begins to read the prompt: a call that waited for
        the lock, or was refused, and ended there generated nothing and is charged nothing."""
        job = parse_request(body)
        if sending is not None:
            sending.started = False
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[GatewayError | None] = loop.create_future()
        out = LocalResponse(job, idle=timeouts.idle)
        gate = _Gate(out.cancel)

        def on_ready(error: GatewayError | None) -> None:
            loop.call_soon_threadsafe(_settle, ready, error)

        def on_text(delta: str) -> None:
            loop.call_soon_threadsafe(out.queue.put_nowait, delta)

        def on_done(_: object) -> None:  # after every callback the thread scheduled
            self._lock.release()
            _settle(ready, None)  # when the thread failed early or was abandoned: `outcome` reports it
            out.queue.put_nowait(None)

        try:
            async with asyncio.timeout(timeouts.first_byte):
                await self._lock.acquire()
                task = asyncio.ensure_future(asyncio.to_thread(self._run, job, gate, on_ready, on_text))
                task.add_done_callback(on_done)
                error = await asyncio.shield(ready)
                if error is not None:
                    raise error
                if not gate.begun:  # the thread raised while preparing (a tokenizer's bug): nothing ran
                    await asyncio.wait([task])
                    outcome(task, sent=False)  # raises: a prepared job begins or is refused
                if sending is not None:
                    sending.started = gate.begun
                if job.stream:  # even when already done: the deltas and the end are on the queue
                    out.task = task
                    return out
                await asyncio.wait([task])  # `outcome` maps what the thread raised
        except (TimeoutError, asyncio.CancelledError) as exc:
            begun = gate.abandon()
            if sending is not None:
                sending.started = begun
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise UpstreamTimeout(f"local model did not answer within {timeouts.first_byte:g}s", sent=begun) from None
        out.body = answer_body(job, outcome(task))
        return out

    def _grammar(self, spec: ConstraintSpec) -> str:
        """The llguidance grammar of `spec`, checked against the model's tokenizer (cached by content).
        Raises InvalidGrammar when llguidance cannot enforce it exactly."""
        cached = self._grammars.get(spec.key)
        if cached is None:
            if len(self._grammars) >= _GRAMMAR_CACHE:
                self._grammars.pop(next(iter(self._grammars)))
            cached = self._grammars[spec.key] = _compile(spec, self._llg_tokenizer)
        if isinstance(cached, InvalidGrammar):
            raise InvalidGrammar(cached.message)
        return cached

    def _run(self, job: Job, gate: _Gate, on_ready: Callable[[GatewayError | None], None],
             on_text: Callable[[str], None]) -> Result | None:
        """Worker thread, under the lock: prepare (then `on_ready`), generate, stream text to `on_text`.
        None when refused (`on_ready` had the error) or abandoned before the model began."""
        try:
            grammar, ids, room = self._prepare(job)
        except GatewayError as exc:
            on_ready(exc)
            return None
        except self._m["TemplateError"] as exc:  # the template's `raise_exception`: a refusal of the messages
            on_ready(_refused_by_template(exc))
            return None
        if not gate.begin():
            return None  # the caller left, or timed out, while it waited
        on_ready(None)
        torch, tf, tok = self._m["torch"], self._m["transformers"], self._tokenizer
        n_prompt = int(ids.shape[1])
        max_new = min(job.max_new or self._provider.max_new_tokens, room or 1 << 30)
        eos = tok.eos_token_id
        # a fresh config: the model's defaults (min_length, penalties, ...) could fight the mask
        config = tf.GenerationConfig(max_new_tokens=max_new, eos_token_id=eos, bos_token_id=tok.bos_token_id,
                                     stop_strings=list(job.stop) or None,
                                     pad_token_id=eos if tok.pad_token_id is None else tok.pad_token_id, **job.sampling)
        processors = tf.LogitsProcessorList()
        if grammar is not None:
            processors.append(self._m["LLGuidanceLogitsProcessor"](grammar, self._llg_tokenizer, "torch"))
        streamer = _Streamer(tok, job.stop, on_text if job.stream else None)
        device = self._model.model.device
        with torch.inference_mode():
            if job.seed is not None:
                torch.manual_seed(job.seed)
            out = self._model.model.generate(
                input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device), generation_config=config,
                logits_processor=processors,
                stopping_criteria=tf.StoppingCriteriaList([_Cancelled(gate.cancel, torch)]),
                streamer=streamer, **({"tokenizer": tok} if job.stop else {}),
            )
        generated = out[0, n_prompt:].tolist()
        text, stopped = streamer.text(final=True)
        done = stopped or len(generated) < max_new or (bool(generated) and generated[-1] == eos)
        return Result(text, n_prompt, len(generated), "stop" if done else "length")

    def prompt_tokens(self, body: bytes) -> int:
        """How many tokens the model reads for this chat-completions body, its chat template applied:
        the input a budget must hold (a template may add more than the body's size bounds). Worker
        thread. Raises InvalidRequest for a body `open` would refuse, a template's refusal included."""
        job = parse_request(body)
        try:
            return int(self._prompt_ids(job).shape[1])
        except self._m["TemplateError"] as exc:
            raise _refused_by_template(exc) from None
        except Exception as exc:  # a tokenizer's bug: to the client the upstream failed, before it began
            raise UpstreamUnavailable(f"local model failed: {type(exc).__name__}: {exc}", sent=False) from exc

    def _prompt_ids(self, job: Job) -> Any:
        tok = self._tokenizer
        templated = bool(getattr(tok, "chat_template", None))
        prompt = (tok.apply_chat_template(job.messages, tokenize=False, add_generation_prompt=True) if templated
                  else "".join(f"{m['role']}: {m['content']}\n" for m in job.messages) + "assistant:")
        return tok(prompt, return_tensors="pt", add_special_tokens=not templated)["input_ids"]

    def _prepare(self, job: Job) -> tuple[str | None, Any, int | None]:
        """(grammar, prompt ids, room left in the context) of a job. Raises InvalidRequest for what
        cannot run (a constraint llguidance cannot enforce, a prompt the context cannot hold)."""
        grammar = self._grammar(job.spec) if job.spec is not None else None
        ids = self._prompt_ids(job)
        n_prompt = int(ids.shape[1])
        room = self._context - n_prompt if self._context else None
        if room is not None and room < 1:
            raise InvalidRequest(f"the prompt is {n_prompt} tokens; the model's context is {self._context}",
                                 param="messages")
        return grammar, ids, room


class _Streamer:
    """transformers streamer: decodes the generated tokens, cuts at a stop string, and passes new text
    to `emit`, holding back a split UTF-8 character or what may be the start of a stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], emit: Callable[[str], None] | None) -> None:
        self._tokenizer, self._stop, self._emit = tokenizer, stop, emit
        self._ids: list[int] | None = None  # None until generate() has put the prompt
        self._sent = 0

    def put(self, value: Any) -> None:
        if self._ids is None:
            self._ids = []
            return
        self._ids.extend(value.reshape(-1).tolist())
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)

    def text(self, *, final: bool) -> tuple[str, bool]:
        """The answer so far (all of it when `final`), and whether a stop string ended it."""
        text = self._tokenizer.decode(self._ids or [], skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if cuts:
            return text[: min(cuts)], True
        keep = len(text) if final else len(text.rstrip("\ufffd"))
        for s in () if final else self._stop:
            keep -= next((n for n in range(min(len(s) - 1, keep), 0, -1) if text[keep - n : keep] == s[:n]), 0)
        return text[:keep], False

    def _flush(self, *, final: bool) -> None:
        if self._emit is None:
            return
        text, _ = self.text(final=final)
        if len(text) > self._sent:
            self._emit(text[self._sent :])
            self._sent = len(text)


class _Cancelled:
    """transformers stopping criterion: true once the client went away."""

    def __init__(self, event: threading.Event, torch: Any) -> None:
        self._event, self._torch = event, torch

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        return self._torch.full((input_ids.shape[0],), self._event.is_set(), dtype=self._torch.bool,
                                device=input_ids.device)


def _compile(spec: ConstraintSpec, llg_tokenizer: Any) -> str | InvalidGrammar:
    import llguidance as llg

    try:
        if spec.is_json:
            schema = orjson.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
            if schema is False:
                return InvalidGrammar("json_schema: the schema `false` accepts nothing")
            grammar = llg.LLMatcher.grammar_from_json_schema(
                orjson.dumps({} if schema is True else schema).decode(), overrides=_JSON_OPTIONS)
        else:
            grammar = engine.grammar_for(spec.kind, spec.source)
    except (ValueError, TypeError) as exc:
        return InvalidGrammar(f"{spec.kind}: {exc}")
    matcher = llg.LLMatcher(llg_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        reason = next((line.strip() for line in matcher.get_error().splitlines() if line.strip()), "rejected")
        return InvalidGrammar(f"{spec.kind}: the local model cannot enforce this constraint: {reason}")
    return grammar


def _refused_by_template(exc: Exception) -> InvalidRequest:
    return InvalidRequest(f"messages: the model's chat template refuses them: {exc}", param="messages",
                          summary="messages: the model's chat template refuses them")


class _Gate:
    """Whether a generation began, settled once between the worker thread (`begin`, right before the
    model reads the prompt) and the event loop giving up on the call (`abandon`): a call abandoned
    first never runs, so it generated nothing; one abandoned after stops at its next token (`cancel`)."""

    def __init__(self, cancel: threading.Event) -> None:
        self.cancel = cancel
        self.begun = False
        self._lock = threading.Lock()  # held for a flag's read and write: the loop never waits on it

    def begin(self) -> bool:
        with self._lock:
            self.begun = not self.cancel.is_set()
            return self.begun

    def abandon(self) -> bool:
        """Stop the call; whether the model had begun it."""
        with self._lock:
            self.cancel.set()
            return self.begun


def _settle(future: asyncio.Future[GatewayError | None], value: GatewayError | None) -> None:
    if not future.done():
        future.set_result(value)
