"""The watch on a connection whose probe was given up (`_core/late_answers.py`): a duplicate of its socket, half
closed, looked at without reading, and closed when the watch ends or when the client closes, on every stack.

The leak it prevents: a guard that kept the given-up connection itself closed it only when another probe of the
origin looked, or when the client closed; a long-running proxy whose server stalled once held those sockets (and
the server's ends) for as long as no new connection was opened.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from llama_guard import GuardPolicy
from llama_guard._core.probes import GivenUpWatches
from llama_guard._core.stats import GuardStats
from llama_guard._runtime import PROCESS
from llama_guard._runtime.late_answers import Expiry, WatchedConnection
from llama_guard.testing import Fault, LlamaServerEmulator

from ._drivers import FLAVORS, ClientSockets, close_driver, make_driver, run_scenario, wait_until
from ._machines import give_up, machine_for, probing
from .test_mechanisms import CHAT, chat

# Every stack the guard probes on: the httpx flavours and aiohttp.
CLIENTS = [pytest.param(flavor, "httpx", id=flavor) for flavor in FLAVORS] + [
    pytest.param("asyncio", "aiohttp", id="aiohttp")
]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair of real TCP sockets on 127.0.0.1: (the client's end, the server's end)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=5)
        server, _ = listener.accept()
    server.settimeout(5)
    try:
        yield client, server
    finally:
        client.close()
        server.close()


# -- the watched connection, on a real socket pair -----------------------------------------------------------------


def test_watched_connection_outlives_the_original_and_sees_an_answer_without_reading_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    watched = WatchedConnection.of(client)
    assert watched is not None
    client.close()  # the adapter closes its own stream at once: the duplicate keeps the connection
    assert server.recv(1) == b""  # the FIN the watch sent: the server sees the end of the request
    assert watched.peek() is None  # nothing came yet
    server.sendall(b"HTTP/1.1 200 OK\r\n")
    deadline = time.monotonic() + 5
    while watched.peek() is None:
        assert time.monotonic() < deadline, "the answer never showed"
    assert watched.peek() is True  # looked at, not read: still there
    watched.close()
    watched.close()  # idempotent: the expiry thread and the transport may both close it
    assert watched.peek() is False


def test_watched_connection_sees_the_peer_close(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    watched = WatchedConnection.of(client)
    assert watched is not None
    server.close()
    deadline = time.monotonic() + 5
    while watched.peek() is None:
        assert time.monotonic() < deadline, "the close never showed"
    assert watched.peek() is False
    watched.close()


def test_nothing_to_watch_without_a_socket() -> None:
    """A closed connection reads as closed, and nothing was missed; a transport with no socket reads as closed
    too, and says why a late answer could not be seen."""
    closed = socket.socket()
    closed.close()
    gone = WatchedConnection.of(closed)
    assert (gone.peek(), gone.unseen) == (False, None)
    none = WatchedConnection.of(None)
    assert none.peek() is False
    assert none.unseen == "the transport's network stream has no socket"


def test_a_connection_that_cannot_be_watched_is_said_once_and_shown_in_stats(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Never silently: the first given-up probe whose connection cannot be watched logs one WARNING (per process),
    and the stats of every guard it happens to say so; the watch settles at once, and no answer is counted."""
    monkeypatch.setattr(PROCESS.warnings, "_said", set())
    caplog.set_level(logging.WARNING, logger="llama_guard")
    stats = [GuardStats(), GuardStats()]
    for each in stats + stats:
        request = machine_for(
            GuardPolicy(connection="reuse"), url="http://127.0.0.1:9/health", method="GET", stats=each
        )
        give_up(probing(request), unseen=WatchedConnection.of(None).unseen)
        [watch] = request.plan.guard.given_up._watches
        request.plan.origin_probes.check_given_up()
        assert watch.settled
    warnings = [record.getMessage() for record in caplog.records if "could not be watched" in record.getMessage()]
    assert len(warnings) == 1
    assert "the transport's network stream has no socket" in warnings[0]
    for each in stats:
        snapshot = each.snapshot()
        assert snapshot.late_answers_unseen is not None
        assert (snapshot.probes_given_up, snapshot.probes_answered_late) == (2, 0)
    assert GuardStats().snapshot().late_answers_unseen is None


def test_given_up_watches_end_with_their_transport(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    watched = WatchedConnection.of(client)
    assert watched is not None

    class Watch:
        settled = False

        def end(self) -> None:
            self.settled = True
            assert watched is not None
            watched.close()

    watches = GivenUpWatches()
    watch = Watch()
    watches.add(watch)
    assert len(watches) == 1
    watches.end_all()
    assert watch.settled
    assert len(watches) == 0
    client.close()
    assert server.recv(1) == b""  # FIN, then the duplicate closed: the server may read to the end


def test_expiry_calls_at_its_time_and_its_thread_ends() -> None:
    expiry = Expiry(name="test-expiry")
    called: list[float] = []
    done = threading.Event()
    start = time.monotonic()
    expiry.at(start + 0.2, lambda: called.append(time.monotonic()))
    expiry.at(start + 0.1, lambda: called.append(time.monotonic()))
    expiry.at(start + 0.3, done.set)
    assert done.wait(10), "the expiry thread never called"
    assert len(called) == 2
    assert called[0] >= start + 0.1  # in order, never early
    assert called[1] >= start + 0.2
    deadline = time.monotonic() + 10
    while any(thread.name == "test-expiry" for thread in threading.enumerate()):
        assert time.monotonic() < deadline, "the expiry thread outlived its last call"
        time.sleep(0.01)
    assert expiry.pending() == 0


def test_expiry_survives_a_failing_call() -> None:
    expiry = Expiry()
    done = threading.Event()

    def fail() -> None:
        raise RuntimeError("a bug")

    expiry.at(time.monotonic(), fail)
    expiry.at(time.monotonic() + 0.05, done.set)
    assert done.wait(10)


# -- on every stack: the emulator never reads one connection ---------------------------------------------------------


async def given_up_once(
    flavor: str, library: str, server: LlamaServerEmulator, policy: GuardPolicy, close: bool
) -> dict[str, int]:
    """One request whose only attempt's probe is given up; then the client sockets to the server must all close:
    with the client open, at the end of the watch; or, with ``close``, when the client closes."""
    client_sockets = ClientSockets(server.port)
    driver = make_driver(flavor, guarded=True, base_url=server.url, policy=policy, library=library)
    try:
        outcome = await driver.request("POST", CHAT, json=chat(stream=False))
        assert outcome.error is not None, outcome  # max_attempts=1: the given-up probe fails the request
        assert driver.stats.probes_given_up == 1
        if close:
            # The adapter's own socket goes at once (aiohttp's on the next turn of the loop); the watched
            # duplicate stays for the 60 s watch.
            await wait_until(lambda: client_sockets.count() == 1, timeout=10, what="one connection watched")
        else:
            await wait_until(
                lambda: client_sockets.count() == 0,
                timeout=20,
                what=f"the given-up connection closed at the end of its watch, the client still open ({library})",
            )
    finally:
        await close_driver(driver)
    if close:
        await wait_until(
            lambda: client_sockets.count() == 0,
            timeout=10,  # the watch runs 60 s: only the client's close can close it this soon
            what=f"the watched connection closed with its client ({library})",
        )
    return {"given_up": driver.stats.probes_given_up}


@pytest.mark.parametrize(
    ("close", "watch"),
    [
        # The client stays open and opens no other connection: the watch's end alone closes the connection.
        pytest.param(False, 0.5, id="at-the-watch-end"),
        # The client closes long before the watch would end.
        pytest.param(True, 60.0, id="with-the-client"),
    ],
)
@pytest.mark.parametrize(("flavor", "library"), CLIENTS)
def test_a_given_up_connection_is_closed(flavor: str, library: str, close: bool, watch: float) -> None:
    # connection="reuse": the emulator is on loopback, where the default closes connections and probes none.
    policy = GuardPolicy(
        connection="reuse", probe_timeout=0.2, probe_timeout_max=watch, probe_learning=False, max_attempts=1
    )
    with LlamaServerEmulator(pool_bug=False) as server:
        server.inject(Fault.NEVER_ANSWER_ACCEPT, count=1)
        seen = run_scenario(flavor, given_up_once, flavor, library, server, policy, close)
    assert seen == {"given_up": 1}
