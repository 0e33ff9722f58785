"""``GuardPolicy(probe_kick=True)``: a stalled connection rescued instead of replaced, on every stack.

The emulator's ``stall_oldest_first`` serves stalled connections as cpp-httplib's FIFO queue does: a connection
accepted after the burst spawns a thread that takes the *oldest* stalled connection, and waits its turn itself.
So a kick (a connection opened and closed at once) serves a stalled client's own connection, and its probe is
answered there; without kicks the probe's deadline passes and the connection is given up (the control).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from llama_guard import GuardPolicy
from llama_guard.testing import LlamaServerEmulator, open_burst

from ._drivers import FLAVORS, close_driver, gather, make_driver, run_scenario
from .test_mechanisms import CHAT, chat, poll

HTTP_THREADS = 4
BURST = 16
STALLED = BURST - HTTP_THREADS
CLIENTS = [pytest.param(flavor, "httpx", id=flavor) for flavor in FLAVORS] + [
    pytest.param("asyncio", "aiohttp", id="aiohttp")
]
# The probe waits long enough that only a stall, never a slow machine, can reach the deadline; the learnt deadline
# (from the served connections' answers, at least 0.05 s) is when the kicks go.
KICKING = GuardPolicy(probe_kick=True, probe_timeout=5.0, probe_timeout_max=5.0)
NOT_KICKING = GuardPolicy(probe_kick=False, probe_timeout=5.0, probe_timeout_max=5.0)


@pytest.fixture(params=[True, False], ids=["oldest-first", "served-at-once"])
def fifo_server(request: pytest.FixtureRequest) -> Iterator[LlamaServerEmulator]:
    """Both models of a connection accepted after the burst: its thread takes the oldest stalled connection (as
    cpp-httplib's queue does), or it is served at once and its thread, freed when the kick closes, takes it."""
    with LlamaServerEmulator(http_threads=HTTP_THREADS, stall_burst=BURST, stall_oldest_first=request.param) as server:
        yield server


async def burst(flavor: str, library: str, url: str, port: int, policy: GuardPolicy) -> list[Any]:
    """``BURST`` connections opened back to back, one handed to each client, which then asks once."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    sockets = open_burst("127.0.0.1", port, BURST)
    drivers = [
        make_driver(
            flavor,
            guarded=True,
            base_url=url,
            limits=limits,
            timeout=30.0,
            policy=policy,
            preopened=[sock],
            library=library,
        )
        for sock in sockets
    ]

    def job(driver: Any) -> Any:
        async def run() -> None:
            await driver.request("POST", CHAT, json=chat(stream=False))

        return run

    try:
        await gather(flavor, [job(d) for d in drivers])
    finally:
        for driver in drivers:
            await close_driver(driver)
    return drivers


def totals(drivers: list[Any]) -> dict[str, int]:
    names = ("probes_given_up", "stall_reconnects", "probe_kicks", "probes_rescued", "retries")
    return {name: sum(getattr(d.stats, name) for d in drivers) for name in names}


@pytest.mark.parametrize(("flavor", "library"), CLIENTS)
def test_kicks_rescue_every_stalled_connection(flavor: str, library: str, fifo_server: LlamaServerEmulator) -> None:
    server = fifo_server
    drivers = run_scenario(flavor, functools.partial(burst, policy=KICKING), flavor, library, server.url, server.port)
    outcomes = [o for d in drivers for o in d.outcomes]
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if o.error]
    counts = totals(drivers)
    # Nothing given up or replaced: every stalled connection was served where it was, by a thread a kick woke.
    assert (counts["probes_given_up"], counts["stall_reconnects"], counts["retries"]) == (0, 0, 0), counts
    assert counts["probe_kicks"] >= STALLED, counts  # each kick's thread serves one stalled connection
    assert 1 <= counts["probes_rescued"] <= STALLED, counts
    assert server.stats().completions_started == len(outcomes) == BURST
    # The burst's own connections and the kicks, nothing else (the last kicks may still be in the listen backlog
    # when the clients are done: accepted within a bound, as each is closed at once).
    expected = BURST + counts["probe_kicks"]
    poll(lambda: server.stats().connections_accepted >= expected, timeout=10.0, what=f"{expected} connections accepted")
    assert server.stats().connections_accepted == expected


@pytest.mark.parametrize(("flavor", "library"), CLIENTS)
def test_without_kicks_the_stalled_connections_are_given_up(
    flavor: str, library: str, fifo_server: LlamaServerEmulator
) -> None:
    """The control: the same burst without kicks gives up a stalled connection at the learnt deadline (nothing
    else can serve it first) and replaces it; the requests still succeed, one attempt later."""
    server = fifo_server
    drivers = run_scenario(
        flavor, functools.partial(burst, policy=NOT_KICKING), flavor, library, server.url, server.port
    )
    outcomes = [o for d in drivers for o in d.outcomes]
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if o.error]
    counts = totals(drivers)
    assert counts["probe_kicks"] == counts["probes_rescued"] == 0, counts
    assert counts["probes_given_up"] >= 1, counts
    assert counts["stall_reconnects"] >= 1, counts
    assert server.stats().completions_started == BURST
