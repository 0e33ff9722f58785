"""The requests flavour of `tests/_drivers.py`: a `Driver` whose client is a `requests.Session` (blocking, "sync").

`make_requests_driver()` builds a plain session (requests' own ``HTTPAdapter``) or a guarded one (a mounted
`llama_guard.requests.GuardAdapter`); its ``client`` is a thin wrapper with the few calls the shared scenarios make
(``close``). The error names the shared cases expect (httpx's) map to the requests classes that stand for them in
`REQUESTS_ERRORS`: requests reports a connection lost before the headers as a ``ConnectionError``, one lost in the
body as a ``ChunkedEncodingError``, and a read timeout in the body as a ``ConnectionError`` (its own choice).
"""

from __future__ import annotations

import contextlib
import socket
from types import SimpleNamespace
from typing import Any

import requests
import requests.adapters
from urllib3.connection import HTTPConnection
from urllib3.connectionpool import HTTPConnectionPool
from urllib3.util.wait import wait_for_read

import llama_guard
import llama_guard.requests as guard_requests

from ._drivers import Driver, Outcome

#: httpx's error names, as the shared cases write them, and the requests classes that stand for each.
REQUESTS_ERRORS = SimpleNamespace(
    HTTPError=requests.RequestException,
    ConnectError=requests.ConnectionError,
    ReadError=(requests.ConnectionError, requests.exceptions.ChunkedEncodingError),
    RemoteProtocolError=(requests.ConnectionError, requests.exceptions.ChunkedEncodingError),
    # A read timeout while waiting for the headers is requests' ReadTimeout; in the body, requests raises a plain
    # ConnectionError (wrapping urllib3's ReadTimeoutError).
    ReadTimeout=(requests.ReadTimeout, requests.ConnectionError),
)


class SessionClient:
    """A session and its base URL."""

    def __init__(self, session: requests.Session, base_url: str, adapter: requests.adapters.HTTPAdapter) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.adapter = adapter

    def close(self) -> None:
        # urllib3 2.8's PoolManager.clear() (what Session.close() calls) drops its pools without closing them: their
        # idle connections close when garbage collected. Closed here, for the test's count of open sockets.
        for pool in _pools_of(self.adapter):
            pool.close()
        self.session.close()


class RequestsDriver(Driver):
    timeout: float = 10.0

    @property
    def stats(self) -> llama_guard.StatsSnapshot:
        assert self.guarded
        return llama_guard.stats_of(self.client.session).snapshot()

    async def request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        content: Any = None,
        stream: bool = False,
        extensions: dict[str, Any] | None = None,
    ) -> Outcome:
        import time

        outcome = Outcome()
        started = time.monotonic()
        options = (extensions or {}).get("llama_guard")
        scope = guard_requests.request_options(**options) if options else contextlib.nullcontext()
        client: SessionClient = self.client
        try:
            with scope:
                response = client.session.request(
                    method, client.base_url + url, json=json, data=content, stream=True, timeout=self.timeout
                )
            outcome.first_byte = time.monotonic() - started
            try:
                outcome.body = response.content
            finally:
                response.close()
            outcome.status = response.status_code
            outcome.result = guard_requests.result_of(response)
        except requests.RequestException as exc:
            outcome.error = exc
        outcome.elapsed = time.monotonic() - started
        self.outcomes.append(outcome)
        return outcome


def make_requests_driver(
    *,
    guarded: bool,
    base_url: str,
    policy: llama_guard.GuardPolicy | None = None,
    maxsize: int = 4,
    timeout: float = 10.0,
    preopened: list[socket.socket] | None = None,
) -> RequestsDriver:
    """A plain or guarded `requests.Session` whose pools keep up to ``maxsize`` connections per origin; with
    ``preopened`` sockets, its first new connections are those (a burst, see `llama_guard.testing.open_burst`)."""
    session = requests.Session()
    adapter: requests.adapters.HTTPAdapter
    if guarded:
        adapter = guard_requests.GuardAdapter(pool_connections=4, pool_maxsize=maxsize, policy=policy)
    else:
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=maxsize)
    if preopened is not None:
        adapter.poolmanager.pool_classes_by_scheme = {
            **adapter.poolmanager.pool_classes_by_scheme,
            "http": _preopened_pool(list(preopened)),
        }
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    driver = RequestsDriver("sync", guarded, SessionClient(session, base_url, adapter), library="requests")
    driver.timeout = timeout
    return driver


def _preopened_pool(sockets: list[socket.socket]) -> type[HTTPConnectionPool]:
    """A pool class whose new connections are made of ``sockets`` while it has any (test-only: urllib3's
    ``HTTPConnection._new_conn``, the step that connects a socket)."""

    class PreopenedConnection(HTTPConnection):
        def _new_conn(self) -> socket.socket:
            if not sockets:
                return super()._new_conn()
            sock = sockets.pop(0)
            sock.settimeout(self.timeout if isinstance(self.timeout, (int, float)) else None)
            return sock

    class PreopenedPool(HTTPConnectionPool):
        ConnectionCls = PreopenedConnection

    return PreopenedPool


def _pools_of(adapter: requests.adapters.HTTPAdapter) -> list[Any]:
    manager = adapter.poolmanager
    return [manager.pools[key] for key in list(manager.pools.keys())]


def _pools(driver: Driver) -> list[Any]:
    return _pools_of(driver.client.adapter)


def requests_pool_problems(driver: Driver) -> list[str]:
    """`pool_problems` for a session's urllib3 pools: connections still checked out (a response nobody will
    finish), and idle ones that are readable (a stray byte or an end of file waiting)."""
    problems = []
    for pool in _pools(driver):
        queue = pool.pool
        if queue is None:
            continue
        in_use = pool.pool.maxsize - queue.qsize()
        if in_use:
            problems.append(f"{in_use} connection(s) checked out of {pool}")
        for conn in list(queue.queue):
            sock = getattr(conn, "sock", None) if conn is not None else None
            if sock is not None and wait_for_read(sock, timeout=0.0):
                problems.append(f"idle, but readable: {conn!r}")
    return problems


def requests_pool_requests(driver: Driver) -> int:
    return sum(pool.pool.maxsize - pool.pool.qsize() for pool in _pools(driver) if pool.pool is not None)


def requests_open_connections(driver: Driver) -> list[Any]:
    return [
        conn
        for pool in _pools(driver)
        if pool.pool is not None
        for conn in list(pool.pool.queue)
        if conn is not None and conn.sock is not None
    ]
