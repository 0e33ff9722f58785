"""aiohttp sessions whose connector the guard cannot hook: an `aiohttp.UnixConnector`, a connector of the caller's
own (an `aiohttp.BaseConnector` subclass), and any connector on an aiohttp version the guard was not tested with.

The guard cannot see their new connections, so it cannot probe them nor time what one costs. Its stats say so
where they should: ``probing_off`` (not ``public_path``, which is for the public-API path of an untested aiohttp)
once a request would have probed, and nothing under the close strategy, where nothing is probed. Its connection
strategy is honest too: ``"auto"`` closes every connection at once on a Unix socket, as for httpx's ``uds=``, and
elsewhere closes them saying it cannot measure, instead of "measuring" forever with probes never sent.

Real sockets: the emulator behind a Unix socket (`UnixRelay`), or reached through a connector that connects to it
whatever the URL says (``http://llama.internal:8080``: not loopback, where ``"auto"`` would have to measure).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

aiohttp = pytest.importorskip("aiohttp")

import llama_guard.aiohttp as guard_aiohttp  # noqa: E402
from llama_guard import GuardPolicy, GuardStats  # noqa: E402
from llama_guard._core.connection_strategy import UNIX_SOCKET  # noqa: E402
from llama_guard._runtime import PROCESS  # noqa: E402
from llama_guard.testing import LlamaServerEmulator  # noqa: E402

from ._connection_kinds import UnixRelay  # noqa: E402

CHAT = "/v1/chat/completions"
#: What the requests name: not loopback, so that only the connector can tell "auto" what a connection costs.
ORIGIN = "http://llama.internal:8080"
#: Every test's event loop is bounded by this (each takes well under a second).
DEADLINE = 30.0
REQUESTS = 8  # half of them streams
UNIX_PROBING_OFF = (
    "the session's connector is a UnixConnector, not an aiohttp.TCPConnector, so the guard cannot probe its new "
    "connections"
)
FORCED_REUSE = "reuse (forced: GuardPolicy(connection='reuse'))"

T = TypeVar("T")


def chat(stream: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 4}


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coroutine, DEADLINE))


async def send(session: aiohttp.ClientSession, count: int = REQUESTS) -> list[int]:
    """``count`` chat requests one after another, every second one a stream, each read whole: their statuses."""
    statuses = []
    for index in range(count):
        async with session.post(CHAT, json=chat(stream=index % 2 == 1)) as response:
            await response.read()
            statuses.append(response.status)
    return statuses


def one_session(
    make_connector: Callable[[], aiohttp.BaseConnector], policy: GuardPolicy | None = None
) -> tuple[list[int], GuardStats]:
    """`send` through one `guarded_session` on the connector ``make_connector`` makes (in the event loop, as aiohttp
    wants): the statuses and the session's guard's stats."""

    async def main() -> tuple[list[int], GuardStats]:
        async with guard_aiohttp.guarded_session(ORIGIN, policy=policy, connector=make_connector()) as session:
            statuses = await send(session)
            guard = guard_aiohttp.guard_of(session)
            assert guard is not None
            return statuses, guard.stats

    return run(main())


class FixedAddressConnector(aiohttp.BaseConnector):
    """A connector of the caller's own (not an `aiohttp.TCPConnector`): a TCP connection to one address, whatever
    the request's URL names."""

    def __init__(self, address: tuple[str, int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._address = address

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        _, protocol = await asyncio.get_running_loop().create_connection(self._factory, *self._address)
        return protocol


class ToLoopback(aiohttp.abc.AbstractResolver):
    """Every host name resolves to the emulator (127.0.0.1 and its port)."""

    def __init__(self, port: int) -> None:
        self._port = port

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
        return [
            {
                "hostname": host,
                "host": "127.0.0.1",
                "port": self._port,
                "family": socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
        ]

    async def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def fresh_process_state() -> Iterator[None]:
    """Each test sees its own warnings (said once per process) and no connection cost measured by an earlier one."""
    PROCESS.warnings.forget()
    PROCESS.connections.forget()
    yield
    PROCESS.warnings.forget()
    PROCESS.connections.forget()


@pytest.fixture
def relay(racy_server: LlamaServerEmulator) -> Iterator[UnixRelay]:
    """The emulator (streams' connections given up after the final chunk) behind a Unix socket."""
    with UnixRelay(("127.0.0.1", racy_server.port)) as unix_relay:
        yield unix_relay


def warnings_said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llama_guard" and r.levelno >= logging.WARNING]


def assert_server_lost_nothing(server: LlamaServerEmulator, posts: int) -> None:
    served = server.stats()
    assert served.requests.get(("POST", CHAT), 0) == posts
    assert served.requests.get(("GET", "/health"), 0) == 0
    assert served.requests_dropped_after_stream == 0
    assert served.errors == ()


@pytest.mark.parametrize("how", ["guarded_session", "guard_session"])
def test_auto_closes_every_connection_of_a_unix_connector_at_once(
    relay: UnixRelay, racy_server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """The default ("auto") on an aiohttp.UnixConnector: close at once, for the Unix socket (as httpx's uds=), not
    "measuring" with probes that are never sent. Nothing is probed under close, so nothing says probing is off,
    and the public path (an untested aiohttp's) is not in use."""

    async def main() -> tuple[list[int], GuardStats]:
        connector = aiohttp.UnixConnector(path=relay.address)
        if how == "guarded_session":
            session = guard_aiohttp.guarded_session(ORIGIN, connector=connector)
        else:
            session = aiohttp.ClientSession(ORIGIN, connector=connector)
            assert guard_aiohttp.guard_session(session) is not None
        async with session:
            statuses = await send(session)
            guard = guard_aiohttp.guard_of(session)
            assert guard is not None
            return statuses, guard.stats

    with caplog.at_level(logging.INFO, logger="llama_guard"):
        statuses, stats = run(main())
    assert statuses == [200] * REQUESTS
    snapshot = stats.snapshot()
    assert snapshot.connection_strategies == {ORIGIN: str(UNIX_SOCKET)}
    assert "Unix socket" in snapshot.connection_strategies[ORIGIN]
    assert snapshot.public_path is None
    assert snapshot.probing_off is None
    assert (snapshot.requests, snapshot.attempts, snapshot.probes_sent) == (REQUESTS, REQUESTS, 0)
    assert "probing=off" not in repr(stats)
    assert warnings_said(caplog) == []
    assert relay.accepted == REQUESTS  # Connection: close on each: a connection per request
    assert_server_lost_nothing(racy_server, REQUESTS)


def test_reuse_on_a_unix_connector_says_probing_is_off(
    relay: UnixRelay, racy_server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """connection="reuse" on an aiohttp.UnixConnector: keep-alive as asked, its new connections unprobed (the guard
    cannot reach them), and stats.probing_off and one warning say so; public_path stays None. Streams still lose
    nothing (each stream's connection dropped after its final chunk)."""

    async def main() -> tuple[list[int], GuardStats]:
        stats = GuardStats()
        for _ in range(2):  # two sessions: one warning
            async with guard_aiohttp.guarded_session(
                ORIGIN,
                policy=GuardPolicy(connection="reuse"),
                stats=stats,
                connector=aiohttp.UnixConnector(path=relay.address),
            ) as session:
                statuses = await send(session)
        return statuses, stats

    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        statuses, stats = run(main())
    assert statuses == [200] * REQUESTS
    snapshot = stats.snapshot()
    assert snapshot.probing_off == UNIX_PROBING_OFF
    assert snapshot.as_dict()["probing_off"] == UNIX_PROBING_OFF
    assert "probing=off" in repr(stats)
    assert snapshot.public_path is None
    assert snapshot.connection_strategies == {ORIGIN: FORCED_REUSE}
    assert snapshot.probes_sent == 0
    assert snapshot.stream_connections_closed == REQUESTS  # 4 streams in each session
    (said,) = warnings_said(caplog)
    assert said.startswith(f"llama_guard on an aiohttp session: {UNIX_PROBING_OFF}: new connections to {ORIGIN} ")
    assert "closes every connection on a Unix socket instead" in said
    assert relay.accepted < 2 * REQUESTS  # connections reused: kept alive between a request and the next stream
    assert_server_lost_nothing(racy_server, 2 * REQUESTS)


def test_no_probing_off_on_a_unix_connector_when_the_policy_does_not_probe(
    relay: UnixRelay, racy_server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """connection="reuse" with probe=False: nothing would be probed, so nothing is off and nothing is said."""

    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        statuses, stats = one_session(
            lambda: aiohttp.UnixConnector(path=relay.address), GuardPolicy(connection="reuse", probe=False)
        )
    assert statuses == [200] * REQUESTS
    snapshot = stats.snapshot()
    assert (snapshot.probing_off, snapshot.public_path) == (None, None)
    assert snapshot.connection_strategies == {ORIGIN: FORCED_REUSE}
    assert warnings_said(caplog) == []
    assert_server_lost_nothing(racy_server, REQUESTS)


def test_a_connector_of_the_callers_own_closes_saying_it_cannot_measure(
    racy_server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """``"auto"`` on a BaseConnector subclass, to an origin that is not loopback: the guard cannot time its new
    connections, so it closes every connection (as while measuring) as its final choice, saying why, rather than
    "measuring (each probed)" forever. Nothing probes under close: probing_off and public_path stay None."""

    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        statuses, stats = one_session(lambda: FixedAddressConnector(("127.0.0.1", racy_server.port)))
    assert statuses == [200] * REQUESTS
    snapshot = stats.snapshot()
    assert snapshot.connection_strategies == {
        ORIGIN: "close (the cost of a new connection cannot be measured: the session's connector is a "
        "FixedAddressConnector, not an aiohttp.TCPConnector, so the guard cannot see its new connections)"
    }
    assert (snapshot.probing_off, snapshot.public_path) == (None, None)
    assert snapshot.probes_sent == 0
    assert warnings_said(caplog) == []
    assert racy_server.stats().connections_accepted == REQUESTS  # closed after each request
    assert_server_lost_nothing(racy_server, REQUESTS)


def test_reuse_on_a_connector_of_the_callers_own_says_probing_is_off(
    racy_server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """connection="reuse" on a BaseConnector subclass: unprobed, said in stats.probing_off (naming the class) and
    one warning that points to a TCPConnector; public_path stays None."""

    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        statuses, stats = one_session(
            lambda: FixedAddressConnector(("127.0.0.1", racy_server.port)), GuardPolicy(connection="reuse")
        )
    assert statuses == [200] * REQUESTS
    snapshot = stats.snapshot()
    assert snapshot.probing_off == (
        "the session's connector is a FixedAddressConnector, not an aiohttp.TCPConnector, so the guard cannot probe "
        "its new connections"
    )
    assert snapshot.public_path is None
    assert snapshot.connection_strategies == {ORIGIN: FORCED_REUSE}
    (said,) = warnings_said(caplog)
    assert "FixedAddressConnector" in said
    assert "GuardConnector" in said
    assert_server_lost_nothing(racy_server, REQUESTS)


def test_an_untested_aiohttp_closes_saying_it_cannot_measure(
    racy_server: LlamaServerEmulator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On an aiohttp version the guard was not tested with, no connector is hooked (a GuardConnector neither):
    public_path says so, as before, and "auto" to an origin that is not loopback closes saying it cannot measure,
    rather than "measuring" forever. probing_off stays None: public_path says it already."""
    monkeypatch.setattr(aiohttp, "__version__", "3.99.0")

    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        statuses, stats = one_session(lambda: guard_aiohttp.GuardConnector(resolver=ToLoopback(racy_server.port)))
    assert statuses == [200] * REQUESTS
    snapshot = stats.snapshot()
    assert snapshot.connection_strategies == {
        ORIGIN: "close (the cost of a new connection cannot be measured: aiohttp 3.99.0 is not a version "
        "llama_guard was tested with, so the guard cannot see the session's new connections)"
    }
    assert snapshot.public_path is not None
    assert "3.99.0" in snapshot.public_path
    assert snapshot.probing_off is None
    assert [said for said in warnings_said(caplog) if "3.99.0" in said] == [snapshot.public_path]
    assert_server_lost_nothing(racy_server, REQUESTS)
