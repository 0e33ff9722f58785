"""A process whose sockets are numbered past 1023 (a proxy's open connections, a burst of hundreds): select(2)
refuses such descriptors (``ValueError: filedescriptor out of range``), so every readiness check the guard, the
burst and the emulator make goes through `llama_guard._readiness` (poll). Each test runs with every new socket past
1023."""

from __future__ import annotations

import asyncio
import os
import resource
from collections.abc import Iterator

import pytest

from llama_guard import GuardPolicy
from llama_guard._readiness import readable_now, ready
from llama_guard.testing import LlamaServerEmulator, open_burst

PAST_SELECT = 1100  # the first descriptor the tests' sockets may get: past FD_SETSIZE (1024)


@pytest.fixture
def high_descriptors() -> Iterator[None]:
    """Descriptors up to `PAST_SELECT` held open on /dev/null, the open-files limit raised to allow it and more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = PAST_SELECT + 1024
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard open-files limit ({hard}) is below the {wanted} descriptors these tests need")
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < PAST_SELECT:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for descriptor in held:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_burst_and_the_emulator_work_past_select(high_descriptors: None) -> None:
    """The burst of doctor and the demo opens its connections past 1023, and the emulator (accept loop, reads)
    serves them: each gets its answer."""
    with LlamaServerEmulator(pool_bug=False) as server:
        sockets = open_burst("127.0.0.1", server.port, 16)
        try:
            assert min(sock.fileno() for sock in sockets) > 1023
            for sock in sockets:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answers = []
            for sock in sockets:
                sock.settimeout(10)
                answers.append(sock.recv(64))
        finally:
            for sock in sockets:
                sock.close()
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers), answers


def test_an_aiohttp_session_reuses_connections_past_select(high_descriptors: None) -> None:
    """A guarded aiohttp session checks a pooled connection before reusing it (a dead one would lose the
    request): past 1023 the check raised ValueError, failing the request."""
    pytest.importorskip("aiohttp")
    import llama_guard.aiohttp as guard_aiohttp

    async def two_requests(url: str) -> list[int]:
        policy = GuardPolicy(connection="reuse")
        async with guard_aiohttp.guarded_session(url, policy=policy) as session:
            statuses = []
            for _ in range(2):
                async with session.get("/health") as response:
                    await response.read()
                    statuses.append(response.status)
            return statuses

    with LlamaServerEmulator(pool_bug=False) as server:
        assert asyncio.run(two_requests(server.url)) == [200, 200]


def test_readiness_tells_ready_from_waiting(high_descriptors: None) -> None:
    """`ready` and `readable_now` past 1023: a socket with bytes waiting is readable, one without is not; both are
    writable; a closed one counts as ready (its read says what happened)."""
    import socket

    left, right = socket.socketpair()
    try:
        assert left.fileno() > 1023
        assert not readable_now(left)
        assert ready([left, right], 0, write=True) == [left, right]
        right.sendall(b"x")
        assert ready([right, left], 5) == [left]
        assert readable_now(left)
    finally:
        right.close()
        left.close()
    assert readable_now(left)
