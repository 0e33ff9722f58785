"""Kicks (``GuardPolicy.probe_kick``, on by default): a stalled connection rescued instead of replaced, on every
stack, with one WARNING per episode.

The emulator's ``stall_oldest_first`` serves stalled connections as cpp-httplib's FIFO queue does: a connection
accepted after the burst spawns a thread that takes the *oldest* stalled connection, and waits its turn itself.
So a kick (a connection opened and closed at once) serves a stalled client's own connection, and its probe is
answered there; without kicks the probe's deadline passes and the connection is given up (the control).
"""

from __future__ import annotations

import functools
import logging
import re
import socket
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from llama_guard import GuardPolicy
from llama_guard._core import connection_machine as connection
from llama_guard._core.stats import GuardStats
from llama_guard._drive.async_drive import _kick as async_kick
from llama_guard._drive.sync_drive import _kick as sync_kick
from llama_guard._runtime import PROCESS
from llama_guard.testing import LlamaServerEmulator, open_burst

from ._drivers import FLAVORS, each_asks_then_close, episode_log, make_driver, run_scenario
from ._machines import machine_for, probing
from .test_mechanisms import CHAT, chat, poll

HTTP_THREADS = 4
BURST = 16
STALLED = BURST - HTTP_THREADS
CLIENTS = [pytest.param(flavor, "httpx", id=flavor) for flavor in FLAVORS] + [
    pytest.param("asyncio", "aiohttp", id="aiohttp")
]
# The probe waits long enough that only a stall, never a slow machine, can reach the deadline; the learnt deadline
# (from the served connections' answers, at least 0.05 s) is when the kicks go. Kicks are the default.
# connection="reuse": the emulator is on loopback, where the default closes connections and probes none; kicks are
# part of the probe of new keep-alive connections.
KICKING = GuardPolicy(connection="reuse", probe_timeout=5.0, probe_timeout_max=5.0)
NOT_KICKING = GuardPolicy(connection="reuse", probe_kick=False, probe_timeout=5.0, probe_timeout_max=5.0)


@pytest.fixture(params=[True, False], ids=["oldest-first", "served-at-once"])
def fifo_server(request: pytest.FixtureRequest) -> Iterator[LlamaServerEmulator]:
    """Both models of a connection accepted after the burst: its thread takes the oldest stalled connection (as
    cpp-httplib's queue does), or it is served at once and its thread, freed when the kick closes, takes it."""
    with LlamaServerEmulator(http_threads=HTTP_THREADS, stall_burst=BURST, stall_oldest_first=request.param) as server:
        yield server


async def burst(flavor: str, library: str, url: str, port: int, policy: GuardPolicy, size: int = BURST) -> list[Any]:
    """``size`` connections opened back to back, one handed to each client, which then asks once."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    sockets = open_burst("127.0.0.1", port, size)
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
    await each_asks_then_close(flavor, drivers, CHAT, chat(stream=False))
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


@pytest.mark.parametrize(("flavor", "library"), CLIENTS)
def test_one_warning_per_episode_of_rescues(
    flavor: str, library: str, caplog: pytest.LogCaptureFixture, fifo_server: LlamaServerEmulator
) -> None:
    """The rescues of a burst are one WARNING naming how many there were (and any replaced); each rescue is a
    DEBUG record."""
    caplog.set_level(logging.DEBUG, logger="llama_guard")
    PROCESS.stalls.flush()  # an earlier test's episode, whose server may have had this test's port
    caplog.clear()
    server = fifo_server
    drivers = run_scenario(flavor, functools.partial(burst, policy=KICKING), flavor, library, server.url, server.port)
    PROCESS.stalls.flush()  # the episode ends when its transports close (httpx) or 2 s after it began (aiohttp): now
    counts = totals(drivers)
    said, details = episode_log(
        caplog,
        server.port,
        r"rescued (\d+) stalled connections? to {origin} in the last [0-9.]+ s \(llama-server before b11737 had not "
        r"read them; a kick connection made it read them; each one at DEBUG level on the 'llama_guard' logger\)",
    )
    assert int(said.group(1)) == counts["probes_rescued"] >= 1, counts
    rescues = [m for m in details if re.search(r"answered its probe after [0-9.]+ s and \d+ kicks?$", m)]
    assert len(rescues) == counts["probes_rescued"], rescues


def unused_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class KickedRun:
    """What one kick left: the request's counters, and the kicks its connection's machine counted."""

    def __init__(self, stats: GuardStats, machine: connection.ConnectionMachine) -> None:
        self.stats = stats.snapshot()
        self.probe_kicks = machine.kicks


def kick_once(flavor: str, port: int) -> KickedRun:
    """One kick of a fresh request's probe to ``port``: the shared drive loop's own kick of that flavour does the
    I/O, and the connection's machine takes what it reports (`Kicked`)."""
    probe = probing(machine_for(GuardPolicy(connection="reuse"), url=f"http://127.0.0.1:{port}{CHAT}"))
    probe.machine.next(connection.WRITTEN)
    probe.clock.now = 0.2  # past the first kick (a quarter of the 0.5 s deadline, nothing learnt)
    kick = probe.machine.next(connection.TIMED_OUT)
    assert kick == connection.Kick("127.0.0.1", port)
    kicked = sync_kick(kick) if flavor == "sync" else anyio.run(async_kick, kick, backend=flavor)
    probe.machine.next(kicked)
    return KickedRun(probe.request.plan.stats, probe.machine)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_kick_that_cannot_connect_is_counted_and_said_once(
    flavor: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never silently: kicks that fail leave stalled connections to be replaced; one WARNING says so, and
    ``probe_kicks_failed`` counts them."""
    monkeypatch.setattr(PROCESS.warnings, "_said", set())
    caplog.set_level(logging.WARNING, logger="llama_guard")
    port = unused_port()
    runs = [kick_once(flavor, port) for _ in range(2)]
    assert [(r.stats.probe_kicks, r.stats.probe_kicks_failed, r.probe_kicks) for r in runs] == [(1, 1, 1)] * 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "llama_guard"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"kick connections to http://127.0.0.1:{port} fail (ConnectError): ")
    assert "probe_kicks_failed" in warnings[0]
    # The control: a kick that connects is counted, not as failed, and says nothing.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        run = kick_once(flavor, listener.getsockname()[1])
        accepted, _ = listener.accept()  # the kick reached the listener
        accepted.close()
    assert (run.stats.probe_kicks, run.stats.probe_kicks_failed) == (1, 0)
    assert len([r for r in caplog.records if r.name == "llama_guard"]) == 1


@pytest.mark.parametrize(("flavor", "library"), CLIENTS)
def test_kicks_go_before_anything_is_learnt(flavor: str, library: str) -> None:
    """A burst whose served connections are too few to learn a deadline from (2 pool threads: 2 answers, 4 needed)
    still kicks, at a quarter and half of ``probe_timeout``: every stalled connection is rescued, none given up."""
    threads, size = 2, 8
    policy = GuardPolicy(connection="reuse", probe_timeout=2.0, probe_timeout_max=2.0)
    with LlamaServerEmulator(http_threads=threads, stall_burst=size, stall_oldest_first=True) as server:
        drivers = run_scenario(
            flavor, functools.partial(burst, policy=policy, size=size), flavor, library, server.url, server.port
        )
        # The burst's own stalled connections, and kicks that waited their turn behind them (cpp-httplib's queue).
        assert server.stats().connections_stalled >= size - threads
    outcomes = [o for d in drivers for o in d.outcomes]
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if o.error]
    counts = totals(drivers)
    assert (counts["probes_given_up"], counts["stall_reconnects"]) == (0, 0), counts
    assert counts["probe_kicks"] >= size - threads, counts
    assert counts["probes_rescued"] >= 1, counts
