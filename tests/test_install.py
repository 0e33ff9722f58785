"""`install()` / `uninstall()`: the process-wide guard, on real loopback sockets.

httpx and httpx2 are both imported in this process already, so these tests cover "imported before install()";
tests/test_install_subprocess.py covers the other import orders in fresh interpreters.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import httpx2
import pytest

import llama_guard
from llama_guard import GuardPolicy
from llama_guard._runtime import new_process_state
from llama_guard.testing import LlamaServerEmulator

from ._recording_server import RecordingServer

CHAT = "/v1/chat/completions"
LIBRARIES = {"httpx": httpx, "httpx2": httpx2}
FLAVORS = ("sync", "asyncio", "trio")
TARGETS = [
    (httpx.HTTPTransport, "handle_request"),
    (httpx.AsyncHTTPTransport, "handle_async_request"),
    (httpx2.HTTPTransport, "handle_request"),
    (httpx2.AsyncHTTPTransport, "handle_async_request"),
]
ORIGINALS = {(cls, name): cls.__dict__[name] for cls, name in TARGETS}


def chat(stream: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 4}


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()
    for (cls, name), original in ORIGINALS.items():
        assert cls.__dict__[name] is original, f"{cls.__module__}.{cls.__name__}.{name} was left patched"


def alternate_streams(library: str, flavor: str, url: str, n: int, client: Any = None) -> list[Any]:
    """``n`` chat completions, every other one streamed, over one pooled client; what each returned or raised."""
    lib = LIBRARIES[library]
    outcomes: list[Any] = []
    if flavor == "sync":
        with client if client is not None else lib.Client(base_url=url) as c:
            for index in range(n):
                try:
                    with c.stream("POST", CHAT, json=chat(stream=index % 2 == 1)) as response:
                        response.read()
                        outcomes.append(response)
                except lib.TransportError as exc:
                    outcomes.append(exc)
        return outcomes

    async def scenario() -> None:
        async with client if client is not None else lib.AsyncClient(base_url=url) as c:
            for index in range(n):
                try:
                    async with c.stream("POST", CHAT, json=chat(stream=index % 2 == 1)) as response:
                        await response.aread()
                        outcomes.append(response)
                except lib.TransportError as exc:
                    outcomes.append(exc)

    anyio.run(scenario, backend=flavor)
    return outcomes


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("library", LIBRARIES)
def test_install_guards_plain_clients(library: str, flavor: str, racy_server: LlamaServerEmulator) -> None:
    """A plain client (created before install()) loses requests after streams; installed, it loses none."""
    lib = LIBRARIES[library]
    before = lib.Client(base_url=racy_server.url) if flavor == "sync" else lib.AsyncClient(base_url=racy_server.url)
    plain = alternate_streams(library, flavor, racy_server.url, 30)
    # Every non-streamed request after the first went to the connection a stream left, and was dropped there.
    lost = [index for index, o in enumerate(plain) if isinstance(o, Exception)]
    assert lost == list(range(2, 30, 2))
    assert racy_server.wait_for(lambda s: s.requests_dropped_after_stream == len(lost))

    installation = llama_guard.install(origins=[racy_server.url])
    ran_before = racy_server.stats().completions_started
    guarded = alternate_streams(library, flavor, racy_server.url, 30, client=before)
    assert [o for o in guarded if isinstance(o, Exception)] == []
    assert all(isinstance(o.extensions["llama_guard"], llama_guard.GuardResult) for o in guarded)
    stats = installation.stats.snapshot()
    assert stats.requests == 30
    assert stats.stream_connections_closed == 15
    server = racy_server.stats()
    assert server.completions_started - ran_before == 30  # none ran twice
    assert server.requests_dropped_after_stream == len(lost)  # and none was lost


def test_auto_mode_learns_llama_servers_from_their_server_header(racy_server: LlamaServerEmulator) -> None:
    installation = llama_guard.install()
    assert installation.origins == "auto"
    with httpx.Client(base_url=racy_server.url) as client:
        first = client.get("/health")
        assert "llama_guard" not in first.extensions  # unknown until it says who it is
        second = client.get("/health")
    assert isinstance(second.extensions["llama_guard"], llama_guard.GuardResult)
    assert installation.known_origins() == {llama_guard.Origin.of("http", "127.0.0.1", racy_server.port)}
    assert installation.stats.snapshot().requests == 1


def exchange_with(url: str) -> list[tuple[int, list[tuple[str, str]], bytes, list[str]]]:
    """A few requests of every kind the guard looks at; what the client saw of each."""
    seen = []
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer not-a-real-key"}) as client:
        for method, path, body in [
            ("GET", "/health", None),
            ("POST", CHAT, chat(stream=True)),
            ("POST", CHAT, chat(stream=False)),
            ("POST", CHAT, chat(stream=True)),
            ("GET", "/v1/models", None),
        ]:
            response = client.request(method, path, json=body)
            seen.append(
                (response.status_code, response.headers.multi_items(), response.content, sorted(response.extensions))
            )
    return seen


@pytest.mark.parametrize("origins", [None, ["http://127.0.0.1:1"]], ids=["auto", "other-origin-listed"])
def test_other_traffic_is_byte_for_byte_unchanged(origins: list[str] | None) -> None:
    """Against a server that is not llama-server, the bytes on the wire and what the client sees are identical."""
    server = RecordingServer()
    try:
        without = exchange_with(server.url)
        wire_without = list(server.received)
        server.received.clear()
        installation = llama_guard.install(origins=origins)
        with_install = exchange_with(server.url)
        wire_with = list(server.received)
    finally:
        server.close()
    assert len(wire_without) == 1, "one pooled connection, no probe"
    assert wire_with == wire_without
    assert with_install == without
    if origins is None:
        assert installation.known_origins() == frozenset()  # nginx is not llama.cpp: nothing learnt
    assert installation.stats.snapshot().requests == 0


#: Both connection strategies: the default ("auto": close on the emulator's loopback address, no probe) and "reuse"
#: (keep-alive, every new connection probed).
STRATEGIES = pytest.mark.parametrize("connection", ["auto", "reuse"])


@STRATEGIES
def test_install_twice_is_harmless_and_a_new_policy_replaces_the_old(
    connection: str, racy_server: LlamaServerEmulator
) -> None:
    policy = GuardPolicy(connection=connection)  # type: ignore[arg-type]
    first = llama_guard.install(origins=[racy_server.url], policy=policy)
    assert llama_guard.install(origins=[racy_server.url], policy=policy) is first
    assert httpx.HTTPTransport.handle_request.__wrapped__ is ORIGINALS[(httpx.HTTPTransport, "handle_request")]
    with httpx.Client(base_url=racy_server.url) as client:
        result = client.get("/health").extensions["llama_guard"]
    assert result.attempts == 1
    assert result.connection == ("reuse" if connection == "reuse" else "close")
    assert first.stats.snapshot().requests == 1
    assert first.stats.snapshot().probes_sent == (1 if connection == "reuse" else 0)  # one guard, one probe at most

    second = llama_guard.install(
        origins=[racy_server.url],
        policy=GuardPolicy(connection=connection, probe=False),  # type: ignore[arg-type]
    )
    assert second is not first
    assert second.policy.probe is False
    assert httpx.HTTPTransport.handle_request.__wrapped__ is ORIGINALS[(httpx.HTTPTransport, "handle_request")]
    with httpx.Client(base_url=racy_server.url) as client:
        client.get("/health")
    assert second.stats.snapshot().requests == 1
    assert second.stats.snapshot().probes_sent == 0
    assert first.stats.snapshot().requests == 1  # the old guard saw nothing more


def test_uninstall_restores_the_originals(racy_server: LlamaServerEmulator) -> None:
    llama_guard.uninstall()  # harmless when nothing is installed
    llama_guard.install(origins=[racy_server.url])
    for cls, name in TARGETS:
        assert cls.__dict__[name] is not ORIGINALS[(cls, name)]
    with httpx.Client(base_url=racy_server.url) as client:
        assert "llama_guard" in client.get("/health").extensions
        llama_guard.uninstall()
        for cls, name in TARGETS:
            assert cls.__dict__[name] is ORIGINALS[(cls, name)]
        assert "llama_guard" not in client.get("/health").extensions
    assert llama_guard._install.patching.installation() is None


@STRATEGIES
def test_an_explicitly_guarded_client_is_not_guarded_twice(connection: str, racy_server: LlamaServerEmulator) -> None:
    policy = GuardPolicy(connection=connection)  # type: ignore[arg-type]
    installation = llama_guard.install(origins=[racy_server.url], policy=policy)
    with llama_guard.guard(httpx.Client(base_url=racy_server.url), policy=policy) as client:
        result = client.get("/health").extensions["llama_guard"]
        own = client._transport.stats.snapshot()
    assert result.attempts == 1
    assert own.requests == 1
    assert own.probes_sent == (1 if connection == "reuse" else 0)  # one guard, one probe at most
    assert installation.stats.snapshot().requests == 0


def test_a_transport_with_its_own_process_state_is_not_guarded_twice(racy_server: LlamaServerEmulator) -> None:
    # Which transports a guard wraps is a fact about those objects, not about what one ProcessState has learnt: a
    # guard handed a process state of its own (tests do) must still be seen by install()'s class patches.
    installation = llama_guard.install(origins=[racy_server.url])
    inner = httpx.HTTPTransport()
    transport = llama_guard.GuardTransport(inner, process=new_process_state())
    with httpx.Client(base_url=racy_server.url, transport=transport) as client:
        result = client.get("/health").extensions["llama_guard"]
    assert result.attempts == 1
    assert transport.stats.snapshot().requests == 1
    assert installation.stats.snapshot().requests == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"origins": "all"}, "never every origin"),
        ({"origins": ["ftp://x"]}, "'ftp://x' is not an origin"),
        ({"origins": []}, "at least one origin"),
        ({"policy": GuardPolicy(origins="auto")}, "install(origins=[...])"),
    ],
)
def test_bad_arguments_say_what_is_accepted(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llama_guard.install(**kwargs)
    assert llama_guard._install.patching.installation() is None


def test_a_policy_of_the_wrong_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"llama_guard\.GuardPolicy"):
        llama_guard.install(policy={"probe": False})  # type: ignore[arg-type]
