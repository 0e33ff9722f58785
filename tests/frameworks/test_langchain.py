"""langchain-openai ``ChatOpenAI``: the openai SDK (3.x, on httpx2) underneath; `install()` covers it, and so does
a guarded client given as ``http_client`` / ``http_async_client``."""

from __future__ import annotations

import asyncio

import httpx2
from langchain_openai import ChatOpenAI
from langchain_openai.chat_models import _client_utils

import llama_guard.httpx2
from llama_guard.testing import LlamaServerEmulator

from ._load import (
    FRAMEWORK_WARNINGS,
    MAX_TOKENS,
    assert_guarded,
    assert_plain_exposed,
    assert_plain_not_exposed,
    installed,
    report,
    run_async,
    run_sync,
)

pytestmark = FRAMEWORK_WARNINGS


def chat_model(server: LlamaServerEmulator, **clients: object) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="sk-none",  # type: ignore[arg-type]
        model="emulated",
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
        **clients,  # type: ignore[arg-type]
    )


def test_langchain_sync(racy_server: LlamaServerEmulator) -> None:
    """Not exposed: the openai SDK's sync stream closes the response at ``[DONE]``, so no request reaches a connection
    a stream left -- the server dropped 0 and plain lost 0."""
    model = chat_model(racy_server)

    def call(index: int, stream: bool) -> str:
        if stream:
            return "".join(str(chunk.content) for chunk in model.stream("hi"))
        return str(model.invoke("hi").content)

    plain = run_sync(racy_server, call)
    with installed(racy_server) as installation:
        guarded = run_sync(racy_server, call)
        report("langchain-openai", "sync", plain, guarded)
        assert_guarded(guarded, installation.stats.requests)
    assert_plain_not_exposed(plain)
    model.root_client.close()  # langchain leaves its clients open otherwise

    transport = llama_guard.httpx2.GuardTransport()
    explicit = chat_model(racy_server, http_client=httpx2.Client(transport=transport))
    model = explicit
    assert_guarded(run_sync(racy_server, call), transport.stats.requests)
    model.root_client.close()


def test_langchain_async(racy_server: LlamaServerEmulator) -> None:
    """The openai SDK's async stream drains the body at ``[DONE]`` and pools the connection (HTTP/1.1): plain loses
    exactly the requests the server dropped there."""

    async def scenario() -> None:
        model = chat_model(racy_server)

        async def call(index: int, stream: bool) -> str:
            if stream:
                return "".join([str(chunk.content) async for chunk in current.astream("hi")])
            return str((await current.ainvoke("hi")).content)

        current = model
        plain = await run_async(racy_server, call)
        # Its pool holds connections streams left: closed, and a new model with a new client for the guard
        # (langchain caches its default async client per base URL; forget the closed one).
        await model.root_async_client.close()
        _client_utils._cached_async_httpx_client.cache_clear()
        assert_plain_exposed(plain)
        with installed(racy_server) as installation:
            current = chat_model(racy_server)
            guarded = await run_async(racy_server, call)
            report("langchain-openai", "async", plain, guarded)
            assert_guarded(guarded, installation.stats.requests)
        await current.root_async_client.close()

        transport = llama_guard.httpx2.AsyncGuardTransport()
        current = chat_model(racy_server, http_async_client=httpx2.AsyncClient(transport=transport))
        assert_guarded(await run_async(racy_server, call), transport.stats.requests)
        await current.root_async_client.close()

    asyncio.run(scenario())
