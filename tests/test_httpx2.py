"""The httpx2 flavour (generated from the httpx one): the same defects, the same fix, httpx2's own error classes."""

from __future__ import annotations

import anyio
import pytest

httpx2 = pytest.importorskip("httpx2")

import llama_guard  # noqa: E402
import llama_guard.httpx2 as guard2  # noqa: E402
from llama_guard.testing import Fault, LlamaServerEmulator  # noqa: E402

CHAT = "/v1/chat/completions"


def _body(stream: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 2}


def _alternate(client: object, n: int) -> int:
    errors = 0
    for index in range(n):
        try:
            with client.stream("POST", CHAT, json=_body(index % 2 == 1)) as response:  # type: ignore[attr-defined]
                response.read()
        except httpx2.HTTPError:
            errors += 1
    return errors


def test_plain_httpx2_loses_requests_after_streams(racy_server: LlamaServerEmulator) -> None:
    """Every non-streamed request after the first goes to the connection a stream left: 14 of 30 lost."""
    with httpx2.Client(base_url=racy_server.url) as client:
        assert _alternate(client, 30) == 14
    assert racy_server.wait_for(lambda s: s.requests_dropped_after_stream == 14).completions_finished == 16


@pytest.mark.parametrize("connection", ["auto", "reuse"])
def test_httpx2_guard_loses_none(connection: str, racy_server: LlamaServerEmulator) -> None:
    """Both strategies: the default ("auto": close on the emulator's loopback address) and "reuse"."""
    policy = llama_guard.GuardPolicy(connection=connection, max_attempts=1)  # type: ignore[arg-type]
    transport = guard2.GuardTransport(policy=policy)
    with httpx2.Client(base_url=racy_server.url, transport=transport) as client:
        assert _alternate(client, 30) == 0
    stats = transport.stats.snapshot()
    assert stats.stream_connections_closed == 15
    if connection == "reuse":
        assert stats.probes_sent == 15  # one per new connection: the first, and one after each stream
    else:
        assert stats.probes_sent == 0  # close: every connection serves one request, and none is probed
    assert racy_server.stats().requests_dropped_after_stream == 0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_httpx2_async_guard_loses_none(racy_server: LlamaServerEmulator, backend: str) -> None:
    async def scenario() -> int:
        errors = 0
        async with httpx2.AsyncClient(base_url=racy_server.url, transport=guard2.AsyncGuardTransport()) as client:
            for index in range(20):
                try:
                    async with client.stream("POST", CHAT, json=_body(index % 2 == 1)) as response:
                        await response.aread()
                except httpx2.HTTPError:
                    errors += 1
        return errors

    assert anyio.run(scenario, backend=backend) == 0
    assert racy_server.stats().requests_dropped_after_stream == 0


def test_guard_accepts_httpx2_clients(racy_server: LlamaServerEmulator) -> None:
    """llama_guard.guard() takes httpx2 clients too, and wraps them with the httpx2 flavour."""
    with llama_guard.guard(httpx2.Client(base_url=racy_server.url)) as client:
        assert isinstance(client._transport, guard2.GuardTransport)
        assert _alternate(client, 10) == 0
        assert client.post(CHAT, json=_body(False)).extensions["llama_guard"].attempts == 1


def test_httpx2_errors_are_httpx2_errors() -> None:
    """An error through the httpx2 flavour is an instance of httpx2's class and of llama_guard.GuardError."""
    with LlamaServerEmulator() as server:
        server.inject(Fault.HEADERS_NEVER, path=CHAT, hold=None, count=None)
        policy = llama_guard.GuardPolicy(first_byte_timeout=0.2, max_attempts=2, backoff=0.0)
        client = httpx2.Client(base_url=server.url, transport=guard2.GuardTransport(policy=policy))
        with client, pytest.raises(httpx2.ReadTimeout) as info:
            client.post(CHAT, json=_body(False))
    assert isinstance(info.value, guard2.FirstByteTimeout)
    assert isinstance(info.value, llama_guard.GuardError)
    assert info.value.attempts == 2


def test_importing_llama_guard_does_not_import_httpx2() -> None:
    import subprocess
    import sys

    code = "import sys, llama_guard; llama_guard.guard; print('httpx2' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
