"""The frameworks' own fixtures. Their server is tests/conftest.py's ``racy_server``: the stream defect,
deterministic."""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Iterator

import pytest

import llama_guard

# litellm fetches its model price list from GitHub at import unless told to use the copy it ships: loopback only.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


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
