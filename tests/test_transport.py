"""The transport's contract beyond the mechanisms: guard(client), origins, the caller's request left as it was,
probe edge cases, what is never resent, errors and logs. Real sockets, the emulator as the server."""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Iterator
from typing import Any

import httpcore
import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy, GuardTransport
from llama_guard._httpx.internals import _assign_requests_to_connections, fix_pool_race
from llama_guard.testing import Fault, LlamaServerEmulator

from ._drivers import FLAVORS, close_driver, make_driver, run_scenario

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
#: For the tests of the probe: the emulator is on loopback, where the default ("auto") closes every connection and
#: probes none; the probe belongs to new keep-alive connections.
REUSE = GuardPolicy(connection="reuse")


@pytest.fixture
def server() -> Iterator[LlamaServerEmulator]:
    with LlamaServerEmulator(http_threads=8) as emulator:
        yield emulator


# -- guard(client) ---------------------------------------------------------------------------------------------


def test_guard_wraps_transport_and_mounts_and_keeps_settings(server: LlamaServerEmulator) -> None:
    """guard() wraps the default transport and every mount; base URL, headers and timeouts stay as they were."""
    client = httpx.Client(
        base_url=server.url,
        headers={"X-Team": "a"},
        timeout=7.0,
        mounts={"http://example.invalid": httpx.HTTPTransport()},
    )
    with llama_guard.guard(client) as guarded:
        assert guarded is client
        assert isinstance(client._transport, GuardTransport)
        assert all(isinstance(t, GuardTransport) for t in client._mounts.values())
        assert str(client.base_url).rstrip("/") == server.url
        assert client.headers["X-Team"] == "a"
        assert client.timeout == httpx.Timeout(7.0)
        response = client.post(CHAT, json=BODY)
        assert response.status_code == 200
        assert response.extensions["llama_guard"].attempts == 1
        assert response.request.headers["X-Team"] == "a"


def test_guard_is_idempotent_and_rewraps_for_a_new_policy() -> None:
    client = llama_guard.guard(httpx.Client())
    first = client._transport
    assert llama_guard.guard(client)._transport is first
    llama_guard.guard(client, policy=GuardPolicy(max_attempts=2))
    assert client._transport is not first
    assert client._transport.transport is first.transport  # type: ignore[attr-defined]
    assert client._transport.policy.max_attempts == 2  # type: ignore[attr-defined]
    client.close()


def test_guard_rejects_what_is_not_an_httpx_client() -> None:
    with pytest.raises(
        TypeError,
        match=(
            r"guard\(\) takes an httpx\.Client or httpx\.AsyncClient \(or their httpx2 twins\) "
            r"or a requests\.Session; got str"
        ),
    ):
        llama_guard.guard("client")  # type: ignore[type-var]


def test_transport_rejects_a_transport_of_the_wrong_kind() -> None:
    with pytest.raises(TypeError, match="for an async client use AsyncGuardTransport"):
        GuardTransport(httpx.AsyncHTTPTransport())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"policy must be a llama_guard\.GuardPolicy"):
        GuardTransport(policy={"max_attempts": 2})  # type: ignore[arg-type]


def test_async_guard(server: LlamaServerEmulator) -> None:
    async def scenario() -> int:
        async with llama_guard.guard(httpx.AsyncClient(base_url=server.url)) as client:
            assert isinstance(client._transport, llama_guard.AsyncGuardTransport)
            return (await client.post(CHAT, json=BODY)).status_code

    assert run_scenario("asyncio", scenario) == 200


# -- the caller's request ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_caller_trace_is_called_and_request_is_left_as_it_was(flavor: str, server: LlamaServerEmulator) -> None:
    """The caller's trace callback sees every event; the request's extensions, headers and body are unchanged."""
    events: list[str] = []

    if flavor == "sync":

        def trace(event: str, info: dict[str, Any]) -> None:
            events.append(event)
    else:

        async def trace(event: str, info: dict[str, Any]) -> None:  # type: ignore[misc]
            events.append(event)

    async def scenario() -> httpx.Response:
        driver = make_driver(flavor, guarded=True, base_url=server.url)
        try:
            request = driver.client.build_request(
                "POST", CHAT, json={**BODY, "stream": True}, extensions={"trace": trace}
            )
            original_extensions = dict(request.extensions)
            if isinstance(driver.client, httpx.Client):
                response = driver.client.send(request)
            else:
                response = await driver.client.send(request)
            assert response.request is request
            assert request.extensions == original_extensions
            assert request.headers["connection"] == "keep-alive"  # the guard sent its Connection: close on a copy
            assert json.loads(request.content)["stream"] is True  # the body the caller built, as it built it
            return response
        finally:
            await close_driver(driver)

    response = run_scenario(flavor, scenario)
    assert response.status_code == 200
    assert response.extensions["llama_guard"].connection_closed
    assert "connection.connect_tcp.complete" in events
    assert "http11.receive_response_headers.complete" in events


# -- origins ---------------------------------------------------------------------------------------------------


def test_listed_origins_only(server: LlamaServerEmulator) -> None:
    """Traffic to origins not listed passes through untouched (counted, not guarded)."""
    policy = GuardPolicy(origins=["http://127.0.0.1:1"])
    with httpx.Client(transport=GuardTransport(policy=policy), base_url=server.url) as client:
        client.post(CHAT, json=BODY)
        stats = client._transport.stats.snapshot()  # type: ignore[attr-defined]
    assert (stats.passthrough, stats.requests, stats.probes_sent) == (1, 0, 0)


def test_auto_origins_learn_from_the_server_header(server: LlamaServerEmulator) -> None:
    """In "auto" mode an origin is guarded once it has answered with Server: llama.cpp."""
    with httpx.Client(transport=GuardTransport(policy=GuardPolicy(origins="auto")), base_url=server.url) as client:
        first = client.get("/health")
        second = client.post(CHAT, json=BODY)
        stats = client._transport.stats.snapshot()  # type: ignore[attr-defined]
    assert "llama_guard" not in first.extensions
    assert second.extensions["llama_guard"].attempts == 1
    assert (stats.passthrough, stats.requests) == (1, 1)


# -- the probe ---------------------------------------------------------------------------------------------------


def test_probe_answered_503_while_loading_keeps_probing(server: LlamaServerEmulator) -> None:
    """llama-server answers the probe with 503 and closes while it loads a model: that connection is lost,
    probing is not (a client that first connects during loading must stay protected)."""
    server.inject(Fault.STATUS_503, path="/health")  # error responses come with Connection: close
    with httpx.Client(transport=GuardTransport(policy=REUSE), base_url=server.url) as client:
        response = client.post(CHAT, json=BODY)
        streamed = client.post(CHAT, json={**BODY, "stream": True})  # reuses the connection, then closes it
        after = client.post(CHAT, json=BODY)  # a new connection: probed again
        stats = client._transport.stats.snapshot()  # type: ignore[attr-defined]
    assert response.status_code == streamed.status_code == after.status_code == 200
    assert response.extensions["llama_guard"].attempts == 2
    assert "answered GET /health with 503" in response.extensions["llama_guard"].history[0]
    # The failed one, none for the retry (the server had just answered), the new connection's after the stream.
    assert stats.probes_sent == 2
    # The 503 that closed the connection is a failed probe, as its ProbeError is an error; the other one passed.
    assert (stats.probes_failed, stats.errors, stats.probe_latency.count) == (1, {"ProbeError": 1}, 1)


@pytest.mark.parametrize("loading_wait", [0.0, 0.3])
@pytest.mark.parametrize("connection", ["auto", "reuse"])
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_server_loading_its_model_answers_the_request_itself(
    flavor: str, connection: str, loading_wait: float, request: pytest.FixtureRequest
) -> None:
    """llama-server loading a model answers everything, /health included, with 503 and closes. Under reuse the
    probe fails, but the caller gets the server's own 503 "Loading model" answer once max_loading_wait has passed
    (at once with 0), not a probe error; under the close strategy nothing is probed."""

    async def scenario(url: str) -> Any:
        policy = GuardPolicy(
            connection=connection,  # type: ignore[arg-type]
            max_attempts=3,
            backoff=0.0,
            backoff_max=0.05,
            max_retry_time=10,
            max_loading_wait=loading_wait,
        )
        driver = make_driver(flavor, guarded=True, base_url=url, policy=policy)
        try:
            return await driver.request("POST", CHAT, json=BODY)
        finally:
            await close_driver(driver)

    with LlamaServerEmulator(loading=True) as loading:
        outcome = run_scenario(flavor, scenario, loading.url)
        seen = loading.stats()
    assert outcome.error is None
    assert outcome.status == 503
    assert b"Loading model" in outcome.body
    assert outcome.result is not None
    assert outcome.result.connection == ("reuse" if connection == "reuse" else "close")
    probes = 1 if connection == "reuse" else 0  # only the first attempt probed
    assert seen.requests.get(("GET", "/health"), 0) == probes
    assert seen.requests[("POST", CHAT)] == outcome.result.attempts - probes
    if loading_wait == 0:
        assert outcome.result.attempts == 1 + probes
    else:
        assert outcome.result.attempts > 1 + probes  # the 503s were retried while the wait lasted


def test_probe_of_a_server_that_closes_after_a_healthy_answer_is_disabled(caplog: pytest.LogCaptureFixture) -> None:
    """A server that closes every connection after one answer (200 with Connection: close) cannot be probed: the
    guard says so once, in stats.probing_off too, and stops probing it; requests still succeed. The connection was
    answered, so it is no stall: the retry is not counted as one."""
    with LlamaServerEmulator(keepalive_max=1) as server:
        with httpx.Client(transport=GuardTransport(policy=REUSE), base_url=server.url) as client:
            first = client.post(CHAT, json=BODY)
            second = client.post(CHAT, json=BODY)
            stats = client._transport.stats.snapshot()  # type: ignore[attr-defined]
        assert server.stats().completions_started == 2
    assert first.status_code == second.status_code == 200
    assert first.extensions["llama_guard"].attempts == 2
    assert second.extensions["llama_guard"].attempts == 1
    assert stats.probes_sent == 1
    assert (stats.probes_failed, stats.errors, stats.probe_latency.count) == (1, {"ProbeError": 1}, 0)
    assert "probing disabled for this origin" in caplog.text
    assert stats.probing_off is not None
    assert "closes connections after answering GET /health (200)" in stats.probing_off
    assert (stats.stall_reconnects, stats.retries_by_reason) == (0, {"connection_error": 1})
    assert "stalled" not in caplog.text


@pytest.mark.parametrize("fault", [Fault.GARBAGE, Fault.RESET_AFTER_HEADERS, Fault.TRUNCATED_CHUNK])
def test_a_broken_probe_answer_means_a_new_connection(server: LlamaServerEmulator, fault: Fault) -> None:
    """A probe answered with garbage or cut short fails that connection only; the request goes on a new one."""
    server.inject(fault, path="/health")
    with httpx.Client(transport=GuardTransport(policy=REUSE), base_url=server.url) as client:
        response = client.post(CHAT, json=BODY)
    assert response.status_code == 200
    result = response.extensions["llama_guard"]
    assert result.attempts == 2
    assert "ProbeError" in result.history[0]
    assert server.stats().completions_started == 1


def test_every_probe_failing_ends_in_a_clear_error(server: LlamaServerEmulator) -> None:
    """A server that resets every new connection, probed (keep-alive): attempts run out, and the error says what was
    tried."""
    server.inject(Fault.RESET_BEFORE_READ, count=None)
    policy = GuardPolicy(connection="reuse", max_attempts=3, backoff=0.0, probe_timeout=0.2)
    with (
        httpx.Client(transport=GuardTransport(policy=policy), base_url=server.url) as client,
        pytest.raises(httpx.ConnectError) as info,
    ):
        client.post(CHAT, json=BODY)
    error = info.value
    assert isinstance(error, llama_guard.GuardError)
    assert error.attempts == 3
    assert len(error.history) == 3
    assert "3 attempts" in str(error)
    assert "max_attempts=3 reached" in str(error)
    assert server.stats().completions_started == 0
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)


# -- what is never sent twice ------------------------------------------------------------------------------------


def test_a_one_shot_body_is_never_sent_twice(server: LlamaServerEmulator) -> None:
    """A generator body that reached the server is not replayed, even to an inference endpoint."""
    server.inject(Fault.HEADERS_NEVER, path=CHAT, hold=0.0)  # read the request, then close without answering

    def body() -> Iterator[bytes]:
        yield b'{"messages": [], "max_tokens": 2}'

    with (
        httpx.Client(transport=GuardTransport(), base_url=server.url) as client,
        pytest.raises(httpx.HTTPError) as info,
    ):
        client.post(CHAT, content=body(), headers={"Content-Type": "application/json"})
    assert isinstance(info.value, llama_guard.GuardError)
    assert info.value.attempts == 1
    assert "one-shot stream" in str(info.value)
    assert server.stats().requests.get(("POST", CHAT)) == 1


def test_the_callers_own_read_timeout_is_not_retried(server: LlamaServerEmulator) -> None:
    """httpx's read timeout is the caller's decision to stop waiting: reported, not retried."""
    server.inject(Fault.HEADERS_NEVER, path=CHAT, hold=None)
    client = httpx.Client(transport=GuardTransport(), base_url=server.url, timeout=0.5)
    with client, pytest.raises(httpx.ReadTimeout) as info:
        client.post(CHAT, json=BODY)
    assert "the caller's own timeout expired" in str(info.value)
    assert server.stats().requests.get(("POST", CHAT)) == 1


def test_first_byte_deadline_expiry_on_last_attempt_is_a_first_byte_timeout(server: LlamaServerEmulator) -> None:
    server.inject(Fault.HEADERS_NEVER, path=CHAT, hold=None, count=None)
    policy = GuardPolicy(first_byte_timeout=0.2, max_attempts=2, backoff=0.0, probe_timeout=0.2)
    client = httpx.Client(transport=GuardTransport(policy=policy), base_url=server.url)
    with client, pytest.raises(llama_guard.FirstByteTimeout) as info:
        client.post(CHAT, json=BODY)
    assert isinstance(info.value, httpx.ReadTimeout)
    assert info.value.attempts == 2
    assert "first_byte_timeout=0.2" in str(info.value.__cause__ or info.value)


def test_per_request_override(server: LlamaServerEmulator) -> None:
    """One request can carry its own deadline; a bad override is a clear error before anything is sent."""
    server.inject(Fault.HEADERS_NEVER, path=CHAT, hold=None)
    with httpx.Client(transport=GuardTransport(), base_url=server.url) as client:
        response = client.post(CHAT, json=BODY, extensions={"llama_guard": {"first_byte_timeout": 0.3}})
        assert response.extensions["llama_guard"].reconnects == 1
        with pytest.raises(ValueError, match=r"first_byte_timeout must be a number of seconds >= 0\.001"):
            client.post(CHAT, json=BODY, extensions={"llama_guard": {"first_byte_timeout": -1}})


# -- logs --------------------------------------------------------------------------------------------------------


def test_logs_carry_no_body_credentials_or_query(server: LlamaServerEmulator, caplog: pytest.LogCaptureFixture) -> None:
    """Recoveries are logged as warnings naming method, origin and path only."""
    caplog.set_level(logging.DEBUG, logger="llama_guard")
    server.inject(Fault.HEADERS_NEVER, path=CHAT, hold=0.0)  # an inference request: retried, so logged
    with httpx.Client(transport=GuardTransport(), base_url=server.url) as client:
        response = client.post(
            CHAT + "?api_key=QUERYSECRET",
            json={"messages": [{"role": "user", "content": "BODYSECRET"}]},
            headers={"Authorization": "Bearer AUTHSECRET", "Cookie": "session=COOKIESECRET"},
        )
    assert response.status_code == 200
    assert any(r.levelno == logging.WARNING and CHAT in r.getMessage() for r in caplog.records)
    for record in caplog.records:
        text = record.getMessage()
        for secret in ("QUERYSECRET", "BODYSECRET", "AUTHSECRET", "COOKIESECRET"):
            assert secret not in text


# -- the httpcore 1.x pool race --------------------------------------------------------------------------------


class _Connection:
    """A stand-in with httpcore's connection interface, to test the assignment rule itself."""

    def __init__(self, *, idle: bool, expired: bool) -> None:
        self._idle, self._expired = idle, expired

    def is_closed(self) -> bool:
        return False

    def has_expired(self) -> bool:
        return self._expired

    def is_idle(self) -> bool:
        return self._idle

    def is_available(self) -> bool:
        return self._idle

    def can_handle_request(self, origin: object) -> bool:
        return True


def test_pool_fix_never_closes_or_reassigns_a_reserved_connection() -> None:
    """httpcore 1.0.9 closes an idle connection that a request holds but has not used yet; the fix does not."""
    transport = httpx.HTTPTransport()
    pool = transport._pool
    reserved = _Connection(idle=True, expired=True)  # e.g. the server closed it after the pass assigned it
    holder = httpcore._sync.connection_pool.PoolRequest(httpcore.Request("GET", "http://a/"))
    holder.connection = reserved  # type: ignore[assignment]
    queued = httpcore._sync.connection_pool.PoolRequest(httpcore.Request("GET", "http://a/"))
    pool._requests = [holder, queued]
    pool._connections = [reserved]
    assert type(pool)._assign_requests_to_connections(pool) == [reserved]  # the bug, as shipped
    pool._requests = [holder, queued]
    pool._connections = [reserved]
    assert _assign_requests_to_connections(pool) == []
    assert queued.connection is not reserved
    assert fix_pool_race(transport) is True
    assert fix_pool_race(httpx.HTTPTransport(http2=True)) is False
    pool._requests, pool._connections = [], []
    transport.close()


def test_guard_lowers_the_keepalive_expiry_below_llama_servers() -> None:
    """httpx's default 5 s expiry equals llama-server's keep-alive timeout; wrapped pools expire at 4 s."""
    client = llama_guard.guard(httpx.Client())
    assert client._transport.transport._pool._keepalive_expiry == 4.0  # type: ignore[attr-defined]
    client.close()
    shorter = httpx.HTTPTransport(limits=httpx.Limits(keepalive_expiry=1.0))
    with GuardTransport(shorter):
        assert shorter._pool._keepalive_expiry == 1.0


# -- how the guard follows attempts: hooks on the pool's backend, or the trace extension ----------------------------


class Forwarding(httpx.BaseTransport):
    """A transport that wraps another one, as caching or instrumentation layers do: the guard cannot reach the
    pool inside, and follows its attempts through httpcore's trace extension instead."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("inner", ["pool", "wrapped", "backend-replaced"])
def test_new_connections_are_probed_and_failures_judged_either_way(server: LlamaServerEmulator, inner: str) -> None:
    """Both ways of following an attempt give the same protection: a new connection the server never reads is
    given up after its probe, and a dead pooled connection is retried at once without the request running twice."""
    policy = GuardPolicy(connection="reuse", probe_timeout=0.3)
    transport = GuardTransport(Forwarding() if inner == "wrapped" else None, policy=policy)
    pool = transport.transport._pool if inner != "wrapped" else None  # type: ignore[attr-defined]
    if inner == "backend-replaced":  # as a test harness or a benchmark may do after building the transport
        pool._network_backend = httpcore.SyncBackend()
    with httpx.Client(transport=transport, base_url=server.url) as client:
        server.inject(Fault.NEVER_ANSWER_ACCEPT, count=1, hold=5.0)
        stalled = client.post(CHAT, json=BODY)
        server.inject(Fault.HEADERS_NEVER, path=CHAT, count=1, hold=0.0)  # reads the request, closes unanswered
        dead = client.post(CHAT, json=BODY)
        stats = transport.stats.snapshot()
    assert stalled.status_code == dead.status_code == 200
    first, second = stalled.extensions["llama_guard"], dead.extensions["llama_guard"]
    assert (first.attempts, first.reconnects) == (2, 1)
    assert "ProbeTimeout on a new connection" in first.history[0]
    assert second.attempts == 2
    assert "on a reused connection (written)" in second.history[0]
    assert stats.probes_failed == 1
    seen = server.stats()
    assert seen.requests[("POST", CHAT)] == 3  # the dropped one was read (never run) and sent again
    assert seen.completions_started == 2
    if pool is not None:
        assert type(pool._network_backend).__name__ == "SyncGuardedBackend"


def test_a_new_connection_is_probed_once_and_its_hook_is_then_gone(server: LlamaServerEmulator) -> None:
    """The first request on a new connection carries the hooks (probe, progress); the connection then drops its
    hook, so later requests on it reach httpcore's own method and nothing of the guard runs per connection."""
    transport = GuardTransport(policy=REUSE)
    pool: Any = transport.transport._pool  # type: ignore[attr-defined]
    with httpx.Client(transport=transport, base_url=server.url) as client:
        answers = [client.post(CHAT, json=BODY) for _ in range(5)]
        (connection,) = pool._connections
        assert "handle_request" not in vars(connection)  # the one-time hook removed itself
        assert type(pool.create_connection).__name__ == "_SyncCreateConnection"
    assert [a.status_code for a in answers] == [200] * 5
    assert all(a.extensions["llama_guard"].attempts == 1 for a in answers)
    seen = server.stats()
    assert seen.requests[("GET", "/health")] == 1  # one probe for the one connection
    assert seen.requests[("POST", CHAT)] == 5
    assert transport.stats.snapshot().probes_sent == 1


def test_the_probe_never_waits_longer_than_the_callers_read_timeout(server: LlamaServerEmulator) -> None:
    """A caller with a 0.2 s read timeout is not kept 0.5 s per probe (the default probe deadline)."""
    server.inject(Fault.NEVER_ANSWER_ACCEPT, count=None, hold=5.0)
    policy = GuardPolicy(connection="reuse", max_attempts=2, backoff=0.0, probe_timeout=0.5)
    with (
        httpx.Client(
            transport=GuardTransport(policy=policy), base_url=server.url, timeout=httpx.Timeout(5, read=0.2)
        ) as client,
        pytest.raises(llama_guard.ProbeTimeout) as info,
    ):
        client.post(CHAT, json=BODY)
    assert all("within 0.2 s" in line for line in info.value.history)  # type: ignore[attr-defined]
