"""One scenario, three ways to run it: a sync client, an asyncio client, a trio client; with httpx or httpx2.

A test writes its scenario once as a coroutine over `Driver`; `run_scenario(flavor, ...)` runs it with a real
`httpx.Client` (blocking calls, the sync transport), or a real `httpx.AsyncClient` under asyncio or trio.
`make_driver(..., library="httpx2")` builds the httpx2 twins with `llama_guard.httpx2`'s transports. No part of
the network is mocked: drivers talk to the emulator on 127.0.0.1.

Also here: `run_bounded()` (a scenario under a hard deadline, so a hang fails the test instead of CI), and what
the fault and cancellation tests inspect afterwards: `pool_problems()` (connections a pool keeps in a state other
than idle-and-healthy or closed) and `ClientSockets` (this process's open sockets connected to a port).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import anyio
import httpx
import pytest

import llama_guard
from llama_guard.testing import async_burst_transport, burst_transport

FLAVORS = ("sync", "asyncio", "trio")
LIBRARIES = ("httpx", "httpx2")
#: httpx2 needs Python 3.11 or later: where it is missing its cases skip and say so, and httpx runs them all.
HAS_HTTPX2 = importlib.util.find_spec("httpx2") is not None
NO_HTTPX2 = pytest.mark.skip(
    reason="httpx2 is not installed (it needs Python 3.11+): pip install 'llama-guard[httpx2]'"
)


def on_every_client(cases: Sequence[tuple[str, Any]], flavors: tuple[str, ...] = FLAVORS) -> list[Any]:
    """``(case, flavor, library)`` parameters: every ``(id, case)`` on every client (flavour and library), ids
    ``"<id>-sync-httpx"``. All but one client per case are marked ``slow``: the fast core (``-m "not slow"``) runs
    each case once, on the clients in turn, so it still has every case and every client."""
    clients = [(flavor, name) for flavor in flavors for name in LIBRARIES]
    installed = [client for client in clients if client[1] != "httpx2" or HAS_HTTPX2]

    def marks(turn: int, client: tuple[str, str]) -> Any:
        if client not in installed:
            return NO_HTTPX2
        return () if client == installed[turn % len(installed)] else pytest.mark.slow

    return [
        pytest.param(case, flavor, name, id=f"{case_id}-{flavor}-{name}", marks=marks(turn, (flavor, name)))
        for turn, (case_id, case) in enumerate(cases)
        for flavor, name in clients
    ]


def library(name: str) -> ModuleType:
    """The client library: ``httpx`` or ``httpx2``."""
    if name == "httpx":
        return httpx
    if name == "httpx2":
        import httpx2

        return httpx2
    if name == "aiohttp":
        from ._aiohttp_driver import AIOHTTP_ERRORS

        return AIOHTTP_ERRORS  # type: ignore[return-value]
    if name == "requests":
        from ._requests_driver import REQUESTS_ERRORS

        return REQUESTS_ERRORS  # type: ignore[return-value]
    raise ValueError(f"unknown library {name!r}")


def guard_module(name: str) -> ModuleType:
    """The guard's flavour for a client library: ``llama_guard`` or ``llama_guard.httpx2``."""
    if name == "httpx":
        return llama_guard
    if name in ("httpx2", "aiohttp", "requests"):
        return importlib.import_module(f"llama_guard.{name}")
    raise ValueError(f"unknown library {name!r}")


@dataclass
class Outcome:
    """What a client saw for one request: a status and a complete body, or the error it raised."""

    status: int | None = None
    body: bytes = b""
    result: llama_guard.GuardResult | None = None
    error: BaseException | None = None
    first_byte: float = 0.0
    elapsed: float = 0.0  # until the body was read whole, or the error

    @property
    def ok(self) -> bool:
        return self.error is None and self.status is not None and self.status < 400


@dataclass
class Driver:
    """A client of one flavour, guarded or plain."""

    flavor: str
    guarded: bool
    client: Any  # httpx.Client | httpx.AsyncClient, or their httpx2 twins
    outcomes: list[Outcome] = field(default_factory=list)
    library: str = "httpx"

    @property
    def transport(self) -> Any:
        return self.client._transport

    @property
    def stats(self) -> llama_guard.StatsSnapshot:
        assert self.guarded
        return self.transport.stats.snapshot()

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
        """Send one request and read the whole body; record the outcome instead of raising network errors."""
        outcome = Outcome()
        started = time.monotonic()
        try:
            if self.flavor == "sync":
                request = self.client.build_request(method, url, json=json, content=content, extensions=extensions)
                response = self.client.send(request, stream=stream)
                outcome.first_byte = time.monotonic() - started
                try:
                    outcome.body = response.read()
                finally:
                    response.close()
            else:
                request = self.client.build_request(method, url, json=json, content=content, extensions=extensions)
                response = await self.client.send(request, stream=stream)
                outcome.first_byte = time.monotonic() - started
                try:
                    outcome.body = await response.aread()
                finally:
                    await response.aclose()
            outcome.status = response.status_code
            outcome.result = response.extensions.get("llama_guard")
        except library(self.library).HTTPError as exc:
            outcome.error = exc
        outcome.elapsed = time.monotonic() - started
        self.outcomes.append(outcome)
        return outcome

    @property
    def errors(self) -> list[BaseException]:
        return [o.error for o in self.outcomes if o.error is not None]


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # One context for every driver: building one (and loading the system's certificates into it) costs about
    # 0.1 s, per client, for clients that only ever speak plain HTTP to the emulator.
    return ssl.create_default_context()


def make_driver(
    flavor: str,
    *,
    guarded: bool,
    base_url: str,
    policy: llama_guard.GuardPolicy | None = None,
    limits: httpx.Limits | None = None,
    timeout: float = 10.0,
    preopened: list[socket.socket] | None = None,
    library: str = "httpx",
) -> Driver:
    """A client of one flavour; with ``preopened`` sockets, its first new connections are those (a burst).

    ``library="httpx2"`` builds an httpx2 client (guarded by `llama_guard.httpx2`); ``limits`` are then httpx2's
    (an `httpx.Limits` is converted) and ``preopened`` is not supported.
    """
    if library == "aiohttp":
        from ._aiohttp_driver import make_aiohttp_driver

        assert flavor == "asyncio", "the aiohttp flavour is asyncio only"
        limit = limits.max_connections if limits is not None and limits.max_connections else 4
        return make_aiohttp_driver(
            guarded=guarded, base_url=base_url, policy=policy, limit=limit, timeout=timeout, preopened=preopened
        )
    if library == "requests":
        from ._requests_driver import make_requests_driver

        assert flavor == "sync", "the requests flavour is sync only"
        maxsize = limits.max_connections if limits is not None and limits.max_connections else 4
        return make_requests_driver(
            guarded=guarded, base_url=base_url, policy=policy, maxsize=maxsize, timeout=timeout, preopened=preopened
        )
    if library != "httpx":
        return _make_other_driver(
            flavor, guarded=guarded, base_url=base_url, policy=policy, limits=limits, timeout=timeout, name=library
        )
    limits = limits or httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=4.0)
    client: httpx.Client | httpx.AsyncClient
    inner: Any
    if flavor == "sync":
        inner = (
            httpx.HTTPTransport(limits=limits, verify=_tls_context())
            if preopened is None
            else burst_transport(preopened, limits=limits)
        )
        transport = llama_guard.GuardTransport(inner, policy=policy) if guarded else inner
        client = httpx.Client(transport=transport, base_url=base_url, timeout=timeout)
    else:
        inner = (
            httpx.AsyncHTTPTransport(limits=limits, verify=_tls_context())
            if preopened is None
            else async_burst_transport(preopened, limits=limits)
        )
        transport = llama_guard.AsyncGuardTransport(inner, policy=policy) if guarded else inner
        client = httpx.AsyncClient(transport=transport, base_url=base_url, timeout=timeout)
    return Driver(flavor, guarded, client)


def _make_other_driver(
    flavor: str,
    *,
    guarded: bool,
    base_url: str,
    policy: llama_guard.GuardPolicy | None,
    limits: Any,
    timeout: float,
    name: str,
) -> Driver:
    lib, guards = library(name), guard_module(name)
    if limits is None:
        limits = lib.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=4.0)
    elif isinstance(limits, httpx.Limits):
        limits = lib.Limits(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
        )
    if flavor == "sync":
        inner = lib.HTTPTransport(limits=limits, verify=_tls_context())
        transport = guards.GuardTransport(inner, policy=policy) if guarded else inner
        client = lib.Client(transport=transport, base_url=base_url, timeout=timeout)
    else:
        inner = lib.AsyncHTTPTransport(limits=limits, verify=_tls_context())
        transport = guards.AsyncGuardTransport(inner, policy=policy) if guarded else inner
        client = lib.AsyncClient(transport=transport, base_url=base_url, timeout=timeout)
    return Driver(flavor, guarded, client, library=name)


async def close_driver(driver: Driver) -> None:
    if driver.flavor == "sync":
        driver.client.close()
    else:
        await driver.client.aclose()


def pool_of(driver: Driver) -> Any:
    """The httpcore (or httpcore2) connection pool under a driver's client, guarded or plain (for aiohttp: the
    session's connector)."""
    if driver.library == "aiohttp":
        from ._aiohttp_driver import aiohttp_connector

        return aiohttp_connector(driver)
    transport = driver.client._transport
    if driver.guarded:
        transport = transport.transport
    return transport._pool


def pool_problems(driver: Driver) -> list[str]:
    """What the pool keeps in a state other than "closed" or "idle and healthy": connections still active (a
    response nobody will finish), idle ones that are readable (a stray byte or an end of file waiting), and
    requests still registered. Empty when the pool is sound."""
    if driver.library == "aiohttp":
        from ._aiohttp_driver import aiohttp_pool_problems

        return aiohttp_pool_problems(driver)
    if driver.library == "requests":
        from ._requests_driver import requests_pool_problems

        return requests_pool_problems(driver)
    pool = pool_of(driver)
    problems = [f"request still in the pool: {request!r}" for request in list(pool._requests)]
    for connection in list(pool.connections):
        if connection.is_closed():
            continue
        if not connection.is_idle():
            problems.append(f"not idle: {connection!r}")
        elif connection.has_expired():
            problems.append(f"idle, but expired or readable: {connection!r}")
    return problems


def pool_requests(driver: Driver) -> int:
    """Requests the pool holds: those on a connection and those queued for one."""
    if driver.library == "aiohttp":
        from ._aiohttp_driver import aiohttp_pool_requests

        return aiohttp_pool_requests(driver)
    if driver.library == "requests":
        from ._requests_driver import requests_pool_requests

        return requests_pool_requests(driver)
    return len(pool_of(driver)._requests)


def open_connections(driver: Driver) -> list[Any]:
    """The pool's connections that are not closed."""
    if driver.library == "aiohttp":
        from ._aiohttp_driver import aiohttp_open_connections

        return aiohttp_open_connections(driver)
    if driver.library == "requests":
        from ._requests_driver import requests_open_connections

        return requests_open_connections(driver)
    return [c for c in pool_of(driver).connections if not c.is_closed()]


_TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2", "06": "TIME_WAIT",
    "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}  # fmt: skip


def _tcp_table() -> dict[str, tuple[int, int, str]]:
    """Socket inode -> (local port, remote port, TCP state), for every TCP socket of the machine (Linux /proc)."""
    table: dict[str, tuple[int, int, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                    table[inode] = (
                        int(local.rsplit(":", 1)[1], 16),
                        int(remote.rsplit(":", 1)[1], 16),
                        _TCP_STATES.get(state, state),
                    )
        except FileNotFoundError:
            continue
    return table


def _client_ends(port: int) -> list[tuple[int, int, str, str]]:
    """(descriptor, local port, TCP state, socket inode) of this process's TCP sockets connected to ``port``."""
    table = _tcp_table()
    ends = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor, among others)
            continue
        if target.startswith("socket:["):
            inode = target[8:-1]
            entry = table.get(inode)
            if entry is not None and entry[1] == port:
                ends.append((int(fd), entry[0], entry[2], inode))
    return ends


class ClientSockets:
    """This process's open TCP sockets connected to ``port`` (client ends of connections to the emulator; the
    emulator's own ends have ``port`` as their local port), less those already connected to it when this view was
    made. Make it when the test's server has started, before any client: the system reuses port numbers, and a
    socket an earlier test left open may still be connected to an earlier server that had the same port; it is not
    this test's (seen once in 1,484 tests: 5 sockets where the server had accepted 4; litellm's cached aiohttp
    clients in tests/real/test_real_litellm.py, which now closes them, had left 3 to 6 such sockets)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.earlier = frozenset(inode for *_, inode in _client_ends(port))

    def _ends(self) -> list[tuple[int, int, str, str]]:
        return [end for end in _client_ends(self.port) if end[3] not in self.earlier]

    def count(self) -> int:
        return len(self._ends())

    def describe(self) -> str:
        """Descriptor, local port and TCP state of each, for a failure message (and how many earlier ones)."""
        ends = ", ".join(f"fd {fd} from port {local} {state}" for fd, local, state, _ in self._ends()) or "none"
        return f"{ends} ({len(self.earlier)} connected before the test's server started, not counted)"


def episode_log(caplog: pytest.LogCaptureFixture, port: int, pattern: str) -> tuple[re.Match[str], list[str]]:
    """The stall log's one WARNING line for ``http://127.0.0.1:{port}``, matched in full against ``pattern`` (whose
    ``{origin}`` stands for the escaped origin), and the DEBUG lines about that origin (one per connection)."""
    origin = f"http://127.0.0.1:{port}"
    ours = [r for r in caplog.records if r.name == "llama_guard" and origin in r.getMessage()]
    warnings = [r.getMessage() for r in ours if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    said = re.fullmatch(pattern.replace("{origin}", re.escape(origin)), warnings[0])
    assert said is not None, warnings[0]
    return said, [r.getMessage() for r in ours if r.levelno == logging.DEBUG]


def open_fds() -> int:
    """This process's open file descriptors."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own


async def wait_until(predicate: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.01) -> None:
    """Poll ``predicate`` (on the running event loop, or blocking for a sync scenario) until true; AssertionError
    naming ``what`` when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await anyio.sleep(interval)


def run_scenario(flavor: str, scenario: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run ``scenario(*args)`` under the event loop the flavour needs (sync drivers run under asyncio, blocking)."""
    backend = "trio" if flavor == "trio" else "asyncio"
    return anyio.run(scenario, *args, backend=backend)


class Hang(AssertionError):
    """A scenario that did not finish within its hard deadline."""


def run_bounded(
    flavor: str,
    scenario: Callable[..., Awaitable[Any]],
    *args: Any,
    deadline: float,
    on_hang: Callable[[], None] | None = None,
) -> Any:
    """`run_scenario` in a thread under a hard deadline: a scenario still running after ``deadline`` seconds fails
    with `Hang` instead of hanging the test run. ``on_hang`` (typically: stop the emulator, which unblocks every
    socket) runs first so that the thread can unwind."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = run_scenario(flavor, scenario, *args)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"scenario-{flavor}", daemon=True)
    thread.start()
    thread.join(deadline)
    if thread.is_alive():
        if on_hang is not None:
            on_hang()
        thread.join(10.0)
        raise Hang(f"the {flavor} scenario did not finish within {deadline:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


async def gather(flavor: str, jobs: list[Callable[[], Awaitable[Any]]]) -> None:
    """Run jobs concurrently: threads for sync drivers (their calls block), tasks for async ones."""
    if flavor == "sync":
        limiter = anyio.CapacityLimiter(max(len(jobs), 1))
        async with anyio.create_task_group() as group:
            for job in jobs:
                group.start_soon(_in_thread, _blocking(job), limiter)
    else:
        async with anyio.create_task_group() as group:
            for job in jobs:
                group.start_soon(job)


async def each_asks_then_close(
    flavor: str, drivers: Sequence[Driver], path: str, body: dict[str, Any], *, times: int = 1
) -> None:
    """Every driver POSTs ``body`` to ``path`` ``times`` times, one after the other, all drivers at once; then
    every driver is closed, whatever happened (each driver keeps its own outcomes)."""

    def job(driver: Driver) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            for _ in range(times):
                await driver.request("POST", path, json=body)

        return run

    try:
        await gather(flavor, [job(d) for d in drivers])
    finally:
        for driver in drivers:
            await close_driver(driver)


async def _in_thread(function: Callable[[], Any], limiter: anyio.CapacityLimiter) -> None:
    await anyio.to_thread.run_sync(function, limiter=limiter)


def _blocking(job: Callable[[], Awaitable[Any]]) -> Callable[[], Any]:
    def run() -> Any:
        # A sync driver's coroutine never awaits anything real: drive it to completion in this thread.
        coroutine = job()
        try:
            coroutine.send(None)
        except StopIteration as stop:
            return stop.value
        raise RuntimeError("a sync driver's job awaited something; it must only block")

    return run
