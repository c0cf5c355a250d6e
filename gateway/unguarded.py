"""Forwarded calls that are not steps (pure, no I/O): which of them an agent's guards forbid.

Many `/v1/...` paths tollgate does not guard are free (model lists, files, token counts, stored objects).
Others spend money or run models in a way no step can bound: a batch's requests run after it ends, an
Assistants run, an eval run or a managed agent session makes its own model calls, a Realtime session key
lets the agent call the model directly, and images, audio, video, fine-tuning and containers are billed
per image, second, character, training token or session at a cost tollgate does not price. Forwarding
them for an agent whose guards they go around would make those guards fail open; each is a 400 instead
(as for the Responses API's `background`), naming what it goes around, and is forwarded as before for an
agent without those guards.

Providers add such endpoints often, so the rule fails closed: a call that may create work (`POST`, `PUT`,
`PATCH`) on a path that is neither known to be billed (`BYPASSES`) nor known to be free (`FREE`) is
treated as one that runs model calls. Reads and deletions pass. Patterns are canonical paths
(`gateway.forward.canonical_path`); `*` is one segment, an id.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from gateway.config import Agent
from gateway.errors import InvalidRequest
from gateway.frozen_init import fast_init

__all__ = ["BYPASSES", "FREE", "Bypass", "bypass_for", "forbidden", "refusal"]


@fast_init
@dataclass(frozen=True, slots=True)
class Bypass:
    """A billed call that is not a step. `why` completes "tollgate refuses it for this agent: ...";
    `model_calls` says the provider runs model calls for it, so it goes around every guard (caps, tool
    allow-lists, grammars, loop detection, custom guards), not only the budget."""

    why: str
    model_calls: bool
    instead: str
    methods: frozenset[str] = frozenset({"POST"})


_BATCH = Bypass("a batch's requests are model calls the provider runs and bills after the batch ends", True,
                "send the calls one by one")
_ASSISTANTS = Bypass("an Assistants run makes model and tool calls the provider runs and bills itself", True,
                     "call the model through /v1/chat/completions or /v1/responses")
_REALTIME = Bypass("a Realtime session's model calls go between the agent and the provider, not through "
                   "steps tollgate can guard", True, "call the model through /v1/chat/completions or /v1/responses")
_IMAGES = Bypass("images are billed per image or image token, at a cost tollgate does not price", False,
                 "use an agent without a budget for images")
_AUDIO = Bypass("audio is billed per character, minute or audio token, at a cost tollgate does not price", False,
                "use an agent without a budget for audio, or audio models through /v1/chat/completions")
_VIDEO = Bypass("videos are billed per second of video, at a cost tollgate does not price", False,
                "use an agent without a budget for videos")
_TRAINING = Bypass("a fine-tuning job is billed for its training after it runs", False,
                   "use an agent without a budget for fine-tuning")
_UNKNOWN = Bypass("tollgate does not know what this call runs or bills (it may make model calls outside the "
                  "run's steps)", True, "send it with an agent key without guards, or through a path tollgate guards")

BYPASSES: Final[dict[str, Bypass]] = {
    "/v1/batches": _BATCH,
    "/v1/messages/batches": _BATCH,
    "/v1/threads/runs": _ASSISTANTS,
    "/v1/threads/*/runs": _ASSISTANTS,
    "/v1/threads/*/runs/*/submit_tool_outputs": _ASSISTANTS,
    "/v1/evals/*/runs": Bypass("an eval run makes model calls the provider runs and bills itself", True,
                               "run evals with an agent without guards"),
    "/v1/fine_tuning/alpha/graders/run": Bypass("a grader run makes model calls the provider bills itself", True,
                                                "run graders with an agent without guards"),
    "/v1/realtime": Bypass(_REALTIME.why, True, _REALTIME.instead, frozenset({"GET", "POST"})),
    "/v1/realtime/sessions": _REALTIME,
    "/v1/realtime/client_secrets": _REALTIME,
    "/v1/realtime/transcription_sessions": _REALTIME,
    "/v1/realtime/calls": _REALTIME,
    "/v1/realtime/calls/*/accept": _REALTIME,
    "/v1/realtime/translations": _REALTIME,
    "/v1/realtime/translations/client_secrets": _REALTIME,
    "/v1/live/sessions": _REALTIME,
    "/v1/live/sessions/*/accept": _REALTIME,
    "/v1/live/sessions/*/fork": _REALTIME,
    "/v1/chatkit/sessions": Bypass("a ChatKit session key lets the agent's front end run a workflow's model calls "
                                   "directly", True, "call the model through /v1/chat/completions or /v1/responses"),
    "/v1/complete": Bypass("Anthropic's legacy Text Completions are model calls tollgate does not guard", True,
                           "use /v1/messages"),
    "/v1/images/generations": _IMAGES,
    "/v1/images/edits": _IMAGES,
    "/v1/images/variations": _IMAGES,
    "/v1/audio/speech": _AUDIO,
    "/v1/audio/transcriptions": _AUDIO,
    "/v1/audio/translations": _AUDIO,
    "/v1/videos": _VIDEO,
    "/v1/videos/*/remix": _VIDEO,
    "/v1/videos/edits": _VIDEO,
    "/v1/videos/extensions": _VIDEO,
    "/v1/fine_tuning/jobs": _TRAINING,
    "/v1/fine_tuning/jobs/*/resume": _TRAINING,
    "/v1/containers": Bypass("a container is billed per session, at a cost tollgate does not price", False,
                             "use an agent without a budget for containers"),
    "/v1/vector_stores/*/search": Bypass("a vector store search is billed per search, and `rewrite_query` runs a "
                                         "model, at a cost tollgate does not price", False,
                                         "search with the file_search tool of /v1/responses, which tollgate "
                                         "reserves and prices"),
}

FREE: Final = frozenset({
    # OpenAI: stored objects and their housekeeping
    "/v1/files", "/v1/uploads", "/v1/uploads/*/parts", "/v1/uploads/*/complete", "/v1/uploads/*/cancel",
    "/v1/conversations", "/v1/conversations/*", "/v1/conversations/*/items",
    "/v1/responses/input_tokens", "/v1/responses/*/cancel", "/v1/chat/completions/*",
    "/v1/assistants", "/v1/assistants/*", "/v1/threads", "/v1/threads/*", "/v1/threads/*/messages",
    "/v1/threads/*/messages/*", "/v1/threads/*/runs/*", "/v1/threads/*/runs/*/cancel",
    "/v1/batches/*/cancel", "/v1/fine_tuning/jobs/*/cancel", "/v1/fine_tuning/jobs/*/pause",
    "/v1/fine_tuning/alpha/graders/validate", "/v1/fine_tuning/checkpoints/*/permissions",
    "/v1/evals", "/v1/evals/*", "/v1/evals/*/runs/*/cancel",
    "/v1/vector_stores", "/v1/vector_stores/*", "/v1/vector_stores/*/files", "/v1/vector_stores/*/files/*",
    "/v1/vector_stores/*/file_batches", "/v1/vector_stores/*/file_batches/*/cancel",
    "/v1/containers/*/files", "/v1/moderations", "/v1/skills", "/v1/skills/*", "/v1/skills/*/versions",
    "/v1/realtime/calls/*/hangup", "/v1/realtime/calls/*/reject", "/v1/realtime/calls/*/refer",
    "/v1/live/sessions/*/hangup", "/v1/live/sessions/*/reject", "/v1/live/sessions/*/refer",
    "/v1/chatkit/sessions/*/cancel",
    # Anthropic
    "/v1/messages/count_tokens", "/v1/messages/batches/*/cancel",
})
"""Paths whose `POST` creates nothing billed per use (storage billed by the day is not a run's spend):
forwarded for every agent."""
_WRITES: Final = frozenset({"POST", "PUT", "PATCH"})


def forbidden(method: str, path: str, policy: Agent) -> InvalidRequest | None:
    """Why `policy`'s agent may not make this forwarded call, or None: a billed call (`BYPASSES`) that goes
    around its guards, or a write to a path known neither billed nor free, for an agent with any guard."""
    bypass = bypass_for(method, path)
    if bypass is None:
        if method not in _WRITES or _matches(path, FREE):
            return None
        bypass = _UNKNOWN
    return refusal(bypass, policy)


def bypass_for(method: str, path: str) -> Bypass | None:
    """The billed call `method` on the canonical `path` creates, or None (a free or a guarded path)."""
    bypass = _matches(path, BYPASSES)
    return BYPASSES[bypass] if bypass is not None and method in BYPASSES[bypass].methods else None


def _matches(path: str, patterns: Iterable[str]) -> str | None:
    """The first of `patterns` that `path` matches, segment by segment (`*`: any one segment)."""
    parts = path.split("/")
    for pattern in patterns:
        wanted = pattern.split("/")
        if len(wanted) == len(parts) and all(want in ("*", got) for want, got in zip(wanted, parts, strict=True)):
            return pattern
    return None


def refusal(bypass: Bypass, policy: Agent) -> InvalidRequest | None:
    """Why this agent may not make the call (the guards it would go around), or None."""
    budget = policy.budget.usd is not None or policy.budget.tokens is not None
    checks = [("budget", budget)]
    if bypass.model_calls:
        checks += [
            ("caps", any(v is not None for v in (policy.caps.llm_calls, policy.caps.tool_calls, policy.caps.seconds))),
            ("tools.allow", policy.tools.allow is not None),
            ("output.grammar", policy.output.grammar is not None),
            ("loop", policy.loop is not None),
            ("guards", bool(policy.guards)),
        ]
    guards = [name for name, on in checks if on]
    if not guards:
        return None
    return InvalidRequest(f"{bypass.why}, outside this agent's guards ({', '.join(guards)}): tollgate refuses "
                          f"it for this agent; {bypass.instead}")
