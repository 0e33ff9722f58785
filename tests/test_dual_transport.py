"""`DualGuardTransport`: one transport object in one kwargs dict, for a sync and an async client (as haystack does)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import httpx2
import pytest

import llama_guard
import llama_guard.httpx2
from llama_guard.testing import LlamaServerEmulator

CHAT = "/v1/chat/completions"
REQUESTS = 30


def chat(stream: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 4}


def run_both(lib: Any, kwargs: dict[str, Any]) -> list[Any]:
    """Alternate streamed and plain completions on a sync client, then on an async one, both built from ``kwargs``."""
    outcomes: list[Any] = []
    with lib.Client(**kwargs) as client:
        for index in range(REQUESTS):
            try:
                with client.stream("POST", CHAT, json=chat(index % 2 == 1)) as response:
                    response.read()
                    outcomes.append(response)
            except lib.TransportError as exc:
                outcomes.append(exc)

    async def scenario() -> None:
        async with lib.AsyncClient(**kwargs) as client:
            for index in range(REQUESTS):
                try:
                    async with client.stream("POST", CHAT, json=chat(index % 2 == 1)) as response:
                        await response.aread()
                        outcomes.append(response)
                except lib.TransportError as exc:
                    outcomes.append(exc)

    asyncio.run(scenario())
    return outcomes


@pytest.mark.parametrize(
    ("lib", "dual"),
    [(httpx, llama_guard.DualGuardTransport), (httpx2, llama_guard.httpx2.DualGuardTransport)],
    ids=["httpx", "httpx2"],
)
def test_one_kwargs_dict_guards_a_sync_and_an_async_client(
    lib: Any, dual: type[Any], racy_server: LlamaServerEmulator
) -> None:
    plain = run_both(lib, {"base_url": racy_server.url})
    # In each client, every non-streamed request after the first went to the connection a stream left: dropped there.
    lost = [index for index, o in enumerate(plain) if isinstance(o, Exception)]
    assert lost == [*range(2, REQUESTS, 2), *range(REQUESTS + 2, 2 * REQUESTS, 2)]
    assert racy_server.stats().requests_dropped_after_stream == len(lost)

    transport = dual()
    ran_before = racy_server.stats().completions_started
    guarded = run_both(lib, {"base_url": racy_server.url, "transport": transport})
    assert [o for o in guarded if isinstance(o, Exception)] == []
    assert all(isinstance(o.extensions["llama_guard"], llama_guard.GuardResult) for o in guarded)
    stats = transport.stats.snapshot()
    assert stats.requests == 2 * REQUESTS  # both clients counted in one place
    assert stats.stream_connections_closed == REQUESTS
    server = racy_server.stats()
    assert server.completions_started - ran_before == 2 * REQUESTS  # none ran twice
    assert server.requests_dropped_after_stream == len(lost)  # and none was dropped


def test_dual_transport_shares_settings_and_checks_them() -> None:
    policy = llama_guard.GuardPolicy(probe=False)
    transport = llama_guard.DualGuardTransport(policy=policy)
    try:
        assert transport.sync_guard.policy is policy
        assert transport.async_guard.policy is policy
        assert transport.sync_guard.stats is transport.stats is transport.async_guard.stats
        assert isinstance(transport, httpx.BaseTransport)
        assert isinstance(transport, httpx.AsyncBaseTransport)
        assert "DualGuardTransport" in repr(transport)
    finally:
        transport.close()
        asyncio.run(transport.aclose())
    with pytest.raises(TypeError, match=r"policy must be a llama_guard\.GuardPolicy"):
        llama_guard.DualGuardTransport(policy={"probe": False})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="for an async client use AsyncGuardTransport"):
        llama_guard.DualGuardTransport(transport=httpx.AsyncHTTPTransport())  # type: ignore[arg-type]
