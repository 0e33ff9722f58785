"""examples/fastapi_proxy.py in front of the real llama-server b11434 (uvicorn in a subprocess, as in
``tests/test_fastapi_proxy.py``, whose helpers these tests share).

Every completion asks for ``"ignore_eos": true`` and a fixed ``max_tokens``, so ``/metrics`` tells how many tokens
the server generated (``_counting.py``): the sum of the requests' ``max_tokens`` when each completion ran exactly
once, fewer when one was lost, more when one ran twice.

Figures measured here (2 cores shared with other work; tiny model, about 370 tokens/s for one stream):

* 64 concurrent clients, 1,024 requests (70% streamed, 20% not, 10% ``/v1/models``), upstream pool of 16: no
  upstream error, every response complete, 6,027 tokens generated for 6,027 asked; 13.2 to 19.7 s in 3 runs.
* a client that leaves a 4,000-token stream after its first chunk: llama-server stopped generating 56 to 148 ms
  later, after 7 to 291 tokens.

No control without the guard here: through an asyncio proxy with 64 clients, plain httpx loses few or no
requests to the real server (see ``test_real_guard.py``: a busy event loop comes back to a streamed connection
after the server's close has arrived). The emulator's control (``tests/test_fastapi_proxy.py``) shows the loss.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from ..test_fastapi_proxy import (
    CHAT,
    LOAD_CLIENTS,
    MODELS,
    PROXY_POOL,
    Sent,
    models_problem,
    run_load,
    start_proxy,  # noqa: F401 -- the fixture, shared
)
from ._counting import body_problem, completion, settled_tokens

pytestmark = pytest.mark.real_server

REAL_REQUESTS = 1_024


def real_problem(sent: Sent) -> str | None:
    """Why a response from the real server is not complete (its text is random; its length is not)."""
    if sent.error is not None:
        return sent.error
    if sent.status != 200:
        return f"HTTP {sent.status}: {sent.body[:200]!r}"
    if sent.kind == "models":
        return models_problem(sent.body)
    return body_problem(sent.body, stream=sent.kind == "stream", max_tokens=sent.max_tokens)


@pytest.mark.slow
def test_real_server_64_streaming_clients_through_the_guarded_proxy(real_server, start_proxy):  # noqa: F811
    server = real_server(metrics=True)
    before = settled_tokens(server)
    proxy = start_proxy(server.url, LLAMA_PROXY_MAX_CONNECTIONS=PROXY_POOL)
    run = asyncio.run(run_load(proxy.url, clients=LOAD_CLIENTS, requests=REAL_REQUESTS, body=completion))
    stats = proxy.stats()
    generated = settled_tokens(server) - before
    expected = sum(s.max_tokens for s in run.sent if s.kind != "models")
    guard = stats["guard"]
    print(
        f"real llama-server: {len(run.sent)} requests ({run.count('stream')} streamed, {run.count('full')} not, "
        f"{run.count('models')} /v1/models) from {LOAD_CLIENTS} clients in {run.seconds:.1f} s; peak in flight "
        f"{run.peak_in_flight}; server generated {generated:g} tokens for {expected}; proxy {stats['proxy']}; "
        f"guard retries={guard['retries']} errors={guard['errors']} probes={guard['probes_sent']} "
        f"(failed {guard['probes_failed']}), first byte max {guard['first_byte']['max']:.2f} s"
    )
    assert len(run.sent) == REAL_REQUESTS
    assert run.peak_in_flight == LOAD_CLIENTS
    assert run.problems(real_problem) == {}
    assert stats["proxy"]["upstream_errors"] == 0, stats["proxy"]
    assert stats["proxy"]["streams_completed"] == run.count("stream")
    assert guard["requests"] == REAL_REQUESTS
    assert generated == expected, "each completion must run exactly once"
    proxy.assert_no_traceback()


def test_real_server_stops_generating_when_the_client_leaves(real_server, start_proxy):  # noqa: F811
    server = real_server(metrics=True)
    before = settled_tokens(server)
    proxy = start_proxy(server.url)
    max_tokens = 4_000  # about 11 s for the tiny model here
    with httpx.Client(base_url=proxy.url, timeout=30.0) as client:
        body = completion(stream=True, max_tokens=max_tokens)
        with client.stream("POST", CHAT, json=body) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()  # kept: a discarded iterator would close the response at once
            assert next(chunks).startswith(b"data: ")
            left = time.monotonic()
    # Long enough for the whole completion even on a loaded machine: the token count below, not this deadline,
    # tells whether the server stopped early.
    deadline = left + 120.0
    while server.metrics()["requests_processing"] != 0:
        assert time.monotonic() < deadline, "llama-server still generating 120 s after the client left"
        time.sleep(0.05)
    stopped_after = time.monotonic() - left
    generated = settled_tokens(server) - before
    print(f"llama-server stopped {stopped_after * 1000:.0f} ms after the client left, at {generated:g} tokens")
    assert generated < max_tokens / 2
    stats = proxy.wait_stats(lambda s: s["proxy"]["client_disconnects"] == 1)
    assert stats["proxy"]["upstream_errors"] == 0
    proxy.assert_no_traceback()


def test_real_server_models_through_the_proxy(real_server, start_proxy):  # noqa: F811
    server = real_server()
    proxy = start_proxy(server.url)
    response = httpx.get(proxy.url + MODELS, timeout=10.0)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert models_problem(response.content) is None
