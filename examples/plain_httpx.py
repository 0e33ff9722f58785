"""Plain httpx against llama-server, then the same requests through llama_guard, with a sync client.

    python examples/plain_httpx.py                         # starts a faulty emulated llama-server in this process
    python examples/plain_httpx.py http://127.0.0.1:8080   # your llama-server (or set LLAMA_URL)

Twenty chat completions, one after another, every other one streamed. llama-server closes the connection of
every streamed response right after the final chunk, although its headers announced keep-alive. Plain httpx sends
the next request on that dying connection and loses it. The guard does not.

Against a real server the plain client may lose fewer requests or none: the server closes at once, and httpx
often notices before it reuses the connection. The losses come under concurrent load (see docs/how-it-works.md).

To point it at the standalone emulator, start that with ``--faulty``: at its defaults it closes a stream's
connection at once, as llama-server does, a race that a client on an idle machine usually wins (nothing is lost);
``--faulty`` drops every request written to a stream's connection, so the plain client's losses show every run::

    python -m llama_guard.testing --faulty --port 8080 &
    python examples/plain_httpx.py http://127.0.0.1:8080

Needs nothing beyond the package itself (``pip install -e .``).
"""

from __future__ import annotations

import sys
from collections import Counter

import httpx
from _llama_url import llama_server  # examples/_llama_url.py: your server, or an emulated one

import llama_guard

CHAT = "/v1/chat/completions"
REQUESTS = 20


def chat(index: int) -> dict[str, object]:
    """A short chat completion; odd ones are streamed."""
    return {
        "messages": [{"role": "user", "content": f"Say hello ({index})."}],
        "max_tokens": 8,
        "stream": index % 2 == 1,
    }


def send_all(client: httpx.Client) -> Counter[str]:
    """Send the requests one after another; count the outcomes ("HTTP 200", or the error class)."""
    outcomes: Counter[str] = Counter()
    for index in range(REQUESTS):
        try:
            with client.stream("POST", CHAT, json=chat(index)) as response:
                response.read()
            outcomes[f"HTTP {response.status_code}"] += 1
        except httpx.TransportError as exc:
            outcomes[type(exc).__name__] += 1
    return outcomes


def show(label: str, outcomes: Counter[str]) -> None:
    failed = REQUESTS - outcomes["HTTP 200"]
    print(f"{label}: {failed} of {REQUESTS} requests failed {dict(outcomes)}")


def main() -> int:
    with llama_server() as url:
        with httpx.Client(base_url=url, timeout=60.0) as plain:
            show("plain httpx", send_all(plain))

        transport = llama_guard.GuardTransport()
        with httpx.Client(transport=transport, base_url=url, timeout=60.0) as client:
            outcomes = send_all(client)
            show("llama_guard", outcomes)

            # What the guard did for one request, and its counters so far.
            response = client.post(CHAT, json=chat(0))
            result: llama_guard.GuardResult = response.extensions["llama_guard"]
            print(
                f"one more request: HTTP {response.status_code}, attempts={result.attempts}, "
                f"headers after {result.first_byte_seconds * 1000:.0f} ms"
            )
            stats = transport.stats.snapshot()
            print(
                f"transport.stats: requests={stats.requests} retries={stats.retries} "
                f"stream_connections_closed={stats.stream_connections_closed} probes_sent={stats.probes_sent}"
            )
            # Why probes_sent may be 0: the connection strategy chosen for the server, and its reason.
            for origin, strategy in stats.connection_strategies.items():
                print(f"connection strategy for {origin}: {strategy}")
    return 0 if outcomes["HTTP 200"] == REQUESTS else 1


if __name__ == "__main__":
    sys.exit(main())
