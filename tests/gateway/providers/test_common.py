"""gateway/providers/common.py: request-shape checks and small conversions shared by the adapters."""

from __future__ import annotations

import base64
import zlib
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from gateway.config import Limits
from gateway.errors import GatewayError, InvalidRequest, RequestTooLarge, error_code
from gateway.providers import common
from gateway.providers.common import (
    PDF_PAGE_IMAGES,
    check_counts,
    content_text,
    count_images,
    count_referenced_documents,
    input_parts,
    json_depth_ok,
    opt_int,
    opt_number,
    opt_strings,
    pdf_documents,
    pdf_pages,
    request_basics,
    require_list,
    require_model,
    stop_text,
    token_count,
)

MSG = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> list[Any]:
    """`depth` lists inside each other, built without recursion."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def refused(error: GatewayError, cls: type[GatewayError], param: str | None, fragment: str) -> None:
    assert type(error) is cls
    assert error.param == param
    assert fragment in error.message


@pytest.mark.parametrize(
    ("value", "limit", "ok"),
    [
        (5, 1, True),  # a scalar has no nesting
        ("text", 1, True),
        ({}, 1, True),
        ({}, 0, False),
        ([], 1, True),
        ([1, "x", None], 1, True),  # scalars inside the container add no depth
        ({"a": {"b": 1}}, 2, True),
        ({"a": {"b": 1}}, 1, False),
        ([[[]]], 3, True),
        ([[[]]], 2, False),
        ({"a": [1, {"b": [2]}]}, 4, True),  # object, list, object, list
        ({"a": [1, {"b": [2]}]}, 3, False),
        ({"flat": [], "deep": [[[]]]}, 4, True),  # the deepest branch counts, not the first
        ({"flat": [], "deep": [[[]]]}, 3, False),
        ([{}, [], {"a": {}}], 3, True),
        (nested(64), 64, True),
        (nested(65), 64, False),
        (nested(20_000), 20_000, True),  # iterative: no RecursionError far past Python's stack
        (nested(20_000), 64, False),
    ],
)
def test_json_depth_ok(value: Any, limit: int, ok: bool) -> None:
    assert json_depth_ok(value, limit) is ok


@pytest.mark.parametrize(
    ("body", "required", "expected"),
    [
        ({"k": [1, 2]}, True, [1, 2]),
        ({"k": []}, True, []),
        ({"k": [1]}, False, [1]),
        ({}, False, []),
        ({"k": None}, False, []),
    ],
)
def test_require_list_accepts(body: dict[str, Any], required: bool, expected: list[Any]) -> None:
    got = require_list(body, "k", required=required)
    assert got == expected
    if "k" in body and body["k"] is not None:
        assert got is body["k"]  # the body's own list, not a copy


@pytest.mark.parametrize(
    ("body", "required", "fragment"),
    [
        ({}, True, "'k' is required"),
        ({"k": None}, True, "'k' is required"),
        ({"k": "x"}, True, "'k' must be an array"),
        ({"k": {"a": 1}}, False, "'k' must be an array"),
        ({"k": 0}, False, "'k' must be an array"),
        ({"k": (1, 2)}, False, "'k' must be an array"),
    ],
)
def test_require_list_refuses(body: dict[str, Any], required: bool, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        require_list(body, "k", required=required)
    refused(info.value, InvalidRequest, "k", fragment)


@pytest.mark.parametrize(
    ("body", "expected"),
    [({"model": "gpt-4o"}, "gpt-4o"), ({"model": "openai/gpt-4o"}, "openai/gpt-4o"), ({"model": "x"}, "x")],
)
def test_require_model_accepts(body: dict[str, Any], expected: str) -> None:
    assert require_model(body) == expected


@pytest.mark.parametrize("body", [{}, {"model": None}, {"model": ""}, {"model": 4}, {"model": ["gpt-4o"]}])
def test_require_model_refuses(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        require_model(body)
    refused(info.value, InvalidRequest, "model", "'model' is required and must be a non-empty string")


@pytest.mark.parametrize(
    ("messages", "tools", "message"),
    [
        (2, 1, None),  # at the limits: accepted
        (0, 0, None),
        (3, 0, "3 messages exceed the limit of 2"),
        (0, 2, "2 tools exceed the limit of 1"),
        (3, 2, "3 messages exceed the limit of 2"),  # messages are checked first
    ],
)
def test_check_counts(messages: int, tools: int, message: str | None) -> None:
    limits = Limits(max_messages=2, max_tools=1)
    if message is None:
        check_counts([{}] * messages, [{}] * tools, limits)
        return
    with pytest.raises(RequestTooLarge) as info:
        check_counts([{}] * messages, [{}] * tools, limits)
    assert info.value.message == message
    assert (info.value.status, error_code(info.value)) == (413, "request_too_large")


@pytest.mark.parametrize(
    ("body", "expected"),
    [({}, None), ({"k": None}, None), ({"k": 1}, 1.0), ({"k": 0}, 0.0), ({"k": -2}, -2.0),
     ({"k": 0.25}, 0.25)],
)
def test_opt_number_accepts(body: dict[str, Any], expected: float | None) -> None:
    got = opt_number(body, "k")
    assert got == expected
    assert got is None or type(got) is float


@pytest.mark.parametrize("value", [True, False, "1", [1], {"v": 1}])
def test_opt_number_refuses(value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        opt_number({"k": value}, "k")
    refused(info.value, InvalidRequest, "k", "'k' must be a number")


@pytest.mark.parametrize(
    ("body", "minimum", "expected"),
    [
        ({}, 0, None),
        ({"k": None}, 1, None),
        ({"k": 0}, 0, 0),
        ({"k": 1}, 1, 1),
        ({"k": -5}, -10, -5),
        ({"k": 2**70}, 1, 2**70),
    ],
)
def test_opt_int_accepts(body: dict[str, Any], minimum: int, expected: int | None) -> None:
    assert opt_int(body, "k", minimum=minimum) == expected


@pytest.mark.parametrize(
    ("value", "minimum"),
    [(0, 1), (-1, 0), (1.0, 0), (1.5, 0), (True, 0), (False, 0), ("3", 0), ([3], 0)],
)
def test_opt_int_refuses(value: Any, minimum: int) -> None:
    with pytest.raises(InvalidRequest) as info:
        opt_int({"k": value}, "k", minimum=minimum)
    refused(info.value, InvalidRequest, "k", f"'k' must be an integer >= {minimum}")


def test_opt_int_default_minimum_is_zero() -> None:
    assert opt_int({"k": 0}, "k") == 0
    with pytest.raises(InvalidRequest, match="'k' must be an integer >= 0"):
        opt_int({"k": -1}, "k")


@pytest.mark.parametrize(
    ("reason", "detail", "expected"),
    [
        ("budget_exhausted", "spent $2.00", "tollgate stopped this run (budget_exhausted): spent $2.00"),
        ("loop_detected", "", "tollgate stopped this run (loop_detected): "),
    ],
)
def test_stop_text(reason: str, detail: str, expected: str) -> None:
    assert stop_text(reason, detail) == expected


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("plain", "plain"),
        ("", ""),
        (None, ""),
        (5, "5"),
        ([], ""),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "a\nb"),
        (["x", {"text": "y"}], "x\ny"),  # bare strings and parts without a type
        ([{"type": "image_url", "image_url": {"url": "u"}}, {"type": "text", "text": "t"}], "t"),
        ([{"type": "text", "text": 5}, 1, None], ""),  # non-text parts are skipped
        ([{"type": "tool_result", "content": "r"}], "r"),
        ([{"type": "tool_result", "content": [{"type": "text", "text": "p"}, "q"]}], "p\nq"),
        ([{"type": "tool_result", "text": "t", "content": "c"}], "t"),  # a part's own text wins
        ([{"type": "text", "text": "a"}, {"type": "tool_result", "content": [{"text": "b"}]}], "a\nb"),
    ],
)
def test_content_text(content: Any, expected: str) -> None:
    assert content_text(content) == expected


def any_role(role: Any) -> bool:
    return isinstance(role, str)


def user_only(role: Any) -> bool:
    return bool(role == "user")


def req(**fields: Any) -> dict[str, Any]:
    """A chat body; a field given as None is left out."""
    return {k: v for k, v in {"model": "m", "messages": MSG, **fields}.items() if v is not None}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (req(), ("m", MSG, [], False)),
        (req(stream=True), ("m", MSG, [], True)),
        (req(stream=None), ("m", MSG, [], False)),  # null is "not streaming", as the OpenAI SDK sends it
        (req(stream=False, tools=[{"name": "t"}]), ("m", MSG, [{"name": "t"}], False)),
        (req(messages=[]), ("m", [], [], False)),
    ],
)
def test_request_basics_accepts(body: dict[str, Any], expected: tuple[Any, ...]) -> None:
    assert request_basics(body, Limits(), user_only, "must be user") == expected


SMALL = Limits(max_messages=2, max_tools=1)


@pytest.mark.parametrize(
    ("body", "role_ok", "limits", "cls", "param", "fragment"),
    [
        (req(model=None), any_role, Limits(), InvalidRequest, "model", "'model' is required"),
        (req(model="", messages="x"), any_role, Limits(), InvalidRequest, "model", "'model'"),  # model first
        (req(messages=None), any_role, Limits(), InvalidRequest, "messages", "'messages' is required"),
        (req(messages={}), any_role, Limits(), InvalidRequest, "messages", "must be an array"),
        (req(tools="t"), any_role, Limits(), InvalidRequest, "tools", "must be an array"),
        (req(messages=MSG * 3), any_role, SMALL, RequestTooLarge, None, "3 messages"),
        (req(tools=[{}, {}]), any_role, SMALL, RequestTooLarge, None, "2 tools"),
        (req(messages=MSG * 3, model=3), any_role, SMALL, InvalidRequest, "model", "'model'"),
        (req(messages=[*MSG, "hi"]), any_role, Limits(), InvalidRequest, "messages", "messages[1] RULE"),
        (req(messages=[{"content": "x"}]), any_role, Limits(), InvalidRequest, "messages", "[0] RULE"),
        (req(messages=[{"role": "system"}]), user_only, Limits(), InvalidRequest, "messages", "[0] RULE"),
        (req(stream="true"), any_role, Limits(), InvalidRequest, "stream", "'stream' must be a boolean"),
        (req(stream=1), any_role, Limits(), InvalidRequest, "stream", "'stream' must be a boolean"),
    ],
)
def test_request_basics_refuses(
    body: dict[str, Any], role_ok: Callable[[Any], bool], limits: Limits, cls: type[GatewayError],
    param: str | None, fragment: str,
) -> None:
    with pytest.raises(GatewayError) as info:
        request_basics(body, limits, role_ok, "RULE")
    refused(info.value, cls, param, fragment)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("END", ("END",)), ([], ()), (["a", "b"], ("a", "b")), (["a", 1, None, ["b"]], ("a",)),
     (7, None), ({"a": 1}, None)],
)
def test_opt_strings(value: object, expected: tuple[str, ...] | None) -> None:
    assert opt_strings(value) == expected


@pytest.mark.parametrize(("value", "expected"), [(None, 0), (0, 0), (12, 12), (12.0, 12), (2**53, 2**53)])
def test_token_count(value: object, expected: int) -> None:
    assert token_count(value) == expected


@pytest.mark.parametrize(
    "value", [-1, -0.5, 1.5, 2**53 + 1, 10**30, 1e300, float("inf"), float("nan"), True, "12", [1], {}]
)
def test_token_count_refuses_what_is_not_a_count(value: object) -> None:
    with pytest.raises(ValueError):
        token_count(value)


IMG = {"type": "image_url", "image_url": {"url": "https://x/a.png"}}


@pytest.mark.parametrize(
    ("body", "count"),
    [
        ({"messages": [{"role": "user", "content": "an image of text"}]}, 0),
        ({"messages": [{"role": "user", "content": [IMG, {"type": "text", "text": "x"}, IMG]}]}, 2),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
                    {"type": "function_call_output", "call_id": "c",
                     "output": [{"type": "input_image", "file_id": "f"}]}]}, 2),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]},
            {"type": "image", "source": {"type": "url", "url": "u"}}]}]}, 2),
        ({"messages": [{"role": "user", "content": [{"type": ["image"]}]}]}, 0),  # no type tollgate knows
        # a computer use screenshot is an image, by URL or by file id
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {
            "type": "computer_screenshot", "image_url": "https://x/s.png"}}]}, 1),
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {
            "type": "computer_screenshot", "file_id": "file-1"}}]}, 1),
    ],
)
def test_count_images(body: dict[str, Any], count: int) -> None:
    assert count_images(body, orjson.dumps(body)) == count


@pytest.mark.parametrize(
    ("body", "count"),
    [
        ({"messages": [{"role": "user", "content": "a file about documents"}]}, 0),
        ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}]}, 1),
        ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_data": "data:..."}}]}]}, 0),
        ({"messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}},
            {"type": "document", "source": {"type": "file", "file_id": "f"}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVB"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}}]}]}, 2),
        ({"messages": [{"role": "user", "content": [{"type": ["file"], "file": {"file_id": "x"}}]}]}, 0),
    ],
)
def test_count_referenced_documents(body: dict[str, Any], count: int) -> None:
    assert count_referenced_documents(body, orjson.dumps(body)) == count



ESCAPED = [  # the same JSON strings, one character spelled as a `\\u` escape: what Anthropic parses alike
    (b'"image"', b'"\\u0069mage"'),
    (b'"document"', b'"\\u0064ocument"'),
    (b'"file"', b'"\\u0066ile"'),
    (b'"file_id"', b'"\\u0066ile_id"'),
]


def escaped(body: dict[str, Any]) -> bytes:
    raw = orjson.dumps(body)
    for plain, spelled in ESCAPED:
        raw = raw.replace(plain, spelled)
    assert orjson.loads(raw) == body
    return raw


def test_an_escaped_spelling_does_not_skip_the_walk() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "u"}}
    document = {"type": "document", "source": {"type": "url", "url": "u"}}
    file = {"type": "file", "file": {"file_id": "f"}}
    body = {"messages": [{"role": "user", "content": [image, image, document, file]}]}
    raw = escaped(body)
    assert b"image" not in raw and b"document" not in raw and b"file" not in raw
    assert (count_images(body, raw), count_referenced_documents(body, raw)) == (2, 2)


def test_a_body_without_the_word_or_an_escape_is_not_walked() -> None:
    """The fast path: bytes that cannot hold the type are trusted (the body is never walked)."""
    body = {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}
    assert count_images(body, b'{"messages":[]}') == 0
    assert count_images(body, b'{"x":"\\u0041"}') == 1  # any escape: walked


def pdf_of(pages: int, *, packed: int = 0, escape: bool = False, count: int | None = None) -> bytes:
    """A PDF of `pages` page objects, `packed` of them more inside a Flate object stream (as PDF 1.5
    writers store them), names spelled with `#xx` escapes if `escape`, a page tree `/Count` if given."""
    page = b"/Ty#70e /P#61ge" if escape else b"/Type /Page"
    out = b"%PDF-1.5\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n"
    if count is not None:
        out += b"2 0 obj\n<< /Type /Pages /Count " + str(count).encode() + b" >>\nendobj\n"
    out += b"".join(b"%d 0 obj\n<< " % (3 + i) + page + b" /Parent 2 0 R >>\nendobj\n" for i in range(pages))
    if packed:
        stream = zlib.compress(b" ".join(b"<< " + page + b" /Parent 2 0 R >>" for _ in range(packed)))
        out += (b"99 0 obj\n<< /Type /ObjStm /N %d /First 0 /Filter /FlateDecode /Length %d >>\nstream\n"
                % (packed, len(stream)) + stream + b"\nendstream\nendobj\n")
    return out + b"trailer\n<< /Root 1 0 R >>\n%%EOF\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("pdf", "pages"),
    [
        (pdf_of(1), 1),
        (pdf_of(40, count=40), 40),  # the `/Pages` tree is not a page
        (pdf_of(2, packed=3), 5),  # pages inside a compressed object stream count too
        (pdf_of(0, packed=4, escape=True), 4),  # `/Ty#70e /P#61ge` is `/Type /Page`
        (pdf_of(2, count=9), 9),  # a tree that says more than the objects found: the larger
        (b"junk before\n" + pdf_of(1), 1),  # readers look for the header in the first 1,024 bytes
    ],
)
def test_pdf_pages(pdf: bytes, pages: int) -> None:
    assert pdf_pages(b64(pdf)) == pages


BOMB = b"%PDF-1.5\n1 0 obj\n<< /Type /ObjStm /Filter /FlateDecode >>\nstream\n"


@pytest.mark.parametrize(
    "data",
    [
        "not base64 at all!",  # decodes to no PDF
        "QUJD=",  # bad padding
        "ünïcode",
        b64(b"GIF89a..."),  # not a PDF
        b64(pdf_of(0)),  # no page found
        b64(pdf_of(2).replace(b"trailer\n<<", b"trailer\n<< /Encrypt 5 0 R")),  # encrypted
        b64(BOMB + zlib.compress(b" " * (65 << 20)) + b"\nendstream\n"),  # inflates past any object stream
        b64(BOMB + b"not deflated\nendstream\n"),
        b64(BOMB.replace(b"/FlateDecode", b"/LZWDecode") + b"x\nendstream\n"),  # a filter not read here
        b64(BOMB + b"no end"),
    ],
)
def test_pdf_pages_none_when_they_cannot_be_counted(data: str) -> None:
    assert pdf_pages(data) is None


def pdf_block(data: Any, media_type: str = "application/pdf") -> dict[str, Any]:
    return {"type": "document", "source": {"type": "base64", "media_type": media_type, "data": data}}


def test_pdf_documents_counts_pages_and_what_cannot_be_counted() -> None:
    content = [pdf_block(b64(pdf_of(3))), pdf_block(b64(pdf_of(2))), pdf_block("!!"), pdf_block(7),
               pdf_block(b64(pdf_of(1)), "image/png"),
               {"type": "document", "source": {"type": "url", "url": "u"}},  # counted as referenced
               {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}},
               {"type": "tool_result", "tool_use_id": "t", "content": [pdf_block(b64(pdf_of(4)))]}]
    body = {"messages": [{"role": "user", "content": content}]}
    assert pdf_documents(body, orjson.dumps(body)) == (3 + 2 + 4, 3)
    assert pdf_documents(body, escaped(body)) == (9, 3)


def test_pdf_documents_decodes_nothing_without_a_document() -> None:
    body = {"messages": [{"role": "user", "content": [pdf_block("!!")]}]}
    assert pdf_documents(body, b'{"messages":[]}') == (0, 0)  # the bytes say no document: no walk


def test_pdfs_openai_reads_inline_are_counted_too() -> None:
    """Chat Completions `file` parts and Responses `input_file` parts carry a PDF as a data URL."""
    url = "data:application/pdf;base64," + b64(pdf_of(5))
    content = [{"type": "file", "file": {"filename": "a.pdf", "file_data": url}},
               {"type": "input_file", "filename": "b.pdf", "file_data": url},
               {"type": "input_file", "filename": "c.pdf", "file_data": "data:application/pdf;base64,!!"},
               {"type": "input_file", "filename": "d.txt", "file_data": "data:text/plain;base64,aGk="},
               {"type": "file", "file": {"file_id": "file-1"}}]  # named, not sent: counted as referenced
    body = {"messages": [{"role": "user", "content": content}]}
    assert pdf_documents(body, orjson.dumps(body)) == (10, 1)
    assert input_parts(body, orjson.dumps(body)) == (10 * PDF_PAGE_IMAGES, 2)


@pytest.mark.parametrize(("raw", "walks"), [
    (b'{"content": "caf\\u00e9 \\u4e2d"}', False),  # escapes of non-ASCII letters spell no type name
    (b'{"type": "\\u0069mage"}', True),  # "image" spelled with an escape
    (b'{"type": "\\u0049MAGE"}', True),  # any escaped ASCII letter: walked, the walk decides
    (b'{"type": "image_url"}', True),
    (b'{"content": "plain"}', False),
])
def test_the_byte_pre_filter_walks_a_body_only_when_a_type_name_may_hide_in_it(raw: bytes, walks: bool) -> None:
    assert common.may_contain(raw, b"image") is walks


@pytest.mark.parametrize(("url", "data"), [
    ("data:application/pdf;base64,QUJD", "QUJD"),
    ("DATA:Application/PDF ; name=report.pdf ; base64,QUJD", "QUJD"),  # parameters, case, blanks
    ("data:text/plain;base64,aGk=", None),  # another media type: bounded by its bytes
    ("data:application/pdf,%25PDF", ""),  # a PDF not in base64: uncounted
    ("QUJD", ""),  # not a data URL: uncounted
])
def test_a_pdf_data_url_is_read_whatever_its_parameters(url: str, data: str | None) -> None:
    assert common._data_url_pdf(url) == data
