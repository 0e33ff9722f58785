"""A write that fails half way through a request body leaves nothing behind for trio's finalizer to warn about.

httpcore writes a body by iterating its stream, and abandons the iterator when the write fails (it then reads for
an answer the server may have sent). httpx's in-memory body is an async generator: abandoned, trio's finalizer warns
(a ResourceWarning, an error in this suite) when it is collected. The guard sends a body it holds in memory as an
iterator object on every attempt, the first one included; a one-shot body (``content=`` an async iterable) goes out
through httpx's generator over it, which the guard closes when the attempt ends. The server here makes the failure
deterministic: it reads the headers and part of a body far larger than the socket buffers, so the client is blocked
half way through the body when the connection is reset; the next connection is answered.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import threading
import warnings
from collections.abc import Callable, Iterator

import httpx
import pytest
import trio

import llama_guard
from llama_guard import GuardPolicy

#: Far more than the client's send buffer (at most 4 MiB here) and the server's receive buffer (pinned at 64 KiB):
#: the client's write is still blocked when the server resets the connection.
BODY = b"x" * (16 * 1024 * 1024)
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"


class ResetMidBody:
    """Resets its first connection once the body has begun to arrive; answers every later one in full."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # inherited by accepted sockets
        self._listener.settimeout(30)
        self.port = self._listener.getsockname()[1]
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> ResetMidBody:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in the thread (close() alone does not)
        self._listener.close()
        self._thread.join(30)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(30)
                self.connections += 1
                head, rest = _read_head(conn)
                if self.connections == 1:
                    while len(rest) < 1024:  # the body has begun: the client is inside its body's iterator
                        rest += conn.recv(65536)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue  # closed with a reset
                length = int(
                    next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(
                        b":"
                    )[1]
                )
                while len(rest) < length:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    rest += chunk
                conn.sendall(ANSWER)


def _read_head(conn: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


@pytest.fixture
def server() -> Iterator[ResetMidBody]:
    with ResetMidBody() as server:
        yield server


def _lost(outcome: object) -> bool:
    """The request failed as a reset connection fails it (the guard's classes subclass httpx's)."""
    return isinstance(outcome, type) and issubclass(
        outcome, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
    )


class OneShot:
    """An async iterable that can be read once, in chunks, with no generator of its own (so that only httpx's
    generator over it can be left suspended)."""

    def __init__(self, data: bytes, chunk: int = 1 << 20) -> None:
        self._chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]

    def __aiter__(self) -> OneShot:
        return self

    async def __anext__(self) -> bytes:
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop(0)


def _post_under(
    client_factory: object, url: str, *, one_shot: bool = False, run: Callable[..., object] = trio.run
) -> tuple[object, list[str]]:
    """Posts BODY (``one_shot``: as an async iterable) under trio (or ``run``: asyncio's); returns the outcome (a
    status or the exception's class) and the messages of the ResourceWarnings seen, collection included."""
    outcome: object = None

    async def main() -> None:
        nonlocal outcome
        async with client_factory() as client:  # type: ignore[operator]
            try:
                response = await client.post(url, content=OneShot(BODY) if one_shot else BODY)
                outcome = response.status_code
            except httpx.TransportError as exc:
                outcome = type(exc)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        run(main)
        gc.collect()
    return outcome, [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]


def test_plain_httpx_abandons_its_body_generator(server: ResetMidBody) -> None:
    """The control: plain httpx fails, and its abandoned body generator is warned about."""
    outcome, resource_warnings = _post_under(httpx.AsyncClient, f"http://127.0.0.1:{server.port}/v1/completions")
    assert _lost(outcome), outcome
    assert server.connections == 1
    assert any("ByteStream.__aiter__" in message for message in resource_warnings), resource_warnings


@pytest.mark.parametrize("connection", ["close", "reuse"])
def test_the_guard_leaves_no_body_generator_behind(server: ResetMidBody, connection: str) -> None:
    """Under either strategy, the guard's first attempt fails the same way, its retry is answered, and nothing is
    left for trio's finalizer."""
    policy = GuardPolicy(probe=False, backoff=0.01, connection=connection)

    def factory() -> httpx.AsyncClient:
        return llama_guard.guard(httpx.AsyncClient(), policy=policy)

    outcome, resource_warnings = _post_under(factory, f"http://127.0.0.1:{server.port}/v1/completions")
    assert outcome == 200
    assert server.connections == 2
    assert resource_warnings == []


def test_plain_httpx_abandons_its_generator_over_a_one_shot_body(server: ResetMidBody) -> None:
    """The control: plain httpx leaves its generator over the caller's async iterable suspended, and it is warned
    about."""
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    outcome, resource_warnings = _post_under(httpx.AsyncClient, url, one_shot=True)
    assert _lost(outcome), outcome
    assert any("AsyncIteratorByteStream.__aiter__" in message for message in resource_warnings), resource_warnings


@pytest.mark.parametrize("connection", ["close", "reuse"])
def test_the_guard_closes_its_generator_over_a_one_shot_body(server: ResetMidBody, connection: str) -> None:
    """The guard sends a one-shot body once (never again: it cannot), fails as plain httpx does, and closes httpx's
    generator over it when the attempt ends: nothing is left for trio's finalizer."""
    policy = GuardPolicy(probe=False, backoff=0.01, connection=connection)

    def factory() -> httpx.AsyncClient:
        return llama_guard.guard(httpx.AsyncClient(), policy=policy)

    url = f"http://127.0.0.1:{server.port}/v1/completions"
    outcome, resource_warnings = _post_under(factory, url, one_shot=True)
    assert _lost(outcome), outcome
    assert server.connections == 1  # sent once
    assert resource_warnings == []


@pytest.mark.parametrize("connection", ["close", "reuse"])
def test_under_asyncio_the_guard_retries_and_leaves_no_warning(server: ResetMidBody, connection: str) -> None:
    """The same under asyncio (whose finalizer would close an abandoned generator quietly): the first attempt
    fails, its retry is answered, nothing is warned about."""
    policy = GuardPolicy(probe=False, backoff=0.01, connection=connection)

    def factory() -> httpx.AsyncClient:
        return llama_guard.guard(httpx.AsyncClient(), policy=policy)

    url = f"http://127.0.0.1:{server.port}/v1/completions"
    outcome, resource_warnings = _post_under(factory, url, run=lambda main: asyncio.run(main()))
    assert outcome == 200
    assert server.connections == 2
    assert resource_warnings == []
