"""gateway/admin_guard.py: browser requests the admin port refuses."""

from __future__ import annotations

import pytest

from gateway.admin_guard import cross_site_refusal, host_refusal


@pytest.mark.parametrize(
    ("method", "headers", "refused"),
    [
        ("POST", {}, False),  # the CLI, curl: no browser headers
        ("POST", {"sec-fetch-site": "same-origin", "origin": "http://127.0.0.1:9464", "host": "127.0.0.1:9464"}, False),
        ("POST", {"sec-fetch-site": "none"}, False),  # typed into the address bar
        ("POST", {"sec-fetch-site": "cross-site"}, True),
        ("POST", {"sec-fetch-site": "same-site"}, True),  # another port of localhost is another app
        ("POST", {"origin": "https://evil.example", "host": "127.0.0.1:9464"}, True),
        ("POST", {"origin": "null", "host": "127.0.0.1:9464"}, True),  # sandboxed frame, file: page
        ("POST", {"origin": "http://127.0.0.1:8080", "host": "127.0.0.1:9464"}, True),
        ("DELETE", {"origin": "https://evil.example", "host": "127.0.0.1:9464"}, True),
        ("GET", {"sec-fetch-site": "cross-site", "origin": "https://evil.example"}, False),  # reads: see host
    ],
)
def test_cross_site_refusal(method: str, headers: dict[str, str], refused: bool) -> None:
    assert (cross_site_refusal(method, headers) is not None) is refused


@pytest.mark.parametrize(
    ("host", "local", "refused"),
    [
        ("127.0.0.1:9464", "127.0.0.1", False),
        ("localhost:9464", "127.0.0.1", False),
        ("LOCALHOST.:9464", "127.0.0.1", False),
        ("[::1]:9464", "::1", False),
        ("app.localhost", "127.0.0.1", False),
        ("127.0.0.2", "127.0.0.1", False),
        ("rebind.evil.example:9464", "127.0.0.1", True),  # DNS rebinding
        ("10.0.0.5:9464", "127.0.0.1", True),
        (None, "127.0.0.1", True),
        ("", "::1", True),
        ("[::1", "::1", True),
        ("rebind.evil.example", "10.0.0.5", False),  # exposed on purpose: the token guards it
        ("rebind.evil.example", None, False),
    ],
)
def test_host_refusal(host: str | None, local: str | None, refused: bool) -> None:
    assert (host_refusal(host, local) is not None) is refused
