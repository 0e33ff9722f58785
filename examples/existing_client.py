"""Protect an httpx client you already have with llama_guard.guard(client).

    python examples/existing_client.py                         # starts a faulty emulated llama-server here
    python examples/existing_client.py http://127.0.0.1:8080   # your llama-server (or set LLAMA_URL)

The same client sends the same requests before and after guard(). guard() wraps the client's transports in
place; base URL, headers, timeouts, limits and the connection pool stay as they were. The guarded client's first
request may take a connection that the plain client left dying in the pool: the guard sends it again on a new
connection and logs one warning.

To point it at the standalone emulator, start that with ``--faulty``: at its defaults it closes a stream's
connection at once, as llama-server does, a race that a client on an idle machine usually wins (nothing is lost);
``--faulty`` drops every request written to a stream's connection, so the plain client's losses show every run::

    python -m llama_guard.testing --faulty --port 8080 &
    python examples/existing_client.py http://127.0.0.1:8080

Needs nothing beyond the package itself (``pip install -e .``).
"""

from __future__ import annotations

import logging
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
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    with llama_server() as url:
        # A client as an application builds it. keepalive_expiry=4.0 lets idle connections go before
        # llama-server's own 5 s keep-alive timeout closes them.
        client = httpx.Client(
            base_url=url,
            headers={"User-Agent": "my-app/1.0"},
            timeout=httpx.Timeout(60.0, connect=5.0),
            limits=httpx.Limits(max_connections=8, max_keepalive_connections=8, keepalive_expiry=4.0),
        )
        with client:
            show("before guard()", send_all(client))

            llama_guard.guard(client)
            outcomes = send_all(client)
            show("after guard() ", outcomes)

            # One request with its own settings: a single attempt, no retry.
            response = client.post(CHAT, json=chat(0), extensions={"llama_guard": {"max_attempts": 1}})
            result: llama_guard.GuardResult = response.extensions["llama_guard"]
            print(f"request with max_attempts=1: HTTP {response.status_code}, attempts={result.attempts}")
            print(f"client._transport is now {client._transport!r}")
    return 0 if outcomes["HTTP 200"] == REQUESTS else 1


if __name__ == "__main__":
    sys.exit(main())
