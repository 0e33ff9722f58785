"""Plain httpx against llama-server, then through llama_guard, with an async client shared by many tasks.

    python examples/async_httpx.py                         # starts a faulty emulated llama-server in this process
    python examples/async_httpx.py http://127.0.0.1:8080   # your llama-server (or set LLAMA_URL)

Sixteen tasks share one client with a 4-connection pool, like a proxy in front of llama-server: 80 chat
completions, half of them streamed. AsyncGuardTransport works the same under trio.

Against a real server the plain client's losses vary with load and timing: llama-server closes the connection at
once, and httpx sometimes notices before it reuses it.

To point it at the standalone emulator, start that with ``--faulty``: at its defaults it closes a stream's
connection at once, as llama-server does, a race that a client on an idle machine usually wins (nothing is lost);
``--faulty`` drops every request written to a stream's connection, so the plain client's losses show every run::

    python -m llama_guard.testing --faulty --port 8080 &
    python examples/async_httpx.py http://127.0.0.1:8080

Needs nothing beyond the package itself (``pip install -e .``).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

import llama_guard
from llama_guard.testing import LlamaServerEmulator
from llama_guard.testing.__main__ import FAULTY_STALL_BURST, FAULTY_STREAM_CLOSE

CHAT = "/v1/chat/completions"
REQUESTS = 80
TASKS = 16
LIMITS = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=4.0)


@asynccontextmanager
async def llama_server() -> AsyncIterator[str]:
    """The base URL to use: the first argument, else LLAMA_URL, else an emulator started here."""
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LLAMA_URL")
    if url:
        yield url
        return
    # Both defects every time, as `python -m llama_guard.testing --faulty` does (see examples/_llama_url.py).
    async with LlamaServerEmulator(stream_close=FAULTY_STREAM_CLOSE, stall_burst=FAULTY_STALL_BURST) as server:
        yield server.url


def chat(index: int) -> dict[str, object]:
    """A short chat completion; odd ones are streamed."""
    return {
        "messages": [{"role": "user", "content": f"Say hello ({index})."}],
        "max_tokens": 8,
        "stream": index % 2 == 1,
    }


async def send_all(client: httpx.AsyncClient) -> Counter[str]:
    """Send the requests from TASKS tasks at once; count the outcomes ("HTTP 200", or the error class)."""
    outcomes: Counter[str] = Counter()
    numbers = iter(range(REQUESTS))

    async def worker() -> None:
        for index in numbers:
            try:
                async with client.stream("POST", CHAT, json=chat(index)) as response:
                    await response.aread()
                outcomes[f"HTTP {response.status_code}"] += 1
            except httpx.TransportError as exc:
                outcomes[type(exc).__name__] += 1

    await asyncio.gather(*(worker() for _ in range(TASKS)))
    return outcomes


def show(label: str, outcomes: Counter[str]) -> None:
    failed = REQUESTS - outcomes["HTTP 200"]
    print(f"{label}: {failed} of {REQUESTS} requests failed {dict(outcomes)}")


async def main() -> int:
    async with llama_server() as url:
        plain_transport = httpx.AsyncHTTPTransport(limits=LIMITS)
        async with httpx.AsyncClient(transport=plain_transport, base_url=url, timeout=60.0) as plain:
            show("plain httpx", await send_all(plain))

        transport = llama_guard.AsyncGuardTransport(httpx.AsyncHTTPTransport(limits=LIMITS))
        async with httpx.AsyncClient(transport=transport, base_url=url, timeout=60.0) as client:
            outcomes = await send_all(client)
            show("llama_guard", outcomes)

            response = await client.post(CHAT, json=chat(0))
            result: llama_guard.GuardResult = response.extensions["llama_guard"]
            print(f"one more request: HTTP {response.status_code}, attempts={result.attempts}")
            stats = transport.stats.snapshot()
            slowest = stats.first_byte.max if stats.first_byte else 0.0
            print(
                f"transport.stats: requests={stats.requests} attempts={stats.attempts} retries={stats.retries} "
                f"errors={stats.errors} slowest headers={slowest * 1000:.0f} ms"
            )
    return 0 if outcomes["HTTP 200"] == REQUESTS else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
