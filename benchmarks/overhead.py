"""What the guard costs per request: guard vs a bare httpx transport vs httpx-retries' `RetryTransport`.

A local keep-alive HTTP server in its own process (``_keepalive_server.py``, identifies as ``Server: llama.cpp``)
answers every request at once with a small JSON body, so the client's own cost is what is measured. Each client
kind (sync ``httpx.Client``, asyncio ``httpx.AsyncClient``) sends non-streamed ``POST /v1/chat/completions`` with a
small JSON body over one keep-alive connection, one request after the other.

Timings: the variants run in many short interleaved blocks (``--block`` requests each, ``--blocks`` of them, the
order rotating ABCD, BCDA, ...) after a warm-up. Each ratio is the median of the per-block ratios (both sides from
the same turn of the rotation, so a slow moment of the machine hits both alike), with a 95% confidence interval
for that median. A second bare client ("bare, control") is measured like the others: its ratio to bare shows what
the noise alone does to a ratio in the same run. On these shared machines a block's ratio varies by 10 to 20%; the
many blocks are what make the median precise to about 1%.

The guard ("guard") is the default policy with the keep-alive strategy forced (``connection="reuse"``: probe on,
stream close on, no first-byte deadline): the server is on loopback, where the default closes every connection, and
that is measured apart: "guard close" (the default) against "bare close" (a bare client sending ``Connection:
close``), a new connection per request on both sides. httpx-retries is configured
to retry POST too (3 retries, 0.05 s backoff), as the guard retries llama-server's inference endpoints; with its
default configuration it would not retry POST at all and would cost nothing to compare.

Two clocks: wall-clock time per request, and the client thread's CPU time per request (the server runs in another
process, so this is the client's own work; less disturbed by other processes than wall-clock time, though not
immune: stolen and contended CPU inflates it).

Large bodies (also alone, ``--large-bodies-only``): chat requests of 2 MB ASCII, 2 MB with ``\\u`` escapes and 6 MB
of escapes, ``"stream"`` false and true, sync, the whole stack in memory. The guard's extra CPU time per request
(guard minus bare, median of interleaved blocks) is printed against ``json.loads`` of the same body, as a ratio;
the target is at most 1 (a body that cannot ask for a stream is filtered without a parse; one that may is read
from its structure, also without a parse, unless it holds too many strings after its key).

Repeatable counts (``_counts.py``; ``--instructions`` for them alone; otherwise they end every run when valgrind is
found, unless ``--no-instructions``): instructions and simulated cache misses per request, sync and asyncio, the
whole stack in memory under cachegrind. They repeat to about 0.1% whatever the machine is doing.

Each client kind's ratio is printed against its target: 1.03 for httpx, 1.115 for aiohttp (issue 23's bound) and
1.05 for requests (issue 24's). When an httpx guard/bare is above 1.03 the guard's hot path is profiled (or always,
with ``--profile``), sync:

* the guard's own Python on its normal path: `GuardTransport` around an in-process canned transport that answers
  at once, against that canned transport bare. The canned transport carries a stand-in pool (``_network_backend``
  and ``create_connection``), so the guard hooks it and sets no ``trace`` extension, as it does around an
  `httpx.HTTPTransport` (the hooks act on new connections only: a request on a pooled connection passes none);
* what the guard makes httpcore do on that path: the time inside the pool's ``_assign_requests_to_connections``
  with the guard's pool-race fix vs without (``llama_guard/_pool_fix.py``), timed during real requests;
* the whole stack in memory (`CannedBackend`: httpx, httpcore and h11 over an in-memory connection), guard vs bare
  vs bare with the pool-race fix, with the automatic cyclic gc on and off, and the objects per request that end
  in reference cycles;
* cProfile of the guard (normal path) on the canned transport: functions and files by own time, per request;
* apart, the trace FALLBACK, which the guard uses only when the wrapped transport has no reachable pool (a
  transport that wraps another one): the guard around a canned transport without ``_pool`` (which then emits the
  ten trace events httpcore emits for a request on a pooled connection) minus the guard on its normal path; the
  fallback's trace callback alone (`_SyncTracer`, x10 events); and httpcore's own cost of a set ``trace``
  extension (the five `Trace` blocks of a request, no-op callback vs none).

The aiohttp row (``llama_guard.aiohttp``): `guarded_session()` (middleware and `GuardConnector`) against a bare
``aiohttp.ClientSession`` (with its own ``TCPConnector``), same server, same requests, same blocks; it has no
httpx-retries column. The requests row (``llama_guard.requests``): a ``requests.Session`` with a mounted
``GuardAdapter`` (keep-alive strategy) against a bare ``requests.Session``, likewise.

Usage::

    python benchmarks/overhead.py                       # 1,200 blocks of 20 requests per variant and client kind
    python benchmarks/overhead.py --only aiohttp        # one client kind alone (sync, asyncio, aiohttp, requests)
    python benchmarks/overhead.py --blocks 3000 --profile
    python benchmarks/overhead.py --instructions        # the repeatable counts alone (about 5 minutes)
    python benchmarks/overhead.py --large-bodies-only   # the large-body rows alone (about a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import logging
import pstats
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpcore
import httpx
from _common import machine, median, median_ci, rotated, spread, table
from _counts import count_table, per_request_counts
from httpx_retries import Retry, RetryTransport

import llama_guard
from llama_guard._httpx.internals import fix_pool_race

PATH = "/v1/chat/completions"
BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}],
    "max_tokens": 8,
    "temperature": 0.0,
}
TARGET = 1.03
# Each client kind's own bound where it is not TARGET: aiohttp's bare request costs half of httpx's, so the
# middleware's fixed cost is a larger share (issue 23: no worse than 1.115); requests' (issue 24: 1.05).
TARGETS = {"asyncio aiohttp.ClientSession": 1.115, "sync requests.Session": 1.05}
# "bare, control" is a second bare client: its ratio to bare is what noise alone does to a ratio.
VARIANTS = ("bare", "bare, control", "guard", "httpx-retries", "bare close", "guard close")
# "guard" is the keep-alive strategy, whose per-request cost is the target: the server here is on loopback, where
# the default ("auto") closes every connection, which is measured apart against a bare client that sends
# Connection: close too ("guard close" vs "bare close": a new connection per request on both sides).
REUSE = llama_guard.GuardPolicy(connection="reuse")
CLOSE_HEADERS = {"Connection": "close"}
# The profile's own rounds (of the parts measured apart; the whole stack in memory takes 4x as many of 100).
PROFILE_ROUNDS, PROFILE_REQUESTS = 30, 250
# The guard's own default limits, for every variant alike (keep-alive expiry below llama-server's 5 s).
LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=4.0)
SERVER_SCRIPT = Path(__file__).resolve().parent / "_keepalive_server.py"
# What _keepalive_server.py answers, for the in-memory connections of the profile.
CANNED_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: application/json\r\n"
    b'Keep-Alive: timeout=5, max=100000\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'
)
# What httpcore emits for one request on a pooled keep-alive connection (recorded from httpcore 1.0.9).
POOLED_TRACE_EVENTS = (
    "http11.send_request_headers.started",
    "http11.send_request_headers.complete",
    "http11.send_request_body.started",
    "http11.send_request_body.complete",
    "http11.receive_response_headers.started",
    "http11.receive_response_headers.complete",
    "http11.receive_response_body.started",
    "http11.receive_response_body.complete",
    "http11.response_closed.started",
    "http11.response_closed.complete",
)


@contextlib.contextmanager
def keepalive_server() -> Iterator[str]:
    """Run ``_keepalive_server.py`` in its own process; yields its base URL."""
    proc = subprocess.Popen(
        [sys.executable, str(SERVER_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the keep-alive server did not start (printed {line!r})")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def retry_config() -> Retry:
    return Retry(
        total=3,
        allowed_methods=["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE", "POST", "PATCH"],
        backoff_factor=0.05,
    )


def sync_client(variant: str, url: str) -> httpx.Client:
    inner = httpx.HTTPTransport(limits=LIMITS)
    transport: httpx.BaseTransport
    if variant in ("bare", "bare, control"):
        transport = inner
    elif variant == "guard":
        transport = llama_guard.GuardTransport(inner, policy=REUSE)
    elif variant == "httpx-retries":
        transport = RetryTransport(transport=inner, retry=retry_config())
    elif variant == "bare+poolfix":  # profiling: the guard's pool-race fix alone
        fix_pool_race(inner)
        transport = inner
    elif variant == "bare close":
        return httpx.Client(transport=inner, base_url=url, headers=CLOSE_HEADERS)
    elif variant == "guard close":
        transport = llama_guard.GuardTransport(inner)  # the default: loopback, so close
    else:
        raise ValueError(variant)
    return httpx.Client(transport=transport, base_url=url)


def async_client(variant: str, url: str) -> httpx.AsyncClient:
    inner = httpx.AsyncHTTPTransport(limits=LIMITS)
    transport: httpx.AsyncBaseTransport
    if variant in ("bare", "bare, control"):
        transport = inner
    elif variant == "guard":
        transport = llama_guard.AsyncGuardTransport(inner, policy=REUSE)
    elif variant == "httpx-retries":
        transport = RetryTransport(transport=inner, retry=retry_config())
    elif variant == "bare close":
        return httpx.AsyncClient(transport=inner, base_url=url, headers=CLOSE_HEADERS)
    elif variant == "guard close":
        transport = llama_guard.AsyncGuardTransport(inner)  # the default: loopback, so close
    else:
        raise ValueError(variant)
    return httpx.AsyncClient(transport=transport, base_url=url)


def _noop_trace(event: str, info: dict[str, Any]) -> None:
    pass


def run_sync(client: httpx.Client, n: int, *, gc_off: bool = False) -> tuple[float, float]:
    """Wall-clock and client CPU seconds per request, for ``n`` requests one after the other (``gc_off``: with the
    automatic cyclic garbage collector disabled meanwhile)."""
    gc.collect()
    if gc_off:
        gc.disable()
    try:
        started, cpu_started = time.perf_counter(), time.thread_time()
        for _ in range(n):
            response = client.post(PATH, json=BODY)
            if response.status_code != 200:
                raise RuntimeError(f"unexpected status {response.status_code}")
        return (time.perf_counter() - started) / n, (time.thread_time() - cpu_started) / n
    finally:
        gc.enable()


# aiohttp and requests: the same variants but httpx-retries, which only wraps httpx.
AIOHTTP_VARIANTS = ("bare", "bare, control", "guard", "bare close", "guard close")


async def run_aiohttp(session: Any, n: int) -> tuple[float, float]:
    gc.collect()
    started, cpu_started = time.perf_counter(), time.thread_time()
    for _ in range(n):
        async with session.post(PATH, json=BODY) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"unexpected status {response.status}")
    return (time.perf_counter() - started) / n, (time.thread_time() - cpu_started) / n


async def measure_aiohttp(url: str, rounds: int, requests: int, warmup: int) -> Measured:
    """Interleaved rounds (blocks) of a bare `aiohttp.ClientSession` and `llama_guard.aiohttp.guarded_session()`
    (the keep-alive strategy); and of both with a new connection per request, as `measure_requests`."""
    import aiohttp

    from llama_guard.aiohttp import guarded_session

    def make_session(variant: str) -> aiohttp.ClientSession:
        if variant == "guard":
            return guarded_session(url, policy=REUSE)
        if variant == "guard close":
            return guarded_session(url)  # the default: loopback, so close
        headers = CLOSE_HEADERS if variant == "bare close" else None
        return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(), headers=headers)

    sessions = {v: make_session(v) for v in AIOHTTP_VARIANTS}
    try:
        for session in sessions.values():
            await run_aiohttp(session, warmup)
        results = Measured.empty(AIOHTTP_VARIANTS)
        for r in range(rounds):
            for variant in rotated(AIOHTTP_VARIANTS, r):
                results.add(variant, await run_aiohttp(sessions[variant], requests))
        return results
    finally:
        for session in sessions.values():
            await session.close()


def run_requests(session: Any, url: str, n: int) -> tuple[float, float]:
    gc.collect()
    started, cpu_started = time.perf_counter(), time.thread_time()
    for _ in range(n):
        response = session.post(url, json=BODY)
        if response.status_code != 200:
            raise RuntimeError(f"unexpected status {response.status_code}")
    return (time.perf_counter() - started) / n, (time.thread_time() - cpu_started) / n


def measure_requests(url: str, rounds: int, requests: int, warmup: int) -> Measured:
    """Interleaved rounds (blocks) of a bare `requests.Session` and one with a mounted
    `llama_guard.requests.GuardAdapter` (the keep-alive strategy, as the httpx rows); and of both with a new
    connection per request (``Connection: close`` sent by the bare one, the guard's default on loopback)."""
    import requests as requests_library

    from llama_guard.requests import GuardAdapter

    sessions = {v: requests_library.Session() for v in AIOHTTP_VARIANTS}
    sessions["guard"].mount("http://", GuardAdapter(policy=REUSE))
    sessions["guard close"].mount("http://", GuardAdapter())  # the default: loopback, so close
    sessions["bare close"].headers["Connection"] = "close"
    target = url + PATH
    try:
        for session in sessions.values():
            run_requests(session, target, warmup)
        results = Measured.empty(AIOHTTP_VARIANTS)
        for r in range(rounds):
            for variant in rotated(AIOHTTP_VARIANTS, r):
                results.add(variant, run_requests(sessions[variant], target, requests))
        return results
    finally:
        for session in sessions.values():
            session.close()


async def run_async(client: httpx.AsyncClient, n: int) -> tuple[float, float]:
    gc.collect()
    started, cpu_started = time.perf_counter(), time.thread_time()
    for _ in range(n):
        response = await client.post(PATH, json=BODY)
        if response.status_code != 200:
            raise RuntimeError(f"unexpected status {response.status_code}")
    return (time.perf_counter() - started) / n, (time.thread_time() - cpu_started) / n


Rounds = dict[str, list[float]]


@dataclasses.dataclass
class Measured:
    """Per variant, one value per round: wall-clock and the client thread's CPU time, seconds per request."""

    wall: Rounds
    cpu: Rounds

    @classmethod
    def empty(cls, variants: tuple[str, ...]) -> Measured:
        return cls({v: [] for v in variants}, {v: [] for v in variants})

    def add(self, variant: str, sample: tuple[float, float]) -> None:
        self.wall[variant].append(sample[0])
        self.cpu[variant].append(sample[1])


def measure_sync(
    url: str,
    variants: tuple[str, ...],
    rounds: int,
    requests: int,
    warmup: int,
    make: Callable[[str, str], httpx.Client] | None = None,
) -> Measured:
    """Interleaved rounds (blocks) of ``requests`` requests of sync variants; a variant named "<variant> gc-off"
    runs with the automatic gc off. ``make(variant, url)`` builds the clients (default `sync_client`)."""
    make = make or sync_client
    clients = {v: make(v.removesuffix(" gc-off"), url) for v in variants}
    try:
        for client in clients.values():
            run_sync(client, warmup)
        results = Measured.empty(variants)
        for r in range(rounds):
            for variant in rotated(variants, r):
                results.add(variant, run_sync(clients[variant], requests, gc_off=variant.endswith("gc-off")))
        return results
    finally:
        for client in clients.values():
            client.close()


async def measure_async(url: str, rounds: int, requests: int, warmup: int) -> Measured:
    """Interleaved rounds (blocks) of ``requests`` requests of the asyncio variants."""
    clients = {v: async_client(v, url) for v in VARIANTS}
    try:
        for client in clients.values():
            await run_async(client, warmup)
        results = Measured.empty(VARIANTS)
        for r in range(rounds):
            for variant in rotated(VARIANTS, r):
                results.add(variant, await run_async(clients[variant], requests))
        return results
    finally:
        for client in clients.values():
            await client.aclose()


def ratios(results: Rounds, top: str, bottom: str) -> list[float]:
    """Per-round ratios: both sides from the same round."""
    return [a / b for a, b in zip(results[top], results[bottom], strict=True)]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def ratio_cell(values: list[float]) -> str:
    """The median of per-block ratios and its 95% confidence interval."""
    low, high = median_ci(values)
    return f"{median(values):.3f} ({low:.3f}-{high:.3f})"


def summary_table(by_kind: dict[str, Measured]) -> str:
    rows = []
    for kind, measured in by_kind.items():
        for metric, results in (("wall", measured.wall), ("client CPU", measured.cpu)):
            retries = "httpx-retries" in results  # not for aiohttp or requests
            rows.append(
                [
                    kind,
                    metric,
                    us(median(results["bare"])),
                    us(median(results["guard"])),
                    us(median(results["httpx-retries"])) if retries else "-",
                    ratio_cell(ratios(results, "guard", "bare")),
                    ratio_cell(ratios(results, "guard", "httpx-retries")) if retries else "-",
                    ratio_cell(ratios(results, "bare, control", "bare")),
                    ratio_cell(ratios(results, "guard close", "bare close")) if "guard close" in results else "-",
                ]
            )
    headers = [
        "client",
        "time",
        "bare µs/req",
        "guard µs/req",
        "httpx-retries µs/req",
        "guard/bare (95% CI)",
        "guard/httpx-retries (95% CI)",
        "control/bare (95% CI)",
        "guard close/bare close (95% CI)",
    ]
    return table(headers, rows, left=2)


# -- profiling the guard's hot path ------------------------------------------------------------------------------


class CannedTransport(httpx.BaseTransport):
    """Answers at once with one prebuilt response (no I/O, next to no work of its own), emitting the trace events
    httpcore emits for a request on a pooled connection when the request carries a ``trace`` extension (as the
    guard's attempts do on its trace fallback). Keeps the last trace callback it saw.

    It has no ``_pool``: a guard around it takes the trace fallback. `PooledCannedTransport` has one."""

    def __init__(self) -> None:
        self.last_trace: Callable[[str, dict[str, Any]], None] | None = None
        headers = [(b"Server", b"llama.cpp"), (b"Content-Type", b"application/json"), (b"Content-Length", b"15")]
        self._response = httpx.Response(200, headers=headers, content=b'{"status":"ok"}')
        self._info: dict[str, Any] = {}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        trace = request.extensions.get("trace")
        if trace is not None:
            self.last_trace = trace
            for event in POOLED_TRACE_EVENTS:
                trace(event, self._info)
        return self._response


class CannedPool:
    """Stands in for an httpcore pool where the guard looks for one: only what it hooks (the network backend, and
    ``create_connection``, which the canned transport never calls: every request is as on a pooled connection)."""

    def __init__(self) -> None:
        self._network_backend: httpcore.NetworkBackend = httpcore.SyncBackend()

    def create_connection(self, origin: httpcore.Origin) -> Any:
        raise AssertionError("the canned transport opens no connection")


class PooledCannedTransport(CannedTransport):
    """`CannedTransport` with a stand-in pool, so that a guard around it takes its normal path: hooks on the pool's
    network backend (which the canned transport never calls: every request is as on a pooled connection), no
    ``trace`` extension."""

    def __init__(self) -> None:
        super().__init__()
        self._pool = CannedPool()


class CannedStream(httpcore.NetworkStream):
    """A keep-alive connection in memory: every request written is answered with the same canned response."""

    def __init__(self, response: bytes) -> None:
        self._response = response
        self._pending = False

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            self._pending = True

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if not self._pending:
            raise httpcore.ReadError("nothing was asked")
        self._pending = False
        return self._response

    def close(self) -> None:
        pass

    def get_extra_info(self, info: str) -> Any:
        return False if info == "is_readable" else None


class CannedBackend(httpcore.NetworkBackend):
    """httpcore's network, in memory: the whole httpx/httpcore stack runs, with no system call and no server."""

    def __init__(self, response: bytes) -> None:
        self._response = response

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        return CannedStream(self._response)


class AsyncCannedStream(httpcore.AsyncNetworkStream):
    """`CannedStream` for the async stack (the same connection behind async methods)."""

    def __init__(self, response: bytes) -> None:
        self._stream = CannedStream(response)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._stream.close()

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class AsyncCannedBackend(httpcore.AsyncNetworkBackend):
    """`CannedBackend` for the async stack."""

    def __init__(self, response: bytes) -> None:
        self._response = response

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        return AsyncCannedStream(self._response)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _inner_transport(transport: Any) -> Any:
    if isinstance(transport, (llama_guard.GuardTransport, llama_guard.AsyncGuardTransport)):
        return transport.transport
    if isinstance(transport, RetryTransport):
        return transport._sync_transport if transport._sync_transport is not None else transport._async_transport
    return transport


def in_memory_async_client(variant: str, url: str = "http://127.0.0.1:8080") -> httpx.AsyncClient:
    """An asyncio client of ``variant`` (as `async_client`) whose connections are in memory (`AsyncCannedStream`)."""
    client = async_client(variant, url)
    _inner_transport(client._transport)._pool._network_backend = AsyncCannedBackend(CANNED_RESPONSE)
    return client


def in_memory_client(variant: str, url: str = "http://127.0.0.1:8080") -> httpx.Client:
    """A client of ``variant`` (as `sync_client`) whose connections are in memory (`CannedStream`)."""
    client = sync_client(variant, url)
    _inner_transport(client._transport)._pool._network_backend = CannedBackend(CANNED_RESPONSE)
    return client


def _requests(url: str, n: int) -> list[httpx.Request]:
    return [httpx.Request("POST", url + PATH, json=BODY) for _ in range(n)]


def _time_direct(transport: httpx.BaseTransport, requests: list[httpx.Request]) -> float:
    """CPU seconds per request of ``transport.handle_request``, automatic gc off (its part is measured apart)."""
    gc.collect()
    gc.disable()
    try:
        started = time.thread_time()
        for request in requests:
            transport.handle_request(request)
        return (time.thread_time() - started) / len(requests)
    finally:
        gc.enable()


def _time_trace_machinery(rounds: int, requests: int) -> float:
    """httpcore's own cost of a set ``trace`` extension: the five `Trace` blocks of a pooled HTTP/1.1 request
    (send headers, send body, receive headers, receive body, close), with a no-op callback vs without one."""
    from httpcore._trace import Trace

    logger = logging.getLogger("httpcore.http11")
    plain = httpcore.Request("POST", "http://127.0.0.1:8080/v1/chat/completions")
    traced = httpcore.Request("POST", "http://127.0.0.1:8080/v1/chat/completions", extensions={"trace": _noop_trace})
    names = ("send_request_headers", "send_request_body", "receive_response_headers", "receive_response_body")

    def run(request: httpcore.Request) -> float:
        started = time.thread_time()
        for _ in range(requests):
            for name in names:
                with Trace(name, logger, request, {"request": request}):
                    pass
            with Trace("response_closed", logger, request):
                pass
        return (time.thread_time() - started) / requests

    differences = []
    for r in range(rounds):
        first, second = (plain, traced) if r % 2 == 0 else (traced, plain)
        a, b = run(first), run(second)
        differences.append(b - a if first is plain else a - b)
    return median(differences)


def _time_pool_fix(rounds: int, requests: int) -> tuple[float, float]:
    """CPU seconds per request inside the pool's ``_assign_requests_to_connections`` (httpcore calls it twice per
    request), original vs the guard's fix, timed around the method itself during (in-memory) requests."""
    clients = {}
    spent = {"original": 0.0, "fixed": 0.0}
    for name in spent:
        client = in_memory_client("bare+poolfix" if name == "fixed" else "bare")
        pool: Any = client._transport._pool  # type: ignore[attr-defined]
        method = pool._assign_requests_to_connections

        def timed(method: Callable[[], list[Any]] = method, name: str = name) -> list[Any]:
            started = time.thread_time()
            try:
                return method()
            finally:
                spent[name] += time.thread_time() - started

        pool._assign_requests_to_connections = timed
        clients[name] = client
    per_request: dict[str, list[float]] = {name: [] for name in spent}
    try:
        for client in clients.values():
            run_sync(client, 200)
        for r in range(rounds):
            for name in rotated(list(clients), r):
                spent[name] = 0.0
                run_sync(clients[name], requests, gc_off=True)
                per_request[name].append(spent[name] / requests)
    finally:
        for client in clients.values():
            client.close()
    return median(per_request["original"]), median(per_request["fixed"])


def _cyclic_garbage(requests: int) -> tuple[float, float, str]:
    """Objects per request that only the cyclic garbage collector frees (reference cycles), bare and guard, and
    the types the guard adds."""
    per_request: dict[str, float] = {}
    types: dict[str, collections.Counter[str]] = {}
    for variant in ("bare", "guard"):
        with in_memory_client(variant) as client:
            run_sync(client, 50)
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                run_sync(client, requests, gc_off=True)
                gc.collect()
                garbage = list(gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
        per_request[variant] = len(garbage) / requests
        types[variant] = collections.Counter(type(o).__qualname__ for o in garbage)
        del garbage
    added = types["guard"] - types["bare"]
    top = ", ".join(f"{name} {count / requests:.1f}" for name, count in added.most_common(8))
    return per_request["bare"], per_request["guard"], top


def guard_alone(rounds: int, requests: int) -> tuple[Rounds, cProfile.Profile, float]:
    """The guard's own cost on a canned transport (no I/O): rounds of the bare canned transport, of the guard on its
    normal path (a pool to hook) and of the guard on its trace fallback (no pool); a cProfile of the normal path;
    the fallback's trace callback alone."""
    url = "http://127.0.0.1:8080"
    pooled_inner = PooledCannedTransport()
    fallback_inner = CannedTransport()
    guarded = llama_guard.GuardTransport(pooled_inner, policy=REUSE)
    variants: dict[str, httpx.BaseTransport] = {
        "canned": CannedTransport(),
        "guard(canned)": guarded,
        "guard(canned, no pool)": llama_guard.GuardTransport(fallback_inner, policy=REUSE),
    }
    for transport in variants.values():
        _time_direct(transport, _requests(url, 2000))
    # The guard took the path each variant is for: no trace extension with a pool to hook, one without.
    if pooled_inner.last_trace is not None or fallback_inner.last_trace is None:
        raise RuntimeError("the guard did not take the expected path (hooks on the pool vs trace fallback)")
    results: Rounds = {name: [] for name in variants}
    for r in range(rounds):
        for name in rotated(list(variants), r):
            results[name].append(_time_direct(variants[name], _requests(url, requests)))

    batch = _requests(url, max(requests, 2000))
    profiler = cProfile.Profile()
    gc.collect()
    gc.disable()
    profiler.enable()
    for request in batch:
        guarded.handle_request(request)
    profiler.disable()
    gc.enable()

    # The fallback's trace callback alone: the last one the guard installed, called with a pooled request's events.
    trace = fallback_inner.last_trace
    assert trace is not None
    info: dict[str, Any] = {}
    per_request = []
    for _ in range(rounds):
        started = time.thread_time()
        for _ in range(requests):
            for event in POOLED_TRACE_EVENTS:
                trace(event, info)
        per_request.append((time.thread_time() - started) / requests)
    return results, profiler, median(per_request)


def _profile_tables(profiler: cProfile.Profile, guard_own: float, limit: int = 20) -> str:
    """The guard's functions by own time, and own time by file: shares of the profiled time, and those shares
    applied to the unprofiled cost (the profiler inflates small calls, so its absolute times are not the real
    ones)."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    # The benchmark's own loop and canned transport are left out: what remains is the guard's time.
    kept = {
        key: value
        for key, value in raw.items()
        if not _short_path(key[0]).startswith("overhead.py") and "_lsprof.Profiler" not in key[2]
    }
    requests = next(value[1] for key, value in kept.items() if key[2] == "handle_request")
    total = sum(entry[2] for entry in kept.values())
    rows: list[list[str]] = []
    by_file: dict[str, float] = {}
    for (filename, line, name), (_, ncalls, tottime, cumtime, _) in sorted(
        kept.items(), key=lambda item: item[1][2], reverse=True
    ):
        where = _short_path(filename) or "(builtins)"
        by_file[where] = by_file.get(where, 0.0) + tottime
        if len(rows) < limit:
            label = f"{where}:{line}({name})" if line else name
            share = tottime / total
            rows.append(
                [
                    label,
                    f"{ncalls / requests:.0f}",
                    f"{share * 100:.1f}%",
                    f"{share * guard_own * 1e6:.2f}",
                    f"{cumtime / total * guard_own * 1e6:.2f}",
                ]
            )
    file_rows = [
        [where, f"{spent / total * 100:.1f}%", f"{spent / total * guard_own * 1e6:.2f}"]
        for where, spent in sorted(by_file.items(), key=lambda item: item[1], reverse=True)
        if spent / total >= 0.005
    ]
    headers = ["function", "calls/req", "share", "≈ own µs/req", "≈ cum µs/req"]
    return (
        f"cProfile of {requests} requests through GuardTransport(canned), normal path; shares of the profiled "
        f"time, and '≈ µs' = share x the unprofiled cost of the guard's own Python ({guard_own * 1e6:.1f} µs):\n"
        + table(headers, rows)
        + "\n\nOwn time by file:\n"
        + table(["file", "share", "≈ µs/req"], file_rows)
    )


def _short_path(filename: str) -> str:
    if filename == "~":
        return ""
    for marker in ("site-packages/", "llama_guard/", "lib/python3"):
        index = filename.find(marker)
        if index >= 0:
            return filename[index:].removeprefix("site-packages/")
    return Path(filename).name


def profile(rounds: int, requests: int, bare_on_server: float) -> str:
    """Where the guard's per-request cost goes: CPU time, sync (the async transport is the same code, generated).

    Everything here runs in this process with no I/O, so the load of the machine disturbs it less; it still does:
    many short interleaved rounds, medians of per-round differences, and the interquartile range of them."""
    short_rounds, short_requests = max(4 * rounds, 40), 100
    stack = measure_sync(
        "http://127.0.0.1:8080",
        ("bare", "guard", "bare gc-off", "bare+poolfix gc-off", "guard gc-off"),
        short_rounds,
        short_requests,
        200,
        make=in_memory_client,
    ).cpu
    alone, profiler, trace_cb = guard_alone(rounds, requests)

    def alone_difference(top: str, bottom: str) -> float:
        return median([t - b for t, b in zip(alone[top], alone[bottom], strict=True)])

    guard_hot = alone_difference("guard(canned)", "canned")
    fallback_extra = alone_difference("guard(canned, no pool)", "guard(canned)")
    trace_machinery = _time_trace_machinery(rounds, requests)
    pool_original, pool_fixed = _time_pool_fix(rounds, requests)
    pool_fix = pool_fixed - pool_original
    garbage_bare, garbage_guard, garbage_types = _cyclic_garbage(500)

    def difference(top: str, bottom: str) -> tuple[float, str]:
        values = sorted(t - b for t, b in zip(stack[top], stack[bottom], strict=True))
        return median(values), f"IQR {values[len(values) // 4] * 1e6:.0f} to {values[3 * len(values) // 4] * 1e6:.0f}"

    bare = median(stack["bare"])
    whole, whole_iqr = difference("guard", "bare")
    whole_off, whole_off_iqr = difference("guard gc-off", "bare gc-off")
    pool_fix_side, pool_fix_iqr = difference("bare+poolfix gc-off", "bare gc-off")
    own, own_iqr = difference("guard gc-off", "bare+poolfix gc-off")

    def row(part: str, value: float, how: str) -> list[str]:
        return [part, us(value), f"{value / bare * 100:.1f}%", f"{value / bare_on_server * 100:.1f}%", how]

    rows = [
        row("bare request, whole stack in memory", bare, "httpx + httpcore + h11 over an in-memory connection"),
        row("guard - bare, whole stack", whole, f"the guard's whole cost; {whole_iqr}"),
        row(
            "  cyclic gc",
            whole - whole_off,
            f"gc on - gc off; objects/req in cycles: bare {garbage_bare:.0f}, guard {garbage_guard:.0f}",
        ),
        row("  guard - bare, automatic gc off", whole_off, whole_off_iqr),
        row("    pool-race fix, in the stack", pool_fix_side, f"bare+pool fix - bare; {pool_fix_iqr}"),
        row(
            "      pool-race fix, alone",
            pool_fix,
            f"_assign_requests_to_connections x2: {us(pool_fixed)} fixed vs {us(pool_original)} original",
        ),
        row("    the guard's own code, in the stack", own, f"guard - (bare+pool fix); {own_iqr}"),
        row(
            "      the same code hot, in a loop",
            guard_hot,
            f"GuardTransport(canned) {us(median(alone['guard(canned)']))} - canned {us(median(alone['canned']))}",
        ),
    ]
    fallback_rows = [
        row(
            "trace fallback - normal path, guard's code hot",
            fallback_extra,
            f"GuardTransport(canned, no pool) {us(median(alone['guard(canned, no pool)']))} - GuardTransport(canned) "
            f"{us(median(alone['guard(canned)']))}",
        ),
        row("  of which its trace callback", trace_cb, "_SyncTracer (trace fallback only), x10 events"),
        row(
            "httpcore tracing, alone (trace fallback only)",
            trace_machinery,
            "httpcore Trace blocks x5, no-op callback vs none",
        ),
    ]
    noise = max(spread(v) for v in stack.values())
    headers = ["part", "µs/req", "% of bare", "% of bare on server", "measured as"]
    return "\n".join(
        [
            f"Where the guard's cost goes: client CPU µs/request, sync, medians of {short_rounds} interleaved rounds "
            f"of {short_requests} (whole stack) and of {rounds} rounds of {requests} (parts alone); '% of bare' = "
            f"of the bare request in memory, '% of bare on server' = of the bare request's wall time on the server "
            f"above ({us(bare_on_server)} µs). Round spread of the in-memory rounds: {noise * 100:.0f}%. The guard "
            "takes its normal path here (hooks on the pool's network backend, no trace extension).",
            table(headers, rows),
            f"The guard's objects left in reference cycles, per request: {garbage_types}",
            "",
            "The trace fallback, which the guard uses instead of the hooks only when the wrapped transport has no "
            "reachable pool (a transport wrapping another one); not part of the figures above. Its extra cost over "
            "the normal path is about the sum of the first and last rows:",
            table(headers, fallback_rows),
            "",
            _profile_tables(profiler, guard_hot),
        ]
    )


# -- the repeatable counts (_counts.py runs this script as their child) ---------------------------------------------


def count_child(kind: str, variant: str, requests: int) -> None:
    """What one child of the counts does: ``requests`` in-memory requests of ``variant``, one after the other."""
    if kind == "sync":
        with in_memory_client(variant) as client:
            run_sync(client, requests)
        return

    async def run() -> None:
        async with in_memory_async_client(variant) as client:
            await run_async(client, requests)

    asyncio.run(run())


# Large request bodies: the text of one user message, sent pre-encoded (json.dumps writes non-ASCII as \\u escapes).
LARGE_BODIES = {
    "2 MB ASCII": "x" * 2_000_000,
    "2 MB with \\u escapes": "é" * 333_000,
    "6 MB of \\u escapes": "é" * 1_000_000,
}


LARGE_BLOCK = 3  # requests per variant per block
LARGE_BODY_CAPTION = (
    "Large bodies: the guard's extra CPU time per request (guard minus bare, sync, whole stack in memory) against "
    "json.loads of the same body; medians of interleaved blocks, one run:"
)


def large_body(content: str, *, stream: bool) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "stream": stream}).encode()


def _time_sends(client: httpx.Client, body: bytes, n: int) -> float:
    """CPU seconds per request of sending ``body`` (a fresh request each time, as a caller builds one)."""
    headers = {"Content-Type": "application/json"}
    started = time.thread_time()
    for _ in range(n):
        client.send(client.build_request("POST", PATH, content=body, headers=headers)).read()
    return (time.thread_time() - started) / n


def _time_json_loads(body: bytes, n: int) -> float:
    started = time.thread_time()
    for _ in range(n):
        json.loads(body)
    return (time.thread_time() - started) / n


def large_body_rows(blocks: int, block: int) -> str:
    """The guard's extra CPU time per request on large bodies (guard minus bare, the whole stack in memory, sync),
    against ``json.loads`` of the same body: medians of interleaved blocks (bare, guard, json.loads), one run.

    "stream": false is answered by the byte filter without a parse (no colon followed by true after a "stream"
    key); "stream": true is read from the body's structure (its last top-level key), and the guard then sends
    ``Connection: close``, so each of those requests also opens a new (in-memory) connection and probes it: that
    is in its figure too."""
    rows = []
    with in_memory_client("bare") as bare, in_memory_client("guard") as guard:
        for name, content in LARGE_BODIES.items():
            for stream in (False, True):
                body = large_body(content, stream=stream)
                for client in (bare, guard):
                    _time_sends(client, body, 2)  # warm-up: the guard learns the origin, connections open
                samples: dict[str, list[float]] = {"bare": [], "guard": [], "json.loads": []}
                for _ in range(blocks):
                    samples["bare"].append(_time_sends(bare, body, block))
                    samples["guard"].append(_time_sends(guard, body, block))
                    samples["json.loads"].append(_time_json_loads(body, block))
                extra = [g - b for g, b in zip(samples["guard"], samples["bare"], strict=True)]
                loads = median(samples["json.loads"])
                rows.append(
                    [
                        f"{name}, stream {str(stream).lower()}",
                        f"{len(body) / 1e6:.1f} MB",
                        f"{median(samples['bare']) * 1e3:.2f} ms",
                        f"{median(extra) * 1e3:.2f} ms",
                        f"{loads * 1e3:.2f} ms",
                        f"{median(extra) / loads:.2f}",
                    ]
                )
    headers = ["body", "size", "bare", "guard's extra", "json.loads(body)", "extra / json.loads"]
    return table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--block", type=int, default=20, help="requests per variant per block (default 20)")
    parser.add_argument("--blocks", type=int, default=1200, help="interleaved blocks (default 1200)")
    parser.add_argument("--warmup", type=int, default=500, help="warm-up requests per variant (default 500)")
    parser.add_argument("--profile", action="store_true", help="profile the guard even when within the target")
    parser.add_argument(
        "--large-bodies-only", action="store_true", help="only the large-body rows (2 MB and 6 MB request bodies)"
    )
    parser.add_argument("--large-blocks", type=int, default=40, help="blocks for the large-body rows (default 40)")
    parser.add_argument(
        "--only",
        choices=("sync", "asyncio", "aiohttp", "requests"),
        action="append",
        help="measure only this client kind (repeatable; default: all four)",
    )
    instructions = parser.add_mutually_exclusive_group()
    instructions.add_argument(
        "--instructions",
        action="store_true",
        help="only the repeatable counts (cachegrind; by default they end the run when valgrind is found)",
    )
    instructions.add_argument("--no-instructions", action="store_true", help="skip the repeatable counts")
    # Internal: one child of the counts (run under cachegrind).
    parser.add_argument("--instructions-child", nargs=3, metavar=("KIND", "VARIANT", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.block < 1 or args.blocks < 3 or args.warmup < 0 or args.large_blocks < 3:
        parser.error("--block must be >= 1, --blocks >= 3, --warmup >= 0, --large-blocks >= 3")
    if args.instructions_child:
        kind, variant, requests = args.instructions_child
        count_child(kind, variant, int(requests))
        return 0
    # The counts cover the httpx clients: not with --only.
    valgrind = None if args.no_instructions or args.only else shutil.which("valgrind")
    if args.instructions and valgrind is None:
        parser.error("--instructions needs valgrind (not found on PATH)")

    print(f"machine: {machine()}")
    started = time.monotonic()
    if args.large_bodies_only:
        print()
        print(LARGE_BODY_CAPTION)
        print(large_body_rows(args.large_blocks, LARGE_BLOCK))
        print(f"\n({time.monotonic() - started:.0f} s)")
        return 0
    if args.instructions:
        assert valgrind is not None
        print()
        print(count_table(per_request_counts(valgrind)))
        print(f"\n({time.monotonic() - started:.0f} s)")
        return 0
    print(
        f"httpx {httpx.__version__}, llama_guard {llama_guard.__version__}; {args.blocks} interleaved blocks x "
        f"{args.block} requests per variant, {args.warmup} warm-up; keep-alive server in its own process"
    )
    only = set(args.only or ("sync", "asyncio", "aiohttp", "requests"))
    with keepalive_server() as url:
        by_kind: dict[str, Measured] = {}
        if "sync" in only:
            by_kind["sync httpx.Client"] = measure_sync(url, VARIANTS, args.blocks, args.block, args.warmup)
        if "asyncio" in only:
            by_kind["asyncio httpx.AsyncClient"] = asyncio.run(measure_async(url, args.blocks, args.block, args.warmup))
        if "aiohttp" in only:
            by_kind["asyncio aiohttp.ClientSession"] = asyncio.run(
                measure_aiohttp(url, args.blocks, args.block, args.warmup)
            )
        if "requests" in only:
            by_kind["sync requests.Session"] = measure_requests(url, args.blocks, args.block, args.warmup)
        print()
        print(
            "Per-request cost, median of blocks; ratios are medians of per-block ratios with a 95% confidence "
            "interval; 'wall' is elapsed time, 'client CPU' the client thread's CPU time (the server runs in "
            "another process); control/bare is a second bare client against the first, the noise alone:"
        )
        print(summary_table(by_kind))
        for metric, attr in (("wall", "wall"), ("client CPU", "cpu")):
            for kind, measured in by_kind.items():
                values = ratios(getattr(measured, attr), "guard", "bare")
                value, (_, high) = median(values), median_ci(values)
                target = TARGETS.get(kind, TARGET)
                verdict = "within" if value <= target else "ABOVE"
                certainty = " (also the 95% upper bound)" if high <= target else f" (95% upper bound {high:.3f})"
                print(f"target guard/bare <= {target}, {kind}, {metric}: {verdict}, {value:.3f}{certainty}")
        httpx_worst = max(
            (
                median(ratios(getattr(m, attr), "guard", "bare"))
                for k, m in by_kind.items()
                for attr in ("wall", "cpu")
                if "httpx" in k
            ),
            default=0.0,
        )
        if (httpx_worst > TARGET or args.profile) and "sync httpx.Client" in by_kind:
            print()
            print(profile(PROFILE_ROUNDS, PROFILE_REQUESTS, median(by_kind["sync httpx.Client"].wall["bare"])))
    print()
    print(LARGE_BODY_CAPTION)
    print(large_body_rows(args.large_blocks, LARGE_BLOCK))
    if valgrind is not None:
        print()
        print(count_table(per_request_counts(valgrind)))
    elif not args.no_instructions:
        print("\n(repeatable counts skipped: valgrind not found)")
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
