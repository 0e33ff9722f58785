"""The guard inside SDKs that build their own clients: openai 3.x and pydantic-ai 2.x (both on httpx2).

The emulator gives up a stream's connection after its final chunk and drops whatever request is written to it next
(``stream_close="on_reuse"``: see tests/test_install.py for plain clients losing exactly those requests). These
tests show that the guard is in the SDK's path, counts every request and loses none: the installation's stats must
count exactly the requests the SDK made, the server must have run each of them exactly once, and no request may
have gone to a stream's connection (the server counts those it dropped: none).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx2
import openai
import pytest

import llama_guard
import llama_guard.httpx2
from llama_guard.testing import LlamaServerEmulator, generated_text

from ._sdk_load import API_KEY, SdkLoad, async_load, sync_load

MAX_TOKENS = 6
REQUESTS = 1000


@pytest.fixture
def server() -> Iterator[LlamaServerEmulator]:
    with LlamaServerEmulator(stream_close="on_reuse", http_threads=32, parallel=8, pool_bug=False) as emulator:
        yield emulator
    assert emulator.stats().requests_dropped_after_stream == 0, "the guard let a stream's connection be reused"


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()


def assert_all_whole(load: SdkLoad, requests: int) -> None:
    assert load.errors == []
    assert len(load.answers) == requests
    expected = generated_text(MAX_TOKENS)
    wrong = [answer for answer in load.answers if answer[1:] != (expected, "length")]
    assert wrong == [], f"{len(wrong)} answers incomplete, e.g. {wrong[:3]}"
    assert sum(streamed for streamed, _, _ in load.answers) == requests // 2


@pytest.mark.slow
def test_openai_sync_client_through_install(server: LlamaServerEmulator) -> None:
    installation = llama_guard.install(origins=[server.url])
    load = sync_load(server.url, requests=REQUESTS, threads=16, max_tokens=MAX_TOKENS)
    assert_all_whole(load, REQUESTS)
    stats = installation.stats.snapshot()
    assert stats.requests == REQUESTS  # every SDK request went through the guard, none twice
    assert stats.stream_connections_closed == REQUESTS // 2
    assert server.stats().completions_started == REQUESTS


@pytest.mark.slow
def test_openai_async_client_through_install(server: LlamaServerEmulator) -> None:
    installation = llama_guard.install()  # no origins: learnt from the emulator's "Server: llama.cpp"
    load = asyncio.run(async_load(server.url, requests=REQUESTS, concurrency=64, max_tokens=MAX_TOKENS))
    assert_all_whole(load, REQUESTS)
    stats = installation.stats.snapshot()
    # In "auto" mode the requests that were in flight before the first response named the server went through
    # unguarded (counted as pass-through); every one went through the guard's transport either way.
    assert stats.requests + stats.passthrough == REQUESTS
    assert stats.requests >= REQUESTS - 64
    assert server.stats().completions_started == REQUESTS


def test_openai_with_a_guarded_http_client(server: LlamaServerEmulator) -> None:
    """Without install(): the SDK takes an httpx2 client whose transport is the guard."""
    transport = llama_guard.httpx2.GuardTransport()
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, http_client=httpx2.Client(transport=transport)
    )
    with client:
        for stream in (True, False, True, False):
            created = client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS, stream=stream
            )
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in created if c.choices)  # type: ignore[union-attr]
            else:
                text = created.choices[0].message.content  # type: ignore[union-attr]
            assert text == generated_text(MAX_TOKENS)
    stats = transport.stats.snapshot()
    assert stats.requests == 4
    assert stats.stream_connections_closed == 2


@pytest.mark.slow  # imports pydantic-ai, seconds
def test_pydantic_ai_agent_through_install(server: LlamaServerEmulator) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    installation = llama_guard.install(origins=[server.url])
    model = OpenAIChatModel("any", provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key=API_KEY))
    agent = Agent(model)

    async def conversation() -> list[str]:
        answers = []
        for index in range(20):
            if index % 2:
                async with agent.run_stream(f"question {index}") as run:
                    answers.append(await run.get_output())
            else:
                answers.append((await agent.run(f"question {index}")).output)
        return answers

    answers = asyncio.run(conversation())
    assert len(answers) == 20
    assert all(answer.startswith(generated_text(4)) for answer in answers)
    assert installation.stats.snapshot().requests == 20
    assert server.stats().completions_started == 20
