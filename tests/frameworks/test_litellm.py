"""litellm: sync on httpx (the openai SDK's client), async on aiohttp (``LiteLLMAiohttpTransport``), through the
``openai/`` and ``hosted_vllm/`` routes. `install()` covers both with no litellm setting."""

from __future__ import annotations

import asyncio
from typing import Any

import litellm
import pytest

from llama_guard.testing import LlamaServerEmulator

from ._load import (
    FRAMEWORK_WARNINGS,
    MAX_TOKENS,
    MESSAGES,
    assert_guarded,
    assert_plain_exposed,
    assert_plain_not_exposed,
    installed,
    report,
    run_async,
    run_sync,
)

pytestmark = FRAMEWORK_WARNINGS
ROUTES = ("openai", "hosted_vllm")


def arguments(server: LlamaServerEmulator, route: str) -> dict[str, Any]:
    return {
        "model": f"{route}/emulated",
        "api_base": f"{server.url}/v1",
        "api_key": "sk-none",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "max_retries": 0,  # litellm's own retries off: what recovers a lost request is the guard
        "num_retries": 0,
    }


async def forget_async_clients() -> None:
    """Close litellm's cached async clients (their aiohttp sessions) and empty its cache."""
    await litellm.close_litellm_async_clients()
    litellm.in_memory_llm_clients_cache.flush_cache()


@pytest.mark.parametrize("route", ROUTES)
def test_litellm_sync(route: str, racy_server: LlamaServerEmulator) -> None:
    """Not exposed: the openai SDK's sync stream closes the response at ``[DONE]``, so no request reaches a connection
    a stream left -- the server dropped 0 and plain lost 0."""
    kwargs = arguments(racy_server, route)

    def call(index: int, stream: bool) -> str:
        if stream:
            return "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(stream=True, **kwargs))
        return str(litellm.completion(**kwargs).choices[0].message.content)

    plain = run_sync(racy_server, call)
    with installed(racy_server) as installation:
        guarded = run_sync(racy_server, call)
        report("litellm", f"sync {route}/", plain, guarded)
        assert_guarded(guarded, installation.stats.requests)
    assert_plain_not_exposed(plain)


@pytest.mark.parametrize("route", ROUTES)
def test_litellm_async(route: str, racy_server: LlamaServerEmulator) -> None:
    """Exposed: aiohttp reads a stream to its end and pools the connection, so plain loses exactly the requests the
    server dropped there."""
    kwargs = arguments(racy_server, route)

    async def call(index: int, stream: bool) -> str:
        if stream:
            chunks = await litellm.acompletion(stream=True, **kwargs)
            return "".join([chunk.choices[0].delta.content or "" async for chunk in chunks])
        return str((await litellm.acompletion(**kwargs)).choices[0].message.content)

    async def scenario() -> None:
        plain = await run_async(racy_server, call)
        await forget_async_clients()  # their pools hold connections streams left: new ones for the guard
        assert_plain_exposed(plain)
        with installed(racy_server) as installation:
            guarded = await run_async(racy_server, call)
            report("litellm", f"async {route}/", plain, guarded)
            assert_guarded(guarded, installation.stats.requests)
        await forget_async_clients()  # else the next test's loop finds this one's sessions and drops them unclosed

    asyncio.run(scenario())
