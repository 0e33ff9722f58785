"""`uninstall()` leaves every client's pool exactly as it was before `install()`, and in "auto" mode `install()`
does not touch the pool of a client that only talks to other servers.

The guard changes a pool instance (keep-alive expiry, httpcore 1.x's race fix, the network backend and
``create_connection`` hooks): each test compares the pool's whole instance dict, and its class dict, before and
after, on real loopback sockets, for httpx and httpx2, sync and async.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

import llama_guard
from llama_guard.testing import LlamaServerEmulator

from ._recording_server import RecordingServer

LIBRARIES = {"httpx": httpx, "httpx2": httpx2}
FLAVORS = ("sync", "asyncio")
CHAT = "/v1/chat/completions"


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()


@pytest.fixture
def other_server() -> Iterator[RecordingServer]:
    """A keep-alive HTTP server that is not llama-server (``Server: nginx``)."""
    server = RecordingServer()
    yield server
    server.close()


def pool_state(pool: Any) -> dict[str, Any]:
    """The pool's instance dict (values compared by ``==``: identity for the backend, the lock, the SSL context)
    and its class's dict."""
    instance = {k: list(v) if isinstance(v, list) else v for k, v in vars(pool).items()}  # httpcore appends in place
    return {"instance": instance, "class": dict(vars(type(pool)))}


def idle_pool_state(pool: Any) -> dict[str, Any]:
    """`pool_state` without the connections and requests in flight, which any use of a client changes."""
    state = pool_state(pool)
    state["instance"] = {k: v for k, v in state["instance"].items() if k not in ("_connections", "_requests")}
    return state


REQUESTS = (
    ("POST", CHAT, {"messages": [], "max_tokens": 2}),
    ("POST", CHAT, {"messages": [], "stream": True, "max_tokens": 2}),
    ("GET", "/health", None),
)


class Client:
    """A plain httpx/httpx2 client, sync or async (its calls run in one event loop, through a portal)."""

    def __init__(self, library: str, flavor: str, portal: BlockingPortal | None) -> None:
        lib = LIBRARIES[library]
        self.client: Any = lib.Client() if portal is None else lib.AsyncClient()
        self.pool = self.client._transport._pool
        self._portal = portal

    def exchange(self, url: str, first: str = "plain") -> list[bool]:
        """A plain and a streamed completion (the stream first if ``first="stream"``), then a health check; whether
        each came back through the guard."""
        requests = REQUESTS if first == "plain" else (REQUESTS[1], REQUESTS[0], REQUESTS[2])
        if self._portal is not None:
            return self._portal.call(self._async_exchange, url, requests)
        guarded = []
        for method, path, body in requests:
            with self.client.stream(method, url + path, json=body) as response:
                response.read()
                guarded.append("llama_guard" in response.extensions)
        return guarded

    async def _async_exchange(self, url: str, requests: tuple[Any, ...]) -> list[bool]:
        guarded = []
        for method, path, body in requests:
            async with self.client.stream(method, url + path, json=body) as response:
                await response.aread()
                guarded.append("llama_guard" in response.extensions)
        return guarded

    def close(self) -> None:
        if self._portal is None:
            self.client.close()
        else:
            self._portal.call(self.client.aclose)


@contextlib.contextmanager
def plain_client(library: str, flavor: str) -> Iterator[Client]:
    if flavor == "sync":
        client = Client(library, flavor, None)
        try:
            yield client
        finally:
            client.close()
        return
    with start_blocking_portal(backend=flavor) as portal:
        client = Client(library, flavor, portal)
        try:
            yield client
        finally:
            client.close()


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("mode", ["origins", "auto"])
def test_uninstall_puts_the_pool_back_as_it_was(library: str, flavor: str, mode: str) -> None:
    """A client created before install(), used while installed, then after uninstall(): its pool is as before."""
    # Streams keep their connection here: after uninstall() the plain client reuses the stream's connection, and
    # the stream defect would race it (lost once in a CI run with two CPU-bound processes); this test is about the
    # pool's attributes.
    with LlamaServerEmulator(close_after_stream=False) as server, plain_client(library, flavor) as client:
        pool = client.pool
        before = pool_state(pool)
        llama_guard.install(origins=[server.url] if mode == "origins" else None)
        guarded = client.exchange(server.url)
        # The control: the guard did change this pool while installed (else there is nothing to restore).
        assert guarded == ([True, True, True] if mode == "origins" else [False, True, True])
        assert idle_pool_state(pool) != idle_pool_state_of(before)
        assert pool._keepalive_expiry == 4.0
        llama_guard.uninstall()
        assert idle_pool_state(pool) == idle_pool_state_of(before)
        assert client.exchange(server.url) == [False, False, False]  # still works, unguarded
        client.close()
        assert pool_state(pool) == before


def idle_pool_state_of(state: dict[str, Any]) -> dict[str, Any]:
    instance = {k: v for k, v in state["instance"].items() if k not in ("_connections", "_requests")}
    return {"instance": instance, "class": state["class"]}


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("library", LIBRARIES)
def test_auto_mode_leaves_other_servers_clients_untouched(
    library: str, flavor: str, other_server: RecordingServer
) -> None:
    """install() in "auto" mode, a client that only talks to a server that is not llama-server: its pool never
    changes, not even while installed (keep-alive expiry still httpx's 5 s, no hooks)."""
    with plain_client(library, flavor) as client:
        pool = client.pool
        before = pool_state(pool)
        installation = llama_guard.install()
        assert client.exchange(other_server.url) == [False, False, False]
        assert idle_pool_state(pool) == idle_pool_state_of(before)
        assert pool._keepalive_expiry == 5.0
        assert installation.known_origins() == frozenset()
        client.close()
        assert pool_state(pool) == before


def test_a_new_installation_puts_the_old_ones_changes_back(racy_server: LlamaServerEmulator) -> None:
    """install() with new settings: the previous installation's changes are undone; the new one makes its own at
    the client's next request to llama-server."""
    with plain_client("httpx", "sync") as client:
        pool = client.pool
        before = idle_pool_state(pool)
        llama_guard.install(origins=[racy_server.url])
        assert client.exchange(racy_server.url) == [True, True, True]
        llama_guard.install(origins=[racy_server.url], policy=llama_guard.GuardPolicy(probe=False))
        assert idle_pool_state(pool) == before
        assert client.exchange(racy_server.url) == [True, True, True]
        assert idle_pool_state(pool) != before
        llama_guard.uninstall()
        assert idle_pool_state(pool) == before


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("library", LIBRARIES)
def test_auto_mode_drops_the_first_streams_connection(
    library: str, flavor: str, racy_server: LlamaServerEmulator
) -> None:
    """In "auto" mode an origin's first response goes through unguarded; when it is a stream that says it is
    llama.cpp, its connection is still dropped, so the next request on the pool is not written to a dying one."""
    installation = llama_guard.install()
    with plain_client(library, flavor) as client:
        guarded = client.exchange(racy_server.url, first="stream")
    assert guarded == [False, True, True]  # the stream taught the origin; the rest went through the guard
    assert racy_server.stats().requests_dropped_after_stream == 0
    snapshot = installation.stats.snapshot()
    assert snapshot.stream_connections_closed == 1
    assert snapshot.passthrough == 1
