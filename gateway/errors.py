"""tollgate's error hierarchy. Every failure the gateway raises on purpose is one of these.

* TollgateError
  x ConfigError                - the config file is invalid (never reaches HTTP)
  x GatewayError               - answered to the caller in the wire format of the API it called
    + InvalidRequest           - 400 invalid_request
      - InvalidGrammar         - 400 invalid_request (a constraint that does not compile)
        - GrammarTooComplex    - 400 (a check hit llguidance's parser limits)
      - UndecodableBody        - 400 invalid_request (broken body encoding or framing; closes the connection)
    + InvalidApiKey            - 401 invalid_api_key
    + ModelNotFound            - 404 model_not_found
    + PathNotFound             - 404 not_found (nothing is served at this path)
    + RequestTooLarge          - 413 request_too_large
    + RequestTimeout           - 408 request_timeout (the request body stopped arriving)
    + Stopped                  - 403 a guard stopped the run (budget_exhausted, loop_detected, ...)
    + BudgetHeld               - 403 budget_exhausted / token_budget_exhausted, held by steps in flight
                                 (this step refused; the run goes on)
      - ToolNotAllowed         - 403 tool_not_allowed
    + ApprovalDenied           - 403 approval_denied (a human denied a parked tool call)
      - ApprovalTimeout        - 403 approval_timeout (nobody decided within approval_timeout_s)
    + DuplicateToolCall        - 403 duplicate_tool_call (a side-effecting call already ran; no result to replay)
    + WriteInProgress          - 403 tool_call_in_progress (the same side-effecting call is running now)
    + OutputNonconforming      - 422 output_nonconforming
    + UpstreamError            - the upstream failed (`request_sent`: it may have the request)
      - UpstreamUnavailable    - 502 upstream_unavailable
      - UpstreamTimeout        - 504 upstream_timeout
    + ShuttingDown             - 503 shutting_down
    + StateUnavailable         - 503 state_unavailable
  x GuardFailure               - a guard raised; the pipeline turns it into a stop (fail closed)
  x RunReset                   - the run was reset after the epoch a stop or an effect was judged on:
                                 the store did nothing (never answered; the pipeline decides again)

Statuses never use 409/429, use 408 only for a request body that stopped arriving (sending it again
can help), and use 5xx only where the gateway or its dependencies failed, so official SDKs do not retry
a decision that retrying cannot change.
"""

from __future__ import annotations

from typing import ClassVar, Final

import orjson


class TollgateError(Exception):
    """Base of every error tollgate raises on purpose."""


class ConfigError(TollgateError):
    """Invalid configuration. `problems` lists (key path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" for path, message in problems))


class GatewayError(TollgateError):
    """An error answered to the agent. `code` is the contract code of DESIGN section 4."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    openai_type: ClassVar[str] = "server_error"
    anthropic_type: ClassVar[str] = "api_error"
    closes_connection: ClassVar[bool] = False  # the request's framing is lost: answer, then close

    def __init__(self, message: str, *, param: str | None = None, summary: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self._summary = summary

    @property
    def redacted(self) -> str:
        """The message for telemetry and the ledger: without the content it quotes (a `summary` given
        where the message quotes what the agent or its tool sent), else the message itself."""
        return self.message if self._summary is None else self._summary

    @property
    def stop_reason(self) -> str | None:
        """The stop code when this error stops the run, else None."""
        return None


class InvalidRequest(GatewayError):
    status = 400
    code = "invalid_request"
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class UndecodableBody(InvalidRequest):
    """The request body's encoding or chunked framing broke: 400, and the connection closes after it."""

    closes_connection = True


class InvalidGrammar(InvalidRequest):
    """A grammar, schema, regex or choice list that does not compile, or an unknown grammar name."""


class GrammarTooComplex(InvalidGrammar):
    """llguidance's parser limits were hit checking an answer (`grammars.engine`). A lexer out of states
    stays so in every copy of the compiled matcher: the compile is spent (`grammars.compile`), by this
    check or, `spent_by_another`, by one before it; `spent_alone`: by this check, the only one of a fresh
    compile (a fresh compile would be spent again)."""

    spent_by_another = False
    spent_alone = False


class InvalidApiKey(GatewayError):
    status = 401
    code = "invalid_api_key"
    openai_type = "invalid_request_error"
    anthropic_type = "authentication_error"


class ModelNotFound(GatewayError):
    status = 404
    code = "model_not_found"
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"


class PathNotFound(GatewayError):
    status = 404
    code = "not_found"
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"


class RequestTooLarge(GatewayError):
    status = 413
    code = "request_too_large"
    openai_type = "invalid_request_error"
    anthropic_type = "request_too_large"


class RequestTimeout(GatewayError):
    """No byte of the request body for `limits.body_idle_s`: a stalled client, or a body whose framing
    broke after the headers (aiohttp's C parser then never ends the body it was reading)."""

    status = 408
    code = "request_timeout"
    openai_type = "invalid_request_error"
    anthropic_type = "timeout_error"
    closes_connection = True


class Stopped(GatewayError):
    """A guard stopped the run. `reason` is the stop code; stops are sticky until reset."""

    status = 403
    code = "run_stopped"
    openai_type = "permission_error"
    anthropic_type = "permission_error"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def stop_reason(self) -> str | None:
        return self.reason


class BudgetHeld(GatewayError):
    """A budget claim that fits what the run spent, refused because its steps in flight hold the rest:
    this step only. The run is not stopped (those steps may settle lower), so this is never a stop's
    final message, whatever `on_stop` says."""

    status = 403
    code = "budget_exhausted"
    openai_type = "permission_error"
    anthropic_type = "permission_error"


class TokenBudgetHeld(BudgetHeld):
    code = "token_budget_exhausted"


HELD: Final[dict[str, type[BudgetHeld]]] = {"budget_exhausted": BudgetHeld,
                                             "token_budget_exhausted": TokenBudgetHeld}


class ToolNotAllowed(Stopped):
    def __init__(self, message: str) -> None:
        super().__init__("tool_not_allowed", message)


class ApprovalDenied(GatewayError):
    """A tool call parked for approval was denied. It does not stop the run."""

    status = 403
    code = "approval_denied"
    openai_type = "permission_error"
    anthropic_type = "permission_error"


class ApprovalTimeout(ApprovalDenied):
    code = "approval_timeout"


class DuplicateToolCall(GatewayError):
    """A `write`/`dangerous` tool call that already ran in this run, whose result was not recorded (too
    large to keep in the run store, or the store failed while it was recorded): it is refused rather
    than run twice."""

    status = 403
    code = "duplicate_tool_call"
    openai_type = "permission_error"
    anthropic_type = "permission_error"


class WriteInProgress(GatewayError):
    """The identical side-effecting call of the run is running now, held by another sidecar (or a
    former request of this one whose lease has not lapsed): it is not run twice. Retrying once it has
    finished gets its recorded result. MCP: JSON-RPC error -32003, `data.code` `tool_call_in_progress`."""

    status = 403
    code = "tool_call_in_progress"
    openai_type = "permission_error"
    anthropic_type = "permission_error"


class OutputNonconforming(GatewayError):
    status = 422
    code = "output_nonconforming"
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class UpstreamError(GatewayError):
    """The upstream failed. `request_sent`: the upstream may have received the request (and may bill
    for it); False only when it failed before a byte of the request was written (connecting, no free
    connection, shutting down)."""

    def __init__(self, message: str, *, sent: bool = True, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.request_sent = sent


class UpstreamUnavailable(UpstreamError):
    status = 502
    code = "upstream_unavailable"
    openai_type = "server_error"
    anthropic_type = "api_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"
    openai_type = "server_error"
    anthropic_type = "timeout_error"  # Anthropic's own category for its 504s


class ShuttingDown(GatewayError):
    status = 503
    code = "shutting_down"
    openai_type = "server_error"
    anthropic_type = "overloaded_error"


class StateUnavailable(GatewayError):
    status = 503
    code = "state_unavailable"
    openai_type = "server_error"
    anthropic_type = "api_error"


class GuardFailure(TollgateError):
    """A guard raised instead of deciding. Carries the guard's name for the stop detail and metric."""

    def __init__(self, guard: str, cause: BaseException) -> None:
        super().__init__(f"guard {guard} failed: {type(cause).__name__}: {cause}")
        self.guard = guard


class RunReset(TollgateError):
    """`RunStore.stop` / `RunStore.apply` given the epoch the caller judged on, when a reset has ended that
    epoch since: nothing was written. The judgement was of the run that ended; the fresh run is not stopped
    or counted by it."""

    def __init__(self, run_id: str, judged: int, current: int) -> None:
        super().__init__(f"run {run_id!r} was reset since epoch {judged} (now {current})")
        self.run_id, self.judged, self.current = run_id, judged, current


def error_code(error: GatewayError) -> str:
    """The code shown to the caller: the stop reason for stops, else the class code."""
    return error.stop_reason or error.code


def both_formats(error: GatewayError, kind: str | None = None) -> bytes:
    """One JSON error body both wire formats read, for an answer whose API is unknown: Anthropic's
    `{"type": "error", "error": {...}}` whose inner object also has OpenAI's four fields. `kind` is
    the inner `type` (default: the Anthropic category)."""
    inner = {"message": error.message, "type": kind or error.anthropic_type, "param": None, "code": error.code}
    return orjson.dumps({"type": "error", "error": inner})
