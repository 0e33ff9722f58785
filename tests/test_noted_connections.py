"""Every driver makes a connection machine only where the core says one is needed
(`RequestPlan.needs_connection_machine`), and a request machine only when its first attempt needs one.

Under the close strategy (the default on loopback) a new connection has nothing to probe and nothing to measure: each
driver only notes it (`RequestPlan.opening`, `opened`), so that a failure can still be judged by how far the attempt
got, and makes no machine. Under keep-alive (``"reuse"``) the same request's new connection is probed by its machine:
the control that the count below sees machines at all. Real loopback sockets, the emulator counting connections.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy
from llama_guard._core import connection_machine, guard
from llama_guard.testing import Fault, LlamaServerEmulator

CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REQUESTS = 4


def httpx_sync(url: str, policy: GuardPolicy) -> list[Any]:
    with httpx.Client(transport=llama_guard.GuardTransport(policy=policy)) as client:
        return [llama_guard.result_of(client.post(f"{url}/v1/chat/completions", json=CHAT)) for _ in range(REQUESTS)]


def httpx_async(url: str, policy: GuardPolicy) -> list[Any]:
    async def run() -> list[Any]:
        async with httpx.AsyncClient(transport=llama_guard.AsyncGuardTransport(policy=policy)) as client:
            return [
                llama_guard.result_of(await client.post(f"{url}/v1/chat/completions", json=CHAT))
                for _ in range(REQUESTS)
            ]

    return asyncio.run(run())


def aiohttp_session(url: str, policy: GuardPolicy) -> list[Any]:
    pytest.importorskip("aiohttp")
    from llama_guard.aiohttp import guarded_session

    async def run() -> list[Any]:
        results = []
        async with guarded_session(policy=policy) as session:
            for _ in range(REQUESTS):
                async with session.post(f"{url}/v1/chat/completions", json=CHAT) as response:
                    await response.read()
                    results.append(llama_guard.result_of(response))
        return results

    return asyncio.run(run())


def requests_session(url: str, policy: GuardPolicy) -> list[Any]:
    requests = pytest.importorskip("requests")
    from llama_guard.requests import GuardAdapter

    with requests.Session() as session:
        session.mount("http://", GuardAdapter(policy=policy))
        return [llama_guard.result_of(session.post(f"{url}/v1/chat/completions", json=CHAT)) for _ in range(REQUESTS)]


DRIVERS: dict[str, Callable[[str, GuardPolicy], list[Any]]] = {
    "httpx sync": httpx_sync,
    "httpx asyncio": httpx_async,
    "aiohttp": aiohttp_session,
    "requests": requests_session,
}


def instances_made(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """Every instance of ``module.name`` (a class the guard makes through its module) made from now on."""
    made: list[Any] = []
    base: Any = getattr(module, name)

    class Counted(base):  # type: ignore[misc]
        __slots__ = ()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(module, name, Counted)
    return made


@pytest.fixture
def machines_made(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every `ConnectionMachine` a driver makes from now on (each driver makes them through the module)."""
    return instances_made(monkeypatch, connection_machine, "ConnectionMachine")


@pytest.mark.parametrize("driver", list(DRIVERS))
@pytest.mark.parametrize("strategy", ["close", "reuse"])
def test_a_new_connection_gets_a_machine_only_when_it_is_probed(
    driver: str, strategy: str, machines_made: list[Any]
) -> None:
    with LlamaServerEmulator(pool_bug=False) as server:
        results = DRIVERS[driver](server.url, GuardPolicy(connection=strategy))  # type: ignore[arg-type]
        accepted = server.stats().connections_accepted
    assert [(result.attempts, result.connection) for result in results] == [(1, strategy)] * REQUESTS
    if strategy == "close":
        assert accepted == REQUESTS  # a new connection for every request ...
        assert machines_made == []  # ... each only noted
    else:
        assert accepted == 1  # one kept-alive connection ...
        assert len(machines_made) == 1  # ... probed by its machine
        assert all(machine.done for machine in machines_made)


@pytest.fixture
def request_machines_made(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every `RequestMachine` a plan makes from now on (only `RequestPlan.start` and `machine` make them)."""
    return instances_made(monkeypatch, guard, "RequestMachine")


@pytest.mark.parametrize("driver", list(DRIVERS))
def test_a_probed_new_connection_makes_no_request_machine_until_an_attempt_needs_one(
    driver: str, machines_made: list[Any], request_machines_made: list[Any]
) -> None:
    """Under keep-alive a request's first attempt on a new connection is probed by the connection's machine, which
    reports to the request's plan: answered, the request never gets a machine of its own. A 503 to a first attempt
    makes one, which retries it: the control that the count sees machines."""
    policy = GuardPolicy(connection="reuse")
    with LlamaServerEmulator(pool_bug=False) as server:
        answered = DRIVERS[driver](server.url, policy)
        assert [(result.attempts, result.connection) for result in answered] == [(1, "reuse")] * REQUESTS
        assert len(machines_made) == 1  # the one new connection, probed by its machine ...
        assert request_machines_made == []  # ... and no request needed one
        server.inject(Fault.STATUS_503, path="/v1/chat/completions", count=1)
        retried = DRIVERS[driver](server.url, policy)
    assert [(result.attempts, result.connection) for result in retried] == [(2, "reuse")] + [(1, "reuse")] * (
        REQUESTS - 1
    )
    assert len(request_machines_made) == 1  # the 503's request, retried by its machine
