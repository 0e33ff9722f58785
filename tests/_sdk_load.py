"""A proxy-like load driven through the openai SDK (3.x, on httpx2): for the emulator and the real-server tests.

Half of the requests are streamed, as behind a chat proxy. Every answer is checked whole: the streamed text is
joined from its chunks and must end with a finish reason, like a non-streamed one. The SDK's own retries are off
(``max_retries=0``), so whatever recovers a lost request is the guard.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import openai

API_KEY = "sk-llama-guard-test"  # the emulator and llama-server without --api-key accept any key


@dataclass
class SdkLoad:
    """What the clients saw: one (streamed, text, finish_reason) per answered request, and every error."""

    answers: list[tuple[bool, str, str | None]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.answers) + len(self.errors)


def _arguments(index: int, max_tokens: int, extra_body: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "model": "any",
        "messages": [{"role": "user", "content": f"request {index}"}],
        "max_tokens": max_tokens,
        "stream": index % 2 == 1,
        "extra_body": extra_body,
    }


def sync_load(
    base_url: str, *, requests: int, threads: int, max_tokens: int, extra_body: dict[str, Any] | None = None
) -> SdkLoad:
    """``requests`` chat completions from ``threads`` threads sharing one `openai.OpenAI` client."""
    load = SdkLoad()
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def one(index: int) -> None:
        arguments = _arguments(index, max_tokens, extra_body)
        try:
            if arguments["stream"]:
                text, finish = "", None
                for chunk in client.chat.completions.create(**arguments):
                    for choice in chunk.choices:
                        text += choice.delta.content or ""
                        finish = choice.finish_reason or finish
                load.answers.append((True, text, finish))
            else:
                completion = client.chat.completions.create(**arguments)
                choice = completion.choices[0]
                load.answers.append((False, choice.message.content or "", choice.finish_reason))
        except openai.APIError as exc:
            load.errors.append(exc)

    with client, ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(requests)))
    return load


async def async_load(
    base_url: str, *, requests: int, concurrency: int, max_tokens: int, extra_body: dict[str, Any] | None = None
) -> SdkLoad:
    """``requests`` chat completions from ``concurrency`` asyncio tasks sharing one `openai.AsyncOpenAI` client."""
    load = SdkLoad()
    indices = iter(range(requests))
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:

        async def worker() -> None:
            for index in indices:
                arguments = _arguments(index, max_tokens, extra_body)
                try:
                    if arguments["stream"]:
                        text, finish = "", None
                        async for chunk in await client.chat.completions.create(**arguments):
                            for choice in chunk.choices:
                                text += choice.delta.content or ""
                                finish = choice.finish_reason or finish
                        load.answers.append((True, text, finish))
                    else:
                        completion = await client.chat.completions.create(**arguments)
                        choice = completion.choices[0]
                        load.answers.append((False, choice.message.content or "", choice.finish_reason))
                except openai.APIError as exc:
                    load.errors.append(exc)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return load
