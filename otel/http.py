"""Calls tollgate forwards unguarded: the GenAI operation of a forwarded path, and the attributes of
the HTTP CLIENT span of one with none (`http-spans.md`, v1.41: named by the method, measured by no
GenAI metric). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv.attributes import http_attributes as Http
from opentelemetry.semconv.attributes import server_attributes as Server
from opentelemetry.semconv.attributes import url_attributes as Url

from otel.attributes import Attributes, present

__all__ = ["HTTP_RESPONSE_STATUS_CODE", "http_client_attributes", "operation_for_path"]

HTTP_RESPONSE_STATUS_CODE: Final = Http.HTTP_RESPONSE_STATUS_CODE
# path after `/v1` -> GenAI operation (OpenAI's wire); other paths are plain HTTP calls
_OPERATIONS: Final[Mapping[str, str]] = {
    "/embeddings": GenAI.GenAiOperationNameValues.EMBEDDINGS.value,
    "/completions": GenAI.GenAiOperationNameValues.TEXT_COMPLETION.value,
}


def operation_for_path(tail: str) -> str | None:
    """The GenAI operation of the path after `/v1` (`/embeddings` -> `embeddings`), or None."""
    return _OPERATIONS.get(tail.rstrip("/").lower())


def http_client_attributes(method: str, url: str, server_address: str | None, server_port: int | None) -> Attributes:
    """Known before the call. `url` is the upstream URL without its query string, whose values may be
    credentials; `http.response.status_code` is set when the answer comes."""
    return present(
        (
            (Http.HTTP_REQUEST_METHOD, method),
            (Url.URL_FULL, url or None),
            (Server.SERVER_ADDRESS, server_address or None),
            (Server.SERVER_PORT, server_port if server_address else None),
        )
    )
