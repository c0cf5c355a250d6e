"""`gateway.body_codings`: a body coding tollgate does not read is a 400, never forwarded as if it were
the body; the ones it reads decode whole, stop at the limit, and a truncated stream is refused."""

from __future__ import annotations

import gzip
import zlib

import pytest
from multidict import CIMultiDict

from gateway.body_codings import BodyDecoder, codings, decoder_for, refuse_unread_codings
from gateway.errors import UndecodableBody
from tests.conftest import GatewayFactory

READ: list[list[tuple[str, str]]] = [
    [],
    [("Content-Encoding", "gzip")],
    [("Content-Encoding", " GZIP ")],
    [("Content-Encoding", "identity")],
    [("Transfer-Encoding", "chunked")],
    [("Transfer-Encoding", "Chunked"), ("Content-Encoding", "deflate")],
]

REFUSED: list[list[tuple[str, str]]] = [
    [("Content-Encoding", "br")],  # documented once, never decoded: no decoder ships with tollgate
    [("Content-Encoding", "zstd")],
    [("Content-Encoding", "x-gzip")],
    [("Content-Encoding", "compress")],
    [("Content-Encoding", "gzip, deflate")],
    [("Content-Encoding", "gzip"), ("Content-Encoding", "gzip")],
    [("Transfer-Encoding", "gzip, chunked")],
    [("Transfer-Encoding", "gzip"), ("Transfer-Encoding", "chunked")],
]


@pytest.mark.parametrize("fields", READ, ids=[str(f) for f in READ])
def test_codings_the_server_decodes_pass(fields: list[tuple[str, str]]) -> None:
    refuse_unread_codings(CIMultiDict(fields))


@pytest.mark.parametrize("fields", REFUSED, ids=[str(f) for f in REFUSED])
def test_codings_the_server_leaves_encoded_are_refused(fields: list[tuple[str, str]]) -> None:
    with pytest.raises(UndecodableBody) as info:
        refuse_unread_codings(CIMultiDict(fields))
    assert info.value.status == 400


def test_codings_reads_a_plain_mapping_too() -> None:
    assert codings({"Content-Encoding": "gzip, br"}, "content-encoding") == ["gzip", "br"]


async def test_an_undecoded_upload_is_refused_and_never_forwarded(gateway_factory: GatewayFactory) -> None:
    """Found by a wire probe: `Content-Encoding: x-gzip` reached the upstream as gzip bytes with no
    coding header (tollgate drops it, since it sends what it read): a corrupt file upload."""
    h = await gateway_factory()
    payload = gzip.compress(b"hello world")
    async with h.session.post(f"{h.url}/v1/files", data=payload, headers={
            "Content-Type": "application/octet-stream", "Content-Encoding": "x-gzip"}) as resp:
        body = await resp.json()
    assert resp.status == 400, body
    assert body["error"]["code"] == "invalid_request" and "x-gzip" in body["error"]["message"]
    assert not [r for r in h.fake.seen if r.path.endswith("/files")]
    async with h.session.post(f"{h.url}/v1/files", data=gzip.compress(b"hello world"), headers={
            "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}) as resp:
        await resp.read()
    [sent] = [r for r in h.fake.seen if r.path.endswith("/files")]
    assert sent.body == b"hello world"  # decoded by the server, forwarded as the body it is


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


PLAIN = b'{"model": "m", "messages": []}' * 50
DECODES = {
    "gzip": gzip.compress(PLAIN),
    "gzip, two members": gzip.compress(PLAIN[:700]) + gzip.compress(PLAIN[700:]),
    "gzip, zero padding": gzip.compress(PLAIN) + b"\0" * 9,  # as gzip(1) and Python's gzip accept
    "zlib deflate": zlib.compress(PLAIN),
    "raw deflate": raw_deflate(PLAIN),
}


@pytest.mark.parametrize("name", DECODES)
@pytest.mark.parametrize("size", [1, 2, 7, 4096])
def test_a_body_decodes_whole_however_it_is_cut(name: str, size: int) -> None:
    data = DECODES[name]
    decoder = BodyDecoder("gzip" if name.startswith("gzip") else "deflate")
    out = b"".join(decoder.feed(data[i:i + size], 10**6) for i in range(0, len(data), size))
    decoder.finish()
    assert out == PLAIN


@pytest.mark.parametrize(("coding", "data", "message"), [
    ("gzip", gzip.compress(PLAIN)[:-9], "ends before its end"),  # aiohttp took a truncated gzip body as whole
    ("deflate", zlib.compress(PLAIN)[:-5], "ends before its end"),
    ("gzip", b"not gzip at all", "not valid gzip"),
    ("deflate", zlib.compress(PLAIN) + b"junk", "data after the end"),
    ("gzip", gzip.compress(PLAIN) + b"junk", "not valid gzip"),
], ids=["gzip truncated", "deflate truncated", "not gzip", "deflate then junk", "gzip then junk"])
def test_a_broken_or_truncated_stream_is_refused(coding: str, data: bytes, message: str) -> None:
    decoder = BodyDecoder(coding)
    with pytest.raises(UndecodableBody, match=message):
        decoder.feed(data, 10**6)
        decoder.finish()


def test_decoding_stops_one_byte_past_the_room() -> None:
    """A bomb (1 GiB of zeros in 1 MB) is decoded no further than the limit allows."""
    bomb = zlib.compress(b"\0" * 50_000_000, 9)
    decoder = BodyDecoder("deflate")
    assert len(decoder.feed(bomb, 1000)) == 1001


def test_an_empty_body_needs_no_stream_and_identity_no_decoder() -> None:
    BodyDecoder("gzip").finish()
    assert decoder_for({"Content-Encoding": "identity"}) is None and decoder_for({}) is None


async def test_a_truncated_gzip_upload_is_refused_not_forwarded_in_part(gateway_factory: GatewayFactory) -> None:
    """A gzip body cut mid-stream was a 200: the upstream got 151 of the file's 36,183 bytes."""
    h = await gateway_factory()
    whole = gzip.compress(bytes(range(256)) * 150)
    async with h.session.post(f"{h.url}/v1/files", data=whole[: len(whole) // 2], headers={
            "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}) as resp:
        body = await resp.json()
    assert resp.status == 400 and "truncated" in body["error"]["message"], body
    assert not [r for r in h.fake.seen if r.path.endswith("/files")]
