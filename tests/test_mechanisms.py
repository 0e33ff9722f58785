"""Each mechanism against the emulator on real loopback sockets: plain httpx fails, the guard does not.

Every test runs on a sync client, an asyncio client and a trio client (`FLAVORS`). The server side counts what
it received and ran, so "not sent twice" is checked where it would happen. The defects are the emulator's
deterministic ones (tests/conftest.py): the counts are exact, whatever the machine's load.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy
from llama_guard.testing import Fault, LlamaServerEmulator, open_burst

from ._drivers import FLAVORS, close_driver, each_asks_then_close, gather, make_driver, run_scenario

pytestmark = pytest.mark.parametrize("flavor", FLAVORS)

CHAT = "/v1/chat/completions"


def chat(stream: bool, tokens: int = 4) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": tokens}


#: Requests of `alternate_streams`: non-streamed, streamed, non-streamed, ... over one pooled connection at a time.
ALTERNATING = 40
#: Plain httpx loses every non-streamed request but the first: each is written to the connection the stream before
#: it left behind. The stream after a loss goes out on a new connection, and succeeds.
LOST_AFTER_STREAMS = ALTERNATING // 2 - 1


async def alternate_streams(flavor: str, url: str, guarded: bool, policy: GuardPolicy | None, n: int) -> object:
    driver = make_driver(flavor, guarded=guarded, base_url=url, policy=policy)
    try:
        for index in range(n):
            await driver.request("POST", CHAT, json=chat(stream=index % 2 == 1), stream=True)
        return driver
    finally:
        await close_driver(driver)


def test_plain_httpx_loses_requests_after_streams(flavor: str, racy_server: LlamaServerEmulator) -> None:
    """The defect: the request after a stream takes the given-up connection and is lost, every time."""
    driver = run_scenario(flavor, alternate_streams, flavor, racy_server.url, False, None, ALTERNATING)
    lost = [index for index, outcome in enumerate(driver.outcomes) if outcome.error is not None]
    assert lost == list(range(2, ALTERNATING, 2))
    assert len(lost) == LOST_AFTER_STREAMS
    assert all(isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)) for e in driver.errors)
    stats = racy_server.wait_for(lambda s: s.requests_dropped_after_stream == LOST_AFTER_STREAMS)
    assert stats.completions_finished == ALTERNATING - LOST_AFTER_STREAMS  # the lost ones never ran


#: Both connection strategies: the default ("auto", which is "close" on the emulator's loopback address: every
#: request carries Connection: close) and "reuse" (keep-alive, where the stream mechanisms matter).
STRATEGIES = pytest.mark.parametrize("connection", ["auto", "reuse"])


@pytest.mark.parametrize("mode", ["close", "drop"])
@STRATEGIES
def test_guard_closes_stream_connections(
    flavor: str, mode: str, connection: str, racy_server: LlamaServerEmulator
) -> None:
    """Connection: close (or dropping after the final chunk) means no stream connection is ever reused. Under the
    close strategy every connection closes after its request, streamed or not."""
    # No retries: the stream mechanism (or the close strategy) alone.
    policy = GuardPolicy(connection=connection, stream_mode=mode, max_attempts=1)
    driver = run_scenario(flavor, alternate_streams, flavor, racy_server.url, True, policy, ALTERNATING)
    assert driver.errors == []
    stats = driver.stats
    assert stats.stream_connections_closed == ALTERNATING // 2
    assert stats.retries == 0
    assert all(o.body.endswith(b"data: [DONE]\n\n") for o in driver.outcomes[1::2])
    results = [o.result for o in driver.outcomes]
    strategy = "close" if connection == "auto" else "reuse"
    assert all(r is not None and r.connection == strategy for r in results)
    if strategy == "close":
        assert all(r is not None and r.connection_closed for r in results)
    else:
        assert all(r is not None and r.connection_closed == r.stream for r in results)
    server = racy_server.stats()
    assert (server.requests_dropped_after_stream, server.completions_finished) == (0, ALTERNATING)


@STRATEGIES
def test_retries_alone_recover_the_lost_requests(
    flavor: str, connection: str, racy_server: LlamaServerEmulator
) -> None:
    """With the stream mechanism off, retrying the dead pooled connection recovers every request (reuse); under the
    close strategy no connection outlives its request, so nothing is lost in the first place."""
    policy = GuardPolicy(connection=connection, stream_mode="off")
    driver = run_scenario(flavor, alternate_streams, flavor, racy_server.url, True, policy, ALTERNATING)
    assert driver.errors == []
    if connection == "auto":
        assert driver.stats.retries == 0
        assert [o.result.attempts for o in driver.outcomes] == [1] * ALTERNATING
        stats = racy_server.stats()
        assert (stats.requests_dropped_after_stream, stats.completions_finished) == (0, ALTERNATING)
        return
    # Exactly the requests plain httpx loses were lost once and resent once, on a new connection.
    assert driver.stats.retries == LOST_AFTER_STREAMS
    assert [o.result.attempts for o in driver.outcomes] == [1, 1] + [2, 1] * (LOST_AFTER_STREAMS)
    stats = racy_server.wait_for(lambda s: s.requests_dropped_after_stream == LOST_AFTER_STREAMS)
    assert stats.completions_finished == ALTERNATING  # each ran once: the dropped copies were never read


async def burst(
    flavor: str,
    url: str,
    port: int,
    guarded: bool,
    clients: int,
    *,
    timeout: float,
    policy: GuardPolicy | None = None,
    drivers: list[Any] | None = None,
) -> list[Any]:
    """The trigger, as measured on the real server: ``clients`` keep-alive connections opened back to back
    before any request, one handed to each client (its pool's only connection); then every client asks twice.
    The drivers are also put in ``drivers`` as soon as they exist, for a test that watches them meanwhile."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    sockets = open_burst("127.0.0.1", port, clients)
    made = [
        make_driver(
            flavor, guarded=guarded, base_url=url, limits=limits, timeout=timeout, policy=policy, preopened=[sock]
        )
        for sock in sockets
    ]
    if drivers is not None:
        drivers.extend(made)
    await each_asks_then_close(flavor, made, CHAT, chat(stream=False), times=2)
    return made


def poll(condition: Any, *, timeout: float, what: str) -> None:
    """Wait (bounded) until ``condition()`` holds, on events another thread causes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.01)


def test_burst_leaves_plain_clients_unanswered_until_released(
    flavor: str, stalling_server: LlamaServerEmulator
) -> None:
    """The pool stall: the clients of the burst's stalled connections get nothing, however long they wait, while
    the others finish; released, they are answered. Exact counts, on the clients' side and on the server's."""
    server = stalling_server
    clients, served = server.config.stall_burst or 0, server.config.http_threads
    stalled = clients - served
    drivers: list[Any] = []
    finished: dict[str, Any] = {}
    plain = functools.partial(burst, timeout=60.0, drivers=drivers)  # no client gives up during the test

    def scenario() -> None:
        try:
            run_scenario(flavor, plain, flavor, server.url, server.port, False, clients)
        except BaseException as exc:
            finished["error"] = exc
        finally:
            finished["done"] = True

    thread = threading.Thread(target=scenario, name=f"burst-{flavor}", daemon=True)
    thread.start()
    try:
        poll(
            lambda: sum(len(d.outcomes) for d in drivers) >= 2 * served or "done" in finished,
            timeout=30,
            what="the served clients finish",
        )
        stats = server.wait_for(lambda s: s.connections_stalled_unread == stalled, timeout=30)
        # Stuck: their requests sit unread in the server's receive queues, so no answer can be on its way.
        assert sorted(len(d.outcomes) for d in drivers) == [0] * stalled + [2] * served
        assert (stats.connections_stalled, stats.completions_started) == (stalled, 2 * served)
        assert "done" not in finished
    finally:
        released = server.release_stalled()
        thread.join(60)
    assert not thread.is_alive(), "the released clients did not finish"
    assert "error" not in finished, finished
    assert released == stalled
    outcomes = [o for d in drivers for o in d.outcomes]
    assert len(outcomes) == 2 * clients
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if o.error]
    stats = server.stats()
    assert stats.connections_accepted == clients  # they waited on their connections; none was replaced
    assert (stats.stalled_released_by_call, stats.completions_started) == (stalled, 2 * clients)


def test_burst_guarded_clients_replace_exactly_the_stalled_connections(
    flavor: str, stalling_server: LlamaServerEmulator
) -> None:
    """The probe finds each stalled connection, and only those; each is replaced once and nothing runs twice."""
    server = stalling_server
    clients, served = server.config.stall_burst or 0, server.config.http_threads
    stalled = clients - served
    # A healthy probe must not time out on a loaded machine (that would replace a good connection too); a stalled
    # one never answers, whatever the deadline. Replaced, not rescued by kicks (the default, tests/test_probe_kick.py).
    # connection="reuse": on loopback the default closes connections and probes none (test below).
    policy = GuardPolicy(connection="reuse", probe_timeout=1.0, probe_kick=False)
    guarded = functools.partial(burst, timeout=30.0, policy=policy)
    drivers = run_scenario(flavor, guarded, flavor, server.url, server.port, True, clients)
    stats = server.stats()
    outcomes = [o for d in drivers for o in d.outcomes]
    assert len(outcomes) == 2 * clients
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if o.error]
    assert stats.connections_stalled == stalled
    assert sorted(d.stats.probes_failed for d in drivers) == [0] * served + [1] * stalled
    # Every stalled connection replaced once (a reconnect after the burst is served at once), nothing else opened.
    assert stats.connections_accepted == clients + stalled
    assert sum(d.stats.probes_sent for d in drivers) == clients + stalled
    assert stats.completions_started == len(outcomes), "a rescued request must not also run on the abandoned connection"
    assert stats.requests_to(CHAT) == len(outcomes)


def test_burst_under_the_close_strategy_waits_for_no_probe(flavor: str, stalling_server: LlamaServerEmulator) -> None:
    """The default on loopback ("auto": close): no connection is probed, none replaced; a stalled connection's
    request is read once a served connection closes, which under close is right after its one request. Every
    request answered, and run once."""
    server = stalling_server
    clients = server.config.stall_burst or 0
    guarded = functools.partial(burst, timeout=30.0, policy=GuardPolicy())
    drivers = run_scenario(flavor, guarded, flavor, server.url, server.port, True, clients)
    outcomes = [o for d in drivers for o in d.outcomes]
    assert len(outcomes) == 2 * clients
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if o.error]
    assert all(o.result is not None and o.result.connection == "close" for o in outcomes)
    assert sum(d.stats.probes_sent for d in drivers) == 0
    assert sum(d.stats.stall_reconnects for d in drivers) == 0
    stats = server.stats()
    assert stats.completions_started == len(outcomes)
    assert stats.requests_to(CHAT) == len(outcomes)


async def slow_pair(flavor: str, url: str) -> object:
    driver = make_driver(flavor, guarded=True, base_url=url, timeout=30.0)

    def job() -> object:
        async def run() -> None:
            await driver.request("POST", CHAT, json=chat(stream=False, tokens=20))

        return run

    try:
        await gather(flavor, [job(), job()])
    finally:
        await close_driver(driver)
    return driver


@pytest.mark.slow  # two 1 s completions, one after the other
def test_slow_healthy_requests_are_not_cut_or_repeated(flavor: str) -> None:
    """One slot, two 1 s completions: the second waits 1 s for its headers; defaults must not cut it."""
    with LlamaServerEmulator(parallel=1, token_interval=0.05, http_threads=8) as server:
        driver = run_scenario(flavor, slow_pair, flavor, server.url)
        stats = server.stats()
    assert [o.ok for o in driver.outcomes] == [True, True]  # type: ignore[attr-defined]
    assert max(o.first_byte for o in driver.outcomes) >= 1.5  # type: ignore[attr-defined]
    assert stats.completions_started == 2
    assert driver.stats.retries == 0  # type: ignore[attr-defined]


async def while_loading(flavor: str, url: str, guarded: bool, server: LlamaServerEmulator) -> object:
    driver = make_driver(flavor, guarded=guarded, base_url=url, policy=GuardPolicy(backoff=0.1, max_attempts=10))
    server.set_loading(True)
    loaded = threading.Timer(0.5, server.set_loading, args=(False,))
    loaded.start()
    try:
        await driver.request("POST", CHAT, json=chat(stream=False))
    finally:
        loaded.join()
        await close_driver(driver)
    return driver


@pytest.mark.parametrize("guarded", [False, True])
def test_503_while_loading(flavor: str, guarded: bool) -> None:
    """llama-server answers 503 while it loads the model; the guard waits it out, plain httpx returns it."""
    with LlamaServerEmulator() as server:
        driver = run_scenario(flavor, while_loading, flavor, server.url, guarded, server)
        ran = server.stats().completions_started
    (outcome,) = driver.outcomes  # type: ignore[attr-defined]
    if guarded:
        assert outcome.status == 200
        assert outcome.result.attempts > 1
        assert ran == 1
    else:
        assert outcome.status == 503
        assert ran == 0


async def one_request(
    flavor: str, url: str, guarded: bool, policy: GuardPolicy | None, method: str, path: str, body: object
) -> object:
    driver = make_driver(flavor, guarded=guarded, base_url=url, policy=policy)
    try:
        await driver.request(method, path, json=body, stream=True)
    finally:
        await close_driver(driver)
    return driver


def test_reset_mid_stream_is_not_retried(flavor: str) -> None:
    """After the response began, nothing is retried: the caller gets the error, the server ran it once."""
    with LlamaServerEmulator() as server:
        server.inject(Fault.RESET_MID_STREAM, path=CHAT, after_chunks=2)
        driver = run_scenario(flavor, one_request, flavor, server.url, True, None, "POST", CHAT, chat(True, 8))
        ran = server.stats().completions_started
    (outcome,) = driver.outcomes  # type: ignore[attr-defined]
    assert isinstance(outcome.error, (httpx.ReadError, httpx.RemoteProtocolError))
    assert ran == 1


@pytest.mark.parametrize(("connection", "reason"), [("auto", "stalled_connection"), ("reuse", "slow_answer")])
def test_headers_that_never_come_are_retried_under_a_deadline(
    flavor: str, connection: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A first-byte deadline abandons a connection whose answer never comes and retries on a fresh one. On
    loopback ("auto": close, no probe) nothing proved the server reads the connection: a stalled connection,
    replaced. Under keep-alive its probe was answered, so a thread serves it: a busy or slow server, retried as any
    failure, not counted or logged as a stalled connection (it was, with "no request was lost" in the log even
    when the request then failed)."""
    policy = GuardPolicy(first_byte_timeout=0.5, connection=connection)  # type: ignore[arg-type]
    with LlamaServerEmulator() as server, caplog.at_level(logging.DEBUG, logger="llama_guard"):
        server.inject(Fault.HEADERS_NEVER, path=CHAT, hold=None)
        driver = run_scenario(flavor, one_request, flavor, server.url, True, policy, "POST", CHAT, chat(False))
    (outcome,) = driver.outcomes  # type: ignore[attr-defined]
    stats = driver.stats  # type: ignore[attr-defined]
    stalled = reason == "stalled_connection"
    assert outcome.ok
    assert outcome.result.attempts == 2
    assert outcome.result.reconnects == stats.stall_reconnects == int(stalled)
    assert stats.retries_by_reason == {reason: 1}
    assert (stats.probes_sent >= 1) is not stalled  # the probe that proved the connection read
    said = [record.getMessage() for record in caplog.records if "retrying" in record.getMessage()]
    assert len(said) == 1, said
    assert ("(a stalled connection, or a slow answer" in said[0]) is stalled, said
    assert ("(the server reads this connection: busy or slow)" in said[0]) is not stalled, said


def test_headers_that_never_come_fail_plain_httpx_only_at_its_timeout(flavor: str) -> None:
    with LlamaServerEmulator() as server:
        server.inject(Fault.HEADERS_NEVER, path=CHAT, hold=None)
        driver = make_driver(flavor, guarded=False, base_url=server.url, timeout=1.0)

        async def scenario() -> None:
            try:
                await driver.request("POST", CHAT, json=chat(False))
            finally:
                await close_driver(driver)

        run_scenario(flavor, scenario)
    assert isinstance(driver.outcomes[0].error, httpx.ReadTimeout)


def test_non_inference_post_is_not_resent(flavor: str) -> None:
    """A POST to an endpoint with side effects, reset after it was written, is reported, not repeated."""
    with LlamaServerEmulator() as server:
        server.inject(Fault.HEADERS_NEVER, path="/slots/0", hold=0.0)  # read it, then close without answering
        policy = GuardPolicy(first_byte_timeout=0.5)
        driver = run_scenario(
            flavor, one_request, flavor, server.url, True, policy, "POST", "/slots/0", {"filename": "x"}
        )
        received = server.stats().requests.get(("POST", "/slots/0"), 0)
    (outcome,) = driver.outcomes  # type: ignore[attr-defined]
    assert isinstance(outcome.error, llama_guard.GuardError)
    assert outcome.error.attempts == 1
    assert "retry_non_idempotent" in str(outcome.error)
    assert received == 1
