"""Which of the guard's files one guarded request passes through, traced at run time (issue 23's "files crossed").

A fresh guarded client sends one chat completion to the emulator, so its connection is new; every call into a
``llama_guard`` module (the emulator left out) is recorded in order. Prints, per stack and connection strategy, the
distinct files and the number of crossings (a call into a file other than the previous call's); for sync httpx, the
same for a client's second connection (its origin's account, strategy and route set up by a first request); and the
same first request through the other drivers, requests (a mounted ``GuardAdapter``) and aiohttp
(``llama_guard.aiohttp.guarded_session``), when those are installed::

    python scripts/files_crossed.py
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from types import FrameType
from typing import Any, Literal

import httpx

import llama_guard
from llama_guard.testing import LlamaServerEmulator

Strategy = Literal["close", "reuse"]
ROOT = os.path.dirname(llama_guard.__file__)
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Crossings:
    """The guard's files entered while installed as the profiler, in order, repeats in a row folded; and which of
    them called on into another of the guard's files (the path) rather than only returning (leaf helpers: pure
    functions, counters)."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.callers: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        name = _guard_file(frame)
        if event != "call" or name is None:
            return
        if not self.files or self.files[-1] != name:
            self.files.append(name)
        caller = frame.f_back
        while caller is not None and _guard_file(caller) is None:
            caller = caller.f_back
        caller_name = None if caller is None else _guard_file(caller)
        if caller_name is not None and caller_name != name:
            self.callers.add(caller_name)

    def __enter__(self) -> Crossings:
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def line(self, label: str) -> str:
        distinct = sorted(set(self.files))
        path = [name for name in distinct if name in self.callers]
        leaves = [name for name in distinct if name not in self.callers]
        return (
            f"{label}: {len(distinct)} files, {len(self.files)} crossings; {len(path)} on the path: "
            f"{', '.join(path)}; {len(leaves)} leaf helpers: {', '.join(leaves)}"
        )


def _guard_file(frame: FrameType) -> str | None:
    path = frame.f_code.co_filename
    if not path.startswith(ROOT) or f"{os.sep}testing{os.sep}" in path:
        return None
    return os.path.relpath(path, ROOT)


def sync_request(url: str, connection: Strategy) -> Crossings:
    policy = llama_guard.GuardPolicy(connection=connection)
    with httpx.Client(transport=llama_guard.GuardTransport(policy=policy)) as warm:
        warm.get(f"{url}/health")  # first-time imports and set-up out of the way
    with httpx.Client(transport=llama_guard.GuardTransport(policy=policy)) as client:
        return traced_chat(client, url)


def traced_chat(client: Any, url: str) -> Crossings:
    """One chat completion through ``client`` (an `httpx.Client` or a `requests.Session`), its calls into the guard
    recorded."""
    with Crossings() as crossings:
        client.post(f"{url}/v1/chat/completions", json=CHAT)
    return crossings


def sync_second_connection(url: str, connection: Strategy) -> Crossings:
    """A client that has asked once already (its origin's account, strategy and route set up) opens a new
    connection for its next request: the path every new connection after the first takes."""
    policy = llama_guard.GuardPolicy(connection=connection)
    no_idle = httpx.Limits(max_keepalive_connections=0)  # each request on a connection of its own
    transport = llama_guard.GuardTransport(httpx.HTTPTransport(limits=no_idle), policy=policy)
    with httpx.Client(transport=transport) as client:
        client.post(f"{url}/v1/chat/completions", json=CHAT)
        return traced_chat(client, url)


async def async_request(url: str, connection: Strategy) -> Crossings:
    policy = llama_guard.GuardPolicy(connection=connection)
    async with httpx.AsyncClient(transport=llama_guard.AsyncGuardTransport(policy=policy)) as warm:
        await warm.get(f"{url}/health")
    async with httpx.AsyncClient(transport=llama_guard.AsyncGuardTransport(policy=policy)) as client:
        with Crossings() as crossings:
            await client.post(f"{url}/v1/chat/completions", json=CHAT)
    return crossings


def requests_request(url: str, connection: Strategy) -> Crossings:
    import requests

    from llama_guard.requests import GuardAdapter

    def session() -> requests.Session:
        made = requests.Session()
        made.mount("http://", GuardAdapter(policy=llama_guard.GuardPolicy(connection=connection)))
        return made

    with session() as warm:
        warm.get(f"{url}/health")
    with session() as client:
        return traced_chat(client, url)


async def aiohttp_request(url: str, connection: Strategy) -> Crossings:
    from llama_guard.aiohttp import guarded_session

    policy = llama_guard.GuardPolicy(connection=connection)
    async with guarded_session(policy=policy) as warm, warm.get(f"{url}/health") as response:
        await response.read()
    async with guarded_session(policy=policy) as client:
        with Crossings() as crossings:
            async with client.post(f"{url}/v1/chat/completions", json=CHAT) as response:
                await response.read()
    return crossings


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def main() -> int:
    with LlamaServerEmulator(pool_bug=False) as server:
        strategies: tuple[Strategy, ...] = ("reuse", "close")
        for connection in strategies:
            print(sync_request(server.url, connection).line(f"httpx sync, {connection}"))
            print(asyncio.run(async_request(server.url, connection)).line(f"httpx asyncio, {connection}"))
            print(sync_second_connection(server.url, connection).line(f"httpx sync, {connection}, second connection"))
            if _installed("requests"):
                print(requests_request(server.url, connection).line(f"requests, {connection}"))
            if _installed("aiohttp"):
                print(asyncio.run(aiohttp_request(server.url, connection)).line(f"aiohttp, {connection}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
