"""litellm's async path (aiohttp, ``LiteLLMAiohttpTransport``) through `install()` against the real llama-server
b11434: the ``openai/`` and ``hosted_vllm/`` routes, 1,000 requests each, half streamed, 16 concurrent tasks, no
litellm setting. Nothing lost, every request counted by the guard, and the server ran each completion once
(``/metrics``, see _counting.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

import llama_guard

from ._counting import completions_ran, settled_tokens

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm's price list from its own copy: no network

pytestmark = [
    pytest.mark.real_server,
    pytest.mark.filterwarnings("ignore:Items? .* on TypedDict class .*ReadOnly:UserWarning"),
]

REQUESTS = 1000
CONCURRENCY = 16
MAX_TOKENS = 4


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()


@pytest.mark.slow
@pytest.mark.parametrize("route", ["openai", "hosted_vllm"])
def test_litellm_async_through_install_on_real_llama_server(real_server, route: str) -> None:  # type: ignore[no-untyped-def]
    import litellm

    server = real_server(metrics=True, parallel=4)
    installation = llama_guard.install(origins=[server.url])
    before = settled_tokens(server)
    kwargs = {
        "model": f"{route}/tiny",
        "api_base": f"{server.url}/v1",
        "api_key": "sk-none",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": MAX_TOKENS,
        "max_retries": 0,
        "num_retries": 0,
        "extra_body": {"ignore_eos": True, "temperature": 0.0},
    }
    finishes: list[str | None] = []
    errors: list[BaseException] = []

    async def one(stream: bool) -> None:
        try:
            if stream:
                finish = None
                async for chunk in await litellm.acompletion(stream=True, **kwargs):
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
                finishes.append(finish)
            else:
                finishes.append((await litellm.acompletion(**kwargs)).choices[0].finish_reason)
        except Exception as exc:
            errors.append(exc)

    async def scenario() -> None:
        indexes = iter(range(REQUESTS))

        async def worker() -> None:
            for index in indexes:
                await one(index % 2 == 1)

        try:
            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        finally:
            # litellm caches its clients for the process; their idle connections would outlive the server and the
            # test, and a later test whose emulator gets the same port number would count them as its own.
            await litellm.close_litellm_async_clients()

    asyncio.run(scenario())
    assert errors == [], f"{len(errors)} of {REQUESTS} lost, e.g. {errors[:3]!r}"
    assert finishes == ["length"] * REQUESTS
    assert installation.stats.snapshot().requests == REQUESTS
    assert completions_ran(server, MAX_TOKENS, since_tokens=before) == REQUESTS
