"""Issue 21's matrix: every way httpx reaches a server, guarded, against the emulator's two defects.

Each kind of connection (`KINDS`) is a real loopback path to the emulator, through the helpers of
tests/_connection_kinds.py where it needs one: plain TCP; TLS to a terminating relay; a Unix socket relayed to TCP;
an HTTP proxy (forwarding for ``http://``, ``CONNECT`` for ``https://``); a SOCKS5 proxy; HTTP/2 over TLS (ALPN
``h2``) and h2c with prior knowledge, to an HTTP/2 relay that sends each stream upstream as HTTP/1.1.

On each kind, with `llama_guard.GuardTransport` (and `AsyncGuardTransport`) around an ``httpx.HTTPTransport`` of
that kind, and plain httpx on the same path as the control:

- streams (defect 1, ``stream_close="on_reuse"``: every reuse of a stream's connection is lost): alternating
  streamed and non-streamed completions lose none and run none twice, where plain httpx loses every request after a
  stream (or, for the HTTP/2 kinds, whose client connection is the relay's and not llama-server's, loses none: the
  kind cannot show the defect);
- a stall burst (defect 2, ``stall_burst``: 12 of 16 connections of a burst left unread until another closes):
  every stalled connection rescued (probed, kicked or replaced) where the kind lets the guard probe, or else one
  warning naming the kind and the mechanism that is off, and a `stats` field saying so; never fewer answers than
  plain httpx, nothing run twice.

Then the cases the issue names: two HTTP/2 streams on one connection, one ending while the other is in flight (20
runs: none killed); ``httpx.Client(transport=GuardTransport(), proxy=...)``, where httpx mounts its own proxy
transport and the guard sees nothing (said, not silent); and ``guard(client)`` with a proxy (nothing lost).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy
from llama_guard._runtime import PROCESS
from llama_guard.testing import LlamaServerEmulator

from ._connection_kinds import H2Relay, HttpProxy, Socks5Proxy, TlsRelay, UnixRelay, refused_port, tls_material
from ._drivers import Driver, Outcome, close_driver, each_asks_then_close, gather, run_bounded

CHAT = "/v1/chat/completions"
#: Requests of the stream rows: non-streamed, streamed, ... one at a time on one client.
ALTERNATING = 20
#: Plain httpx loses every non-streamed request but the first: each goes to the connection the stream before it
#: left behind (index 2, 4, ...).
LOST_AFTER_STREAMS = list(range(2, ALTERNATING, 2))
#: The stall burst: 16 clients, one connection each, opened together; the server serves 4 and leaves 12 unread.
HTTP_THREADS = 4
BURST = 16
#: Every client's read timeout in the stall rows, plain and guarded alike (so that "as many answers as plain" compares
#: like with like): a stalled request that nothing rescues waits this long. The server would leave it unread until a
#: served connection closes, which none does before every client is done.
STALL_TIMEOUT = 4.0
#: A row (plain and guarded) still running after this long is a hang.
ROW_DEADLINE = 60.0
FLAVORS = ("sync", "asyncio", "trio")


@dataclass(frozen=True)
class Kind:
    """A way httpx reaches the server."""

    id: str
    #: Whether a pooled client on this path meets llama-server's stream defect (its connection is llama-server's).
    shows_stream_defect: bool
    #: Whether the guard can and must probe a new connection here (no "said instead" allowed).
    must_probe: bool
    #: Words, one of which a warning or stats field about this kind names (lower case).
    words: tuple[str, ...]
    why: str = ""


KINDS = {
    kind.id: kind
    for kind in (
        Kind("tcp", True, True, ("tcp",)),
        Kind("tls", True, True, ("tls", "https")),
        Kind("uds", True, True, ("unix", "uds")),
        Kind("http-proxy", True, False, ("proxy",)),
        Kind("connect-proxy", True, False, ("proxy", "connect")),
        Kind("socks", True, False, ("socks", "proxy")),
        Kind(
            "h2", False, False, ("http/2", "h2"),
            why="the client's HTTP/2 connection is the relay's; its HTTP/1.1 connections to llama-server are the "
            "relay's own, one per request",
        ),
        Kind(
            "h2c", False, False, ("http/2", "h2c", "h2"),
            why="the client's HTTP/2 connection is the relay's; its HTTP/1.1 connections to llama-server are the "
            "relay's own, one per request",
        ),
    )
}  # fmt: skip


@dataclass
class Reach:
    """How clients of one kind reach the emulator: a base URL and the arguments of the httpx transport."""

    kind: Kind
    base_url: str
    transport_args: dict[str, Any] = field(default_factory=dict)
    #: The relay or proxy in the way, if any (its counters).
    helper: Any = None

    def inner(self, flavor: str, limits: httpx.Limits) -> Any:
        factory = httpx.HTTPTransport if flavor == "sync" else httpx.AsyncHTTPTransport
        return factory(limits=limits, **self.transport_args)

    def driver(
        self,
        flavor: str,
        *,
        guarded: bool,
        limits: httpx.Limits,
        timeout: float,
        policy: GuardPolicy | None = None,
    ) -> Driver:
        inner = self.inner(flavor, limits)
        policy = policy or keep_alive_policy()
        client: Any
        if flavor == "sync":
            transport = llama_guard.GuardTransport(inner, policy=policy) if guarded else inner
            client = httpx.Client(transport=transport, base_url=self.base_url, timeout=timeout)
        else:
            transport = llama_guard.AsyncGuardTransport(inner, policy=policy) if guarded else inner
            client = httpx.AsyncClient(transport=transport, base_url=self.base_url, timeout=timeout)
        return Driver(flavor, guarded, client)


@contextlib.contextmanager
def reach(kind: str, server: LlamaServerEmulator) -> Iterator[Reach]:
    """The path of ``kind`` to ``server``, its helpers running for the block."""
    upstream = ("127.0.0.1", server.port)
    verify = tls_material().client_context()
    this = KINDS[kind]
    if kind == "tcp":
        yield Reach(this, server.url)
    elif kind == "tls":
        with TlsRelay(upstream) as relay:
            yield Reach(this, f"https://127.0.0.1:{relay.port}", {"verify": verify}, relay)
    elif kind == "uds":
        # The URL's host and port are not where the client connects (the socket is): a port where nothing listens,
        # so that nothing of the guard's can reach the server around the socket by accident.
        with UnixRelay(upstream) as relay, refused_port() as port:
            yield Reach(this, f"http://127.0.0.1:{port}", {"uds": relay.address}, relay)
    # Behind a proxy the origin is reachable through the proxy only: its URL names a port that refuses
    # connections, which the proxy routes to the server (so nothing of the guard's reaches it around the proxy).
    elif kind == "http-proxy":
        with refused_port() as port, HttpProxy(route=upstream) as proxy:
            yield Reach(this, f"http://127.0.0.1:{port}", {"proxy": proxy.url}, proxy)
    elif kind == "connect-proxy":
        with refused_port() as port, TlsRelay(upstream) as relay, HttpProxy(route=relay.address) as proxy:
            yield Reach(this, f"https://127.0.0.1:{port}", {"proxy": proxy.url, "verify": verify}, proxy)
    elif kind == "socks":
        with refused_port() as port, Socks5Proxy(route=upstream) as proxy:
            yield Reach(this, f"http://127.0.0.1:{port}", {"proxy": proxy.url}, proxy)
    elif kind == "h2":
        with H2Relay(upstream, tls=True) as relay:
            yield Reach(this, relay.url, {"http2": True, "verify": verify}, relay)
    elif kind == "h2c":
        with H2Relay(upstream, tls=False) as relay:
            yield Reach(this, relay.url, {"http1": False, "http2": True}, relay)
    else:
        raise ValueError(f"unknown kind {kind!r}")


def keep_alive_policy(**settings: Any) -> GuardPolicy:
    """The guard keeping connections alive and probing new ones, as it does for a server across a network. On
    loopback (all these tests) ``GuardPolicy(connection="auto")``, where that setting exists, closes every
    connection instead, which leaves neither defect anything to act on: pinned to ``"reuse"`` there."""
    if "connection" in {f.name for f in dataclasses.fields(GuardPolicy)}:
        settings.setdefault("connection", "reuse")
    return GuardPolicy(**settings)


def chat(stream: bool, tokens: int = 4) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": tokens}


def kind_params(*, xfail: dict[str, str] | None = None, slow_async: bool = True) -> list[Any]:
    """``(kind, flavor)`` parameters; ``xfail``: kind (or ``kind-flavor``) -> reason, for a library bug."""
    params = []
    for kind in KINDS:
        for flavor in FLAVORS:
            marks: list[Any] = []
            reason = (xfail or {}).get(f"{kind}-{flavor}") or (xfail or {}).get(kind)
            if reason is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            if slow_async and flavor != "sync":
                marks.append(pytest.mark.slow)
            params.append(pytest.param(kind, flavor, id=f"{kind}-{flavor}", marks=marks))
    return params


@pytest.fixture
def quiet_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Warnings said once per process are said again in this test, and captured (DEBUG and up)."""
    monkeypatch.setattr(PROCESS.warnings, "_said", set())
    PROCESS.stalls.flush()  # an earlier test's stall episode
    caplog.set_level(logging.DEBUG, logger="llama_guard")
    caplog.clear()
    return caplog


# -- defect 1: streams -----------------------------------------------------------------------------------------------


async def alternate(reach_: Reach, flavor: str, guarded: bool, policy: GuardPolicy | None = None) -> Driver:
    """``ALTERNATING`` requests on one client, one at a time: non-streamed, streamed, non-streamed, ..."""
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=4.0)
    driver = reach_.driver(flavor, guarded=guarded, limits=limits, timeout=10.0, policy=policy)
    try:
        for index in range(ALTERNATING):
            await driver.request("POST", CHAT, json=chat(stream=index % 2 == 1), stream=True)
    finally:
        await close_driver(driver)
    return driver


def lost(driver: Driver) -> list[int]:
    return [index for index, outcome in enumerate(driver.outcomes) if not outcome.ok]


def stream_row(kind: str, flavor: str, guarded: bool, policy: GuardPolicy | None = None) -> tuple[Driver, Any]:
    """One stream row on a fresh server (every reuse of a stream's connection lost): the driver and the server's
    counts once every completion the clients asked for has finished."""
    with (
        LlamaServerEmulator(stream_close="on_reuse", http_threads=16, pool_bug=False) as server,
        reach(kind, server) as path,
    ):
        driver = run_bounded(
            flavor, alternate, path, flavor, guarded, policy, deadline=ROW_DEADLINE, on_hang=server.stop
        )
        answered = sum(o.ok for o in driver.outcomes)
        stats = server.wait_for(lambda s: s.completions_finished >= answered and s.connections_active == 0, 10.0)
    return driver, stats


@pytest.mark.parametrize(("kind", "flavor"), kind_params())
def test_plain_httpx_loses_requests_after_streams(kind: str, flavor: str) -> None:
    """The control: on a path to llama-server's own connection, plain httpx loses every request written to a
    stream's connection; on an HTTP/2 relay (whose upstream connections are its own) it loses none."""
    driver, stats = stream_row(kind, flavor, guarded=False)
    if KINDS[kind].shows_stream_defect:
        assert lost(driver) == LOST_AFTER_STREAMS, [o.error for o in driver.outcomes]
        assert all(isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)) for e in driver.errors), driver.errors
        assert stats.requests_dropped_after_stream == len(LOST_AFTER_STREAMS)
    else:
        assert lost(driver) == [], [o.error for o in driver.outcomes]
        assert stats.requests_dropped_after_stream == 0
    assert stats.completions_started == ALTERNATING - len(lost(driver))  # the lost ones never ran


@pytest.mark.parametrize("policy", ["keep-alive", "default"])
@pytest.mark.parametrize(("kind", "flavor"), kind_params())
def test_guard_loses_no_request_after_streams(kind: str, flavor: str, policy: str) -> None:
    """Guarded, the same requests on the same path: none lost, each completion run exactly once, every answer
    whole; with connections kept alive (as across a network) and with the default policy."""
    driver, stats = stream_row(
        kind, flavor, guarded=True, policy=keep_alive_policy() if policy == "keep-alive" else GuardPolicy()
    )
    assert lost(driver) == [], [o.error for o in driver.outcomes]
    assert all(o.body.endswith(b"data: [DONE]\n\n") for o in driver.outcomes[1::2])
    assert stats.completions_started == stats.completions_finished == ALTERNATING


# -- defect 2: the stall burst ----------------------------------------------------------------------------------------


@dataclass
class StallRun:
    drivers: list[Driver]
    stalled: int  # connections the server left unread
    completions: int  # completions the server ran, once every connection is done

    @property
    def outcomes(self) -> list[Any]:
        return [o for d in self.drivers for o in d.outcomes]

    @property
    def answered(self) -> int:
        return sum(o.ok for o in self.outcomes)


async def burst(reach_: Reach, flavor: str, guarded: bool, timeout: float) -> list[Driver]:
    """``BURST`` clients, one connection each, all asking at once (their connections open together); then all
    close."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    drivers = [reach_.driver(flavor, guarded=guarded, limits=limits, timeout=timeout) for _ in range(BURST)]
    await each_asks_then_close(flavor, drivers, CHAT, chat(stream=False))
    return drivers


def stall_row(kind: str, flavor: str, guarded: bool) -> StallRun:
    timeout = STALL_TIMEOUT
    with (
        LlamaServerEmulator(http_threads=HTTP_THREADS, stall_burst=BURST) as server,
        reach(kind, server) as path,
    ):
        drivers = run_bounded(flavor, burst, path, flavor, guarded, timeout, deadline=ROW_DEADLINE, on_hang=server.stop)
        # Every connection done (a stalled one is served once the others close): nothing can run any more.
        stats = server.wait_for(lambda s: s.connections_active == 0 and s.connections_queued == 0, 15.0)
    return StallRun(drivers, stats.connections_stalled, stats.completions_started)


def said(caplog: pytest.LogCaptureFixture, kind: Kind) -> list[str]:
    """The guard's warnings that name this kind of connection and the probe."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "llama_guard"
        and r.levelno >= logging.WARNING
        and "prob" in r.getMessage().lower()
        and any(word in r.getMessage().lower() for word in kind.words)
    ]


def stats_say(driver: Driver, kind: Kind) -> bool:
    """A field of the transport's stats names this kind of connection and the probe being off."""
    snapshot = driver.stats
    texts = [
        str(getattr(snapshot, f.name)).lower()
        for f in dataclasses.fields(snapshot)
        if isinstance(getattr(snapshot, f.name), (str, dict, list, tuple))
    ]
    return any("prob" in text and any(word in text for word in kind.words) for text in texts)


@pytest.mark.parametrize(("kind", "flavor"), kind_params())
def test_stall_burst_rescued_or_said(kind: str, flavor: str, quiet_once: pytest.LogCaptureFixture) -> None:
    """A burst that leaves 12 of 16 connections unread: plain httpx (control) gets no answer on the stalled ones;
    guarded, every connection is probed and every request answered (for a kind that cannot be probed: one warning
    per transport at most, and a stats field, naming it; as many answers as plain), and no completion runs twice."""
    this = KINDS[kind]
    plain = stall_row(kind, flavor, guarded=False)
    # Where the client's connections are the server's, the burst reaches it whole: the cause was there. The HTTP/2
    # relay's own connections, one per request, close after each answer, and whether any of them stalls for a
    # moment is a race: on HTTP/2 the row is about the guard saying that it does not probe.
    if this.shows_stream_defect:
        assert plain.stalled == BURST - HTTP_THREADS
        assert plain.answered < BURST, "the stall did not reach plain httpx"
    quiet_once.clear()
    guarded = stall_row(kind, flavor, guarded=True)
    if this.shows_stream_defect:
        assert guarded.stalled == BURST - HTTP_THREADS
    assert guarded.completions <= BURST, "a completion ran twice"
    probes = sum(d.stats.probes_sent for d in guarded.drivers)
    rescued = guarded.answered == BURST and probes >= BURST
    if this.must_probe or not said(quiet_once, this):
        assert rescued, (
            f"{guarded.answered} of {BURST} answered, {probes} probes; errors: {[o.error for o in guarded.outcomes]}"
        )
    else:
        assert len(said(quiet_once, this)) == 1, said(quiet_once, this)  # once per origin and reason, process-wide
        assert all(stats_say(d, this) for d in guarded.drivers)
        assert guarded.answered >= plain.answered


# -- HTTP/2: a stream ends while another request is in flight on the same connection --------------------------------

H2_RUNS = 20
H2_MODES = {
    "plain": None,
    "drop": keep_alive_policy(stream_mode="drop"),
    # The default mode, with a stream whose body is an iterator: the guard cannot read its stream flag.
    "default-iterator": keep_alive_policy(),
}
#: Where the other request is when the stream ends: waiting for its response headers, or reading its body.
H2_PHASES = ("awaiting-headers", "reading-body")


async def h2_runs(relay: H2Relay, flavor: str, mode: str, phase: str) -> Driver:
    """``H2_RUNS`` times on one client (one HTTP/2 connection at a time): a completion A is sent and held at the
    relay (before its response headers, or after them, before its body); meanwhile a stream B is sent on the same
    connection and read to its end, and closed; then A is let go and read."""
    policy = H2_MODES[mode]
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    path = Reach(KINDS["h2"], relay.url, {"http2": True, "verify": tls_material().client_context()})
    driver = path.driver(flavor, guarded=policy is not None, limits=limits, timeout=10.0, policy=policy)

    async def stream_b() -> None:
        if mode == "default-iterator":
            await _send(driver, content=_iterator_body(flavor, chat(stream=True)))
        else:
            await _send(driver, json=chat(stream=True))

    try:
        for run in range(H2_RUNS):
            tag = f"run-{run}"
            if phase == "reading-body":
                await _held_body_run(driver, relay, tag, stream_b)
                continue

            async def held_request(tag: str = tag) -> None:
                await _send(driver, json=chat(stream=False), headers={"x-relay-hold": tag})

            async def stream_meanwhile(tag: str = tag) -> None:
                try:
                    await _wait_event(flavor, relay.held(tag))
                    await stream_b()
                finally:
                    relay.release(tag)

            await gather(flavor, [held_request, stream_meanwhile])
    finally:
        await close_driver(driver)
    return driver


async def _held_body_run(driver: Driver, relay: H2Relay, tag: str, stream_b: Any) -> None:
    """A's response headers arrive, its body is held; B runs to its end; then A's body is let go and read."""
    outcome = Outcome()
    request = driver.client.build_request("POST", CHAT, json=chat(stream=False), headers={"x-relay-hold-body": tag})
    try:
        if driver.flavor == "sync":
            response = driver.client.send(request, stream=True)
        else:
            response = await driver.client.send(request, stream=True)
        assert relay.held(tag).is_set()  # A's headers came, its body waits at the relay
        await stream_b()
        relay.release(tag)
        try:
            if driver.flavor == "sync":
                outcome.body = response.read()
            else:
                outcome.body = await response.aread()
            outcome.status = response.status_code
        finally:
            if driver.flavor == "sync":
                response.close()
            else:
                await response.aclose()
    except httpx.HTTPError as exc:
        outcome.error = exc
    finally:
        relay.release(tag)
    driver.outcomes.append(outcome)


def _iterator_body(flavor: str, body: dict[str, object]) -> Any:
    data = json.dumps(body).encode()
    if flavor == "sync":
        return iter([data])

    async def chunks() -> AsyncIterator[bytes]:
        yield data

    return chunks()


async def _wait_event(flavor: str, event: threading.Event) -> None:
    if flavor == "sync":
        assert event.wait(10.0), "the held request never reached the relay"
    else:
        assert await anyio.to_thread.run_sync(event.wait, 10.0), "the held request never reached the relay"


async def _send(
    driver: Driver, *, json: Any = None, content: Any = None, headers: dict[str, str] | None = None
) -> None:
    """`Driver.request` (a POST to the chat endpoint, read whole) with headers: the outcome is recorded on the
    driver."""
    outcome = Outcome()
    try:
        request = driver.client.build_request("POST", CHAT, json=json, content=content, headers=headers)
        if driver.flavor == "sync":
            response = driver.client.send(request, stream=True)
            try:
                outcome.body = response.read()
            finally:
                response.close()
        else:
            response = await driver.client.send(request, stream=True)
            try:
                outcome.body = await response.aread()
            finally:
                await response.aclose()
        outcome.status = response.status_code
    except httpx.HTTPError as exc:
        outcome.error = exc
    driver.outcomes.append(outcome)


def h2_params() -> list[Any]:
    params = []
    for phase in H2_PHASES:
        for mode in H2_MODES:
            for flavor in FLAVORS:
                marks: list[Any] = []
                if phase == "awaiting-headers" and flavor == "sync":
                    marks.append(
                        pytest.mark.skip(
                            reason="httpcore's sync HTTP/2 connection reads for one thread at a time: the thread "
                            "waiting for A's headers holds the read lock and B's thread cannot take it back, so "
                            "B cannot end while A waits (the reading-body phase runs the sync client)"
                        )
                    )
                params.append(pytest.param(mode, phase, flavor, id=f"{mode}-{phase}-{flavor}", marks=marks))
    return params


@pytest.mark.parametrize(("mode", "phase", "flavor"), h2_params())
def test_h2_stream_end_kills_no_concurrent_request(mode: str, phase: str, flavor: str) -> None:
    """HTTP/2: a stream that ends while another request is in flight on the same connection never takes that
    request down (20 runs: none killed, every completion run once)."""
    with (
        LlamaServerEmulator(http_threads=16, pool_bug=False) as server,
        H2Relay(("127.0.0.1", server.port), tls=True) as relay,
    ):
        driver = run_bounded(flavor, h2_runs, relay, flavor, mode, phase, deadline=ROW_DEADLINE, on_hang=server.stop)
        stats = server.wait_for(lambda s: s.connections_active == 0, 10.0)
    killed = [o.error for o in driver.outcomes if not o.ok]
    assert killed == [], f"{len(killed)} of {len(driver.outcomes)} requests killed: {killed[:3]}"
    assert len(driver.outcomes) == 2 * H2_RUNS
    assert stats.completions_started == 2 * H2_RUNS  # none ran twice
    # Both requests of every run shared the one connection: the scenario is sound (plain), and the guard dropped no
    # HTTP/2 connection when a stream ended (guarded).
    assert relay.accepted == 1


# -- proxies given to the client, not to the transport ---------------------------------------------------------------

PROXIED = {
    "http-proxy": "http://",
    "connect-proxy": "https:// through CONNECT",
    "socks": "http:// through SOCKS5",
}


async def alternate_on(client: Any, flavor: str) -> Driver:
    """`alternate` on a client built by the test (closed afterwards)."""
    driver = Driver(flavor, False, client)
    try:
        for index in range(ALTERNATING):
            await driver.request("POST", CHAT, json=chat(stream=index % 2 == 1), stream=True)
    finally:
        await close_driver(driver)
    return driver


def proxied_client(path: Reach, flavor: str, transport: Any = None) -> Any:
    """A client with the proxy (and TLS trust) of ``path`` given to the client itself, as users write it."""
    verify = path.transport_args.get("verify", True)
    proxy = path.transport_args["proxy"]
    if flavor == "sync":
        return httpx.Client(base_url=path.base_url, proxy=proxy, verify=verify, transport=transport, timeout=10.0)
    return httpx.AsyncClient(base_url=path.base_url, proxy=proxy, verify=verify, transport=transport, timeout=10.0)


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("kind", list(PROXIED))
def test_guard_client_with_a_proxy_loses_nothing(kind: str, flavor: str) -> None:
    """``guard(client)`` on a client given a proxy guards the proxy's transport: no request lost after a stream,
    each completion run once."""
    with (
        LlamaServerEmulator(stream_close="on_reuse", http_threads=16, pool_bug=False) as server,
        reach(kind, server) as path,
    ):
        client = llama_guard.guard(proxied_client(path, flavor), policy=keep_alive_policy())

        async def scenario() -> Driver:
            return await alternate_on(client, flavor)

        driver = run_bounded(flavor, scenario, deadline=ROW_DEADLINE, on_hang=server.stop)
        stats = server.wait_for(lambda s: s.completions_finished >= ALTERNATING and s.connections_active == 0, 10.0)
    assert lost(driver) == [], [o.error for o in driver.outcomes]
    assert stats.completions_started == ALTERNATING
    assert path.helper.accepted >= 1  # through the proxy


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("kind", list(PROXIED))
def test_guard_transport_bypassed_by_a_client_proxy_is_said(
    kind: str, flavor: str, quiet_once: pytest.LogCaptureFixture
) -> None:
    """``httpx.Client(transport=GuardTransport(), proxy=...)``: httpx sends every request through its own proxy
    transport, which the guard never sees; that is said (a warning naming the proxy, and a stats field), not left
    silent."""
    with (
        LlamaServerEmulator(stream_close="on_reuse", http_threads=16, pool_bug=False) as server,
        reach(kind, server) as path,
    ):
        guard_class = llama_guard.GuardTransport if flavor == "sync" else llama_guard.AsyncGuardTransport
        guard = guard_class(policy=keep_alive_policy())
        client = proxied_client(path, flavor, transport=guard)

        async def scenario() -> Driver:
            return await alternate_on(client, flavor)

        run_bounded(flavor, scenario, deadline=ROW_DEADLINE, on_hang=server.stop)
    assert path.helper.accepted >= 1  # the requests went through the proxy
    warnings = [
        r.getMessage()
        for r in quiet_once.records
        if r.name == "llama_guard" and r.levelno >= logging.WARNING and "proxy" in r.getMessage().lower()
    ]
    snapshot = guard.stats.snapshot()
    fields = {f.name: getattr(snapshot, f.name) for f in dataclasses.fields(snapshot)}
    in_stats = [name for name, value in fields.items() if isinstance(value, str) and "proxy" in value.lower()]
    said_so = f"the guard saw {snapshot.requests} requests; warnings naming a proxy: {warnings}; stats: {fields}"
    assert len(warnings) == 1, said_so
    assert in_stats, said_so


def test_client_proxy_bypass_is_said_after_the_client_dict_was_read(quiet_once: pytest.LogCaptureFixture) -> None:
    """The bypass is said however the client object is held in memory: here after ``vars(client)``, which gives
    the client a real ``__dict__`` (the one request goes through the proxy, unguarded)."""
    with LlamaServerEmulator(http_threads=16, pool_bug=False) as server, reach("http-proxy", server) as path:
        guard = llama_guard.GuardTransport(policy=keep_alive_policy())
        client = proxied_client(path, "sync", transport=guard)
        assert vars(client)["_transport"] is guard
        with client:
            assert client.post(CHAT, json=chat(stream=False)).status_code == 200
    assert path.helper.forwarded == 1
    assert guard.stats.snapshot().bypassed is not None
    warnings = [r.getMessage() for r in quiet_once.records if r.name == "llama_guard" and r.levelno >= logging.WARNING]
    assert any("proxy" in w for w in warnings), warnings
