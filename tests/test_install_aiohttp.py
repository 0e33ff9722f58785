"""`install()` covers aiohttp sessions: created before or after the call, for the named origins only, undone by
`uninstall()`; other origins' bytes unchanged. On real loopback sockets (the emulator and a recording server)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

import llama_guard
from llama_guard import GuardPolicy
from llama_guard.aiohttp import guard_of, guard_result, guarded_session
from llama_guard.testing import LlamaServerEmulator

from ._recording_server import RecordingServer

CHAT = "/v1/chat/completions"
REQUESTS = 30
ORIGINAL_REQUEST = aiohttp.ClientSession.__dict__["_request"]


def chat(stream: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 4}


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()
    assert aiohttp.ClientSession.__dict__["_request"] is ORIGINAL_REQUEST, "ClientSession._request left patched"


async def alternate_streams(session: aiohttp.ClientSession, url: str, n: int) -> list[Any]:
    """``n`` chat completions, every other one streamed, one after another; each response's result or the error."""
    outcomes: list[Any] = []
    for index in range(n):
        try:
            async with session.post(f"{url}{CHAT}", json=chat(index % 2 == 1)) as response:
                await response.read()
                outcomes.append(guard_result(response))
        except aiohttp.ClientError as exc:
            outcomes.append(exc)
    return outcomes


@pytest.mark.parametrize("connection", ["auto", "reuse"])
def test_install_guards_sessions_created_before_and_after(connection: str, racy_server: LlamaServerEmulator) -> None:
    """Both strategies: the default ("auto": close on the emulator's loopback address, no probe) and "reuse"."""

    async def scenario() -> None:
        async with aiohttp.ClientSession() as plain:
            outcomes = await alternate_streams(plain, racy_server.url, REQUESTS)
        # Every non-streamed request after the first went to the connection a stream left, and was dropped there.
        lost = [index for index, o in enumerate(outcomes) if isinstance(o, Exception)]
        assert lost == list(range(2, REQUESTS, 2))
        assert racy_server.stats().requests_dropped_after_stream == len(lost)

        async with aiohttp.ClientSession() as before:
            policy = GuardPolicy(connection=connection)  # type: ignore[arg-type]
            installation = llama_guard.install(origins=[racy_server.url], policy=policy)
            async with aiohttp.ClientSession() as after:
                ran_before = racy_server.stats().completions_started
                outcomes = [
                    *await alternate_streams(before, racy_server.url, REQUESTS),
                    *await alternate_streams(after, racy_server.url, REQUESTS),
                ]
                assert [o for o in outcomes if not isinstance(o, llama_guard.GuardResult)] == []
                server = racy_server.stats()
                assert server.completions_started - ran_before == 2 * REQUESTS  # none ran twice
                assert server.requests_dropped_after_stream == len(lost)  # and none was dropped
                stats = installation.stats.snapshot()
                assert stats.requests == 2 * REQUESTS
                if connection == "reuse":
                    assert stats.probes_sent >= 2  # each session's first connection at least
                else:
                    assert stats.probes_sent == 0
                    assert all(o.connection == "close" for o in outcomes)  # type: ignore[union-attr]
                assert guard_of(before) is not None
                assert guard_of(after) is not None

                llama_guard.uninstall()
                assert guard_of(before) is None
                assert guard_of(after) is None
                back = await alternate_streams(after, racy_server.url, REQUESTS)
                assert all(o is None or isinstance(o, Exception) for o in back)  # no guard result any more
                # ... and the defect is back: the same requests are lost as in the plain session.
                assert [index for index, o in enumerate(back) if isinstance(o, Exception)] == lost
                assert racy_server.stats().requests_dropped_after_stream == 2 * len(lost)
                assert installation.stats.snapshot().requests == 2 * REQUESTS

    asyncio.run(scenario())


def test_an_explicitly_guarded_session_is_not_guarded_twice(racy_server: LlamaServerEmulator) -> None:
    async def scenario() -> None:
        mine = llama_guard.aiohttp.GuardMiddleware
        async with guarded_session() as session:
            own = guard_of(session)
            installation = llama_guard.install(origins=[racy_server.url])
            outcomes = await alternate_streams(session, racy_server.url, 6)
            assert all(isinstance(o, llama_guard.GuardResult) for o in outcomes)
            assert guard_of(session) is own
            assert isinstance(own, mine)
            assert own.stats.snapshot().requests == 6
            assert installation.stats.snapshot().requests == 0
            llama_guard.uninstall()
            assert guard_of(session) is own  # uninstall() leaves the session's own guard alone

    asyncio.run(scenario())


async def aiohttp_exchange(url: str) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    seen = []
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer not-a-real-key"}) as session:
        for method, path, body in [
            ("GET", "/health", None),
            ("POST", CHAT, chat(stream=True)),
            ("POST", CHAT, chat(stream=False)),
            ("POST", CHAT, chat(stream=True)),
            ("GET", "/v1/models", None),
        ]:
            async with session.request(method, f"{url}{path}", json=body) as response:
                content = await response.read()
                headers = [(k, v) for k, v in response.headers.items() if k.lower() != "date"]
                seen.append((response.status, headers, content))
    return seen


def test_other_origins_bytes_unchanged() -> None:
    """A session's requests to an origin not named in install() go out byte for byte as without it."""
    server = RecordingServer()
    try:
        without = asyncio.run(aiohttp_exchange(server.url))
        wire_without = list(server.received)
        server.received.clear()
        installation = llama_guard.install(origins=["http://127.0.0.1:1"])
        with_install = asyncio.run(aiohttp_exchange(server.url))
        wire_with = list(server.received)
    finally:
        server.close()
    assert len(wire_without) == 1, "one pooled connection, no probe"
    assert wire_with == wire_without
    assert with_install == without
    assert installation.stats.snapshot().requests == 0


def test_an_untested_aiohttp_is_left_alone_and_said_so(
    racy_server: LlamaServerEmulator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """install() wraps a private aiohttp method only on the versions it was tested with; otherwise one warning that
    says install() leaves the sessions alone, and stats.unguarded says the same. The control: on this (tested)
    aiohttp, nothing is unguarded."""
    control = llama_guard.install(origins=[racy_server.url])
    assert aiohttp.ClientSession.__dict__["_request"] is not ORIGINAL_REQUEST
    assert control.stats.snapshot().unguarded == {}
    llama_guard.uninstall()
    monkeypatch.setattr(aiohttp, "__version__", "3.99.0-install-test")
    installation = llama_guard.install(origins=[racy_server.url])
    assert aiohttp.ClientSession.__dict__["_request"] is ORIGINAL_REQUEST
    said = [m for r in caplog.records if r.name == "llama_guard" and "3.99.0-install-test" in (m := r.getMessage())]
    assert len(said) == 1, said
    assert said[0].startswith("install() leaves aiohttp's sessions unguarded: aiohttp 3.99.0-install-test")
    why = installation.stats.snapshot().unguarded["aiohttp"]
    assert "3.99.0-install-test is not a version llama_guard was tested with" in why
    assert "guard_session(session)" in why
    assert "unguarded=aiohttp" in repr(installation.stats)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            await alternate_streams(session, racy_server.url, 4)
            assert guard_of(session) is None

    asyncio.run(scenario())
    assert installation.stats.snapshot().requests == 0
