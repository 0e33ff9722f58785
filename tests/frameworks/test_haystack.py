"""haystack ``OpenAIChatGenerator``: the openai SDK (3.x) on the httpx clients haystack builds from one
``http_client_kwargs`` dict for its sync and async paths. `install()` covers both; so does `DualGuardTransport` in
that dict (a `GuardTransport` there breaks the async path: it has no ``handle_async_request``)."""

from __future__ import annotations

import asyncio
from typing import Any

from haystack.components.generators.chat import OpenAIChatGenerator
from haystack.dataclasses import ChatMessage, StreamingChunk
from haystack.utils import Secret

import llama_guard
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
MESSAGES = [ChatMessage.from_user("hi")]


def generator(server: LlamaServerEmulator, http_client_kwargs: dict[str, Any] | None = None) -> OpenAIChatGenerator:
    return OpenAIChatGenerator(
        api_key=Secret.from_token("sk-none"),
        model="emulated",
        api_base_url=f"{server.url}/v1",
        max_retries=0,
        generation_kwargs={"max_tokens": MAX_TOKENS},
        http_client_kwargs=http_client_kwargs,
    )


def text_of(result: dict[str, Any]) -> str:
    return str(result["replies"][0].text)


def sync_call(component: OpenAIChatGenerator):
    def call(index: int, stream: bool) -> str:
        if stream:
            chunks: list[StreamingChunk] = []
            component.run(messages=MESSAGES, streaming_callback=chunks.append)
            return "".join(chunk.content for chunk in chunks)
        return text_of(component.run(messages=MESSAGES))

    return call


def async_call(component: OpenAIChatGenerator):
    async def call(index: int, stream: bool) -> str:
        if stream:
            chunks: list[StreamingChunk] = []

            async def collect(chunk: StreamingChunk) -> None:
                chunks.append(chunk)

            await component.run_async(messages=MESSAGES, streaming_callback=collect)
            return "".join(chunk.content for chunk in chunks)
        return text_of(await component.run_async(messages=MESSAGES))

    return call


def test_haystack_sync(racy_server: LlamaServerEmulator) -> None:
    """Not exposed: the openai SDK's sync stream closes the response at ``[DONE]``, so no request reaches a connection
    a stream left -- the server dropped 0 and plain lost 0."""
    component = generator(racy_server)
    call = sync_call(component)
    plain = run_sync(racy_server, call)
    with installed(racy_server) as installation:
        guarded = run_sync(racy_server, call)
        report("haystack", "sync", plain, guarded)
        assert_guarded(guarded, installation.stats.requests)
    component.close()  # haystack leaves its clients open otherwise
    assert_plain_not_exposed(plain)


def test_haystack_async(racy_server: LlamaServerEmulator) -> None:
    """The openai SDK's async stream drains the body after ``[DONE]`` and pools the connection: plain loses exactly
    the requests the server dropped there."""

    async def scenario() -> None:
        component = generator(racy_server)
        plain = await run_async(racy_server, async_call(component))
        await component.close_async()  # its pool holds connections streams left: a new component for the guard
        assert_plain_exposed(plain)
        with installed(racy_server) as installation:
            component = generator(racy_server)
            guarded = await run_async(racy_server, async_call(component))
            report("haystack", "async", plain, guarded)
            assert_guarded(guarded, installation.stats.requests)
        await component.close_async()

    asyncio.run(scenario())


def test_haystack_one_kwargs_dict_with_dual_guard_transport(racy_server: LlamaServerEmulator) -> None:
    """The explicit way: one `DualGuardTransport` in ``http_client_kwargs`` guards both paths of one component."""
    transport = llama_guard.DualGuardTransport()
    component = generator(racy_server, {"transport": transport})
    assert_guarded(run_sync(racy_server, sync_call(component)), transport.stats.requests)
    counted = transport.stats.requests
    component.close()

    async def scenario() -> None:
        phase = await run_async(racy_server, async_call(component))
        assert_guarded(phase, transport.stats.requests - counted)
        await component.close_async()

    asyncio.run(scenario())
