"""Shared fixtures: emulators whose defects are deterministic, for the tests that assert that plain clients fail
or that a mechanism of the guard fired.

A control must not pass or fail by chance: on these servers every request written to a stream's kept-alive
connection is lost (``stream_close="on_reuse"``), and a burst of new connections stalls by position, not by how
fast threads wake (``stall_burst``). The server counts both (``requests_dropped_after_stream``,
``connections_stalled``), so a test can compare what its clients saw with what the server did, exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llama_guard.testing import LlamaServerEmulator

#: The burst of the stalling server: of the first 16 connections of a burst, 4 are served and 12 stall.
BURST_THREADS = 4
BURST_SIZE = 16


@pytest.fixture
def racy_server() -> Iterator[LlamaServerEmulator]:
    """Streams' connections are given up after the final chunk without a FIN: a pooled client reuses them, and
    the request it writes there is dropped unanswered -- every time. Enough threads that no burst stalls."""
    with LlamaServerEmulator(stream_close="on_reuse", http_threads=16, pool_bug=False) as server:
        yield server


@pytest.fixture
def stalling_server() -> Iterator[LlamaServerEmulator]:
    """The pool stall, deterministic: connections 5 to 16 of a burst leave their first request unread until a
    served connection closes (or ``release_stalled()``); later connections, a client's reconnects, are served."""
    with LlamaServerEmulator(http_threads=BURST_THREADS, stall_burst=BURST_SIZE) as server:
        yield server
