"""The adaptive probe: a deadline learnt per origin, admission of new connections, late answers, one log line per
stall episode. The core as tables of cases; the whole on the emulator, over real loopback sockets.

The tests of a probe given up at the learnt deadline run with ``probe_kick=False``: with kicks (the default) the
learnt deadline is when the first kick goes, and the probe is given up at ``probe_timeout``
(tests/test_probe_kick.py).

The tests on the emulator pin ``connection="reuse"``: it listens on loopback, where the default closes every
connection and probes none; the probe belongs to keep-alive connections."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import anyio
import httpcore
import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy, Origin
from llama_guard._core import connection_machine as connection
from llama_guard._core.probes import LEARN_AFTER, PROBE_SLICE, Admission, OriginProbes
from llama_guard._core.stats import GuardStats
from llama_guard._drive import async_drive, sync_drive
from llama_guard._runtime import PROCESS
from llama_guard._runtime.admission_turns import AsyncTurn, ThreadTurn
from llama_guard._runtime.stall_log import StallLog
from llama_guard.testing import Fault, LlamaServerEmulator, reset_probe_learning

from ._drivers import (
    FLAVORS,
    Driver,
    close_driver,
    each_asks_then_close,
    episode_log,
    make_driver,
    run_bounded,
    run_scenario,
)
from ._machines import answered, give_up, machine_for, probing
from .test_mechanisms import CHAT, burst, chat

ORIGIN = Origin("http", "127.0.0.1", 1)


# -- the core: the deadline ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "latencies", "expected"),
    [
        (GuardPolicy(), (0.001,) * (LEARN_AFTER - 1), 0.5),  # too few answers: the configured deadline
        (GuardPolicy(), (0.001,) * LEARN_AFTER, 0.05),  # learnt, at the floor
        (GuardPolicy(), (0.001, 0.002, 0.030, 0.004), 0.12),  # 4 x the slowest
        (GuardPolicy(), (0.001, 0.2, 0.001, 0.001), 0.5),  # never above the configured deadline
        (GuardPolicy(probe_learning=False), (0.001,) * 10, 0.5),
        (GuardPolicy(probe_learning_factor=10.0), (0.02,) * 4, 0.2),
        (GuardPolicy(probe_timeout_min=0.01), (0.001,) * 4, 0.01),
        (GuardPolicy(probe_timeout=0.02), (0.001,) * 4, 0.02),  # the configured deadline beats the floor
    ],
)
def test_learnt_deadline(policy: GuardPolicy, latencies: tuple[float, ...], expected: float) -> None:
    """factor x the slowest recent answer, at least the floor, at most probe_timeout; configured until 4 answers."""
    probes = OriginProbes(ORIGIN)
    answered(probes, *latencies)
    assert probes.deadline(policy) == pytest.approx(expected)


def test_late_answer_raises_the_deadline_unless_a_newer_connection_was_probed() -> None:
    """A given-up probe answered while no newer connection was probed is a false alarm and raises the deadline;
    one answered while a newer connection was probed may be the server draining its queue, and is not counted."""
    policy = GuardPolicy()
    probes = OriginProbes(ORIGIN)
    answered(probes, *(0.001,) * LEARN_AFTER)
    stats = GuardStats()
    arrived: dict[str, bool | None] = {"late": None, "drained": None}

    late = probes.probe_given_up(
        probes.probe_started(), lambda: arrived["late"], stats, time.monotonic() - 0.05, watch=4
    )
    probes.check_given_up()
    assert not late.settled  # nothing yet
    arrived["late"] = True
    probes.check_given_up()
    assert late.settled
    assert late.answered_late
    assert stats.probes_answered_late == 1
    assert probes.deadline(policy) >= 4 * 0.05

    drained = probes.probe_given_up(
        probes.probe_started(), lambda: arrived["drained"], stats, time.monotonic(), watch=4
    )
    newer = probes.probe_started()  # a reconnect, probed while the old connection is answered
    arrived["drained"] = True
    probes.probe_answered(0.001, newer)
    assert drained.settled
    assert not drained.answered_late
    assert stats.probes_answered_late == 1


def test_given_up_watch_ends() -> None:
    """A connection closed by the server, or silent for longer than the longest probe, is settled uncounted."""
    probes = OriginProbes(ORIGIN)
    stats = GuardStats()
    closed = probes.probe_given_up(probes.probe_started(), lambda: False, stats, time.monotonic(), watch=4)
    silent = probes.probe_given_up(probes.probe_started(), lambda: None, stats, time.monotonic() - 5, watch=4)
    probes.check_given_up()
    assert closed.settled
    assert silent.settled
    assert stats.probes_answered_late == 0


# -- the core: admission -------------------------------------------------------------------------------------------


class CountedTurn:
    """A turn that counts its wake-ups (the core only calls ``wake``)."""

    def __init__(self) -> None:
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1


#: How long a connect holds the origin's turn in the tests of the queue (the guard's: probe_timeout): longer than any
#: test, so that a held turn is held until it is left.
HOLD = 600.0


def test_admission_one_at_a_time_in_order() -> None:
    """Tickets are admitted in the order taken, one at a time; a waiting ticket can give its place up."""
    probes = OriginProbes(ORIGIN)
    first, second, third = (probes.take_ticket(CountedTurn()) for _ in range(3))
    assert not probes.admit(second, HOLD)
    assert probes.admit(first, HOLD)
    assert not probes.admit(second, HOLD)  # the first is still being opened
    probes.leave(second)  # cancelled while waiting
    probes.leave(first)
    assert probes.admit(third, HOLD)
    assert probes.waiting() == 0


def test_a_connect_holds_the_turn_for_its_hold_and_a_probe_until_it_leaves() -> None:
    """A connection admitted and still connecting keeps the others waiting for its hold only (the guard's:
    probe_timeout); once its connect returned (`connected`), it holds the turn through its probe, until it leaves.
    Holds of 0 and of 600 s stand for a hold passed and one not: no clock is waited on."""
    probes = OriginProbes(ORIGIN)
    hung, second, third = (probes.take_ticket(CountedTurn()) for _ in range(3))
    assert probes.admit(hung, 0.0)  # its hold is over at once: its connect never returns
    assert probes.hold_ends_in(second) == 0.0
    assert probes.admit(second, HOLD)  # goes while the hung connect is still under way
    assert probes.opening() == 2
    ends_in = probes.hold_ends_in(third)
    assert ends_in is not None
    assert HOLD - 60 < ends_in <= HOLD  # the head times its wait on the connect ahead
    probes.connected(second)  # connected: probing now
    assert probes.hold_ends_in(third) is None  # a probe wakes the head when it leaves
    assert not probes.admit(third, HOLD)
    probes.leave(second)
    assert probes.admit(third, HOLD)  # the hung connect, past its hold, keeps nobody waiting
    probes.leave(hung)
    probes.leave(third)
    assert (probes.waiting(), probes.opening(), probes.admitted()) == (0, 0, 3)


def test_leave_wakes_only_the_connection_whose_turn_may_have_come() -> None:
    """The head of the queue is woken when it becomes the head (to time its wait on the connect ahead, which holds
    the turn for its hold only), when the connection ahead is probed, or a place ahead is given up; the others
    sleep on."""
    probes = OriginProbes(ORIGIN)
    turns = [CountedTurn() for _ in range(4)]
    tickets = [probes.take_ticket(turn) for turn in turns]
    assert probes.admit(tickets[0], HOLD)
    assert [t.woken for t in turns] == [0, 1, 0, 0]  # the new head
    probes.leave(tickets[2])  # a place behind the head given up: nobody's turn changed
    assert [t.woken for t in turns] == [0, 1, 0, 0]
    probes.leave(tickets[0])  # probed: the next in the queue may go
    assert [t.woken for t in turns] == [0, 2, 0, 0]
    probes.leave(tickets[1])  # the head gives its place up (timed out): the one behind it is now first
    assert [t.woken for t in turns] == [0, 2, 0, 1]
    assert probes.admit(tickets[3], HOLD)
    probes.leave(tickets[3])
    assert (probes.waiting(), probes.opening(), probes.admitted()) == (0, 0, 2)


def test_waiters_in_other_threads_and_event_loops_are_woken() -> None:
    """A sync waiter, one in an asyncio loop and one in a trio run, each in its own thread, queue behind a
    connection this thread holds; releasing it wakes them in turn, across threads and loops, with no polling: a
    missed wake-up leaves a waiter asleep until its 30 s bound, and the test fails."""
    probes = OriginProbes(ORIGIN)
    holder = probes.take_ticket(CountedTurn())
    assert probes.admit(holder, HOLD)
    order: list[str] = []
    results: dict[str, bool] = {}

    def admitted(name: str, admission: Admission[Any], came: bool) -> bool:
        if came:
            order.append(name)
            admission.leave()  # the next waiter is woken from this thread and loop
        return came

    def sync_waiter() -> None:
        admission = Admission(probes, GuardStats(), ThreadTurn(), hold=HOLD)
        results["sync"] = admitted("sync", admission, sync_drive._wait_for_turn(admission, 30.0))

    async def async_waiter(name: str) -> None:
        admission = Admission(probes, GuardStats(), AsyncTurn(), hold=HOLD)
        results[name] = admitted(name, admission, await async_drive._wait_for_turn(admission, 30.0))

    threads = [
        threading.Thread(target=sync_waiter),
        threading.Thread(target=anyio.run, args=(async_waiter, "asyncio"), kwargs={"backend": "asyncio"}),
        threading.Thread(target=anyio.run, args=(async_waiter, "trio"), kwargs={"backend": "trio"}),
    ]
    for queued, thread in enumerate(threads, start=1):
        thread.start()
        wait_until(
            lambda queued=queued: probes.waiting() == queued, "a waiter takes its place"
        )  # one at a time: a known order
    probes.leave(holder)
    for thread in threads:
        thread.join(60)
    assert results == {"sync": True, "asyncio": True, "trio": True}
    assert order == ["sync", "asyncio", "trio"]
    assert (probes.waiting(), probes.opening()) == (0, 0)


@pytest.mark.parametrize(
    ("mode", "given_up", "needed"),
    [("after_stall", False, False), ("after_stall", True, True), ("always", False, True), ("off", True, False)],
)
def test_admission_modes(mode: Any, given_up: bool, needed: bool) -> None:
    probes = OriginProbes(ORIGIN)
    if given_up:
        probes.probe_given_up(probes.probe_started(), lambda: None, GuardStats(), time.monotonic(), watch=4)
    assert probes.admission_needed(GuardPolicy(connect_admission=mode)) is needed


# -- on the emulator -------------------------------------------------------------------------------------------------
# Each test starts from nothing learnt (the autouse `fresh_probe_learning` in conftest.py). What a test asserts about
# a stall or a mechanism is shown by counts and state (the server's counters, the guard's, the origin's book), never
# by elapsed time: these tests must hold on a busy two-core machine.


def origin_of(server: LlamaServerEmulator) -> OriginProbes:
    return PROCESS.probes.of(Origin("http", "127.0.0.1", server.port))


async def new_connections(flavor: str, url: str, policy: GuardPolicy, count: int, **request: Any) -> list[Driver]:
    """``count`` requests one after another, each on a new connection (a new client each)."""
    drivers = []
    for _ in range(count):
        driver = make_driver(flavor, guarded=True, base_url=url, policy=policy)
        try:
            await driver.request("POST", CHAT, json=chat(stream=False), **request)
        finally:
            await close_driver(driver)
        drivers.append(driver)
    return drivers


def given_up(drivers: list[Driver]) -> int:
    return sum(d.stats.probes_given_up for d in drivers)


def wait_until(condition: Any, what: str, timeout: float = 30.0) -> None:
    """Wait (bounded) for state another thread or the server changes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.002)


def test_reset_probe_learning_forgets_every_origin() -> None:
    """`llama_guard.testing.reset_probe_learning()`: what was learnt is gone, the configured deadline is back."""
    policy = GuardPolicy()
    probes = PROCESS.probes.of(ORIGIN)
    answered(probes, *(0.001,) * LEARN_AFTER)
    assert probes.deadline(policy) == policy.probe_timeout_min
    reset_probe_learning()
    fresh = PROCESS.probes.of(ORIGIN)
    assert fresh is not probes
    assert (fresh.answers_seen(), fresh.deadline(policy)) == (0, policy.probe_timeout)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_learnt_deadline_converges_and_catches_a_stall_sooner(flavor: str) -> None:
    """After 4 answers the deadline in force is learnt, below the configured one; a connection the server never
    reads is then given up at the learnt deadline (its ProbeTimeout names it) and replaced."""
    policy = GuardPolicy(connection="reuse", probe_timeout=3.0, probe_kick=False)
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        assert probes.deadline(policy) == 3.0
        learning = run_scenario(flavor, new_connections, flavor, server.url, policy, LEARN_AFTER)
        assert probes.answers_seen() == LEARN_AFTER
        learnt = probes.deadline(policy)
        server.inject(Fault.NEVER_ANSWER_ACCEPT, count=1)
        (stalled,) = run_scenario(flavor, new_connections, flavor, server.url, policy, 1)
    # 4 x the slowest loopback answer (milliseconds, more on a busy machine), at least the 0.05 s floor.
    assert policy.probe_timeout_min <= learnt < policy.probe_timeout
    assert given_up(learning) == 0
    (outcome,) = stalled.outcomes
    assert outcome.ok
    assert outcome.result is not None
    assert outcome.result.attempts == 2
    assert stalled.stats.probes_given_up == 1
    (failure,) = outcome.result.history
    assert f"did not answer GET /health within {learnt:.3g} s" in failure, failure


@pytest.mark.parametrize("flavor", FLAVORS)
def test_slow_health_answers_raise_no_false_alarm(flavor: str) -> None:
    """A server that reads every new connection 150 ms late (busy): the deadline is learnt from those answers,
    and no probe is given up on a connection the server serves."""
    policy = GuardPolicy(connection="reuse", probe_timeout=2.0)
    with LlamaServerEmulator(pool_bug=False) as server:
        server.inject(Fault.READ_LATE, after=0.15, count=None)
        drivers = run_scenario(flavor, new_connections, flavor, server.url, policy, 10)
        served = server.stats().requests_to("/health")
        learnt = origin_of(server).deadline(policy)
    assert all(o.ok for d in drivers for o in d.outcomes)
    assert given_up(drivers) == 0
    assert served == 10
    assert learnt >= 4 * 0.15  # learnt from the slow answers


@pytest.mark.parametrize("flavor", FLAVORS)
def test_deadline_follows_rising_load(flavor: str) -> None:
    """Learnt on a fast server, then the server turns slow (every /health read 0.3 s after the learnt deadline):
    the first probe after the change is given up (the deadline in force was shorter), the deadline rises from the
    answers of the request's further probes, and probes stop being given up."""
    policy = GuardPolicy(connection="reuse", probe_timeout=3.0, backoff=0.01, max_attempts=8, probe_kick=False)
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        run_scenario(flavor, new_connections, flavor, server.url, policy, LEARN_AFTER)
        slow = probes.deadline(policy) + 0.3  # a margin for the time between the server's accept and the probe
        server.inject(Fault.READ_LATE, after=slow, count=None)
        rising = run_scenario(flavor, new_connections, flavor, server.url, policy, 1)
        steady = run_scenario(flavor, new_connections, flavor, server.url, policy, 4)
        learnt = probes.deadline(policy)
    assert all(o.ok for d in rising + steady for o in d.outcomes)
    assert given_up(rising) >= 1  # the load came unannounced
    assert given_up(steady) == 0
    # Above the slow answers, with the factor's margin (an answer is timed from the probe, the delay from the accept).
    assert learnt > 2 * slow


async def given_up_then_answered(flavor: str, server: LlamaServerEmulator, policy: GuardPolicy) -> list[Driver]:
    """One request whose only attempt is given up; the server answers that probe later (the guard looks, as a
    new probe would, until it sees the answer); then one more request."""
    first = make_driver(flavor, guarded=True, base_url=server.url, policy=policy.merged({"max_attempts": 1}))
    try:
        await first.request("POST", CHAT, json=chat(stream=False))
        probes = origin_of(server)
        deadline = time.monotonic() + 30.0
        while first.stats.probes_answered_late == 0 and time.monotonic() < deadline:
            probes.check_given_up()
            await anyio.sleep(0.005)
        return [first, *await new_connections(flavor, server.url, policy, 1)]
    finally:
        await close_driver(first)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_probe_answered_late_is_counted_and_raises_the_deadline(flavor: str) -> None:
    """A probe given up on a connection that the server then serves: counted in probes_answered_late, and the
    deadline rises above that answer's latency."""
    policy = GuardPolicy(connection="reuse", probe_timeout=3.0, probe_kick=False)
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        run_scenario(flavor, new_connections, flavor, server.url, policy, LEARN_AFTER)
        late = probes.deadline(policy) + 0.2  # later than the deadline in force
        server.inject(Fault.READ_LATE, after=late, count=1)
        first, second = run_scenario(flavor, given_up_then_answered, flavor, server, policy)
        learnt = probes.deadline(policy)
        health = server.stats().requests_to("/health")
    assert first.stats.probes_given_up == 1
    assert isinstance(first.outcomes[0].error, httpx.TransportError)  # max_attempts=1: not retried
    assert first.stats.probes_answered_late == 1
    assert second.outcomes[0].ok
    assert health == LEARN_AFTER + 2  # the late probe was served by the server too
    assert learnt > 2 * late  # the late answer counts as one of its latency (timed from the probe, not the accept)


# -- admission --------------------------------------------------------------------------------------------------------


class OpenCounter:
    """Connections being opened and probed at once: from the connect until the first bytes read (the probe's
    answer) or the close."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.opened = 0

    def start(self) -> None:
        with self._lock:
            self.now += 1
            self.opened += 1
            self.peak = max(self.peak, self.now)

    def end(self) -> None:
        with self._lock:
            self.now -= 1


class _CountingStream:
    def __init__(self, stream: Any, counter: OpenCounter) -> None:
        self._stream = stream
        self._counter: OpenCounter | None = counter

    def _done(self) -> None:
        if self._counter is not None:
            self._counter.end()
            self._counter = None

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data: bytes = self._stream.read(max_bytes, timeout)
        self._done()
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, timeout)

    def close(self) -> None:
        self._done()
        self._stream.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> Any:
        return self._stream.start_tls(*args, **kwargs)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _AsyncCountingStream(_CountingStream):
    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # type: ignore[override]
        data: bytes = await self._stream.read(max_bytes, timeout)
        self._done()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # type: ignore[override]
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        self._done()
        await self._stream.aclose()


class CountingBackend(httpcore.NetworkBackend):
    def __init__(self, backend: Any, counter: OpenCounter) -> None:
        self._backend = backend
        self._counter = counter

    def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
        self._counter.start()
        return _CountingStream(self._backend.connect_tcp(*args, **kwargs), self._counter)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class AsyncCountingBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, backend: Any, counter: OpenCounter) -> None:
        self._backend = backend
        self._counter = counter

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
        self._counter.start()
        return _AsyncCountingStream(await self._backend.connect_tcp(*args, **kwargs), self._counter)

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def counted_driver(flavor: str, url: str, policy: GuardPolicy, counter: OpenCounter) -> Driver:
    """A guarded client with one connection, lazily opened, whose opens the counter sees."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    client: Any
    if flavor == "sync":
        inner = httpx.HTTPTransport(limits=limits)
        # httpx takes no network backend argument; its pool does (test tooling, as testing.burst_transport).
        inner._pool._network_backend = CountingBackend(inner._pool._network_backend, counter)
        client = httpx.Client(transport=llama_guard.GuardTransport(inner, policy=policy), base_url=url, timeout=30)
    else:
        ainner = httpx.AsyncHTTPTransport(limits=limits)
        ainner._pool._network_backend = AsyncCountingBackend(ainner._pool._network_backend, counter)
        transport = llama_guard.AsyncGuardTransport(ainner, policy=policy)
        client = httpx.AsyncClient(transport=transport, base_url=url, timeout=30)
    return Driver(flavor, True, client)


async def lazy_burst(flavor: str, url: str, policy: GuardPolicy, counter: OpenCounter, clients: int) -> list[Driver]:
    """``clients`` clients ask at once, each on its own new connection."""
    drivers = [counted_driver(flavor, url, policy, counter) for _ in range(clients)]
    await each_asks_then_close(flavor, drivers, CHAT, chat(stream=False))
    return drivers


class HeldTurn:
    """The turn of an origin's new connections, held by the test as a connection being probed holds it."""

    def __init__(self, probes: OriginProbes) -> None:
        self.probes = probes
        self.ticket = probes.take_ticket(ThreadTurn())
        assert probes.admit(self.ticket, HOLD)
        probes.connected(self.ticket)  # held through its probe: a connect alone holds the turn for its hold only

    def release(self) -> None:
        self.probes.leave(self.ticket)  # wakes the first waiter, in its own thread or event loop


def scenario_in_thread(flavor: str, scenario: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run a scenario in a thread of its own (its event loop, or its client threads), so that this thread can
    watch and release the origin's turn meanwhile."""
    finished: dict[str, Any] = {}

    def run() -> None:
        try:
            finished["result"] = run_scenario(flavor, scenario, *args)
        except BaseException as exc:
            finished["error"] = exc

    thread = threading.Thread(target=run, name=f"scenario-{flavor}", daemon=True)
    thread.start()
    return thread, finished


@pytest.mark.parametrize("flavor", FLAVORS)
def test_admission_opens_lazy_connections_one_at_a_time(flavor: str) -> None:
    """connect_admission="always": 16 clients that ask at once wait while another connection to the origin holds
    the turn (none is opened meanwhile), then are opened and probed one at a time, each woken by the one before
    it; every wait is counted."""
    # The floor keeps a healthy probe on a busy machine (the emulator shares the test's GIL) from being given up.
    policy = GuardPolicy(connection="reuse", connect_admission="always", probe_timeout=3.0, probe_timeout_min=0.5)
    clients = 16
    counter = OpenCounter()
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        held = HeldTurn(probes)
        thread, finished = scenario_in_thread(flavor, lazy_burst, flavor, server.url, policy, counter, clients)
        try:
            wait_until(lambda: probes.waiting() == clients or not thread.is_alive(), "the clients queue up")
            assert (counter.opened, server.stats().connections_accepted) == (0, 0)
        finally:
            held.release()
            thread.join(60)
        assert not thread.is_alive()
        assert "error" not in finished, finished
        drivers = finished["result"]
        stats = server.stats()
    assert all(o.ok for d in drivers for o in d.outcomes)
    assert counter.opened == clients
    assert counter.peak == 1  # opened and probed one at a time
    assert (probes.admitted(), probes.waiting(), probes.opening()) == (clients + 1, 0, 0)
    assert sum(d.stats.admission_waits for d in drivers) == clients  # the cost of a healthy burst is counted
    assert given_up(drivers) == 0
    assert (stats.connections_accepted, stats.completions_started) == (clients, clients)


async def one_request(flavor: str, url: str, policy: GuardPolicy, timeout: float) -> Driver:
    driver = make_driver(flavor, guarded=True, base_url=url, policy=policy, timeout=timeout)
    try:
        await driver.request("POST", CHAT, json=chat(stream=False))
    finally:
        await close_driver(driver)
    return driver


@pytest.mark.parametrize("flavor", FLAVORS)
def test_admission_wait_is_bounded_by_the_connect_timeout(flavor: str) -> None:
    """A connection waiting for its turn waits no longer than the caller's connect timeout: ConnectTimeout naming
    the admission while the turn is still held, its place given up, no connection opened."""
    policy = GuardPolicy(connection="reuse", connect_admission="always", max_attempts=1)
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        held = HeldTurn(probes)
        try:
            driver = run_scenario(flavor, one_request, flavor, server.url, policy, 0.3)
            assert (probes.waiting(), probes.opening()) == (0, 1)  # gave its place up; the turn is still held
        finally:
            held.release()
        accepted = server.stats().connections_accepted
    (waited,) = driver.outcomes
    assert isinstance(waited.error, httpx.ConnectTimeout)
    assert "connect_admission" in str(waited.error)
    assert "waited 0.3 s (the connect timeout)" in str(waited.error)
    assert driver.stats.admission_waits == 0  # it was never admitted
    assert accepted == 0


class HangingBackend(httpcore.NetworkBackend):
    """A backend whose connects hang, as a SYN nobody answers, until the test releases them."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.entered = threading.Event()
        self.release = threading.Event()

    def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        self.release.wait(60)
        return self._backend.connect_tcp(*args, **kwargs)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class AsyncHangingBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, backend: Any, hanging: HangingBackend) -> None:
        self._backend = backend
        self._hanging = hanging

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
        self._hanging.entered.set()
        await anyio.to_thread.run_sync(self._hanging.release.wait, 60)
        return await self._backend.connect_tcp(*args, **kwargs)

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


NO_CONNECT_TIMEOUT = httpx.Timeout(30.0, connect=None)


async def request_without_connect_timeout(
    flavor: str, url: str, policy: GuardPolicy, hanging: HangingBackend | None
) -> GuardStats:
    """One request from a guarded client of its own, connect timeout None; ``hanging``: its connects hang first."""
    if flavor == "sync":
        inner = httpx.HTTPTransport()
        if hanging is not None:
            inner._pool._network_backend = hanging
        transport = llama_guard.GuardTransport(inner, policy=policy)
        with httpx.Client(transport=transport, timeout=NO_CONNECT_TIMEOUT) as client:
            await anyio.to_thread.run_sync(lambda: client.post(url + CHAT, json=chat(stream=False)).raise_for_status())
        return transport.stats
    ainner = httpx.AsyncHTTPTransport()
    if hanging is not None:
        ainner._pool._network_backend = AsyncHangingBackend(ainner._pool._network_backend, hanging)
    atransport = llama_guard.AsyncGuardTransport(ainner, policy=policy)
    async with httpx.AsyncClient(transport=atransport, timeout=NO_CONNECT_TIMEOUT) as aclient:
        (await aclient.post(url + CHAT, json=chat(stream=False))).raise_for_status()
    return atransport.stats


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_connect_that_hangs_holds_the_turn_no_longer_than_probe_timeout(flavor: str) -> None:
    """connect_admission: a new connection whose connect hangs (no connect timeout: only the OS bounds it, about
    2 minutes) holds its origin's turn for probe_timeout, not until the OS gives up: the connection queued behind
    it is admitted, opened, probed and served while the first still hangs. Before, it waited for the hung connect
    (here, until the test's 20 s bound released it)."""
    policy = GuardPolicy(connection="reuse", connect_admission="always", max_attempts=1, probe_timeout=0.5)
    with LlamaServerEmulator(pool_bug=False) as server:
        hanging = HangingBackend(httpcore.SyncBackend())
        first, finished = scenario_in_thread(
            flavor, request_without_connect_timeout, flavor, server.url, policy, hanging
        )
        try:
            wait_until(lambda: hanging.entered.is_set() or not first.is_alive(), "the first connect starts")
            assert origin_of(server).opening() == 1, finished  # admitted: the turn is the hung connect's
            stats = run_bounded(
                flavor,
                request_without_connect_timeout,
                flavor,
                server.url,
                policy,
                None,
                deadline=20.0,
                on_hang=hanging.release.set,
            )
            assert not hanging.release.is_set()  # served while the first connect still hung
        finally:
            hanging.release.set()
            first.join(60)
        assert "error" not in finished, finished
    assert stats.snapshot().admission_waits == 1  # it waited for the turn, then took it
    assert finished["result"].snapshot().requests == 1  # the hung one, released, is served too


@pytest.mark.parametrize("flavor", FLAVORS)
def test_reconnects_after_a_stall_are_admitted_in_turn(flavor: str, stalling_server: LlamaServerEmulator) -> None:
    """A pre-opened burst stalls exactly its connections 5 to 16; each is given up once, and its reconnect is
    opened through admission (default connect_admission="after_stall") and served: nothing is lost or run twice."""
    server = stalling_server
    clients, served = server.config.stall_burst or 0, server.config.http_threads
    stalled = clients - served
    # A floor above a busy machine's answer time (the emulator shares the test's GIL): no healthy connection is given
    # up, so the counts are exact. Replaced, not rescued by kicks (the default, tests/test_probe_kick.py).
    policy = GuardPolicy(connection="reuse", probe_timeout_min=0.5, probe_kick=False)
    guarded = functools.partial(burst, timeout=30.0, policy=policy)
    drivers = run_scenario(flavor, guarded, flavor, server.url, server.port, True, clients)
    stats = server.stats()
    probes = origin_of(server)
    outcomes = [o for d in drivers for o in d.outcomes]
    assert len(outcomes) == 2 * clients
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if o.error]
    assert stats.connections_stalled == stalled
    assert given_up(drivers) == stalled
    assert sum(d.stats.stall_reconnects for d in drivers) == stalled
    assert max(o.result.attempts for o in outcomes if o.result is not None) == 2
    assert probes.admitted() >= stalled  # every reconnect took its turn (a late first connect may have too)
    assert (probes.waiting(), probes.opening()) == (0, 0)
    assert stats.connections_accepted == clients + stalled
    assert stats.completions_started == 2 * clients


# -- logging -----------------------------------------------------------------------------------------------------


def test_library_logger_has_a_null_handler() -> None:
    """The library-logging convention: a NullHandler, no other handler, so nothing is printed unless asked."""
    handlers = logging.getLogger("llama_guard").handlers
    assert [type(h) for h in handlers] == [logging.NullHandler]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_one_warning_per_stall_episode(
    flavor: str, caplog: pytest.LogCaptureFixture, stalling_server: LlamaServerEmulator
) -> None:
    """A burst with stalled connections logs one WARNING with their number; each reconnect is a DEBUG record. The
    stall is the deterministic one (12 of 16 connections), not the timing race, which a loaded machine may not
    lose."""
    caplog.set_level(logging.DEBUG, logger="llama_guard")
    PROCESS.stalls.flush()  # an earlier test's episode, whose server may have had this test's port
    caplog.clear()
    server = stalling_server
    clients = server.config.stall_burst or 0
    replacing = GuardPolicy(connection="reuse", probe_kick=False)  # rescues by kicks: tests/test_probe_kick.py
    drivers = run_scenario(
        flavor, functools.partial(burst, timeout=30.0, policy=replacing), flavor, server.url, server.port, True, clients
    )
    reconnects = sum(d.stats.stall_reconnects for d in drivers)
    assert reconnects >= clients - server.config.http_threads  # every stalled connection, at least
    said, details = episode_log(
        caplog,
        server.port,
        f"replaced {reconnects} stalled connection{'s' if reconnects > 1 else ''} to {{origin}} "
        r"in the last ([0-9.]+) s \(llama-server before b11737 did not read them; their requests went on new "
        r"connections; each one at DEBUG level on the 'llama_guard' logger\)",
    )
    # The episode lasts 2 s, or less when the transport closes first (then the time it did last).
    assert 0.1 <= float(said.group(1)) <= 2.0
    assert len([m for m in details if "retrying POST" in m]) == reconnects


def test_an_episode_flushed_early_names_the_time_it_lasted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="llama_guard")
    log = StallLog(episode=30.0)
    origin = Origin("http", "127.0.0.1", 9)
    log.replaced(origin, "one")
    log.replaced(origin, "two")
    log.flush(origin)  # long before the 30 s episode ends
    [warning] = [record.getMessage() for record in caplog.records if "stalled connections" in record.getMessage()]
    assert "replaced 2 stalled connections to http://127.0.0.1:9 in the last 0.1 s " in warning


def test_only_a_first_probe_waits_the_learnt_deadline() -> None:
    """After a probe was given up, the request's next probes wait the configured ladder (0.5, 1, 2 s by default):
    a server that turned slow since the guard learnt costs the request a reconnect, never its attempts."""
    policy = GuardPolicy(probe_kick=False, connection="reuse")
    request = machine_for(policy)
    answered(request.plan.origin_probes, *(0.001,) * LEARN_AFTER)
    probes = [probing(request)]
    for _ in range(3):
        give_up(probes[-1])
        probes.append(probing(request))
    deadlines = [probe.write.timeout for probe in probes]
    assert deadlines == [pytest.approx(policy.probe_timeout_min), 0.5, 1.0, 2.0]


def test_with_kicks_the_learnt_deadline_is_when_the_kicks_go() -> None:
    """With kicks (the default) a first probe waits ``probe_timeout``; its kicks go at the learnt deadline, then 2,
    4, 8... times it, never more than a quarter of the deadline apart, none at or after the give-up; between kicks
    the probe looks again at the next one."""
    policy = GuardPolicy(connection="reuse")
    assert policy.probe_kick
    request = machine_for(policy)
    probe = probing(request)
    assert probe.write.timeout == policy.probe_timeout
    # Nothing learnt yet: kicks at a quarter, half and three quarters of the probe's deadline, none at the give-up.
    assert probe.machine.next(connection.WRITTEN) == connection.Read(pytest.approx(PROBE_SLICE))
    kicks = []
    for at in (0.125, 0.25, 0.375):
        probe.clock.now = at
        assert isinstance(probe.machine.next(connection.TIMED_OUT), connection.Kick)
        kicks.append(at)
        action = probe.machine.next(connection.Kicked())
    assert kicks == [0.125, 0.25, 0.375]
    probe.clock.now = 0.49
    assert isinstance(action, connection.Read)
    assert probe.machine.next(connection.TIMED_OUT) == connection.Read(pytest.approx(0.01))  # no kick at the end
    # The next probe, once the origin's answers taught a deadline: kicks at it, then 2 and 4 times it, then a
    # quarter of the deadline apart.
    answered(request.plan.origin_probes, *(0.001,) * LEARN_AFTER)
    probe = probing(request)
    probe.clock.now = 0.01
    assert probe.machine.next(connection.WRITTEN) == connection.Read(pytest.approx(0.02))
    kicks = []
    for at in (0.05, 0.1, 0.2, 0.325, 0.45):
        probe.clock.now = at
        assert isinstance(probe.machine.next(connection.TIMED_OUT), connection.Kick)  # not waited past
        kicks.append(at)
        action = probe.machine.next(connection.Kicked())
    assert kicks == pytest.approx([0.05, 0.1, 0.2, 0.325, 0.45])
    probe.clock.now = 0.47
    assert probe.machine.next(connection.TIMED_OUT) == connection.Read(pytest.approx(0.02))  # then the give-up
    assert request.plan.stats.snapshot().probe_kicks == 8
