"""llama_guard for requests and urllib3, against the emulator on real loopback sockets.

Each mechanism is shown failing with plain requests and holding through the guard, in the same test, three ways:
a mounted `GuardAdapter`, `llama_guard.guard(session)`, and `llama_guard.install()` (sessions made before and
after it, the module-level ``requests.post``, urllib3's ``PoolManager`` and pools used directly). The server side
counts what it received and ran. Also here: how the guard's retries and urllib3's ``Retry`` combine, the caller's
request left as it was, results and counters, bad input, and the public names.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import json
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
import requests.adapters
import urllib3
from urllib3.connectionpool import HTTPConnectionPool
from urllib3.util.retry import Retry

import llama_guard
import llama_guard.requests as guard_requests
from llama_guard import GuardPolicy, Origin
from llama_guard._requests.adapter import _adapter_guard
from llama_guard.testing import Fault, LlamaServerEmulator

from ._drivers import ClientSockets
from ._recording_server import RecordingServer

CHAT = "/v1/chat/completions"
#: Requests of a sequential run: non-streamed, streamed, non-streamed, ... on one session.
ALTERNATING = 40
#: Plain requests loses every non-streamed request but the first: urllib3 hands it the connection the stream before it
#: left behind, which the emulator's server dropped after the final chunk without a FIN (stream_close="on_reuse").
LOST_AFTER_STREAMS = ALTERNATING // 2 - 1
#: The shared-session load: threads, requests per thread (every other one streamed), the pool's size.
THREADS = 16
PER_THREAD = 10
POOL_MAXSIZE = 4
#: Every wait of these tests is bounded by this (the client's read timeout; a lost request fails, never hangs).
TIMEOUT = 10.0
ORIGINALS = {
    (HTTPConnectionPool, "urlopen"): HTTPConnectionPool.__dict__["urlopen"],
    (requests.adapters.HTTPAdapter, "send"): requests.adapters.HTTPAdapter.__dict__["send"],
}


def chat(stream: bool, tokens: int = 4) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": tokens}


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()
    for (cls, name), original in ORIGINALS.items():
        assert cls.__dict__[name] is original, f"{cls.__module__}.{cls.__name__}.{name} was left patched"


def close_session(session: Any) -> None:
    """Close a session and its pools' idle connections, its proxies' included (urllib3 2.8's PoolManager.clear()
    leaves them to the garbage collector)."""
    for adapter in session.adapters.values():
        for manager in (adapter.poolmanager, *adapter.proxy_manager.values()):
            for key in list(manager.pools.keys()):
                manager.pools[key].close()
    session.close()


def ask(post: Callable[..., Any], url: str, stream: bool) -> Any:
    """One chat completion, its body read whole: the response, or the requests error it raised."""
    try:
        response = post(url + CHAT, json=chat(stream), timeout=TIMEOUT)
        body = response.content
        assert response.status_code == 200, response.status_code
        if stream:
            assert body.endswith(b"data: [DONE]\n\n"), body[-40:]
        return response
    except requests.RequestException as exc:
        return exc


def alternate(post: Callable[..., Any], url: str, n: int = ALTERNATING) -> list[Any]:
    return [ask(post, url, stream=index % 2 == 1) for index in range(n)]


def lost(outcomes: list[Any]) -> list[int]:
    return [index for index, outcome in enumerate(outcomes) if isinstance(outcome, BaseException)]


def guarded_session(how: str, url: str, policy: GuardPolicy | None = None, **adapter: Any) -> Any:
    """A session guarded ``how``: "adapter" (a mounted GuardAdapter), "guard" (guard(session)), "install"
    (a plain session, with install() for ``url``)."""
    session = requests.Session()
    if how == "adapter":
        mounted = guard_requests.GuardAdapter(policy=policy, **adapter)
        session.mount("http://", mounted)
        session.mount("https://", mounted)
        return session
    if adapter:
        session.mount("http://", requests.adapters.HTTPAdapter(**adapter))
    if how == "guard":
        return llama_guard.guard(session, policy=policy)
    assert how == "install"
    llama_guard.install(origins=[url], policy=policy)
    return session


HOW = pytest.mark.parametrize("how", ["adapter", "guard", "install"])
STRATEGIES = pytest.mark.parametrize("connection", ["auto", "reuse"])


@HOW
@STRATEGIES
def test_sequential_streams_lose_nothing_where_plain_requests_loses(
    how: str, connection: str, racy_server: LlamaServerEmulator
) -> None:
    """Defect 1: plain requests loses the request after every stream, every time; through the guard nothing is
    lost and each completion runs once."""
    plain = requests.Session()
    try:
        outcomes = alternate(plain.post, racy_server.url)
    finally:
        close_session(plain)
    assert lost(outcomes) == list(range(2, ALTERNATING, 2))
    assert all(isinstance(outcomes[i], requests.ConnectionError) for i in lost(outcomes))
    racy_server.wait_for(lambda s: s.requests_dropped_after_stream == LOST_AFTER_STREAMS)

    session = guarded_session(how, racy_server.url, GuardPolicy(connection=connection))
    try:
        outcomes = alternate(session.post, racy_server.url)
        stats = llama_guard.stats_of(session).snapshot()
    finally:
        close_session(session)
    assert lost(outcomes) == []
    results = [guard_requests.result_of(o) for o in outcomes]
    assert all(
        r is not None and r.attempts == 1 and r.connection == connection.replace("auto", "close") for r in results
    )
    assert [r.stream for r in results if r is not None] == [index % 2 == 1 for index in range(ALTERNATING)]
    assert stats.requests == ALTERNATING
    assert stats.retries == 0
    assert stats.stream_connections_closed == ALTERNATING // 2  # Connection: close on every stream
    server = racy_server.wait_for(lambda s: s.completions_finished == 2 * ALTERNATING - LOST_AFTER_STREAMS)
    assert server.requests_dropped_after_stream == LOST_AFTER_STREAMS  # plain's only: the guard lost none
    if connection == "reuse":
        assert server.requests_to("/health") == stats.probes_sent > 0  # each new connection probed once


def test_stream_drop_mode_closes_the_connection_after_the_final_chunk(racy_server: LlamaServerEmulator) -> None:
    """stream_mode="drop": no Connection: close on the request; the stream's connection is closed when the
    response gives it back to urllib3's pool, never reused."""
    policy = GuardPolicy(connection="reuse", stream_mode="drop", max_attempts=1)  # no retry: the drop alone
    session = guarded_session("adapter", racy_server.url, policy)
    try:
        outcomes = alternate(session.post, racy_server.url)
        stats = llama_guard.stats_of(session).snapshot()
    finally:
        close_session(session)
    assert lost(outcomes) == []
    assert stats.stream_connections_dropped == ALTERNATING // 2
    assert racy_server.stats().requests_dropped_after_stream == 0


def shared_load(session: Any, url: str) -> list[Any]:
    """THREADS threads share ``session``, each sending PER_THREAD chat completions, every other one streamed, all
    starting together."""
    start = threading.Barrier(THREADS)

    def worker(index: int) -> list[Any]:
        start.wait(TIMEOUT)
        return [ask(session.post, url, stream=(index + n) % 2 == 1) for n in range(PER_THREAD)]

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        return [o for outcomes in pool.map(worker, range(THREADS)) for o in outcomes]


@HOW
@STRATEGIES
@pytest.mark.timeout(120)
def test_shared_session_under_16_threads_loses_nothing_where_plain_loses(
    how: str, connection: str, racy_server: LlamaServerEmulator
) -> None:
    """One session shared by 16 threads (a pool of 4, so urllib3 opens, pools and discards connections all the
    time), half of the requests streamed: plain requests loses some; through the guard none, each run once."""
    plain = requests.Session()
    plain.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=POOL_MAXSIZE))
    try:
        outcomes = shared_load(plain, racy_server.url)
    finally:
        close_session(plain)
    plain_lost = len(lost(outcomes))
    assert plain_lost > 0
    before = racy_server.wait_for(lambda s: s.requests_dropped_after_stream == plain_lost)

    session = guarded_session(how, racy_server.url, GuardPolicy(connection=connection), pool_maxsize=POOL_MAXSIZE)
    try:
        outcomes = shared_load(session, racy_server.url)
        stats = llama_guard.stats_of(session).snapshot()
    finally:
        close_session(session)
    assert lost(outcomes) == [], [outcomes[i] for i in lost(outcomes)][:3]
    assert stats.requests == THREADS * PER_THREAD
    total = THREADS * PER_THREAD
    after = racy_server.wait_for(lambda s: s.completions_finished == before.completions_finished + total)
    # Ran exactly once each: a request resent after a dead pooled connection had never been read.
    assert after.completions_started == before.completions_started + total


def burst_load(url: str, session: Any, clients: int, timeout: float) -> list[Any]:
    """``clients`` threads share ``session`` and ask at once: ``clients`` new connections in a burst."""
    start = threading.Barrier(clients)

    def worker(_: int) -> Any:
        start.wait(TIMEOUT)
        return _ask_within(session, url, timeout)

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(worker, range(clients)))


def _ask_within(session: Any, url: str, timeout: float) -> Any:
    try:
        response = session.post(url + CHAT, json=chat(False), timeout=timeout)
        assert response.status_code == 200
        return response
    except requests.RequestException as exc:
        return exc


#: The plain session's read timeout in the burst: what a request left unread waits before it fails.
PLAIN_BURST_TIMEOUT = 1.0


@pytest.mark.timeout(120)
def test_the_probe_replaces_the_connections_a_burst_leaves_unread(stalling_server: LlamaServerEmulator) -> None:
    """Defect 2 (the pool stall of builds before b11737): 16 threads open 16 connections at once on one session;
    the server leaves up to 12 of them unread (how many of the threads' connections make one burst depends on when
    each connects). Plain requests: those requests get nothing until their read timeout (on a server of its own,
    as configured). Guarded (reuse: the probe), each stalled connection fails its probe and is replaced; every
    request answered once.

    Unless the server read it in time: reconnects after a stall are opened and probed one at a time
    (connect_admission), so a burst of fewer than 16 connections (a thread that starts late reuses a pooled one)
    stalls reconnects too, each given up after a 1 s deadline. If that lasts until a served connection closes
    (the server's 5 s keep-alive timeout), its thread takes the oldest stalled connection: the given-up ones, half
    closed, are answered and end at once, each handing the thread on, and a reconnect still probing is answered
    within its deadline and used. The emulator counts those (`stalled_used_after_release`)."""
    server = stalling_server
    clients = server.config.stall_burst or 0
    stalled = clients - server.config.http_threads
    with LlamaServerEmulator(http_threads=server.config.http_threads, stall_burst=clients) as plain_server:
        plain = requests.Session()
        plain.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=clients))
        try:
            outcomes = burst_load(plain_server.url, plain, clients, PLAIN_BURST_TIMEOUT)
        finally:
            close_session(plain)
        # How many of the threads' connections the server takes for one burst depends on when each connects.
        assert 0 < len(lost(outcomes)) <= stalled
        assert all(isinstance(outcomes[i], requests.ReadTimeout) for i in lost(outcomes))

    policy = GuardPolicy(connection="reuse", probe_timeout=1.0, probe_kick=False)
    session = guarded_session("adapter", server.url, policy, pool_maxsize=clients)
    try:
        outcomes = burst_load(server.url, session, clients, TIMEOUT)
        stats = llama_guard.stats_of(session).snapshot()
    finally:
        close_session(session)
    assert lost(outcomes) == []
    seen = server.stats()
    assert 0 < seen.connections_stalled <= stalled
    # Exactly the stalled ones the server had not read by their probe's deadline, each replaced once.
    assert stats.probes_failed == seen.connections_stalled - seen.stalled_used_after_release
    # Named as on every stack (they were all MaxRetryError, urllib3's wrapper of each attempt's failure).
    assert stats.errors == {"ProbeTimeout": stats.probes_failed}
    assert seen.completions_started == clients  # nothing ran twice


def other_server_is_untouched(url: str) -> None:
    """Requests to an origin install() was not given: no probe, no Connection: close, no result."""
    response = requests.post(url + CHAT, json=chat(True), timeout=TIMEOUT)
    assert response.status_code == 200
    assert guard_requests.result_of(response) is None


@pytest.mark.timeout(120)
def test_install_covers_sessions_module_functions_and_urllib3(racy_server: LlamaServerEmulator) -> None:
    """install(origins=[url]): a session made before it and one made after, requests.post, a urllib3 PoolManager
    and an HTTPConnectionPool used directly lose nothing; plain, each of them loses. uninstall() restores urllib3
    and requests, and the pools it hooked."""
    url = racy_server.url
    before = requests.Session()
    manager = urllib3.PoolManager()
    pool = HTTPConnectionPool("127.0.0.1", racy_server.port, maxsize=1)

    def urllib3_post(target: Any) -> Callable[..., Any]:
        def post(address: str, *, json: Any, timeout: float) -> Any:
            path = address.removeprefix(url)
            try:
                if target is manager:
                    answer = manager.request("POST", address, json=json, timeout=timeout, retries=False)
                else:
                    answer = pool.request("POST", path, json=json, timeout=timeout, retries=False)
            except urllib3.exceptions.HTTPError as exc:
                raise requests.ConnectionError(exc) from exc
            return _Urllib3Answer(answer)

        return post

    def everyone() -> dict[str, list[Any]]:
        after = requests.Session()
        try:
            return {
                "session made before": alternate(before.post, url, 10),
                "session made after": alternate(after.post, url, 10),
                "requests.post": alternate(requests.post, url, 10),
                "PoolManager": alternate(urllib3_post(manager), url, 10),
                "HTTPConnectionPool": alternate(urllib3_post(pool), url, 10),
            }
        finally:
            close_session(after)

    try:
        plain = everyone()
        # requests.post opens a new session per call: plain, it never reuses a connection, and loses nothing.
        assert {name: len(lost(o)) > 0 for name, o in plain.items()} == {
            "session made before": True,
            "session made after": True,
            "requests.post": False,
            "PoolManager": True,
            "HTTPConnectionPool": True,
        }
        installation = llama_guard.install(origins=[url], policy=GuardPolicy(connection="reuse"))
        guarded = everyone()
        assert {name: lost(o) for name, o in guarded.items()} == {name: [] for name in guarded}
        assert installation.stats.snapshot().requests == 50
        assert all(guard_requests.result_of(o) is not None for outcomes in guarded.values() for o in outcomes)
        assert llama_guard.stats_of(before) is installation.stats
        llama_guard.uninstall()
        for hooked in (pool, *(manager.pools[key] for key in list(manager.pools.keys()))):
            hooks = {"urlopen", "ConnectionCls", "_put_conn", "_get_conn", "_llama_guard_pool"}
            assert not hooks & set(vars(hooked)), vars(hooked)
        again = alternate(before.post, url, 10)
        assert len(lost(again)) > 0  # plain again
    finally:
        close_session(before)
        manager.clear()
        pool.close()


class _Urllib3Answer:
    """A urllib3 response with the parts `ask` reads of a requests response."""

    def __init__(self, response: Any) -> None:
        self.raw = response
        self.status_code = response.status
        self.content = response.data
        self._llama_guard_result = getattr(response, "_llama_guard_result", None)


def test_other_origins_are_left_alone(racy_server: LlamaServerEmulator) -> None:
    """install() for one origin: another origin's requests go out as without it (no probe, no Connection: close:
    one kept-alive connection for all; no result), although it is a llama-server too."""
    with LlamaServerEmulator() as other:
        installation = llama_guard.install(origins=[racy_server.url], policy=GuardPolicy(connection="reuse"))
        session = requests.Session()
        try:
            for _ in range(3):
                response = session.post(other.url + CHAT, json=chat(False), timeout=TIMEOUT)
                assert response.status_code == 200
                assert guard_requests.result_of(response) is None
        finally:
            close_session(session)
        seen = other.stats()
        assert seen.requests_to("/health") == 0
        assert seen.connections_accepted == 1  # kept alive: no Connection: close was added (auto is close here)
        assert installation.stats.snapshot().requests == 0


def requests_exchange_with(url: str) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    """A few requests of every kind the guard looks at, through a session and through urllib3 directly; what the
    client saw of each."""
    seen = []
    session = requests.Session()
    manager = urllib3.PoolManager()
    try:
        for method, path, body in [
            ("GET", "/health", None),
            ("POST", CHAT, chat(stream=True)),
            ("POST", CHAT, chat(stream=False)),
            ("POST", CHAT, chat(stream=True)),
        ]:
            response = session.request(method, url + path, json=body, headers={"Authorization": "Bearer not-a-key"})
            seen.append((response.status_code, sorted(response.headers.items()), response.content))
            answer = manager.request(method, url + path, json=body)
            seen.append((answer.status, sorted(answer.headers.items()), answer.data))
    finally:
        close_session(session)
        manager.clear()
    return seen


@pytest.mark.parametrize("origins", [None, ["http://127.0.0.1:1"]], ids=["auto", "other-origin-listed"])
def test_other_traffic_is_byte_for_byte_unchanged(origins: list[str] | None) -> None:
    """Against a server that is not llama-server, through requests and urllib3, the bytes on the wire and what the
    client sees are identical with install() and without (tests/test_install.py's recording server)."""
    server = RecordingServer()
    try:
        without = requests_exchange_with(server.url)
        wire_without = sorted(server.received)
        server.received.clear()
        installation = llama_guard.install(origins=origins)
        with_install = requests_exchange_with(server.url)
        wire_with = sorted(server.received)
    finally:
        server.close()
    assert len(wire_without) == 2, "one pooled connection each, no probe"
    assert wire_with == wire_without
    assert with_install == without
    if origins is None:
        assert installation.known_origins() == frozenset()  # nginx is not llama.cpp: nothing learnt
    assert installation.stats.snapshot().requests == 0


def test_an_explicit_guard_is_not_doubled_by_install(racy_server: LlamaServerEmulator) -> None:
    installation = llama_guard.install(origins=[racy_server.url])
    session = guarded_session("adapter", racy_server.url, GuardPolicy(connection="reuse"))
    try:
        outcomes = alternate(session.post, racy_server.url, 10)
    finally:
        close_session(session)
    assert lost(outcomes) == []
    assert llama_guard.stats_of(session).snapshot().requests == 10
    assert installation.stats.snapshot().requests == 0


# -- the guard's retries and urllib3's Retry ------------------------------------------------------------------------


def test_a_retried_503_given_to_the_caller_reads_as_the_servers() -> None:
    """Every answer is 503 (Retry-After: 0): the guard reads each one's short body to keep its connection, and once
    its loading wait is over hands the caller the last one, rebuilt from the bytes read. It reads as plain requests'
    does: status, headers, body, and the HTTP version (as a number, and as text where urllib3 has it). The second
    attempt goes at once, as Retry-After says; a third as max_loading_wait passes."""
    with LlamaServerEmulator() as server:
        server.inject(Fault.STATUS_503, path=CHAT, count=None, retry_after=0)
        plain = requests.Session()
        try:
            expected = plain.post(server.url + CHAT, json=chat(False), timeout=TIMEOUT)
        finally:
            close_session(plain)
        session = guarded_session("adapter", server.url, GuardPolicy(max_loading_wait=0.3))
        try:
            response = session.post(server.url + CHAT, json=chat(False), timeout=TIMEOUT)
        finally:
            close_session(session)
    result = guard_requests.result_of(response)
    assert result is not None
    assert result.attempts >= 2
    assert response.status_code == expected.status_code == 503
    assert response.content == expected.content
    assert dict(response.headers) == dict(expected.headers)
    assert response.raw.version == expected.raw.version == 11
    assert getattr(response.raw, "version_string", None) == getattr(expected.raw, "version_string", None)


#: A Retry that lets urllib3 resend everything: connect, read and status retries, every method.
GENEROUS_RETRY = Retry(total=5, connect=5, read=5, status=5, other=5, allowed_methods=None, backoff_factor=0)


def test_urllib3_retry_and_the_guard_never_multiply() -> None:
    """Every answer is garbage (no valid headers): plain requests with a generous Retry sends the request 6 times
    (urllib3's 5 retries); guarded, with the same Retry on the adapter and max_attempts=3, exactly 3: urllib3 sends
    each of the guard's attempts once, so the total is the guard's, never 3 x 6."""
    with LlamaServerEmulator() as server:
        server.inject(Fault.GARBAGE, path=CHAT, count=None)
        plain = requests.Session()
        plain.mount("http://", requests.adapters.HTTPAdapter(max_retries=GENEROUS_RETRY))
        try:
            with pytest.raises(requests.ConnectionError):
                plain.post(server.url + CHAT, json=chat(False), timeout=TIMEOUT)
        finally:
            close_session(plain)
        assert server.wait_for(lambda s: s.requests_to(CHAT) == 6).requests_to(CHAT) == 6

        policy = GuardPolicy(max_attempts=3, backoff=0.01)
        session = guarded_session("adapter", server.url, policy, max_retries=GENEROUS_RETRY)
        try:
            with pytest.raises(requests.ConnectionError) as raised:
                session.post(server.url + CHAT, json=chat(False), timeout=TIMEOUT)
        finally:
            close_session(session)
        assert isinstance(raised.value, llama_guard.GuardError)
        assert raised.value.attempts == 3
        assert "max_attempts=3 reached" in str(raised.value)
        assert server.wait_for(lambda s: s.requests_to(CHAT) == 6 + 3).requests_to(CHAT) == 9


def test_a_one_shot_body_is_never_sent_twice_by_either() -> None:
    """A generator body, written and then the connection closed without an answer: urllib3's generous Retry would
    resend it (with nothing left to send); through the guard it goes once, and the caller gets the error."""
    with LlamaServerEmulator() as server:
        server.inject(Fault.HEADERS_NEVER, path=CHAT, count=None, hold=0)
        session = guarded_session("adapter", server.url, GuardPolicy(backoff=0.01), max_retries=GENEROUS_RETRY)
        body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
        try:
            with pytest.raises(requests.ConnectionError) as raised:
                session.post(
                    server.url + CHAT, data=iter([body]), headers={"Content-Type": "application/json"}, timeout=TIMEOUT
                )
        finally:
            close_session(session)
        assert isinstance(raised.value, llama_guard.GuardError)
        assert raised.value.attempts == 1
        assert "one-shot" in str(raised.value)
        assert server.stats().requests_to(CHAT) == 1


def test_the_guard_retries_where_requests_default_would_not(racy_server: LlamaServerEmulator) -> None:
    """requests' default Retry(0, read=False) sends once; the guard's own attempts still resend a request lost on a
    dead pooled connection (stream_mode="off": the stream's connection is reused, and the request after it lost)."""
    session = guarded_session("adapter", racy_server.url, GuardPolicy(connection="reuse", stream_mode="off"))
    try:
        outcomes = alternate(session.post, racy_server.url, 10)
        stats = llama_guard.stats_of(session).snapshot()
    finally:
        close_session(session)
    assert lost(outcomes) == []
    assert stats.retries == 4 == stats.retries_by_reason["dead_connection"]
    results = [guard_requests.result_of(o) for o in outcomes]
    assert [r.attempts for r in results if r is not None] == [1, 1] + [2, 1] * 4


# -- the caller's request, results, counters ------------------------------------------------------------------------


def test_the_callers_request_is_never_changed(racy_server: LlamaServerEmulator) -> None:
    """Connection: close goes out on a copy of the headers: the caller's PreparedRequest keeps its own."""
    session = guarded_session("adapter", racy_server.url)  # auto: close on loopback
    try:
        prepared = requests.Request("POST", racy_server.url + CHAT, json=chat(True)).prepare()
        headers = dict(prepared.headers)
        response = session.send(prepared, timeout=TIMEOUT)
        assert response.status_code == 200
        assert dict(prepared.headers) == headers
        assert "Connection" not in prepared.headers
        result = llama_guard.result_of(response)
        assert result is not None
        assert result.connection == "close"
        assert result.connection_closed
    finally:
        close_session(session)


def test_result_and_stats_reach_every_way_in(racy_server: LlamaServerEmulator) -> None:
    adapter = guard_requests.GuardAdapter()
    session = requests.Session()
    session.mount("http://", adapter)
    try:
        response = session.post(racy_server.url + CHAT, json=chat(False), timeout=TIMEOUT)
        assert llama_guard.result_of(response) == guard_requests.result_of(response) == response.raw._llama_guard_result
        assert llama_guard.stats_of(session) is adapter.stats is llama_guard.stats_of(adapter)
        accounts = adapter.stats.by_origin()
        assert [(stack, str(origin)) for stack, origin in accounts] == [("requests", racy_server.url)]
        assert next(iter(accounts.values())).snapshot().requests == 1
    finally:
        close_session(session)
    with pytest.raises(ValueError, match=r"guard\(session\)"):
        llama_guard.stats_of(requests.Session())


def test_guard_session_keeps_the_adapters_settings(racy_server: LlamaServerEmulator) -> None:
    session = requests.Session()
    retry = Retry(total=2)
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=3, max_retries=retry))
    assert llama_guard.guard(session) is session
    adapter = session.adapters["http://"]
    assert type(adapter) is requests.adapters.HTTPAdapter
    assert adapter.max_retries is retry
    assert adapter._pool_maxsize == 3
    stats = llama_guard.stats_of(session)
    assert llama_guard.guard(session) is session  # again: the same guard
    assert llama_guard.stats_of(session) is stats
    llama_guard.guard(session, policy=GuardPolicy(max_attempts=2))  # a new policy: a new guard
    assert llama_guard.stats_of(session) is not stats
    close_session(session)


# -- bad input, the public face -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: guard_requests.GuardAdapter(policy="reuse"), TypeError, "policy must be a llama_guard.GuardPolicy"),
        (lambda: guard_requests.GuardAdapter(stats={}), TypeError, "stats must be a llama_guard.GuardStats"),
        (lambda: llama_guard.guard(requests.Session(), policy=3), TypeError, "policy must be"),
        (lambda: guard_requests.guard_session(object()), TypeError, "takes a requests.Session"),
        (lambda: guard_requests.request_options(bogus=1).__enter__(), ValueError, "bogus"),
    ],
)
def test_bad_input_says_what_is_accepted(call: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


class _MethodIsConnected(urllib3.connection.HTTPConnection):
    def is_connected(self) -> bool:  # type: ignore[override]  # a method: ``not conn.is_connected`` is always False
        return True


class _OwnHTTPConnection(urllib3.connection.HTTPConnection):
    pass


def test_a_pool_connection_class_that_is_not_urllib3s_is_refused_by_name() -> None:
    """A pool's ConnectionCls is wrapped by subclassing it; one whose ``is_connected`` is not urllib3 2's property is
    refused with its name and what is accepted, and a subclass of urllib3's is wrapped."""
    from llama_guard._requests.connections import guarded_connection_class, original_connection_class

    with pytest.raises(TypeError, match=r"_MethodIsConnected is not a urllib3 2 connection class: .*HTTPConnection"):
        guarded_connection_class(_MethodIsConnected)
    with pytest.raises(TypeError, match=r"builtins.object is not a urllib3 2 connection class"):
        guarded_connection_class(object)
    guarded = guarded_connection_class(_OwnHTTPConnection)
    assert issubclass(guarded, _OwnHTTPConnection)
    assert original_connection_class(guarded) is _OwnHTTPConnection
    assert guarded_connection_class(guarded) is guarded


def test_without_the_extra_llama_guard_requests_names_it_and_the_rest_works() -> None:
    """requests and urllib3 hidden from a fresh interpreter: install()/uninstall() and guard() on httpx need neither,
    and importing llama_guard.requests says which extra to install."""
    script = textwrap.dedent(
        """
        import json, sys
        for name in ("requests", "urllib3"):
            sys.modules[name] = None
        import httpx, llama_guard
        llama_guard.install(origins=["http://127.0.0.1:9"])
        llama_guard.uninstall()
        llama_guard.guard(httpx.Client()).close()
        try:
            import llama_guard.requests
        except ModuleNotFoundError as exc:
            print(json.dumps({"error": str(exc)}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert "llama_guard.requests needs requests" in error
    assert "pip install 'llama-guard[requests]'" in error


def test_urllib3_1_is_refused_by_name() -> None:
    """requests still allows urllib3 1.26; the guard drives urllib3 2.x's pools, and says so."""
    from types import SimpleNamespace

    from llama_guard._install.requests_pools import unsupported_urllib3

    assert unsupported_urllib3(urllib3) is None
    message = unsupported_urllib3(SimpleNamespace(__version__="1.26.20"))
    assert message is not None
    assert "urllib3 2.x" in message
    assert "1.26.20" in message
    assert "pip install 'urllib3>=2,<3'" in message


def test_install_on_urllib3_1_leaves_requests_alone_and_says_so(
    racy_server: LlamaServerEmulator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On urllib3 1.x install() wraps neither urllib3's pools nor requests' adapter: one warning, and stats.unguarded
    names the library and why; requests go out as without install(). The control: on urllib3 2.x it wraps both and
    nothing is unguarded."""
    original = HTTPConnectionPool.__dict__["urlopen"]
    control = llama_guard.install(origins=[racy_server.url])
    assert HTTPConnectionPool.__dict__["urlopen"] is not original
    assert control.stats.snapshot().unguarded == {}
    llama_guard.uninstall()
    monkeypatch.setattr(urllib3, "__version__", "1.26.20")
    installation = llama_guard.install(origins=[racy_server.url])
    assert HTTPConnectionPool.__dict__["urlopen"] is original
    response = requests.post(racy_server.url + CHAT, json=chat(False), timeout=TIMEOUT)
    assert response.status_code == 200
    assert guard_requests.result_of(response) is None
    said = [r.getMessage() for r in caplog.records if r.name == "llama_guard" and "1.26.20" in r.getMessage()]
    assert said == [
        "install() leaves requests and urllib3 unguarded: the guard needs urllib3 2.x and this is "
        "urllib3 1.26.20 (pip install 'urllib3>=2,<3')"
    ]
    snap = installation.stats.snapshot()
    assert snap.unguarded == {"urllib3": said[0].partition("unguarded: ")[2]}
    assert snap.as_dict()["unguarded"] == snap.unguarded
    assert snap.requests == 0
    assert "unguarded=urllib3" in repr(installation.stats)


def test_public_names() -> None:
    assert sorted(guard_requests.__all__) == sorted(
        [
            "FirstByteTimeout",
            "GuardAdapter",
            "GuardError",
            "GuardPolicy",
            "GuardResult",
            "GuardStats",
            "ProbeError",
            "ProbeTimeout",
            "Urllib3FirstByteTimeout",
            "Urllib3ProbeError",
            "Urllib3ProbeTimeout",
            "guard_session",
            "request_options",
            "result_of",
        ]
    )
    assert issubclass(guard_requests.ProbeTimeout, requests.ConnectTimeout)
    assert issubclass(guard_requests.ProbeError, requests.ConnectionError)
    assert issubclass(guard_requests.FirstByteTimeout, requests.ReadTimeout)
    assert issubclass(guard_requests.GuardAdapter, requests.adapters.HTTPAdapter)
    for name in ("ProbeTimeout", "ProbeError", "FirstByteTimeout", "GuardAdapter"):
        assert getattr(guard_requests, name).__module__ == "llama_guard.requests"
        assert issubclass(getattr(guard_requests, name), (llama_guard.GuardError, requests.adapters.HTTPAdapter))


def test_install_auto_learns_llama_servers_and_drops_the_first_streams_connection(
    racy_server: LlamaServerEmulator,
) -> None:
    """install() without origins: the first response passes unguarded, but it says llama.cpp, so its stream's
    connection is dropped all the same (the next request would be lost on it); the requests after it are guarded."""
    installation = llama_guard.install()
    session = requests.Session()
    try:
        first = session.post(racy_server.url + CHAT, json=chat(True), timeout=TIMEOUT)
        assert first.content.endswith(b"data: [DONE]\n\n")
        assert guard_requests.result_of(first) is None  # unknown until it said who it is
        second = session.post(racy_server.url + CHAT, json=chat(False), timeout=TIMEOUT)
        assert second.status_code == 200
        assert guard_requests.result_of(second) is not None
    finally:
        close_session(session)
    assert installation.known_origins() == {llama_guard.Origin.of("http", "127.0.0.1", racy_server.port)}
    stats = installation.stats.snapshot()
    assert (stats.requests, stats.passthrough, stats.stream_connections_dropped) == (1, 1, 1)
    assert racy_server.stats().requests_dropped_after_stream == 0


def test_an_interrupted_probe_leaves_nothing_behind() -> None:
    """A blocking client's cancellation is an exception raised in its thread (KeyboardInterrupt): raised while the
    guard probes a new connection the server never reads, it reaches the caller as it is; the connection is closed,
    the pool keeps nothing of it, the request is counted, and the session answers the next request."""
    with LlamaServerEmulator() as server:
        sockets = ClientSockets(server.port)
        server.inject(Fault.NEVER_ANSWER_ACCEPT, count=1)
        policy = GuardPolicy(connection="reuse", probe_timeout=30.0, probe_timeout_max=30.0, probe_kick=False)
        session = guarded_session("adapter", server.url, policy)
        raised: list[BaseException] = []

        def worker() -> None:
            try:
                session.post(server.url + CHAT, json=chat(False), timeout=TIMEOUT)
            except BaseException as exc:
                raised.append(exc)

        thread = threading.Thread(target=worker, name="interrupted-request")
        thread.start()
        try:
            deadline = time.monotonic() + TIMEOUT
            while not _in_probe(thread):  # waits on the thread's own progress, bounded
                assert time.monotonic() < deadline, "the request never reached the probe"
                time.sleep(0.01)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)
            )
            thread.join(TIMEOUT)
            assert not thread.is_alive()
            assert len(raised) == 1
            assert isinstance(raised[0], KeyboardInterrupt)
            stats = llama_guard.stats_of(session).snapshot()
            assert stats.requests == 1
            assert stats.probes_failed == 0  # abandoned: neither answered nor failed
            adapter = session.get_adapter(server.url)
            pools = [adapter.poolmanager.pools[key] for key in list(adapter.poolmanager.pools.keys())]
            assert all(pool.pool.qsize() == pool.pool.maxsize for pool in pools)  # nothing checked out
            assert sockets.count() == 0, sockets.describe()
            answer = session.post(server.url + CHAT, json=chat(False), timeout=TIMEOUT)
            assert answer.status_code == 200
            assert server.stats().completions_started == 1
        finally:
            thread.join(TIMEOUT)
            close_session(session)


def _in_probe(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        # The probe's read on the new connection's socket (the requests driver's I/O for its machine).
        if frame.f_code.co_name == "read" and frame.f_code.co_filename.endswith("_requests/connections.py"):
            return True
        frame = frame.f_back
    return False


def test_https_connections_are_probed_after_tls(racy_server: LlamaServerEmulator, tmp_path: Any) -> None:
    """Through TLS (a relay with a test certificate in front of the emulator): the probe goes after the handshake,
    on the TLS socket; the stream defect comes through the relay, and nothing is lost."""
    from ._connection_kinds import TlsRelay, tls_material

    authority = tmp_path / "ca.pem"
    authority.write_bytes(tls_material().ca.cert_pem.bytes())
    with TlsRelay(("127.0.0.1", racy_server.port)) as relay:
        url = f"https://127.0.0.1:{relay.port}"
        session = guarded_session("adapter", url, GuardPolicy(connection="reuse"))
        try:
            # Per request: requests lets REQUESTS_CA_BUNDLE in the environment win over a session's verify.
            outcomes = alternate(functools.partial(session.post, verify=str(authority)), url, 10)
            stats = llama_guard.stats_of(session).snapshot()
        finally:
            close_session(session)
    assert lost(outcomes) == []
    assert stats.probes_sent >= 1
    assert stats.probes_failed == 0
    assert racy_server.stats().requests_to("/health") == stats.probes_sent


def test_a_proxy_is_said_and_its_connections_not_probed(racy_server: LlamaServerEmulator) -> None:
    """Through an HTTP proxy the connection is the proxy's: not probed, said in stats.probing_off; the requests are
    still guarded (stream close, retries)."""
    from ._connection_kinds import HttpProxy

    with HttpProxy() as proxy:
        session = guarded_session("adapter", racy_server.url, GuardPolicy(connection="reuse"))
        session.proxies = {"http": f"http://127.0.0.1:{proxy.port}"}
        try:
            outcomes = alternate(session.post, racy_server.url, 6)
            stats = llama_guard.stats_of(session).snapshot()
        finally:
            close_session(session)
    assert lost(outcomes) == []
    assert stats.probes_sent == 0
    assert stats.probing_off is not None
    assert "proxy" in stats.probing_off


def test_a_first_byte_timeout_is_named_as_on_every_stack() -> None:
    """The headers never come on the first attempt: the deadline retries, and stats.errors and the history name the
    failure FirstByteTimeout (they said MaxRetryError, urllib3's wrapper, or Urllib3FirstByteTimeout)."""
    with LlamaServerEmulator() as server:
        server.inject(Fault.HEADERS_NEVER, path=CHAT, hold=None)
        session = guarded_session("adapter", server.url, GuardPolicy(first_byte_timeout=0.5))
        try:
            response = session.post(server.url + CHAT, json=chat(False), timeout=TIMEOUT)
            stats = llama_guard.stats_of(session).snapshot()
        finally:
            close_session(session)
    assert response.status_code == 200
    result = guard_requests.result_of(response)
    assert result is not None
    assert result.attempts == 2
    assert stats.errors == {"FirstByteTimeout": 1}
    assert result.history[0].startswith("attempt 1: FirstByteTimeout on a new connection (written): "), result.history


@pytest.mark.parametrize("how", ["guard", "adapter"])
def test_a_pickled_guarded_session_is_guarded(how: str, racy_server: LlamaServerEmulator) -> None:
    """A session guarded by guard(session) (its own HTTPAdapters) or a mounted GuardAdapter, pickled (sent to
    another process) and loaded: still guarded, with the same policy and one set of counters for its adapters. A
    guard(session) copy was a plain session, silently (its streams lost the next request)."""
    policy = GuardPolicy(stream_mode="drop", max_attempts=3)
    original = guarded_session(how, racy_server.url, policy)
    copy = pickle.loads(pickle.dumps(original))
    close_session(original)
    try:
        outcomes = alternate(copy.post, racy_server.url, 6)
        stats = llama_guard.stats_of(copy).snapshot()  # one set of counters: else a ValueError
        guards = {id(_adapter_guard(adapter)) for adapter in copy.adapters.values()}
        kept = {_adapter_guard(adapter).policy for adapter in copy.adapters.values()}  # type: ignore[union-attr]
    finally:
        close_session(copy)
    assert lost(outcomes) == []
    assert stats.requests == 6
    assert stats.stream_connections_closed == 3
    assert len(guards) == 1
    assert kept == {policy}
    assert racy_server.stats().requests_dropped_after_stream == 0


def test_an_error_keeps_urllib3_s_reason_readable() -> None:
    """The guard's error and history say what urllib3 said ('Connection aborted.', the bad status line), as plain
    requests does: every quoted value was '<redacted>', the reason included."""
    with LlamaServerEmulator() as server:
        server.inject(Fault.GARBAGE, path=CHAT, data=b"THIS IS NOT HTTP\r\n\r\n")
        session = guarded_session("adapter", server.url, GuardPolicy(max_attempts=1))
        try:
            with pytest.raises(requests.ConnectionError) as raised:
                session.post(server.url + CHAT, json=chat(False), timeout=TIMEOUT)
        finally:
            close_session(session)
    text = str(raised.value)
    assert "'Connection aborted.'" in text, text
    assert "THIS IS NOT HTTP" in text, text
    assert "<redacted>" not in text, text


def test_through_a_forwarding_proxy_the_origin_is_the_server_not_the_proxy(racy_server: LlamaServerEmulator) -> None:
    """A forwarding proxy's pool is the proxy's (urllib3 sends it absolute URLs): the guard took the proxy for the
    origin. With origins=[the server] nothing was guarded (streams lost the next request, as plain requests
    does), and another server behind the same proxy would have been guarded as llama-server."""
    from ._connection_kinds import HttpProxy

    policy = GuardPolicy(origins=[racy_server.url])
    with HttpProxy() as proxy, LlamaServerEmulator(pool_bug=False) as other:
        session = guarded_session("adapter", racy_server.url, policy)
        session.proxies = {"http": proxy.url}
        try:
            outcomes = alternate(session.post, racy_server.url, 6)
            elsewhere = session.get(other.url + "/health", timeout=TIMEOUT)
            stats = llama_guard.stats_of(session).snapshot()
        finally:
            close_session(session)
    assert proxy.forwarded == 7  # every request went through the proxy
    assert lost(outcomes) == []
    assert (stats.requests, stats.passthrough) == (6, 1)
    assert stats.stream_connections_closed == 3
    assert guard_requests.result_of(elsewhere) is None  # not llama-server's: passed through as it was
    assert list(stats.connection_strategies) == [str(Origin.of("http", "127.0.0.1", racy_server.port))]
    assert racy_server.stats().requests_dropped_after_stream == 0


def test_the_admission_wait_is_bounded_by_the_connect_timeout() -> None:
    """connect_admission="always", the origin's turn held by another connection: the request's new connection waits
    no longer than its connect timeout, then fails as a connect that timed out (requests' ConnectTimeout, naming the
    admission), its place given up and nothing opened (tests/test_adaptive_probe.py's tooling)."""
    from .test_adaptive_probe import HeldTurn, origin_of

    policy = GuardPolicy(connection="reuse", connect_admission="always", max_attempts=1)
    with LlamaServerEmulator(pool_bug=False) as server:
        probes = origin_of(server)
        held = HeldTurn(probes)
        session = guarded_session("adapter", server.url, policy)
        try:
            with pytest.raises(requests.ConnectTimeout) as raised:
                session.post(server.url + CHAT, json=chat(False), timeout=(0.3, TIMEOUT))
            assert (probes.waiting(), probes.opening()) == (0, 1)  # gave its place up; the turn is still held
        finally:
            held.release()
            close_session(session)
        assert server.stats().connections_accepted == 0
    assert "waited 0.3 s (the connect timeout)" in str(raised.value)
    assert "connect_admission" in str(raised.value)
    assert isinstance(raised.value, llama_guard.GuardError)


def test_a_connection_idle_past_the_guards_keep_alive_is_not_reused() -> None:
    """llama-server closes an idle connection at 5 s and urllib3 keeps one for ever: a pooled connection idle for 4 s
    (CLIENT_KEEPALIVE) is closed before it is handed out, and the request goes on a new (probed) connection. The idle
    time is set on the connection (its stamp moved back), not waited for."""
    from llama_guard._core.llama_server import CLIENT_KEEPALIVE

    with LlamaServerEmulator(pool_bug=False) as server:
        session = guarded_session("adapter", server.url, GuardPolicy(connection="reuse"))
        try:
            for _ in range(2):  # one connection, reused while fresh
                assert ask(session.post, server.url, stream=False).status_code == 200
            assert server.stats().connections_accepted == 1
            adapter = session.get_adapter(server.url)
            (pool,) = [adapter.poolmanager.pools[key] for key in list(adapter.poolmanager.pools.keys())]
            (idle,) = [conn for conn in list(pool.pool.queue) if conn is not None]
            idle._llama_guard_answered_at -= CLIENT_KEEPALIVE
            assert ask(session.post, server.url, stream=False).status_code == 200
            stats = llama_guard.stats_of(session).snapshot()
        finally:
            close_session(session)
        seen = server.stats()
    assert seen.connections_accepted == 2
    assert seen.requests_to("/health") == stats.probes_sent == 2
    assert stats.retries == 0
