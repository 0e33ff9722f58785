"""The connection strategy per origin (GuardPolicy.connection): the core's decisions as tables, and on the wire what
each strategy does to connections, probes and results; the measured choice away from loopback in a network namespace
of the test's own."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections import deque

import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy
from llama_guard._core import connection_machine as connection
from llama_guard._core.connection_strategy import (
    CLOSE_COST_SHARE,
    MIN_CONNECTS,
    MIN_REQUESTS,
    OriginConnections,
    is_loopback_host,
)
from llama_guard._core.origins import Origin
from llama_guard._runtime import PROCESS
from llama_guard.testing import LlamaServerEmulator

from ._drivers import FLAVORS, close_driver, make_driver, run_scenario
from ._machines import URL, fresh_origins, machine_for, probing
from .test_mechanisms import CHAT, chat


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST", True),
        ("llama.localhost", True),
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.5", False),
        ("192.168.1.10", False),
        ("::2", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    """Which hosts cost no network round trip to reconnect to."""
    assert is_loopback_host(host) is loopback


REMOTE = Origin("http", "10.1.2.3", 8080)
REMOTE_URL_ORIGIN = Origin.of_url(httpx.URL(URL))  # the origin of the machines' requests (tests/_machines.py)


@pytest.mark.parametrize(
    ("mode", "origin", "unix_socket", "strategy", "final", "reason"),
    [
        ("close", REMOTE, False, "close", True, "forced"),
        ("reuse", Origin("http", "127.0.0.1", 8080), False, "reuse", True, "forced"),
        ("reuse", REMOTE, True, "reuse", True, "forced"),
        ("auto", Origin("http", "127.0.0.1", 8080), False, "close", True, "loopback"),
        ("auto", Origin("https", "::1", 443), False, "close", True, "loopback"),
        ("auto", REMOTE, True, "close", True, "Unix socket"),
        ("auto", REMOTE, False, "close", False, "measuring"),
    ],
)
def test_choice_before_any_measurement(
    mode: str, origin: Origin, unix_socket: bool, strategy: str, final: bool, reason: str
) -> None:
    """Forced modes win; auto closes on loopback and Unix sockets at once, and closes (probing) while measuring
    elsewhere."""
    choice = OriginConnections(origin).choice(mode, unix_socket=unix_socket)  # type: ignore[arg-type]
    assert (choice.strategy, choice.final) == (strategy, final)
    assert reason in choice.reason


@pytest.mark.parametrize(
    ("connect", "request_time", "strategy"),
    [
        (0.0002, 0.030, "close"),  # same machine or LAN: 0.7% of a request
        (0.001, 0.020, "close"),  # exactly the share
        (0.004, 0.040, "reuse"),  # 2 ms round trip, handshake included: 10%
        (0.040, 0.080, "reuse"),  # 20 ms round trip
        (0.001, 0.0, "reuse"),  # requests answered in no time: any connect cost is too much
    ],
)
def test_measured_choice(connect: float, request_time: float, strategy: str) -> None:
    """After MIN_CONNECTS connects and MIN_REQUESTS requests, close if a connect costs at most CLOSE_COST_SHARE of
    the median request; decided once, and nothing before enough samples."""
    connections = OriginConnections(REMOTE)
    decided = None
    for _ in range(MIN_CONNECTS):
        assert connections.connected(connect) is None  # too few requests yet
    for index in range(MIN_REQUESTS):
        decided = connections.answered(request_time)
        assert (decided is None) is (index < MIN_REQUESTS - 1)
    assert decided is not None
    assert decided.strategy == strategy
    assert decided.final
    assert f"{CLOSE_COST_SHARE:.0%}" in decided.reason
    assert connections.choice("auto") is decided
    assert connections.answered(request_time) is None  # decided once: later samples change nothing


def test_a_provisional_choice_reported_late_never_replaces_the_final_one() -> None:
    """A request that read "measuring" just before another request's sample made the choice reports after it (CI saw
    this race): stats keep the final choice, and a `choice` call that lost the race returns the final one."""
    connections = OriginConnections(REMOTE)
    provisional = connections.choice("auto")
    assert not provisional.final
    for _ in range(MIN_CONNECTS):
        connections.connected(0.0001)
    for _ in range(MIN_REQUESTS):
        final = connections.answered(1.0)
    assert final is not None
    assert final.final
    assert connections._measuring() is final  # the lock-free read in `choice` saw None; the locked one sees it

    stats = llama_guard.GuardStats()
    PROCESS.connections.announce(REMOTE, final, stats)
    PROCESS.connections.announce(REMOTE, provisional, stats)  # the late report
    assert stats.snapshot().connection_strategies == {str(REMOTE): str(final)}
    other = Origin("http", "10.0.0.9", 8080)
    PROCESS.connections.announce(other, provisional, stats)  # an origin still measuring reports it
    assert stats.snapshot().connection_strategies[str(other)] == str(provisional)


def test_an_origin_account_records_choices_as_its_transport_does() -> None:
    """A choice announced through an origin's account (what a request with per-request state does when its sample
    decides) is kept by the account and its transport alike; a late provisional one replaces neither (this raised
    AttributeError on the account: it kept no record of final choices)."""
    connections = OriginConnections(REMOTE)
    provisional = connections.choice("auto")
    for _ in range(MIN_CONNECTS):
        connections.connected(0.0001)
    for _ in range(MIN_REQUESTS):
        final = connections.answered(1.0)
    assert final is not None
    stats = llama_guard.GuardStats()
    account = stats.of_origin("httpx", REMOTE)
    PROCESS.connections.announce(REMOTE, provisional, account)
    PROCESS.connections.announce(REMOTE, final, account)
    PROCESS.connections.announce(REMOTE, provisional, account)
    for counts in (account, stats):
        assert counts.snapshot().connection_strategies == {str(REMOTE): str(final)}


def test_an_origin_account_has_every_attribute_of_guard_stats() -> None:
    """OriginStats builds itself without GuardStats.__init__ (its counts go to its parent): every attribute that
    GuardStats sets must exist on an account too, or the method that uses it fails on accounts only."""
    stats = llama_guard.GuardStats()
    account = stats.of_origin("httpx", REMOTE)
    missing = {name for name in vars(stats) if not hasattr(account, name)}
    assert not missing


async def requests_in_a_row(flavor: str, url: str, policy: GuardPolicy, count: int) -> object:
    driver = make_driver(flavor, guarded=True, base_url=url, policy=policy)
    try:
        for index in range(count):
            await driver.request("POST", CHAT, json=chat(stream=index % 2 == 0))
    finally:
        await close_driver(driver)
    return driver


@pytest.mark.parametrize("flavor", FLAVORS)
def test_default_on_loopback_closes_every_connection(flavor: str, caplog: pytest.LogCaptureFixture) -> None:
    """The default on loopback: every request on a new connection that the server closes, none probed; the result,
    stats and log (once) say close and why."""
    PROCESS.connections.forget()
    with caplog.at_level(logging.INFO, logger="llama_guard"), LlamaServerEmulator() as server:
        driver = run_scenario(flavor, requests_in_a_row, flavor, server.url, GuardPolicy(), 6)
        stats = server.stats()
    outcomes = driver.outcomes  # type: ignore[attr-defined]
    assert [o.status for o in outcomes] == [200] * 6
    assert {o.result.connection for o in outcomes} == {"close"}
    assert all(o.result.connection_closed for o in outcomes)
    assert stats.connections_accepted == 6  # one per request
    assert stats.requests_to("/health") == 0  # nothing probed
    guard_stats = driver.stats  # type: ignore[attr-defined]
    (why,) = guard_stats.connection_strategies.values()
    assert why.startswith("close (a loopback address")
    assert guard_stats.stream_connections_closed == 3  # the streams, not every closed connection
    said = [r for r in caplog.records if "connections to" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.parametrize("flavor", FLAVORS)
def test_forced_reuse_keeps_connections_and_probes_new_ones(flavor: str) -> None:
    """connection='reuse' on loopback: plain requests share a kept connection, the new ones are probed."""
    with LlamaServerEmulator() as server:
        policy = GuardPolicy(connection="reuse")
        driver = run_scenario(flavor, requests_in_a_row, flavor, server.url, policy, 6)
        stats = server.stats()
    outcomes = driver.outcomes  # type: ignore[attr-defined]
    assert [o.status for o in outcomes] == [200] * 6
    assert {o.result.connection for o in outcomes} == {"reuse"}
    # Stream, plain, stream, plain, stream, plain: each stream closes the connection it went out on (the first one's
    # own, then the kept one of the plain request before it), so 4 connections, each probed once.
    assert stats.connections_accepted == 4
    assert stats.requests_to("/health") == 4


def test_a_request_may_override_the_strategy() -> None:
    """extensions={'llama_guard': {'connection': 'reuse'}} on one request: that request keeps its connection."""
    with LlamaServerEmulator() as server, httpx.Client(transport=llama_guard.GuardTransport()) as client:
        first = client.post(server.url + CHAT, json=chat(stream=False))
        second = client.post(
            server.url + CHAT, json=chat(stream=False), extensions={"llama_guard": {"connection": "reuse"}}
        )
        third = client.post(
            server.url + CHAT, json=chat(stream=False), extensions={"llama_guard": {"connection": "reuse"}}
        )
        accepted = server.stats().connections_accepted
    assert [r.extensions["llama_guard"].connection for r in (first, second, third)] == ["close", "reuse", "reuse"]
    assert accepted == 2  # the third reused the second's connection


def test_unix_socket_transport_closes_by_default(tmp_path: object) -> None:
    """A transport that connects through a Unix socket chooses close at once, whatever the URL's host."""
    transport = llama_guard.GuardTransport(httpx.HTTPTransport(uds=str(tmp_path) + "/nothing.sock"))
    choice = transport._guard.strategies.choice("http", "llama.example", 80, None, "auto")
    assert (choice.strategy, choice.final) == ("close", True)
    assert "Unix socket" in choice.reason
    transport.close()


# -- the measured choice, on the wire ---------------------------------------------------------------------------

_NETNS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from concurrent.futures import ThreadPoolExecutor
    import httpx, llama_guard
    from llama_guard.testing import DelayRelayProcess, LlamaServerEmulator

    delay, tokens = float(sys.argv[1]), int(sys.argv[2])
    sys.setswitchinterval(0.0005)  # the emulator's threads share this process with the client
    with LlamaServerEmulator(host="10.77.0.1", token_interval=0.05) as server, DelayRelayProcess(
        ("10.77.0.1", server.port), delay=delay, host="10.77.0.1"
    ) as relay:
        url = f"http://10.77.0.1:{relay.port}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
        transport = llama_guard.GuardTransport()
        with httpx.Client(transport=transport, timeout=30) as client:
            def one(index):
                # Every fourth request a stream, whose connection closes: the connect cost is sampled too.
                response = client.post(url, json={**body, "stream": index % 4 == 0})
                return response.extensions["llama_guard"].connection
            # Four at a time (the emulator's four slots), in order: the last ones start after the choice is made.
            with ThreadPoolExecutor(4) as pool:
                strategies = list(pool.map(one, range(24)))
        print(json.dumps({"strategies": strategies, "why": transport.stats.snapshot().connection_strategies}))
    """
)


def _run_in_network_namespace(delay: float, tokens: int) -> dict[str, object]:
    import json

    setup = 'ip link set lo up && ip addr add 10.77.0.1/32 dev lo && exec "$0" "$@"'
    result = subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", setup, sys.executable, "-c", _NETNS_SCRIPT, str(delay), str(tokens)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")),
    reason="needs root with unshare and ip (CI has both): a network namespace of the test's own with a "
    "non-loopback address, so the guard cannot tell it is local",
)


@needs_netns
@pytest.mark.slow  # a subprocess and 24 requests of up to 3 s, four at a time
@pytest.mark.parametrize(
    ("delay", "tokens", "chosen"),
    [
        (0.0, 60, "close"),  # no network delay, 3 s completions: a new connection costs well under 1% of one
        (0.010, 1, "reuse"),  # a 20 ms round trip (and its handshake), 0.05 s completions: it costs about 100%
    ],
)
def test_auto_measures_away_from_loopback(delay: float, tokens: int, chosen: str) -> None:
    """On a non-loopback address (10.77.0.1 in a namespace of the test's own), auto closes (probing each new
    connection) while measuring and then chooses by the measured cost, far from the 5% line either way."""
    data = _run_in_network_namespace(delay, tokens)
    strategies = data["strategies"]
    assert isinstance(strategies, list)
    assert strategies[0] == "close"  # measuring
    assert strategies[-1] == chosen, data["why"]
    (why,) = data["why"].values()  # type: ignore[attr-defined]
    assert why.startswith(f"{chosen} (measured:"), why


def test_while_measuring_only_the_connections_that_take_a_sample_are_probed() -> None:
    """auto, measuring: the first MIN_CONNECTS new connections are probed for their cost; the next is not (a probed
    connection holds a server thread for a round trip before its request) and teaches nothing (its connect alone
    would read cheaper); a sample whose probe ended unanswered frees its place."""
    assert MIN_CONNECTS == 2
    process = fresh_origins()
    first = probing(machine_for(GuardPolicy(), process=process))
    second = probing(machine_for(GuardPolicy(), process=process))
    third = connection.ConnectionMachine(machine_for(GuardPolicy(), process=process).plan)
    assert third.next(connection.Opening()) is connection.OPEN
    assert third.next(connection.Opened()) is connection.READY
    assert process.connections.of(REMOTE_URL_ORIGIN)._connects == deque()
    assert isinstance(first.machine.next(connection.WRITTEN), connection.Read)
    assert isinstance(first.machine.next(connection.CANCELLED), connection.Abort)  # unanswered: no sample
    fourth = probing(machine_for(GuardPolicy(), process=process))  # takes the freed place
    fifth = connection.ConnectionMachine(machine_for(GuardPolicy(), process=process).plan)
    assert fifth.next(connection.Opening()) is connection.OPEN
    assert fifth.next(connection.Opened()) is connection.READY
    for probe in (second, fourth):
        assert isinstance(probe.machine.next(connection.WRITTEN), connection.Read)
        probe.clock.now += 0.004
        answer = b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'
        assert probe.machine.next(connection.Received(answer)) is connection.READY
    assert list(process.connections.of(REMOTE_URL_ORIGIN)._connects) == [0.004, 0.004]
