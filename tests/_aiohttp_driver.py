"""The aiohttp flavour of `tests/_drivers.py`: a `Driver` whose client is an aiohttp session (asyncio only).

`make_aiohttp_driver()` builds a plain `aiohttp.ClientSession` or a guarded one (`llama_guard.aiohttp`); its
``client`` is a thin adapter with the few httpx-like calls the shared scenarios make (``post``, ``stream``,
``aclose``), so the fault matrix and the cancellation tests run their own cases unchanged. The error names those
cases expect (httpx's) map to the aiohttp classes that stand for them in `AIOHTTP_ERRORS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import socket
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp

import llama_guard
import llama_guard.aiohttp as guard_aiohttp

from ._drivers import Driver, Outcome

#: httpx's error names, as the shared cases write them, and the aiohttp classes that stand for each.
AIOHTTP_ERRORS = SimpleNamespace(
    HTTPError=(aiohttp.ClientError, asyncio.TimeoutError),
    ConnectError=aiohttp.ClientConnectorError,
    ReadError=(aiohttp.ClientPayloadError, aiohttp.ClientOSError, aiohttp.ServerDisconnectedError),
    # aiohttp reports a response that is not HTTP as a ClientResponseError (400, "Bad status line"), and a body
    # cut short as a ClientPayloadError (or a disconnect before the end).
    RemoteProtocolError=(aiohttp.ClientResponseError, aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError),
    ReadTimeout=(aiohttp.SocketTimeoutError,),
)


class HttpxLikeSession:
    """The aiohttp session under a driver, with the httpx calls the shared scenarios make."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def post(self, url: str, *, json: Any = None) -> SimpleNamespace:
        async with self.session.post(url, json=json) as response:
            body = await response.read()
        return SimpleNamespace(status_code=response.status, json=lambda: jsonlib.loads(body))

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, *, json: Any = None) -> AsyncIterator[Any]:
        async with self.session.request(method, url, json=json) as response:
            yield SimpleNamespace(status_code=response.status, aiter_bytes=response.content.iter_any)

    async def aclose(self) -> None:
        await self.session.close()


class AiohttpDriver(Driver):
    @property
    def stats(self) -> llama_guard.StatsSnapshot:
        assert self.guarded
        guard = guard_aiohttp.guard_of(self.client.session)
        assert guard is not None
        return guard.stats.snapshot()

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
        outcome = Outcome()
        started = time.monotonic()
        options = (extensions or {}).get("llama_guard")
        scope = guard_aiohttp.request_options(**options) if options else contextlib.nullcontext()
        try:
            with scope:
                response = await self.client.session.request(method, url, json=json, data=content)
            outcome.first_byte = time.monotonic() - started
            try:
                outcome.body = await response.read()
            finally:
                response.release()
            outcome.status = response.status
            outcome.result = guard_aiohttp.guard_result(response)
        except AIOHTTP_ERRORS.HTTPError as exc:
            outcome.error = exc
        outcome.elapsed = time.monotonic() - started
        self.outcomes.append(outcome)
        return outcome


def make_aiohttp_driver(
    *,
    guarded: bool,
    base_url: str,
    policy: llama_guard.GuardPolicy | None = None,
    limit: int = 4,
    timeout: float = 10.0,
    preopened: list[socket.socket] | None = None,
) -> AiohttpDriver:
    """A plain or guarded aiohttp session (call from a running event loop); ``preopened``: connected sockets that
    its first new connections are made of (a burst, see `llama_guard.testing.open_burst`)."""
    client_timeout = aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout)
    base = guard_aiohttp.GuardConnector if guarded else aiohttp.TCPConnector
    connector_class = base if preopened is None else _preopened_connector(base)
    connector = connector_class(limit=limit, limit_per_host=limit, keepalive_timeout=4.0)
    if preopened is not None:
        connector.preopened = list(preopened)  # type: ignore[attr-defined]
    if guarded:
        session = guard_aiohttp.guarded_session(base_url, policy=policy, connector=connector, timeout=client_timeout)
    else:
        session = aiohttp.ClientSession(base_url, connector=connector, timeout=client_timeout)
    return AiohttpDriver("asyncio", guarded, HttpxLikeSession(session), library="aiohttp")


def _preopened_connector(base: type[aiohttp.TCPConnector]) -> type[aiohttp.TCPConnector]:
    class PreopenedConnector(base):  # type: ignore[misc, valid-type]
        """Makes its new connections of pre-opened sockets, while it has any (test-only: aiohttp's private
        ``_wrap_create_connection``, the step that connects a socket)."""

        preopened: list[socket.socket]

        async def _wrap_create_connection(self, *args: Any, **kwargs: Any) -> Any:
            if not self.preopened:
                return await super()._wrap_create_connection(*args, **kwargs)
            sock = self.preopened.pop(0)
            for name in ("addr_infos", "req", "timeout", "client_error"):
                kwargs.pop(name, None)
            return await asyncio.get_running_loop().create_connection(*args, **kwargs, sock=sock)

    return PreopenedConnector


def aiohttp_connector(driver: Driver) -> aiohttp.BaseConnector:
    connector = driver.client.session.connector
    assert connector is not None
    return connector


def aiohttp_pool_problems(driver: Driver) -> list[str]:
    """`pool_problems` for an aiohttp connector: connections in use, idle ones that are not healthy, and requests
    queued for a connection."""
    connector: Any = aiohttp_connector(driver)
    problems = [f"connection in use: {proto!r}" for proto in list(connector._acquired)]
    for key, idle in list(connector._conns.items()):
        for proto, _ in list(idle):
            if proto.is_connected() and proto.should_close:
                problems.append(f"idle, but not reusable: {key}")
    problems += [f"request queued for {key}" for key, waiters in connector._waiters.items() if waiters]
    return problems


def aiohttp_pool_requests(driver: Driver) -> int:
    """Requests holding or waiting for one of the connector's connections."""
    connector: Any = aiohttp_connector(driver)
    return len(connector._acquired) + sum(len(waiters) for waiters in connector._waiters.values())


def aiohttp_open_connections(driver: Driver) -> list[Any]:
    connector: Any = aiohttp_connector(driver)
    idle = [proto for conns in connector._conns.values() for proto, _ in conns if proto.is_connected()]
    return [*connector._acquired, *idle]
