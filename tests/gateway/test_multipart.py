"""`gateway.multipart`: one form field of a multipart body, found and replaced without touching the rest."""

from __future__ import annotations

import pytest

from gateway.multipart import boundary_of, replace_field, text_field

CT = "multipart/form-data; boundary=XyZ"


def body(*parts: tuple[str, bytes]) -> bytes:
    return b"".join(b"--XyZ\r\n" + head.encode() + b"\r\n\r\n" + value + b"\r\n" for head, value in parts) + b"--XyZ--\r\n"


MODEL = ('Content-Disposition: form-data; name="model"', b"groq/whisper-large-v3")
FILE = ('Content-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav', b"RIFF\r\n--Xy")


@pytest.mark.parametrize(("content_type", "boundary"), [
    (CT, b"XyZ"), ('multipart/form-data; boundary="a b"', b"a b"), ("Multipart/Form-Data;boundary=q", b"q"),
    ("application/json", None), ("multipart/form-data", None), ("multipart/mixed; boundary=XyZ", None),
    ("multipart/form-data; boundary=" + "x" * 201, None), ("multipart/form-data; boundary=\u00e9", None),
])
def test_boundary_of(content_type: str, boundary: bytes | None) -> None:
    assert boundary_of(content_type) == boundary


@pytest.mark.parametrize("parts", [(MODEL, FILE), (FILE, MODEL), (("Content-Disposition: form-data; name=x", b"1"), MODEL)])
def test_the_field_is_found_wherever_it_is(parts: tuple[tuple[str, bytes], ...]) -> None:
    raw = body(*parts)
    found = text_field(raw, CT, "model")
    assert found is not None and found[0] == "groq/whisper-large-v3"
    assert replace_field(raw, found[1], "whisper-large-v3") == raw.replace(b"groq/whisper-large-v3", b"whisper-large-v3")


@pytest.mark.parametrize("raw", [
    body(FILE),  # no such field
    body(('Content-Disposition: form-data; name="model"; filename="m.txt"', b"gpt-4o")),  # a file named model
    body(('Content-Disposition: form-data; name="models"', b"gpt-4o")),
    body(('Content-Disposition: form-data; name="model"', b"\xff\xfe")),  # not UTF-8
    b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ngpt-4o",  # never closed
    b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"",  # no end of headers
    b"garbage", b"", b"x--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ngpt\r\n--XyZ--",
])
def test_nothing_is_found_in_what_is_not_that_field(raw: bytes) -> None:
    assert text_field(raw, CT, "model") is None


def test_a_body_that_is_not_multipart_is_not_read() -> None:
    assert text_field(body(MODEL), "application/json", "model") is None


def test_padding_after_a_delimiter_and_an_empty_value() -> None:
    raw = b"--XyZ  \r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n\r\n--XyZ--"
    assert text_field(raw, CT, "model") == ("", slice(raw.index(b"\r\n\r\n") + 4, raw.index(b"\r\n\r\n") + 4))
