"""Forwarded calls the provider bills outside a run's steps (pure, no I/O): which of them an agent's
guards forbid.

Most `/v1/...` paths tollgate does not guard are free (model lists, files, token counts, stored objects).
Some spend money or run models in a way no step can bound: a batch's requests run after it ends, an
Assistants run or an eval run makes its own model calls, a Realtime session key lets the agent call the
model directly, and images, audio, video, fine-tuning and containers are billed per image, second,
character, training token or session at a cost tollgate does not price. Forwarding them for an agent whose
guards they go around would make those guards fail open; each is a 400 instead (as for the Responses API's
`background`), naming what it goes around, and is forwarded as before for an agent without those guards.

`BYPASSES` is the registry: a canonical path (`gateway.forward.canonical_path`; `*` is one segment, an id)
and the methods that create the billed work, to what it goes around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gateway.config import Agent
from gateway.errors import InvalidRequest

__all__ = ["BYPASSES", "Bypass", "bypass_for", "refusal"]


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
    "/v1/fine_tuning/jobs": Bypass("a fine-tuning job is billed for its training after it runs", False,
                                   "use an agent without a budget for fine-tuning"),
    "/v1/containers": Bypass("a container is billed per session, at a cost tollgate does not price", False,
                             "use an agent without a budget for containers"),
}

def bypass_for(method: str, path: str) -> Bypass | None:
    """The billed call `method` on the canonical `path` creates, or None (a free or a guarded path)."""
    parts = path.split("/")
    for pattern, bypass in BYPASSES.items():
        wanted = pattern.split("/")
        if (method in bypass.methods and len(wanted) == len(parts)
                and all(want in ("*", got) for want, got in zip(wanted, parts, strict=True))):
            return bypass
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
