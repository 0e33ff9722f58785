"""The frameworks' server: the emulator with the stream defect on, in one fixture so its mode changes in one place."""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Iterator

import pytest

import llama_guard
from llama_guard.testing import LlamaServerEmulator

# litellm fetches its model price list from GitHub at import unless told to use the copy it ships: loopback only.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture
def racy_server() -> Iterator[LlamaServerEmulator]:
    """Streams close 60 ms after their final chunk: a client that reuses the connection in between loses its request
    (a race, which the plain controls of tests/frameworks/_load.py allow for)."""
    with LlamaServerEmulator(stream_close_delay=0.06, http_threads=16, pool_bug=False) as server:
        yield server


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()


@pytest.fixture(autouse=True)
def no_event_loop_left_open() -> Iterator[None]:
    """litellm's sync path leaves an event loop set on the main thread; the next asyncio.run() would drop it
    unclosed (a ResourceWarning, an error here). Close it after each test."""
    yield
    policy = asyncio.get_event_loop_policy()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            loop = policy.get_event_loop()
    except RuntimeError:  # none set
        return
    if not loop.is_running():
        loop.close()
        policy.set_event_loop(None)
