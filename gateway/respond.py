"""The respond stage (DESIGN section 4): the headers every answer carries, and errors and stops in the
caller's wire format (statuses, error bodies per protocol, `x-tollgate-stop-reason`)."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from gateway.errors import GatewayError, Stopped, UpstreamUnavailable
from gateway.identity import RUN_ID_HEADER, RUN_ID_RE, Identity, requested_run_id
from gateway.providers.base import Adapter
from gateway.step import Step

STOP_HEADER = "x-tollgate-stop-reason"
MAX_TOKENS_HEADER = "x-tollgate-max-tokens"
JSON = "application/json"


def base_headers(identity: Identity | None, step: Step | None = None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if identity is not None:
        headers[RUN_ID_HEADER] = identity.run_id
    if step is not None and step.max_tokens_set is not None:
        headers[MAX_TOKENS_HEADER] = str(step.max_tokens_set)
    return headers


def echo_headers(request_headers: Mapping[str, str]) -> dict[str, str]:
    """The run id to echo when identity could not be resolved: the one the request names, if well-formed."""
    run_id = requested_run_id(request_headers)
    return {RUN_ID_HEADER: run_id} if run_id is not None and RUN_ID_RE.match(run_id) else {}


def error_response(adapter: Adapter, error: GatewayError, headers: dict[str, str]) -> web.Response:
    if error.stop_reason:
        headers = {**headers, STOP_HEADER: error.stop_reason}
    body = adapter.error_body(error)
    response = web.Response(status=error.status, body=body, content_type=JSON, headers=headers)
    if error.closes_connection:
        response.force_close()
    return response


def stop_response(step: Step, error: Stopped) -> web.Response:
    """A stop before any byte was sent: 403 in the wire format, or 200 with a final message."""
    headers = {**base_headers(step.identity, step), STOP_HEADER: error.reason}
    if step.identity.policy.on_stop == "message":
        if step.call.stream:
            body = step.adapter.stop_stream(step.call, error.reason, error.message)
            return web.Response(status=200, body=body, content_type="text/event-stream", headers=headers)
        body = step.adapter.stop_answer(step.call, error.reason, error.message)
        return web.Response(status=200, body=body, content_type=JSON, headers=headers)
    return web.Response(status=403, body=step.adapter.error_body(error), content_type=JSON, headers=headers)


def malformed_upstream(detail: str) -> UpstreamUnavailable:
    return UpstreamUnavailable(f"upstream answered malformed JSON: {detail}")
