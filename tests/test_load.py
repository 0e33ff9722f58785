"""The proxy-like load of the first issue, against the emulator: 16 threads (sync) or 64 tasks (asyncio, trio)
sharing one client with a 4-connection pool, half of the requests streamed, 2,000 requests in all.

Plain httpx loses requests to connections that the server closes after a stream (deterministically here: the
emulator drops every request written to such a connection, and counts it); the guard loses none, and the server ran
no completion more often than the clients asked for it.

Then the same with many more workers and a faulty server: 64 threads on one sync client, 1,000 tasks on one async
client (asyncio and trio), faults armed all along, the pool's bound held (see the comment above those tests).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import socket
import threading
import time
from typing import Any

import anyio
import httpcore
import httpx
import pytest

import llama_guard
from llama_guard.testing import Fault, LlamaServerEmulator

from ._drivers import FLAVORS, close_driver, gather, make_driver, run_scenario

REQUESTS = 2_000
CHAT = "/v1/chat/completions"


async def proxy_load(flavor: str, url: str, guarded: bool) -> object:
    driver = make_driver(flavor, guarded=guarded, base_url=url, timeout=10.0)
    workers = 16 if flavor == "sync" else 64
    counter = itertools.count()

    def worker() -> object:
        async def run() -> None:
            while (index := next(counter)) < REQUESTS:
                stream = index % 2 == 1
                body = {"messages": [{"role": "user", "content": f"request {index}"}], "stream": stream}
                await driver.request("POST", CHAT, json=body, stream=stream)

        return run

    try:
        await gather(flavor, [worker() for _ in range(workers)])
    finally:
        await close_driver(driver)
    return driver


def _server() -> LlamaServerEmulator:
    return LlamaServerEmulator(stream_close="on_reuse", parallel=8, n_tokens=4)


@pytest.mark.slow
@pytest.mark.parametrize("flavor", FLAVORS)
def test_proxy_like_load_loses_requests_with_plain_httpx(flavor: str) -> None:
    with _server() as server:
        plain = run_scenario(flavor, proxy_load, flavor, server.url, False)
        server_side = server.wait_for(lambda s: s.connections_closed == s.connections_accepted)
    assert len(plain.outcomes) == REQUESTS  # type: ignore[attr-defined]
    errors = plain.errors  # type: ignore[attr-defined]
    dropped = server_side.requests_dropped_after_stream
    print(f"{flavor}: plain httpx lost {len(errors)}/{REQUESTS}, {dropped} of them dropped after streams")
    assert dropped > 0, "plain httpx reuses the connections streams leave"
    # Every request reached the server: it ran, or it was written to a connection a stream had left and dropped.
    assert server_side.completions_started + dropped == REQUESTS
    dropped_errors = [e for e in errors if isinstance(e, httpx.RemoteProtocolError)]
    if flavor == "sync":
        # On top: httpcore's own race between threads sharing a pool (a socket closed under a reader, "Bad file
        # descriptor"), which strikes requests that did run, and some of the dropped ones; with two CPU-bound
        # processes beside the suite a reader caught in it also waited out the 10 s timeout (ReadTimeout, seen in a
        # clean-clone CI run and reproduced once in a run of its own).
        assert len(errors) >= dropped
        assert {type(e) for e in errors} <= {httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout}
    else:
        assert len(dropped_errors) == len(errors) == dropped


@pytest.mark.slow
@pytest.mark.parametrize("flavor", FLAVORS)
def test_proxy_like_load_loses_nothing_through_the_guard(flavor: str) -> None:
    with _server() as server:
        guarded = run_scenario(flavor, proxy_load, flavor, server.url, True)
        server_side = server.stats()
    assert len(guarded.outcomes) == REQUESTS  # type: ignore[attr-defined]
    assert guarded.errors == [], guarded.errors[:3]  # type: ignore[attr-defined]
    assert all(o.status == 200 and o.body for o in guarded.outcomes)  # type: ignore[attr-defined]
    assert server_side.completions_started == REQUESTS, "no completion may run twice"
    assert server_side.requests_dropped_after_stream == 0, "a stream's connection was reused"
    stats = guarded.stats  # type: ignore[attr-defined]
    assert stats.stream_connections_closed == REQUESTS // 2
    print(f"{flavor}: guard lost 0/{REQUESTS}; {stats.retries} retries, {stats.probes_sent} probes")


# -- Many workers, one client, a faulty server: nothing lost, the pool's bound held --------------------------------
#
# 64 threads share one guarded `httpx.Client`, or 1,000 tasks share one `httpx.AsyncClient` (asyncio and trio), with
# a pool of MAX_CONNECTIONS. The emulator has both defects on (connections closed after streams; the thread pool's
# idle-counter bug, with 4 base threads) and faults are armed all along the run: resets before anything is read,
# connections never read, requests read and left unanswered, garbage in answer to the probe, 503s and 429s. Every
# one of those is something the guard must recover from without running a completion twice.
#
# "Bounded as configured" means: the pool never owns more than `max_connections` TCP connections at once, counting
# every socket from the start of its connect until httpcore lets go of it (decides to close it). The probe adds
# none: it is sent on the pool's own new connection, before the request, inside httpcore's connect step. Why "until
# httpcore lets go of it" rather than "until the socket is closed": httpcore marks a connection closed and then
# closes its socket, without a lock (`HTTP11Connection.close`), and closes the expired or surplus connections it
# removes from the pool after releasing the pool's lock; a thread switch (or an await) in between lets another
# request connect a replacement first. For that moment the process holds a socket more than the limit (measured:
# up to 2 more, with 64 threads on 2 cores). That is httpcore's design, with or without the guard. The test counts
# those sockets apart, reports the raw figure, and checks that every socket is closed in the end.
#
# The count is taken on the client side, by a network backend that wraps httpcore's. The server's count is no
# measure of the client's pool: the server notices a client's close only when it next reads, and a
# NEVER_ANSWER_ACCEPT fault parks sockets the client has already given up. The server-side figure is checked for
# consistency instead: it accepted exactly as many connections as the client opened, so nothing else connected.

MAX_CONNECTIONS = 16
FAULT_EVERY = 20  # one fault armed every 20 requests


def _fault_plan(index: int) -> tuple[Fault, dict[str, Any]]:
    plan: list[tuple[Fault, dict[str, Any]]] = [
        (Fault.RESET_BEFORE_READ, {}),  # the next new connection is reset: its probe fails
        (Fault.HEADERS_NEVER, {"path": CHAT, "hold": 0.0}),  # request read, connection closed unanswered
        (Fault.STATUS_503, {"path": CHAT}),  # llama-server loading a model
        (Fault.GARBAGE, {"path": "/health"}),  # the probe is answered with garbage
        (Fault.NEVER_ANSWER_ACCEPT, {"hold": 2.0}),  # the next new connection is never read: its probe times out
        (Fault.STATUS_429, {"path": CHAT, "retry_after": 0}),
    ]
    return plan[(index // FAULT_EVERY) % len(plan)]


class OpenConnections:
    """The client's TCP connections: open now, opened in all, and the most open at once, both in the process
    (``peak``) and owned by the pool (``peak_owned``: not counting those the pool has let go and is closing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = 0
        self.opened = 0
        self.peak = 0
        self.peak_owned = 0
        self.peak_closing = 0
        self._closing: set[object] = set()

    def up(self) -> None:
        with self._lock:
            self.open += 1
            self.opened += 1
            self.peak = max(self.peak, self.open)
            self.peak_owned = max(self.peak_owned, self.open - len(self._closing))

    def down(self, stream: object) -> None:
        with self._lock:
            self.open -= 1
            self._closing.discard(stream)

    def released(self, stream: object) -> None:
        """The pool let go of this connection (removed it from its list, under its lock); it closes it next."""
        with self._lock:
            self._closing.add(stream)
            self.peak_closing = max(self.peak_closing, len(self._closing))

    def watch(self, pool: Any) -> None:
        """Learn which connections ``pool`` removes to close them later: wrap its assignment method (the guard's
        fixed one), which runs under the pool's lock and returns the connections to close."""
        assign = pool._assign_requests_to_connections

        def assign_and_report() -> list[Any]:
            closing = assign()
            for connection in closing:
                _released(getattr(getattr(connection, "_connection", None), "_network_stream", None))
            return closing

        pool._assign_requests_to_connections = assign_and_report


def _released(stream: object) -> None:
    if isinstance(stream, (_CountedStream, _AsyncCountedStream)):
        stream._counter.released(stream)


@pytest.fixture
def count_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count a connection as let go when httpcore marks it closed, before it closes its socket (instrumentation
    only: httpcore's own method runs unchanged; restored after the test)."""
    sync_close = httpcore._sync.http11.HTTP11Connection.close
    async_close = httpcore._async.http11.AsyncHTTP11Connection.aclose

    def close(self: Any) -> None:
        _released(self._network_stream)
        sync_close(self)

    async def aclose(self: Any) -> None:
        _released(self._network_stream)
        await async_close(self)

    monkeypatch.setattr(httpcore._sync.http11.HTTP11Connection, "close", close)
    monkeypatch.setattr(httpcore._async.http11.AsyncHTTP11Connection, "aclose", aclose)


class _CountedStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream, counter: OpenConnections) -> None:
        self._stream, self._counter, self._open = stream, counter, True

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, timeout)

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            if self._open:
                self._open = False
                self._counter.down(self)

    def get_extra_info(self, info: str) -> Any:
        return _socket_seen(self, self._stream.get_extra_info(info), info)


class _ShutdownSeen:
    """A connection's socket, as the guard gets it: sending FIN on a connection whose probe it gave up (it keeps it a
    while, half closed, to see whether the answer comes late) lets the connection go, out of the pool's count."""

    def __init__(self, sock: Any, stream: Any) -> None:
        self._sock, self._stream = sock, stream

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)
        if how == socket.SHUT_WR:
            _released(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _socket_seen(stream: Any, extra: Any, info: str) -> Any:
    return _ShutdownSeen(extra, stream) if info == "socket" and extra is not None else extra


class _CountingBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend, counter: OpenConnections) -> None:
        self._inner, self._counter = inner, counter

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, **kwargs: Any) -> httpcore.NetworkStream:
        self._counter.up()  # from the start of the connect: a connecting socket is an open one
        try:
            stream = self._inner.connect_tcp(host, port, timeout, **kwargs)
        except BaseException:
            self._counter.down(None)
            raise
        return _CountedStream(stream, self._counter)

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        raise AssertionError("no unix sockets here")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _AsyncCountedStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream, counter: OpenConnections) -> None:
        self._stream, self._counter, self._open = stream, counter, True

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if self._open:
                self._open = False
                self._counter.down(self)

    def get_extra_info(self, info: str) -> Any:
        return _socket_seen(self, self._stream.get_extra_info(info), info)


class _AsyncCountingBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, inner: httpcore.AsyncNetworkBackend, counter: OpenConnections) -> None:
        self._inner, self._counter = inner, counter

    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None, **kwargs: Any
    ) -> httpcore.AsyncNetworkStream:
        self._counter.up()
        try:
            stream = await self._inner.connect_tcp(host, port, timeout, **kwargs)
        except BaseException:
            self._counter.down(None)
            raise
        return _AsyncCountedStream(stream, self._counter)

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise AssertionError("no unix sockets here")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


LIMITS = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS, keepalive_expiry=4.0)
# The pool timeout is the only one that needs room: 1,000 tasks queue for 16 connections.
TIMEOUT = httpx.Timeout(20.0, pool=120.0)


def _faulty_server() -> LlamaServerEmulator:
    return LlamaServerEmulator(stream_close_delay=0.02, parallel=8, n_tokens=4, http_threads=4, pool_bug=True)


@dataclasses.dataclass
class LoadRun:
    requests: int
    answers: dict[int, tuple[int, bytes] | BaseException] = dataclasses.field(default_factory=dict)
    counter: OpenConnections = dataclasses.field(default_factory=OpenConnections)
    open_after_close: int = -1
    stats: llama_guard.StatsSnapshot | None = None


def _body(index: int) -> dict[str, Any]:
    """Odd requests are streamed."""
    return {"messages": [{"role": "user", "content": f"request {index}"}], "stream": index % 2 == 1}


def _arm(server: LlamaServerEmulator, index: int) -> None:
    if index % FAULT_EVERY == 0:
        fault, params = _fault_plan(index)
        server.inject(fault, **params)


def sync_load(
    server: LlamaServerEmulator, *, threads: int, requests: int, policy: llama_guard.GuardPolicy | None = None
) -> LoadRun:
    run = LoadRun(requests)
    inner = httpx.HTTPTransport(limits=LIMITS)
    inner._pool._network_backend = _CountingBackend(inner._pool._network_backend, run.counter)
    transport = llama_guard.GuardTransport(inner, policy=policy)
    run.counter.watch(inner._pool)
    client = httpx.Client(transport=transport, base_url=server.url, timeout=TIMEOUT)
    counter = itertools.count()
    lock = threading.Lock()

    def worker() -> None:
        while (index := next(counter)) < requests:
            _arm(server, index)
            answer: tuple[int, bytes] | BaseException
            try:
                with client.stream("POST", CHAT, json=_body(index)) as response:
                    answer = (response.status_code, response.read())
            except BaseException as exc:  # anything at all counts as lost; the assertion shows it
                answer = exc
            with lock:
                run.answers[index] = answer

    workers = [threading.Thread(target=worker, name=f"load-{n}", daemon=True) for n in range(threads)]
    with client:
        for thread in workers:
            thread.start()
        deadline = time.monotonic() + 150
        for thread in workers:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in workers), "the load did not finish within 150 s"
        run.stats = transport.stats.snapshot()
    run.open_after_close = run.counter.open
    return run


async def async_load(
    server: LlamaServerEmulator, *, tasks: int, per_task: int, policy: llama_guard.GuardPolicy | None = None
) -> LoadRun:
    run = LoadRun(tasks * per_task)
    inner = httpx.AsyncHTTPTransport(limits=LIMITS)
    inner._pool._network_backend = _AsyncCountingBackend(inner._pool._network_backend, run.counter)
    transport = llama_guard.AsyncGuardTransport(inner, policy=policy)
    run.counter.watch(inner._pool)
    client = httpx.AsyncClient(transport=transport, base_url=server.url, timeout=TIMEOUT)

    async def task(first: int) -> None:
        for index in range(first, first + per_task):
            _arm(server, index)
            answer: tuple[int, bytes] | BaseException
            try:
                async with client.stream("POST", CHAT, json=_body(index)) as response:
                    answer = (response.status_code, await response.aread())
            except Exception as exc:  # anything but cancellation counts as lost; the assertion shows it
                answer = exc
            run.answers[index] = answer

    async with client:
        with anyio.fail_after(150):
            async with anyio.create_task_group() as group:
                for n in range(tasks):
                    group.start_soon(task, n * per_task)
        run.stats = transport.stats.snapshot()
    run.open_after_close = run.counter.open
    return run


def _complete(body: bytes, *, stream: bool) -> bool:
    """A whole stream (its last event is ``[DONE]``), or a whole chat completion (JSON with a message)."""
    if stream:
        return body.startswith(b"data: ") and body.endswith(b"data: [DONE]\n\n")
    try:
        return bool(json.loads(body)["choices"][0]["message"]["content"])
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def check_load(run: LoadRun, server: LlamaServerEmulator, label: str, connection: str = "auto") -> None:
    """``connection``: the guard's strategy ("auto" is close on the emulator's loopback address: no probe, so the
    fault armed for the probe's answer never strikes, and a connection fault strikes the request itself)."""
    # (The accept loop runs in its own thread: let it catch up with every connect the client made.) Kicks
    # (GuardPolicy.probe_kick: a slow probe opens and closes a connection of its own, outside the pool) count too:
    # under CPU load a healthy probe can wait past the first kick.
    assert run.stats is not None
    kicks = run.stats.probe_kicks - run.stats.probe_kicks_failed
    server_side = server.wait_for(lambda stats: stats.connections_accepted >= run.counter.opened + kicks)
    assert sorted(run.answers) == list(range(run.requests))
    lost = {index: a for index, a in run.answers.items() if isinstance(a, BaseException)}
    assert lost == {}, f"{len(lost)} lost, e.g. {list(lost.items())[:3]!r}"
    answered = {index: a for index, a in run.answers.items() if not isinstance(a, BaseException)}
    assert collections.Counter(status for status, _ in answered.values()) == {200: run.requests}
    incomplete = [index for index, (_, body) in answered.items() if not _complete(body, stream=index % 2 == 1)]
    assert incomplete == [], f"{len(incomplete)} incomplete bodies, e.g. {answered[incomplete[0]]!r}"

    # The server ran every completion exactly once: faults struck before inference, and nothing was run twice.
    assert server_side.completions_started == run.requests
    assert server_side.completions_finished == run.requests
    faults = server_side.faults_triggered
    # Each chat request that reached the server either ran its completion or was answered by a fault (and retried).
    chat_faults = sum(faults.get(f, 0) for f in (Fault.HEADERS_NEVER, Fault.STATUS_503, Fault.STATUS_429))
    assert server_side.requests_to(CHAT) == run.requests + chat_faults
    assert server_side.errors == ()
    # Every kind of fault really struck, and the guard recovered from each (no probe under close: none in answer to it).
    armed = {fault for fault, _ in map(_fault_plan, range(0, run.requests, FAULT_EVERY))}
    if connection != "reuse":
        armed.discard(Fault.GARBAGE)  # armed for /health, which only the probe asks for
    assert {fault for fault, count in faults.items() if count} == armed, faults
    stats = run.stats
    assert stats is not None
    assert stats.requests == run.requests
    # Each fault failed one attempt, and each of those was retried (more retries: stalls of the pool bug, dead
    # pooled connections). A reset fails the probe, or the connect itself when it comes first. A fault armed for
    # the next accepted connection may strike a kick instead, which sends nothing: no attempt fails for it.
    assert stats.retries >= sum(faults.values()) - kicks
    connection_faults = (Fault.RESET_BEFORE_READ, Fault.GARBAGE, Fault.NEVER_ANSWER_ACCEPT)
    if connection == "reuse":
        assert (
            stats.probes_failed + stats.errors.get("ConnectError", 0)
            >= sum(faults.get(f, 0) for f in connection_faults) - kicks
        )
    else:
        assert stats.probes_sent == kicks == 0

    # The pool's bound held, and every connection the client opened is closed again.
    counter = run.counter
    assert 0 < counter.peak_owned <= MAX_CONNECTIONS, counter.peak_owned
    assert counter.peak <= MAX_CONNECTIONS + counter.peak_closing
    assert run.open_after_close == 0
    # The pool's connects are counted from their start, failed ones too. A kick the client saw fail may still have
    # been accepted: a reset at accept (a fault armed for the next connection) can reach its socket before the event
    # loop sees the connect complete, and a timed-out connect can complete as the client gives up. Those are the
    # only connections the client makes and does not count, so they bound the difference.
    accepted = server_side.connections_accepted
    kicks_failed = stats.probe_kicks_failed
    assert counter.opened + kicks <= accepted <= counter.opened + kicks + kicks_failed, (
        f"a connection came from outside the pool: {accepted} accepted, {counter.opened} opened by the pool, "
        f"{kicks} kicks and {kicks_failed} failed kicks; errors {dict(stats.errors)}"
    )
    print(
        f"{label}: 0/{run.requests} lost; faults { {f.name: n for f, n in faults.items()} }; "
        f"{stats.retries} retries, {stats.probes_sent} probes ({stats.probes_failed} failed); "
        f"{counter.opened} connections, at most {counter.peak_owned} owned by the pool at once (limit "
        f"{MAX_CONNECTIONS}), at most {counter.peak} open in the process ({counter.peak_closing} being closed)"
    )


#: Both strategies: the default ("auto": close on the emulator's loopback address) and "reuse" (keep-alive, the probe).
STRATEGIES = pytest.mark.parametrize("connection", ["auto", "reuse"])


@pytest.mark.slow
@pytest.mark.usefixtures("count_releases")
@STRATEGIES
def test_64_threads_on_one_client_against_a_faulty_server_lose_nothing_within_the_pool_limit(connection: str) -> None:
    policy = llama_guard.GuardPolicy(connection=connection)  # type: ignore[arg-type]
    with _faulty_server() as server:
        run = sync_load(server, threads=64, requests=2_048, policy=policy)
        server.clear_faults()
        check_load(run, server, f"sync, 64 threads, {connection}", connection)


@pytest.mark.slow
@pytest.mark.usefixtures("count_releases")
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@STRATEGIES
def test_1000_tasks_on_one_client_against_a_faulty_server_lose_nothing_within_the_pool_limit(
    backend: str, connection: str
) -> None:
    policy = llama_guard.GuardPolicy(connection=connection)  # type: ignore[arg-type]
    with _faulty_server() as server:
        run = anyio.run(functools.partial(async_load, server, tasks=1_000, per_task=1, policy=policy), backend=backend)
        server.clear_faults()
        check_load(run, server, f"{backend}, 1,000 tasks, {connection}", connection)
