"""httpx2 (the maintained fork of httpx) against llama-server, through ``llama_guard.httpx2``.

    python examples/httpx2_client.py                         # starts an emulated llama-server in this process
    python examples/httpx2_client.py http://127.0.0.1:8080   # your llama-server (or set LLAMA_URL)

Needs the httpx2 extra: ``pip install -e '.[httpx2]'`` (or ``'.[examples]'``, which has it). Same behaviour,
settings and results as the httpx flavour.
"""

from __future__ import annotations

import asyncio
import sys

from _llama_url import llama_server, missing_extra  # examples/_llama_url.py: your server, or an emulated one

try:
    import httpx2

    import llama_guard.httpx2
except ModuleNotFoundError as error:
    missing_extra(error, "httpx2")

CHAT = "/v1/chat/completions"
REQUESTS = 20


def chat(index: int) -> dict[str, object]:
    """A short chat completion; odd ones are streamed."""
    return {
        "messages": [{"role": "user", "content": f"Say hello ({index})."}],
        "max_tokens": 8,
        "stream": index % 2 == 1,
    }


async def send_all(url: str) -> int:
    """Every other request streamed, over one guarded async client; how many were answered."""
    transport = llama_guard.httpx2.AsyncGuardTransport()
    answered = 0
    async with httpx2.AsyncClient(base_url=url, transport=transport, timeout=60.0) as client:
        for index in range(REQUESTS):
            async with client.stream("POST", CHAT, json=chat(index)) as response:
                await response.aread()
                answered += response.status_code == 200
    print(f"httpx2 + llama_guard: {answered} of {REQUESTS} answered; {transport.stats}")
    return answered


def main() -> int:
    with llama_server() as url:
        # A sync client is guarded the same way, or an existing one with llama_guard.httpx2.guard(client).
        with httpx2.Client(base_url=url, transport=llama_guard.httpx2.GuardTransport()) as client:
            print("sync:", client.get("/health").extensions["llama_guard"])
        answered = asyncio.run(send_all(url))
    return 0 if answered == REQUESTS else 1


if __name__ == "__main__":
    sys.exit(main())
