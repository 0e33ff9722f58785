"""One scenario, three ways to run it: a sync client, an asyncio client, a trio client.

A test writes its scenario once as a coroutine over `Driver`; `run_scenario(flavor, ...)` runs it with a real
`httpx.Client` (blocking calls, the sync transport), or a real `httpx.AsyncClient` under asyncio or trio. No
part of the network is mocked: drivers talk to the emulator on 127.0.0.1.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

import llama_guard
from llama_guard.testing import async_burst_transport, burst_transport

FLAVORS = ("sync", "asyncio", "trio")


@dataclass
class Outcome:
    """What a client saw for one request: a status and a complete body, or the error it raised."""

    status: int | None = None
    body: bytes = b""
    result: llama_guard.GuardResult | None = None
    error: BaseException | None = None
    first_byte: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.status is not None and self.status < 400


@dataclass
class Driver:
    """A client of one flavour, guarded or plain."""

    flavor: str
    guarded: bool
    client: httpx.Client | httpx.AsyncClient
    outcomes: list[Outcome] = field(default_factory=list)

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
            if isinstance(self.client, httpx.Client):
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
        except httpx.HTTPError as exc:
            outcome.error = exc
        self.outcomes.append(outcome)
        return outcome

    @property
    def errors(self) -> list[BaseException]:
        return [o.error for o in self.outcomes if o.error is not None]


def make_driver(
    flavor: str,
    *,
    guarded: bool,
    base_url: str,
    policy: llama_guard.GuardPolicy | None = None,
    limits: httpx.Limits | None = None,
    timeout: float = 10.0,
    preopened: list[socket.socket] | None = None,
) -> Driver:
    """A client of one flavour; with ``preopened`` sockets, its first new connections are those (a burst)."""
    limits = limits or httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=4.0)
    client: httpx.Client | httpx.AsyncClient
    inner: Any
    if flavor == "sync":
        inner = httpx.HTTPTransport(limits=limits) if preopened is None else burst_transport(preopened, limits=limits)
        transport = llama_guard.GuardTransport(inner, policy=policy) if guarded else inner
        client = httpx.Client(transport=transport, base_url=base_url, timeout=timeout)
    else:
        inner = (
            httpx.AsyncHTTPTransport(limits=limits)
            if preopened is None
            else async_burst_transport(preopened, limits=limits)
        )
        transport = llama_guard.AsyncGuardTransport(inner, policy=policy) if guarded else inner
        client = httpx.AsyncClient(transport=transport, base_url=base_url, timeout=timeout)
    return Driver(flavor, guarded, client)


async def close_driver(driver: Driver) -> None:
    if isinstance(driver.client, httpx.Client):
        driver.client.close()
    else:
        await driver.client.aclose()


def run_scenario(flavor: str, scenario: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run ``scenario(*args)`` under the event loop the flavour needs (sync drivers run under asyncio, blocking)."""
    backend = "trio" if flavor == "trio" else "asyncio"
    return anyio.run(scenario, *args, backend=backend)


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
