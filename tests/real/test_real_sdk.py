"""The openai SDK (3.x, on httpx2) through `install()` against the real llama-server b11434.

The same proxy-like load as tests/test_sdk_integrations.py: half of the requests streamed, the SDK's retries off.
The SDK's own per-request work tends to hide the stream race (a run in the issue lost 0 of 992 without a guard),
so this shows what matters here: every request went through the guard, none was lost or cut short, and the
server ran each completion exactly once (``/metrics``, see _counting.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import llama_guard

from .._sdk_load import SdkLoad, async_load, sync_load
from ._counting import completions_ran, settled_tokens

pytestmark = pytest.mark.real_server

REQUESTS = 1000
MAX_TOKENS = 4
EXTRA = {"ignore_eos": True, "temperature": 0.0}


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()


def assert_whole(load: SdkLoad) -> None:
    assert load.errors == []
    assert len(load.answers) == REQUESTS
    assert all(finish == "length" for _, _, finish in load.answers)
    assert sum(streamed for streamed, _, _ in load.answers) == REQUESTS // 2


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
def test_openai_sdk_through_install_on_real_llama_server(real_server, flavor: str) -> None:  # type: ignore[no-untyped-def]
    server = real_server(metrics=True, parallel=4)
    installation = llama_guard.install(origins=[server.url])
    before = settled_tokens(server)
    if flavor == "sync":
        load = sync_load(server.url, requests=REQUESTS, threads=16, max_tokens=MAX_TOKENS, extra_body=EXTRA)
    else:
        load = asyncio.run(
            async_load(server.url, requests=REQUESTS, concurrency=16, max_tokens=MAX_TOKENS, extra_body=EXTRA)
        )
    assert_whole(load)
    stats = installation.stats.snapshot()
    assert stats.requests == REQUESTS
    assert stats.stream_connections_closed == REQUESTS // 2
    assert completions_ran(server, MAX_TOKENS, since_tokens=before) == REQUESTS
