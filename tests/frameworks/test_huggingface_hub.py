"""huggingface_hub ``InferenceClient`` / ``AsyncInferenceClient`` (2.x, on httpx2): one process-wide sync client
and one async client per inference client. `install()` covers both; so does a guarded client factory."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import huggingface_hub
import pytest
from huggingface_hub.utils import _http as hf_http

import llama_guard
from llama_guard.testing import LlamaServerEmulator

from ._load import (
    FRAMEWORK_WARNINGS,
    MAX_TOKENS,
    MESSAGES,
    assert_guarded,
    assert_plain_not_exposed,
    installed,
    report,
    run_async,
    run_sync,
)

pytestmark = FRAMEWORK_WARNINGS


@pytest.fixture(autouse=True)
def default_factories() -> Iterator[None]:
    """huggingface_hub's clients are process-wide: each test starts and ends with its default ones, closed."""
    huggingface_hub.set_client_factory(hf_http.default_client_factory)
    yield
    huggingface_hub.set_client_factory(hf_http.default_client_factory)
    huggingface_hub.set_async_client_factory(hf_http.default_async_client_factory)


def sync_call(client: huggingface_hub.InferenceClient):
    def call(index: int, stream: bool) -> str:
        if stream:
            chunks = client.chat_completion(MESSAGES, max_tokens=MAX_TOKENS, stream=True)
            return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        return str(client.chat_completion(MESSAGES, max_tokens=MAX_TOKENS).choices[0].message.content)

    return call


def async_call(client: huggingface_hub.AsyncInferenceClient):
    async def call(index: int, stream: bool) -> str:
        if stream:
            chunks = await client.chat_completion(MESSAGES, max_tokens=MAX_TOKENS, stream=True)
            return "".join([chunk.choices[0].delta.content or "" async for chunk in chunks if chunk.choices])
        completion = await client.chat_completion(MESSAGES, max_tokens=MAX_TOKENS)
        return str(completion.choices[0].message.content)

    return call


def test_huggingface_hub_sync(racy_server: LlamaServerEmulator) -> None:
    """Not exposed: it stops reading at ``[DONE]`` and closes the response, so no request reaches a connection a
    stream left -- the server dropped 0 and plain lost 0."""
    call = sync_call(huggingface_hub.InferenceClient(base_url=racy_server.url))
    plain = run_sync(racy_server, call)
    with installed(racy_server) as installation:
        guarded = run_sync(racy_server, call)
        report("huggingface_hub", "sync", plain, guarded)
        assert_guarded(guarded, installation.stats.requests)
    assert_plain_not_exposed(plain)

    guards: list[llama_guard.GuardTransport] = []

    def guarded_factory():  # the explicit way: huggingface_hub's own factory, guarded
        client = llama_guard.guard(hf_http.default_client_factory())
        guards.append(client._transport)
        return client

    huggingface_hub.set_client_factory(guarded_factory)
    assert_guarded(run_sync(racy_server, call), sum(guard.stats.requests for guard in guards))


def test_huggingface_hub_async(racy_server: LlamaServerEmulator) -> None:
    """Not exposed: it stops reading at ``[DONE]`` and closes the response, so no request reaches a connection a
    stream left -- the server dropped 0 and plain lost 0."""

    async def scenario() -> None:
        async with huggingface_hub.AsyncInferenceClient(base_url=racy_server.url) as client:
            call = async_call(client)
            plain = await run_async(racy_server, call)
            with installed(racy_server) as installation:
                guarded = await run_async(racy_server, call)
                report("huggingface_hub", "async", plain, guarded)
                assert_guarded(guarded, installation.stats.requests)
            assert_plain_not_exposed(plain)

        guards: list[llama_guard.AsyncGuardTransport] = []

        def guarded_factory():
            client = llama_guard.guard(hf_http.default_async_client_factory())
            guards.append(client._transport)
            return client

        huggingface_hub.set_async_client_factory(guarded_factory)
        async with huggingface_hub.AsyncInferenceClient(base_url=racy_server.url) as client:
            assert_guarded(await run_async(racy_server, async_call(client)), sum(g.stats.requests for g in guards))

    asyncio.run(scenario())
