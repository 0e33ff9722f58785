"""Loopback spellings of one server match: an origin listed as ``localhost`` guards requests to ``127.0.0.1``
(and the reverse, and ``[::1]``), in install() and in a guard's own origins. Users write whichever spelling their
config has; a silent mismatch would leave every request unguarded."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy, GuardTransport, Origin
from llama_guard._core.origins import OriginRegistry
from llama_guard.testing import LlamaServerEmulator

CHAT = "/v1/chat/completions"


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()


def _alternate(client: httpx.Client, n: int) -> list[object]:
    """``n`` completions, every other one streamed, on one pooled client: what each returned or raised."""
    outcomes: list[object] = []
    for index in range(n):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": index % 2 == 1}
        try:
            with client.stream("POST", CHAT, json=body) as response:
                response.read()
                outcomes.append(response.status_code)
        except httpx.TransportError as exc:
            outcomes.append(exc)
    return outcomes


@pytest.mark.parametrize(
    ("listed", "called"),
    [("localhost", "127.0.0.1"), ("127.0.0.1", "localhost"), ("[::1]", "127.0.0.1"), ("localhost", "localhost")],
)
def test_install_guards_the_other_loopback_spelling(listed: str, called: str, racy_server: LlamaServerEmulator) -> None:
    """The server drops every request sent on a connection after a stream; guarded, none is lost."""
    with httpx.Client(base_url=f"http://{called}:{racy_server.port}") as plain:
        lost = [o for o in _alternate(plain, 6) if isinstance(o, Exception)]
    assert len(lost) == 2  # the control: unguarded, the requests after the streams are lost

    installation = llama_guard.install(origins=[f"http://{listed}:{racy_server.port}"])
    with httpx.Client(base_url=f"http://{called}:{racy_server.port}") as client:
        outcomes = _alternate(client, 6)
    assert outcomes == [200] * 6
    assert installation.stats.snapshot().requests == 6


def test_a_guard_transport_listing_localhost_guards_127_0_0_1(racy_server: LlamaServerEmulator) -> None:
    policy = GuardPolicy(origins=[f"http://localhost:{racy_server.port}"])
    transport = GuardTransport(policy=policy)
    with httpx.Client(transport=transport, base_url=f"http://127.0.0.1:{racy_server.port}") as client:
        assert _alternate(client, 6) == [200] * 6
    assert transport.stats.snapshot().requests == 6


@pytest.mark.parametrize(
    ("listed", "request_origin", "matches"),
    [
        ("http://localhost:8080", Origin("http", "127.0.0.1", 8080), True),
        ("http://127.0.0.1:8080", Origin("http", "::1", 8080), True),
        ("http://localhost:8080", Origin("http", "127.0.0.1", 8081), False),  # another port: another server
        ("http://localhost:8080", Origin("https", "127.0.0.1", 8080), False),  # another scheme
        ("http://localhost:8080", Origin("http", "127.0.0.2", 8080), False),  # another address
        ("http://example.com:8080", Origin("http", "127.0.0.1", 8080), False),
    ],
)
def test_loopback_matching_table(listed: str, request_origin: Origin, matches: bool) -> None:
    assert OriginRegistry([listed]).is_llama(request_origin) is matches


def test_a_learnt_loopback_origin_covers_its_other_spellings() -> None:
    registry = OriginRegistry("auto")
    assert registry.learn(Origin("http", "127.0.0.1", 8080), {"server": "llama.cpp"})
    assert registry.is_llama(Origin("http", "localhost", 8080))
    assert not registry.is_llama(Origin("http", "localhost", 8081))
