"""The openai SDK 3.x (on httpx2), the base of langchain, haystack, pydantic-ai and litellm's sync path."""

from __future__ import annotations

import asyncio

import httpx2
import openai

import llama_guard.httpx2
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


def arguments(stream: bool) -> dict[str, object]:
    return {"model": "emulated", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": stream}


def test_openai_sync(racy_server: LlamaServerEmulator) -> None:
    """Not exposed: the sync stream closes the response at ``[DONE]``, so no request reaches a connection a stream
    left -- the server dropped 0 and plain lost 0."""

    def client_call(client: openai.OpenAI):
        def call(index: int, stream: bool) -> str:
            if stream:
                chunks = client.chat.completions.create(**arguments(True))  # type: ignore[call-overload]
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return str(client.chat.completions.create(**arguments(False)).choices[0].message.content)  # type: ignore[call-overload]

        return call

    client = openai.OpenAI(base_url=f"{racy_server.url}/v1", api_key="sk-none", max_retries=0)
    call = client_call(client)
    plain = run_sync(racy_server, call)
    with installed(racy_server) as installation:
        guarded = run_sync(racy_server, call)
        report("openai 3.x", "sync", plain, guarded)
        assert_guarded(guarded, installation.stats.requests)
    assert_plain_not_exposed(plain)
    client.close()

    transport = llama_guard.httpx2.GuardTransport()
    explicit = openai.OpenAI(
        base_url=f"{racy_server.url}/v1",
        api_key="sk-none",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )
    assert_guarded(run_sync(racy_server, client_call(explicit)), transport.stats.requests)
    explicit.close()


def test_openai_async(racy_server: LlamaServerEmulator) -> None:
    """Exposed: the async stream drains the body after ``[DONE]`` on HTTP/1.1 and pools the connection, so plain loses
    exactly the requests the server dropped there."""

    def client_call(client: openai.AsyncOpenAI):
        async def call(index: int, stream: bool) -> str:
            if stream:
                chunks = await client.chat.completions.create(**arguments(True))  # type: ignore[call-overload]
                return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            completion = await client.chat.completions.create(**arguments(False))  # type: ignore[call-overload]
            return str(completion.choices[0].message.content)

        return call

    async def scenario() -> None:
        client = openai.AsyncOpenAI(base_url=f"{racy_server.url}/v1", api_key="sk-none", max_retries=0)
        plain = await run_async(racy_server, client_call(client))
        await client.close()  # its pool holds connections streams left: a new client for the guard
        assert_plain_exposed(plain)
        with installed(racy_server) as installation:
            client = openai.AsyncOpenAI(base_url=f"{racy_server.url}/v1", api_key="sk-none", max_retries=0)
            guarded = await run_async(racy_server, client_call(client))
            report("openai 3.x", "async", plain, guarded)
            assert_guarded(guarded, installation.stats.requests)
        await client.close()

        transport = llama_guard.httpx2.AsyncGuardTransport()
        explicit = openai.AsyncOpenAI(
            base_url=f"{racy_server.url}/v1",
            api_key="sk-none",
            max_retries=0,
            http_client=httpx2.AsyncClient(transport=transport),
        )
        assert_guarded(await run_async(racy_server, client_call(explicit)), transport.stats.requests)
        await explicit.close()

    asyncio.run(scenario())
