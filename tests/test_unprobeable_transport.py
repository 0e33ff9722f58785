"""A guard around a transport that does not send through httpcore: it cannot probe, and says so, once.

The foreign transports here send on real loopback sockets through another HTTP stack: the standard library's
``http.client`` (sync) and aiohttp, as litellm's ``LiteLLMAiohttpTransport`` does (async).
"""

from __future__ import annotations

import asyncio
import http.client
import logging
from collections.abc import Iterator

import httpx
import pytest

import llama_guard
from llama_guard.testing import LlamaServerEmulator

from .conftest import PARTIAL_DEPS

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
#: The emulator is on loopback, where the default ("auto") closes every connection and probes none: probing, and
#: saying that it cannot be done, belong to keep-alive.
REUSE = llama_guard.GuardPolicy(connection="reuse")


class HttpClientTransport(httpx.BaseTransport):
    """An httpx transport on the standard library's http.client, one connection per request: no httpcore."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert request.url.host is not None
        assert request.url.port is not None
        connection = http.client.HTTPConnection(request.url.host, request.url.port, timeout=5)
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() != "connection"}
            connection.request(request.method, request.url.raw_path.decode(), body=request.read(), headers=headers)
            answer = connection.getresponse()
            return httpx.Response(answer.status, headers=answer.getheaders(), content=answer.read())
        finally:
            connection.close()


class PassThroughTransport(httpx.BaseTransport):
    """A wrapper that hides the pool from the guard but passes requests (and their trace extension) to httpcore."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def server() -> Iterator[LlamaServerEmulator]:
    with LlamaServerEmulator(pool_bug=False) as emulator:
        yield emulator


def warnings_about_probing(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "llama_guard" and "not probed" in r.getMessage() and r.levelno == 30]


def test_a_foreign_sync_transport_warns_once_and_stats_say_probing_is_off(
    server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    guard = llama_guard.GuardTransport(HttpClientTransport(), policy=REUSE)
    with httpx.Client(transport=guard, base_url=server.url) as client:
        for _ in range(5):
            assert client.post(CHAT, json=BODY).status_code == 200
    warnings = warnings_about_probing(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "HttpClientTransport" in warnings[0].getMessage()
    snapshot = guard.stats.snapshot()
    assert snapshot.requests == 5
    assert snapshot.probes_sent == 0
    assert snapshot.probing_off is not None
    assert "HttpClientTransport" in snapshot.probing_off
    assert snapshot.as_dict()["probing_off"] == snapshot.probing_off
    assert "probing=off" in repr(guard.stats)


def test_a_wrapper_around_httpcore_is_probed_and_does_not_warn(
    server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """The control: a transport that hides its pool but sends through httpcore is probed through trace events."""
    guard = llama_guard.GuardTransport(PassThroughTransport(), policy=REUSE)
    with httpx.Client(transport=guard, base_url=server.url) as client:
        for _ in range(5):
            assert client.post(CHAT, json=BODY).status_code == 200
    assert warnings_about_probing(caplog) == []
    snapshot = guard.stats.snapshot()
    assert snapshot.probes_sent >= 1
    assert snapshot.probing_off is None
    assert "probing=off" not in repr(guard.stats)


def test_no_warning_when_the_policy_turns_probing_off(
    server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    guard = llama_guard.GuardTransport(
        HttpClientTransport(), policy=llama_guard.GuardPolicy(connection="reuse", probe=False)
    )
    with httpx.Client(transport=guard, base_url=server.url) as client:
        assert client.post(CHAT, json=BODY).status_code == 200
    assert warnings_about_probing(caplog) == []
    assert guard.stats.snapshot().probing_off is None


def test_no_warning_under_the_close_strategy(server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture) -> None:
    """The default on loopback ("auto": close) probes no connection of any transport: a transport that could not
    be probed is nothing to warn about, and stats do not say probing is off."""
    guard = llama_guard.GuardTransport(HttpClientTransport())
    with httpx.Client(transport=guard, base_url=server.url) as client:
        assert client.post(CHAT, json=BODY).status_code == 200
    assert guard.stats.snapshot().connection_strategies  # the close strategy was chosen for the origin
    assert warnings_about_probing(caplog) == []
    assert guard.stats.snapshot().probing_off is None


def test_each_transport_warns_once(server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture) -> None:
    for _ in range(2):
        guard = llama_guard.GuardTransport(HttpClientTransport(), policy=REUSE)
        with httpx.Client(transport=guard, base_url=server.url) as client:
            client.post(CHAT, json=BODY)
            client.post(CHAT, json=BODY)
    assert len(warnings_about_probing(caplog)) == 2


def test_guard_over_litellms_aiohttp_transport_says_probing_is_off(
    server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """litellm's async clients send through aiohttp: guard(client) over one retries but cannot probe, and says so."""
    import aiohttp

    if PARTIAL_DEPS:  # the version matrix installs the test extra only; anywhere else a missing litellm is an error
        pytest.importorskip("litellm", reason="the frameworks extra is not installed (LLAMA_GUARD_PARTIAL_DEPS)")
    from litellm.llms.custom_httpx import aiohttp_transport  # the frameworks extra, part of dev

    async def scenario() -> llama_guard.StatsSnapshot:
        session = aiohttp.ClientSession()
        transport = aiohttp_transport.LiteLLMAiohttpTransport(client=session)
        async with llama_guard.guard(
            httpx.AsyncClient(transport=transport, base_url=server.url), policy=REUSE
        ) as client:
            guard = client._transport
            assert isinstance(guard, llama_guard.AsyncGuardTransport)
            for _ in range(3):
                assert (await client.post(CHAT, json=BODY)).status_code == 200
        await session.close()
        return guard.stats.snapshot()

    snapshot = asyncio.run(scenario())
    assert snapshot.requests == 3
    assert snapshot.probes_sent == 0
    assert snapshot.probing_off is not None
    assert "LiteLLMAiohttpTransport" in snapshot.probing_off
    assert len(warnings_about_probing(caplog)) == 1


class RoutedTransport(HttpClientTransport):
    """`HttpClientTransport` that sends every request to ``port`` on loopback, whatever host its URL names: an
    origin away from loopback, where ``"auto"`` would measure what a new connection costs."""

    def __init__(self, port: int) -> None:
        self.port = port

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        routed = request.url.copy_with(host="127.0.0.1", port=self.port)
        return super().handle_request(
            httpx.Request(request.method, routed, headers=request.headers, content=request.read())
        )


def test_auto_closes_for_good_where_it_cannot_time_a_new_connection(server: LlamaServerEmulator) -> None:
    """A foreign transport to an origin away from loopback: no trace event times its new connections, so "auto"
    cannot measure what one costs. It said "measuring ... 0 of 2 connections" without end; it now closes every
    connection as its final choice, saying why (probing_off stays None: the close strategy probes nothing)."""
    origin = "http://llama.internal:8080"
    guard = llama_guard.GuardTransport(RoutedTransport(server.port))
    with httpx.Client(transport=guard, base_url=origin) as client:
        results = [llama_guard.result_of(client.post(CHAT, json=BODY)) for _ in range(20)]
    strategy = guard.stats.snapshot().connection_strategies[origin]
    assert strategy == (
        "close (the cost of a new connection cannot be measured: RoutedTransport does not send through httpcore (it "
        "reports no trace events), so the guard cannot time its new connections)"
    )
    assert {result.connection for result in results} == {"close"}
    assert guard.stats.snapshot().probing_off is None
    assert server.stats().completions_finished == 20
