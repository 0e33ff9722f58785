"""The adaptive probe in the aiohttp flavour, on the emulator: the deadline learnt per origin and used, a late
answer counted, admission of new connections woken in turn and bounded by the connect timeout, and the text of a
given-up probe. Shown by counts and state, not elapsed time (see tests/test_adaptive_probe.py for the core).

Every test pins ``connection="reuse"``: the emulator is on loopback, where the default closes every connection and
probes none; the probe belongs to keep-alive connections."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

import llama_guard.aiohttp as guard_aiohttp  # noqa: E402
from llama_guard import GuardPolicy, Origin  # noqa: E402
from llama_guard._core.probes import LEARN_AFTER, OriginProbes  # noqa: E402
from llama_guard._runtime import PROCESS  # noqa: E402
from llama_guard._runtime.admission_turns import ThreadTurn  # noqa: E402
from llama_guard.testing import Fault, LlamaServerEmulator  # noqa: E402

from ._aiohttp_driver import AiohttpDriver, make_aiohttp_driver  # noqa: E402

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def origin_of(server: LlamaServerEmulator) -> OriginProbes:
    return PROCESS.probes.of(Origin("http", "127.0.0.1", server.port))


async def new_connections(url: str, policy: GuardPolicy, count: int, timeout: float = 10.0) -> list[AiohttpDriver]:
    """``count`` requests one after another, each on a new connection (a new session each)."""
    drivers = []
    for _ in range(count):
        driver = make_aiohttp_driver(guarded=True, base_url=url, policy=policy, timeout=timeout)
        try:
            await driver.request("POST", CHAT, json=BODY)
        finally:
            await driver.client.aclose()
        drivers.append(driver)
    return drivers


def test_learnt_deadline_is_used_and_a_given_up_probe_says_so() -> None:
    """After 4 answers the learnt deadline is in force: a connection the server never reads is given up at it, and
    the error says the probe got no answer within that deadline (not aiohttp's "Cannot connect to host")."""
    # Given up at the learnt deadline: without kicks.
    policy = GuardPolicy(connection="reuse", probe_timeout=3.0, probe_kick=False)
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        learning = asyncio.run(new_connections(server.url, policy, LEARN_AFTER))
        learnt = probes.deadline(policy)
        server.inject(Fault.NEVER_ANSWER_ACCEPT, count=2)
        (failed,) = asyncio.run(new_connections(server.url, policy.merged({"max_attempts": 1}), 1))
        (rescued,) = asyncio.run(new_connections(server.url, policy, 1))
    assert policy.probe_timeout_min <= learnt < policy.probe_timeout
    assert sum(d.stats.probes_given_up for d in learning) == 0
    (error,) = failed.errors
    assert isinstance(error, guard_aiohttp.ProbeTimeout)
    text = str(error)
    assert f"did not answer GET /health within {learnt:.3g} s" in text, text
    assert "Cannot connect to host" not in text
    assert failed.stats.probes_given_up == 1
    (outcome,) = rescued.outcomes
    assert outcome.ok
    assert outcome.result is not None
    assert outcome.result.attempts == 2
    (history,) = outcome.result.history
    assert f"within {learnt:.3g} s" in history, history
    assert "Cannot connect" not in history


async def given_up_then_answered(server: LlamaServerEmulator, policy: GuardPolicy) -> AiohttpDriver:
    """One request whose only attempt is given up; the server answers that probe later, while the session is still
    open (the guard looks, as a new probe would, until it sees the answer)."""
    driver = make_aiohttp_driver(guarded=True, base_url=server.url, policy=policy.merged({"max_attempts": 1}))
    try:
        await driver.request("POST", CHAT, json=BODY)
        probes = origin_of(server)
        deadline = time.monotonic() + 30.0
        while driver.stats.probes_answered_late == 0 and time.monotonic() < deadline:
            probes.check_given_up()
            await asyncio.sleep(0.005)
    finally:
        await driver.client.aclose()
    return driver


def test_probe_answered_late_is_counted_and_raises_the_deadline() -> None:
    """A probe given up on a connection the server then serves: counted in probes_answered_late, and the deadline
    rises above that answer's latency."""
    # Given up at the learnt deadline: without kicks.
    policy = GuardPolicy(connection="reuse", probe_timeout=3.0, probe_kick=False)
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        asyncio.run(new_connections(server.url, policy, LEARN_AFTER))
        late = probes.deadline(policy) + 0.2  # later than the deadline in force
        server.inject(Fault.READ_LATE, after=late, count=1)
        driver = asyncio.run(given_up_then_answered(server, policy))
        learnt = probes.deadline(policy)
    stats = driver.stats
    assert (stats.probes_given_up, stats.probes_answered_late) == (1, 1)
    assert learnt > 2 * late


class HeldTurn:
    """The origin's turn for new connections, held by the test as a connection being probed holds it."""

    def __init__(self, probes: OriginProbes) -> None:
        self.probes = probes
        self.ticket = probes.take_ticket(ThreadTurn())
        assert probes.admit(self.ticket, 600.0)
        probes.connected(self.ticket)  # held through its probe: a connect alone holds the turn for its hold only

    def release(self) -> None:
        self.probes.leave(self.ticket)


async def sessions_at_once(url: str, policy: GuardPolicy, count: int) -> list[AiohttpDriver]:
    drivers = [make_aiohttp_driver(guarded=True, base_url=url, policy=policy, timeout=30.0) for _ in range(count)]
    try:
        await asyncio.gather(*(d.request("POST", CHAT, json=BODY) for d in drivers))
    finally:
        for driver in drivers:
            await driver.client.aclose()
    return drivers


def wait_until(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.002)


def test_admission_wakes_sessions_in_turn() -> None:
    """connect_admission="always": sessions that ask at once wait (no connection opened) while another connection
    to the origin holds the turn, here this thread's; released from outside their event loop, they are woken and
    opened one at a time, every wait counted."""
    policy = GuardPolicy(connection="reuse", connect_admission="always", probe_timeout_min=0.5)
    count = 8
    finished: dict[str, Any] = {}
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        held = HeldTurn(probes)

        def run() -> None:
            try:
                finished["drivers"] = asyncio.run(sessions_at_once(server.url, policy, count))
            except BaseException as exc:
                finished["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            wait_until(lambda: probes.waiting() == count or not thread.is_alive(), "the sessions queue up")
            assert server.stats().connections_accepted == 0
        finally:
            held.release()
            thread.join(60)
        assert "error" not in finished, finished
        stats = server.stats()
    drivers = finished["drivers"]
    assert all(o.ok for d in drivers for o in d.outcomes)
    assert sum(d.stats.admission_waits for d in drivers) == count
    assert (probes.admitted(), probes.waiting(), probes.opening()) == (count + 1, 0, 0)
    assert (stats.connections_accepted, stats.completions_started) == (count, count)


def test_admission_wait_is_bounded_by_the_connect_timeout() -> None:
    """A session waiting for its turn waits no longer than its connect timeout: aiohttp's ConnectionTimeoutError
    while the turn is still held, its place given up, no connection opened. (aiohttp's own ``connect`` timer, which
    covers the whole connect, and the guard's bound on the wait expire together; either may raise.)"""
    policy = GuardPolicy(connection="reuse", connect_admission="always", max_attempts=1)
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        held = HeldTurn(probes)
        try:
            (driver,) = asyncio.run(new_connections(server.url, policy, 1, timeout=0.3))
            assert (probes.waiting(), probes.opening()) == (0, 1)
        finally:
            held.release()
        accepted = server.stats().connections_accepted
    (error,) = driver.errors
    assert isinstance(error, aiohttp.ConnectionTimeoutError)
    assert driver.stats.admission_waits == 0
    assert accepted == 0


async def ask_with_timeout(url: str, policy: GuardPolicy, timeout: Any) -> BaseException | None:
    session = guard_aiohttp.guarded_session(url, policy=policy, timeout=timeout)
    try:
        async with session.post(CHAT, json=BODY) as response:
            await response.read()
    except aiohttp.ClientError as exc:
        return exc
    finally:
        await session.close()
    return None


def test_admission_wait_names_itself_when_sock_connect_is_the_bound() -> None:
    """With a ``sock_connect`` shorter than ``connect``, the guard's own bound ends the wait first, and the error's
    cause says what the connection waited for."""
    policy = GuardPolicy(connection="reuse", connect_admission="always", max_attempts=1)
    timeout = aiohttp.ClientTimeout(total=None, connect=30.0, sock_connect=0.3)
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        held = HeldTurn(probes)
        try:
            error = asyncio.run(ask_with_timeout(server.url, policy, timeout))
            assert (probes.waiting(), probes.opening()) == (0, 1)
        finally:
            held.release()
        accepted = server.stats().connections_accepted
    assert isinstance(error, aiohttp.ConnectionTimeoutError)
    # aiohttp re-raises any timeout of a connect as its own "Connection timeout to host ...": the guard's account
    # is the cause.
    causes = []
    cause: BaseException | None = error
    while cause is not None:
        causes.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    assert any("waited 0.3 s (the connect timeout)" in text and "connect_admission" in text for text in causes), causes
    assert accepted == 0
