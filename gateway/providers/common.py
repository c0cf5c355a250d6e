"""Helpers shared by the adapters: request-shape checks and small conversions (pure)."""

from __future__ import annotations

import base64
import binascii
import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gateway.config import Limits
from gateway.errors import InvalidRequest, RequestTooLarge, ToolNotAllowed


def json_depth_ok(value: Any, limit: int) -> bool:
    """True when nesting of lists/objects stays within `limit` (iterative, one level at a time; stops at
    the first level past it). For parsed JSON: only exact `dict` and `list` count as containers.

    Level by level with the type tests inline: every request longer than twice the limit (any agent
    request) is walked, and this is ~4x faster than a stack of (node, depth) pairs filled by a generator
    per container (90 against 390 us for a 65 KB agent body)."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return False
        below: list[Any] = []
        for node in level:
            for item in node.values() if type(node) is dict else node:
                kind = type(item)
                if kind is dict or kind is list:
                    below.append(item)
        level = below
    return True


# image parts of Chat Completions, Responses (a `computer_call_output` screenshot too) and Anthropic content
IMAGE_PARTS = frozenset({"image_url", "input_image", "computer_screenshot", "image"})
# JSON may spell any character of a string as \uXXXX: the byte searches miss an ASCII word spelled so
# (an escape of a non-ASCII character, which clients send for every accented letter, spells none of them)
_ASCII_ESCAPE = re.compile(rb"\\u00[0-7][0-9A-Fa-f]")


def refusal_of(part: Mapping[str, Any]) -> str:
    """The refusal an OpenAI answer part carries in its `refusal` field (a Chat Completions message or
    delta, a Responses content part), or "" (structured outputs put a refusal there, not in the text)."""
    refusal = part.get("refusal")
    return refusal if isinstance(refusal, str) else ""


def may_contain(raw: bytes, *words: bytes) -> bool:
    """False only when no JSON string of `raw` can be any of `words` (ASCII): none is in the bytes, and no
    `\\u` escape of an ASCII character could spell one. A cheap test that lets most requests skip a walk
    of their body. The escape pattern is searched directly: sre finds its literal `\\u00` prefix in a
    64 KB body in ~20 us, a `b"\\u" in raw` test took ~50 (a JSON body holds many backslashes)."""
    return any(word in raw for word in words) or _ASCII_ESCAPE.search(raw) is not None


_CONTAINERS = (dict, list)  # a tuple built once: `dict | list` in a generator built a union per value


def _objects(value: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object inside `value`, itself included (iterative: no recursion limit)."""
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(v for v in node.values() if isinstance(v, _CONTAINERS))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, _CONTAINERS))


def _referenced_document(node: Mapping[str, Any]) -> bool:
    kind, file, source = node.get("type"), node.get("file"), node.get("source")
    if kind == "file":
        return isinstance(file, Mapping) and bool(file.get("file_id"))
    return kind == "document" and isinstance(source, Mapping) and source.get("type") in ("url", "file")


def count_referenced_documents(body: Mapping[str, Any], raw: bytes) -> int:
    """Documents a request names instead of sending (Chat Completions `file` parts by `file_id`,
    Anthropic `document` blocks whose source is a URL or a file): their tokens are unknown here."""
    return _tally(body, raw)[1]


def count_images(body: Mapping[str, Any], raw: bytes) -> int:
    """Image parts anywhere in a request (messages, tool results): an image's tokens follow its pixels,
    not its bytes (a URL is a few bytes; a flat PNG compresses far below its token count), so the
    budget bounds each one apart (`guards.budget`)."""
    return _tally(body, raw)[0]


PDF_PAGE_IMAGES = 2
"""Image bounds (`guards.bounds.image_tokens`: 8,192 tokens each on most models) one page of a PDF sent as base64 counts
as: Anthropic bills each page as an image of it plus its extracted text (1,500-3,000 tokens a page by its
PDF support docs), so a page is bounded at one image for its picture and one image's worth for its text."""
_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z0-9#.+_-])")  # a page object, not the `/Pages` tree
_PDF_COUNT = re.compile(rb"/Count\s+(\d{1,9})")  # page tree sizes (and outline item counts: only higher)
_PDF_OBJSTM = re.compile(rb"/Type\s*/ObjStm\b")  # a compressed stream of objects, pages may hide in it
_PDF_STREAM = re.compile(rb"stream\r?\n")
_PDF_ESCAPED_NAME = re.compile(rb"/[^\s/<>\[\]()%{}]*#[0-9A-Fa-f]{2}[^\s/<>\[\]()%{}]*")
_PDF_HEX = re.compile(rb"#([0-9A-Fa-f]{2})")
_PDF_INFLATED_MAX = 64 << 20  # object streams inflated past this are a bomb, not a document: uncounted


def _inline_pdf(node: Mapping[str, Any]) -> str | None:
    """The base64 data of a PDF a content part sends inline, `""` for an Anthropic base64 document that is
    no PDF (nothing else is sent so), None for any other part. Anthropic: a `document` whose source is
    base64; Chat Completions: a `file` part's `file_data`; Responses: an `input_file`'s `file_data` (both
    data URLs; OpenAI reads PDFs there)."""
    kind = node.get("type")
    if kind == "document":
        source = node.get("source")
        if not isinstance(source, Mapping) or source.get("type") != "base64":
            return None
        data = source.get("data")
        return data if isinstance(data, str) and source.get("media_type") == "application/pdf" else ""
    part = node.get("file") if kind == "file" else node if kind == "input_file" else None
    url = part.get("file_data") if isinstance(part, Mapping) else None
    return _data_url_pdf(url) if isinstance(url, str) else None


def _data_url_pdf(url: str) -> str | None:
    """The base64 data of a PDF data URL (`data:application/pdf[;name=...];base64,...`, any case, blanks
    around its parts), None for a data URL of another media type (bounded by its bytes), `""` for what
    cannot be read as one (not a data URL, a PDF not in base64): uncounted."""
    if url[:5].lower() != "data:":
        return ""
    head, comma, payload = url[5:].partition(",")
    params = [p.strip().lower() for p in head.split(";")]
    if params[0] != "application/pdf":
        return None if comma else ""
    return payload if comma and "base64" in params[1:] else ""


def pdf_documents(body: Mapping[str, Any], raw: bytes) -> tuple[int, int]:
    """(pages, uncounted) of the PDFs a request sends inline as base64 (`_inline_pdf`): their tokens
    follow their pages, not their bytes. `uncounted` are those whose pages cannot be counted (not base64,
    not a PDF, encrypted, no page found): no bound is known, as for a document by URL."""
    _, _, pages, uncounted = _tally(body, raw)
    return pages, uncounted


def input_parts(body: Mapping[str, Any], raw: bytes) -> tuple[int, int]:
    """(images, unbounded) of a request, for `Call.input_images` and `Call.referenced_documents`: its image
    parts plus `PDF_PAGE_IMAGES` for each page of the PDFs it sends inline; the documents it names instead
    of sending plus the inline PDFs whose pages cannot be counted."""
    images, named, pages, uncounted = _tally(body, raw)
    return images + PDF_PAGE_IMAGES * pages, named + uncounted


def _tally(body: Mapping[str, Any], raw: bytes) -> tuple[int, int, int, int]:
    """(image parts, documents named, PDF pages sent inline, inline PDFs uncounted) of a request, with one
    byte test and at most one walk of its body (every request pays this: most skip the walk). PDFs are
    decoded only when the body has such a part."""
    if not may_contain(raw, b"image", b"file", b"document"):  # `file_data` contains `file`
        return 0, 0, 0, 0
    images = named = pages = uncounted = 0
    for node in _objects(body):
        kind = node.get("type")
        if isinstance(kind, str) and kind in IMAGE_PARTS:
            images += 1
        named += _referenced_document(node)
        data = _inline_pdf(node)
        if data is not None:
            counted = pdf_pages(data) if data else None
            if counted is None:
                uncounted += 1
            else:
                pages += counted
    return images, named, pages, uncounted


def pdf_pages(data: str) -> int | None:
    """Pages of the base64 PDF `data`, counted without parsing it: its page objects (`/Type /Page`, in
    the file and in its compressed object streams, names with `#xx` escapes decoded), or the largest
    `/Count` it gives, whichever is more (both only ever overcount: replaced objects of incremental
    updates, outline counts). None when it cannot be counted: not base64, not a PDF, encrypted (its
    object streams cannot be read), an object stream that does not inflate, or no page found."""
    try:
        pdf = base64.b64decode(data)
    except (binascii.Error, ValueError):
        return None
    if b"%PDF-" not in pdf[:1024] or b"/Encrypt" in pdf:
        return None
    objects, counts = _pdf_count(pdf)
    read = 0  # bytes of object streams scanned: bounded whole, so no PDF costs more than the cap to count
    starts: set[int] = set()  # a stream several markers point at is read once
    for match in _PDF_OBJSTM.finditer(pdf):
        start = _PDF_STREAM.search(pdf, match.end())
        end = pdf.find(b"endstream", start.end()) if start is not None else -1
        if start is None or end < 0:
            return None
        if start.end() in starts:
            continue
        starts.add(start.end())
        head, stream = pdf[max(0, pdf.rfind(b"obj", 0, match.start())):start.start()], pdf[start.end():end]
        room = _PDF_INFLATED_MAX - read
        if b"/Filter" in head:  # compressed: only Flate is read here (what PDF writers use for objects)
            if b"/FlateDecode" not in head:
                return None
            try:  # `room` > 0 here: zlib takes a max_length of 0 as no limit
                inflater = zlib.decompressobj()
                stream = inflater.decompress(stream, room)
            except (zlib.error, ValueError):
                return None
            if inflater.unconsumed_tail:
                return None
        read += len(stream)
        if read >= _PDF_INFLATED_MAX:
            return None  # a bomb, not a document
        found, count = _pdf_count(stream)
        objects, counts = objects + found, max(counts, count)
    return max(objects, counts) or None


def _pdf_count(text: bytes) -> tuple[int, int]:
    """(page objects, largest `/Count`) of one part of a PDF."""
    if b"#" in text:  # `/Ty#70e /P#61ge` is `/Type /Page` to a PDF reader
        text = _PDF_ESCAPED_NAME.sub(lambda m: _PDF_HEX.sub(lambda h: bytes([int(h[1], 16)]), m[0]), text)
    return len(_PDF_PAGE.findall(text)), max([0, *(int(n) for n in _PDF_COUNT.findall(text))])


def require_list(body: Mapping[str, Any], key: str, *, required: bool) -> list[Any]:
    value = body.get(key)
    if value is None:
        if required:
            raise InvalidRequest(f"'{key}' is required", param=key)
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"'{key}' must be an array", param=key)
    return value


def require_model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    return model


def check_counts(messages: list[Any], tools: list[Any], limits: Limits) -> None:
    if len(messages) > limits.max_messages:
        raise RequestTooLarge(f"{len(messages)} messages exceed the limit of {limits.max_messages}")
    if len(tools) > limits.max_tools:
        raise RequestTooLarge(f"{len(tools)} tools exceed the limit of {limits.max_tools}")


def opt_number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"'{key}' must be a number", param=key)
    return float(value)


def opt_int(body: Mapping[str, Any], key: str, *, minimum: int = 0, maximum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value >= 2**63 and value.is_integer():
        value = int(value)  # orjson reads an integer beyond 64 bits as a float: it is still an integer
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequest(f"'{key}' must be an integer >= {minimum}", param=key)
    if maximum is not None and value > maximum:
        raise InvalidRequest(f"'{key}' must be an integer from {minimum} to {maximum}", param=key)
    return value


MAX_TOKEN_COUNT = 1 << 53  # no answer uses more; a JSON number beyond it is not a count


def token_count(value: Any) -> int:
    """A usage count as a provider reports it: absent is 0, an integer (JSON may write `12.0`) from 0
    to `MAX_TOKEN_COUNT` is itself. Raises ValueError for anything else (negative, fractional, huge,
    not a number): such usage is not believed (the step settles at its reservation)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"token count {value!r} is not a number")  # noqa: TRY004 - one error for all
    if not 0 <= value <= MAX_TOKEN_COUNT or int(value) != value:  # NaN fails the range test
        raise ValueError(f"token count {value!r} is out of range")
    return int(value)


def required_count(value: Any) -> int:
    """`token_count` of a count every usage report carries (input, output): absent raises ValueError too,
    so a `usage: {}` is no report at all (settled at the reservation), never a free call."""
    if value is None:
        raise ValueError("a usage report without its input or output count")
    return token_count(value)


def opt_strings(value: Any) -> tuple[str, ...] | None:
    """Stop sequences for telemetry: a string, or the strings of a list; None when absent. What is not
    a string is left out here (the body goes upstream as it came, and the provider judges it)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(item for item in value if isinstance(item, str))
    return None


def usage_detail(details: Any, key: str) -> Any:
    """`details[key]` of a usage details object, or None when it is not an object."""
    if type(details) is dict:  # parsed JSON: a type test, not the Mapping ABC's (~5x the cost, per answer)
        return details.get(key)
    return details.get(key) if details is not None and isinstance(details, Mapping) else None


def stop_text(reason: str, detail: str) -> str:
    return f"tollgate stopped this run ({reason}): {detail}"


def content_text(content: Any) -> str:
    """Text of a message `content` that is a string or a list of parts/blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                elif part.get("type") in ("tool_result",):
                    parts.append(content_text(part.get("content")))
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return "" if content is None else str(content)


def request_basics(
    body: Mapping[str, Any], limits: Limits, role_ok: Callable[[Any], bool], role_rule: str
) -> tuple[str, list[Any], list[Any], bool]:
    """The fields every chat request has: model, messages (each with a valid role), tools, stream."""
    model = require_model(body)
    messages = require_list(body, "messages", required=True)
    raw_tools = require_list(body, "tools", required=False)
    check_counts(messages, raw_tools, limits)
    for index, message in enumerate(messages):  # `type() is dict` first: an ABC isinstance costs ~5x more
        if not (type(message) is dict or isinstance(message, Mapping)) or not role_ok(message.get("role")):
            raise InvalidRequest(f"messages[{index}] {role_rule}", param="messages")
    stream = body.get("stream")
    if stream is None:  # absent, or null (the OpenAI SDK sends `stream=None` as null): not streaming
        stream = False
    elif not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    return model, messages, raw_tools, stream


def allowed_subset(listed: list[Any], mode: Any, allowed: Callable[[str], bool],
                   name_of: Callable[[Any], str]) -> list[Any] | None:
    """The tools of an `allowed_tools` tool choice (OpenAI's APIs) the allow-list keeps: `listed` itself
    when it keeps all, None when it keeps none and the choice lets the model answer without a call (the
    choice becomes `none`). Raises ToolNotAllowed when it keeps none and the choice requires a call."""
    kept = [tool for tool in listed if allowed(name_of(tool))]
    if len(kept) == len(listed):
        return listed
    if kept:
        return kept
    if mode == "required":
        raise ToolNotAllowed("tool_choice requires tools outside the allow-list: "
                             + ", ".join(sorted(name_of(tool) for tool in listed)))
    return None
