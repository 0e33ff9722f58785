"""The caller's ``httpx.Request`` after the guard is done with it: same body stream, same extensions, same headers.

The guard lends the request its attempt's body (and extensions, when an attempt needs its own) rather than copying
it (``RequestRun.begin_attempt``/``end_attempt``, and the transport's first attempt); whatever the outcome, the
caller gets back exactly what it passed.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

import llama_guard
from llama_guard.testing import Fault, LlamaServerEmulator, free_port

from ._recording_server import RecordingServer

CHAT = "/v1/chat/completions"


def _snapshot(request: httpx.Request) -> tuple[Any, ...]:
    extensions = request.extensions
    return request.stream, extensions, dict(extensions), list(request.headers.raw)


class _Checking(httpx.BaseTransport):
    """Around the guard: records the request as the guard gets it and as the guard gives it back."""

    def __init__(self, guard: llama_guard.GuardTransport) -> None:
        self.guard = guard
        self.seen: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        before = _snapshot(request)
        try:
            return self.guard.handle_request(request)
        finally:
            self.seen.append((before, _snapshot(request)))

    def close(self) -> None:
        self.guard.close()


class _AsyncChecking(httpx.AsyncBaseTransport):
    def __init__(self, guard: llama_guard.AsyncGuardTransport) -> None:
        self.guard = guard
        self.seen: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        before = _snapshot(request)
        try:
            return await self.guard.handle_async_request(request)
        finally:
            self.seen.append((before, _snapshot(request)))

    async def aclose(self) -> None:
        await self.guard.aclose()


def _assert_given_back(seen: list[tuple[tuple[Any, ...], tuple[Any, ...]]]) -> None:
    assert len(seen) == 1
    before, after = seen[0]
    assert after == before
    assert after[0] is before[0]  # the caller's own stream object
    assert after[1] is before[1]  # and extensions dict


@pytest.mark.parametrize(
    ("stream", "extensions"),
    [
        (False, {}),
        (True, {}),  # "close" mode: the attempt goes out with Connection: close
        (False, {"llama_guard": {"first_byte_timeout": 5.0}}),  # per-request options, first-byte deadline
    ],
)
def test_the_callers_request_is_given_back_unchanged(stream: bool, extensions: dict[str, object]) -> None:
    """Answered requests: the caller's stream, extensions (the same object, same items) and headers are intact."""
    checking = _Checking(llama_guard.GuardTransport())
    with LlamaServerEmulator() as server, httpx.Client(transport=checking) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 2}
        response = client.post(server.url + CHAT, json=body, extensions=extensions)
        assert response.status_code == 200
        assert response.extensions["llama_guard"].stream is stream
    _assert_given_back(checking.seen)


def test_a_retried_request_is_given_back_unchanged() -> None:
    """A 503 first attempt, retried: the caller's request is still its own afterwards."""
    checking = _Checking(llama_guard.GuardTransport())
    with LlamaServerEmulator() as server, httpx.Client(transport=checking) as client:
        server.inject(Fault.STATUS_503, count=1, retry_after=0)
        response = client.post(server.url + CHAT, json={"messages": [], "max_tokens": 2})
        assert response.extensions["llama_guard"].attempts == 2
    _assert_given_back(checking.seen)


def test_a_failed_async_request_is_given_back_unchanged() -> None:
    """Nothing listening: the request fails after its attempts, and is the caller's own again."""
    policy = llama_guard.GuardPolicy(max_attempts=2, backoff=0.0)
    checking = _AsyncChecking(llama_guard.AsyncGuardTransport(policy=policy))

    async def send() -> None:
        async with httpx.AsyncClient(transport=checking) as client:
            with pytest.raises(httpx.ConnectError):
                await client.post(f"http://127.0.0.1:{free_port()}{CHAT}", json={"stream": True})

    anyio.run(send)
    _assert_given_back(checking.seen)


CALLER_HEADERS = [
    [],
    [("Connection", "keep-alive")],
    [("X-Before", "1"), ("connection", "Keep-Alive"), ("X-After", "2"), ("CONNECTION", "upgrade")],
]


@pytest.mark.parametrize("caller", CALLER_HEADERS, ids=["httpx default", "keep-alive", "three, mixed case"])
def test_the_close_strategy_sends_exactly_one_connection_close_header(caller: list[tuple[str, str]]) -> None:
    """The close strategy (the default on loopback) lends each attempt ``Connection: close``: on the wire there is
    exactly one Connection header, ``close``, whatever the caller set (its own, or httpx's default ``keep-alive``,
    replaced, not repeated), and the caller's other headers go out in their order. Fails when the header is appended
    beside the caller's."""
    server = RecordingServer()
    try:
        with httpx.Client(transport=llama_guard.GuardTransport()) as client:
            response = client.post(server.url + CHAT, json={"messages": [], "max_tokens": 2}, headers=caller)
        assert response.extensions["llama_guard"].connection == "close"
        [head] = [raw.split(b"\r\n\r\n")[0] for raw in server.received]
    finally:
        server.close()
    lines = [line.decode() for line in head.split(b"\r\n")[1:]]
    assert [line for line in lines if line.lower().startswith("connection:")] == ["Connection: close"], lines
    own = [f"{name}: {value}" for name, value in caller if name.lower() != "connection"]
    assert [line for line in lines if line in own] == own


@pytest.mark.parametrize("caller", CALLER_HEADERS, ids=["httpx default", "keep-alive", "three, mixed case"])
def test_the_fast_close_headers_equal_httpx_own_way(caller: list[tuple[str, str]]) -> None:
    """The tested versions' way of lending ``Connection: close`` (httpx's header triples) gives the headers the
    public API gives (the untested versions' way), and leaves the caller's request as it was."""
    from llama_guard._httpx import internals

    for request in (
        httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions", headers=caller),  # no Connection of httpx's
        httpx.Client().build_request("POST", "http://127.0.0.1:1/v1/chat/completions", headers=caller),
    ):
        before = list(request.headers.raw)
        fast = internals.close_headers(True)(request)
        public = internals.close_headers(False)(request)
        assert fast.raw == public.raw
        assert fast is not request.headers
        assert list(request.headers.raw) == before
