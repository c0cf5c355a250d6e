"""`gateway.body_codings`: a body coding the server leaves undecoded is a 400, never forwarded as if
it were the body; end to end, the upstream never receives such bytes."""

from __future__ import annotations

import gzip

import pytest
from multidict import CIMultiDict

from gateway.body_codings import codings, refuse_unread_codings
from gateway.errors import UndecodableBody
from tests.conftest import GatewayFactory

READ: list[list[tuple[str, str]]] = [
    [],
    [("Content-Encoding", "gzip")],
    [("Content-Encoding", " GZIP ")],
    [("Content-Encoding", "identity")],
    [("Content-Encoding", "br")],
    [("Transfer-Encoding", "chunked")],
    [("Transfer-Encoding", "Chunked"), ("Content-Encoding", "deflate")],
]

REFUSED: list[list[tuple[str, str]]] = [
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
