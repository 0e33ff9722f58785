"""What the guard costs per request: guard vs a bare httpx transport vs httpx-retries' `RetryTransport`.

A local keep-alive HTTP server in its own process (``_keepalive_server.py``, identifies as ``Server: llama.cpp``)
answers every request at once with a small JSON body, so the client's own cost is what is measured. Each client
kind (sync ``httpx.Client``, asyncio ``httpx.AsyncClient``) sends non-streamed ``POST /v1/chat/completions`` with a
small JSON body over one keep-alive connection, one request after the other. The three transports are measured
in interleaved rounds (ABC, BCA, CAB, ...) after a warm-up, and each figure is the median of the rounds; the ratios
are medians of the per-round ratios, so a slow moment of the machine hits both sides of a ratio alike.

The guard is the default policy (probe on, stream close on, no first-byte deadline). httpx-retries is configured
to retry POST too (3 retries, 0.05 s backoff), as the guard retries llama-server's inference endpoints; with its
default configuration it would not retry POST at all and would cost nothing to compare.

Two clocks: wall-clock time per request, and the client thread's CPU time per request (the server runs in another
process, so this is the client's own work; on a shared machine it is far less disturbed by other processes than
wall-clock time, though not immune: stolen and contended CPU inflates it).

When guard/bare is above the target (1.03) the guard's hot path is profiled (or always, with ``--profile``), sync:

* the guard's own Python on its normal path: `GuardTransport` around an in-process canned transport that answers
  at once, against that canned transport bare. The canned transport carries a stand-in pool (a ``_pool`` with a
  ``_network_backend``), so the guard hooks that backend and sets no ``trace`` extension, as it does around an
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

Instruction counts (``--instructions`` for them alone; otherwise they end every run when valgrind is found, unless
``--no-instructions``): the whole sync stack in memory (`CannedBackend`), one child Python per variant and request
count under ``valgrind --tool=callgrind`` (two at a time), making 200 and, separately, 1200 requests; instructions
per request = (Ir(1200) - Ir(200)) / 1000, which takes out start-up, imports and warm-up. They count the client's
user-space instructions, whatever else the machine is doing, so they are the one figure of this benchmark that
repeats on a shared machine: to a few instructions per request with the same software and environment (the
children get a fixed one; a different environment moved the counts by 0.1%, through the memory layout). They leave
out the kernel's time in system calls (none in memory; a real request makes several) and what an instruction costs:
cache misses, branch mispredictions, and the slower clock of a loaded machine. They measure work done, not time.

Usage::

    python benchmarks/overhead.py                       # 250 requests x 30 rounds per variant and client kind
    python benchmarks/overhead.py --requests 1000 --rounds 40 --profile
    python benchmarks/overhead.py --instructions        # the instruction counts alone (about 5 minutes)
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
import logging
import os
import pstats
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpcore
import httpx
from _common import machine, median, rotated, spread, table
from httpx_retries import Retry, RetryTransport

import llama_guard
from llama_guard._pool_fix import fix_pool_race

PATH = "/v1/chat/completions"
BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}],
    "max_tokens": 8,
    "temperature": 0.0,
}
TARGET = 1.03
# Instruction counts: these variants, each in memory; two request counts, the difference is per request.
INSTRUCTION_VARIANTS = ("bare", "guard", "bare+poolfix", "httpx-retries")
INSTRUCTION_REQUESTS = (200, 1200)
INSTRUCTION_JOBS = 2  # children under callgrind at a time (about 30 s each)
VARIANTS = ("bare", "guard", "httpx-retries")
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
    proc = subprocess.Popen([sys.executable, str(SERVER_SCRIPT)], stdout=subprocess.PIPE, text=True)
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
        if proc.stdout is not None:
            proc.stdout.close()


def retry_config() -> Retry:
    return Retry(
        total=3,
        allowed_methods=["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE", "POST", "PATCH"],
        backoff_factor=0.05,
    )


def sync_client(variant: str, url: str) -> httpx.Client:
    inner = httpx.HTTPTransport(limits=LIMITS)
    transport: httpx.BaseTransport
    if variant == "bare":
        transport = inner
    elif variant == "guard":
        transport = llama_guard.GuardTransport(inner)
    elif variant == "httpx-retries":
        transport = RetryTransport(transport=inner, retry=retry_config())
    elif variant == "bare+poolfix":  # profiling: the guard's pool-race fix alone
        fix_pool_race(inner)
        transport = inner
    else:
        raise ValueError(variant)
    return httpx.Client(transport=transport, base_url=url)


def async_client(variant: str, url: str) -> httpx.AsyncClient:
    inner = httpx.AsyncHTTPTransport(limits=LIMITS)
    transport: httpx.AsyncBaseTransport
    if variant == "bare":
        transport = inner
    elif variant == "guard":
        transport = llama_guard.AsyncGuardTransport(inner)
    elif variant == "httpx-retries":
        transport = RetryTransport(transport=inner, retry=retry_config())
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
    """Interleaved rounds of sync variants; a variant named "<variant> gc-off" runs with the automatic gc off.
    ``make(variant, url)`` builds the clients (default `sync_client`)."""
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


def summary_table(by_kind: dict[str, Measured]) -> str:
    rows = []
    for kind, measured in by_kind.items():
        for metric, results in (("wall", measured.wall), ("client CPU", measured.cpu)):
            vs_bare = ratios(results, "guard", "bare")
            vs_retries = ratios(results, "guard", "httpx-retries")
            noise = max(spread(results[v]) for v in VARIANTS)
            rows.append(
                [
                    kind,
                    metric,
                    us(median(results["bare"])),
                    us(median(results["guard"])),
                    us(median(results["httpx-retries"])),
                    f"{median(vs_bare):.3f} ({min(vs_bare):.2f}-{max(vs_bare):.2f})",
                    f"{median(vs_retries):.3f} ({min(vs_retries):.2f}-{max(vs_retries):.2f})",
                    f"{noise * 100:.0f}%",
                ]
            )
    headers = [
        "client",
        "time",
        "bare µs/req",
        "guard µs/req",
        "httpx-retries µs/req",
        "guard/bare (range)",
        "guard/httpx-retries (range)",
        "round spread",
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
    """Stands in for an httpcore pool where the guard looks for one: only the network backend it hooks."""

    def __init__(self) -> None:
        self._network_backend: httpcore.NetworkBackend = httpcore.SyncBackend()


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


def in_memory_client(variant: str, url: str = "http://127.0.0.1:8080") -> httpx.Client:
    """A client of ``variant`` (as `sync_client`) whose connections are in memory (`CannedStream`)."""
    client = sync_client(variant, url)
    transport = client._transport
    inner: Any = transport
    if isinstance(transport, llama_guard.GuardTransport):
        inner = transport.transport
    elif isinstance(transport, RetryTransport):
        inner = transport._sync_transport
    inner._pool._network_backend = CannedBackend(CANNED_RESPONSE)
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
    guarded = llama_guard.GuardTransport(pooled_inner)
    variants: dict[str, httpx.BaseTransport] = {
        "canned": CannedTransport(),
        "guard(canned)": guarded,
        "guard(canned, no pool)": llama_guard.GuardTransport(fallback_inner),
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


# -- instruction counts -------------------------------------------------------------------------------------------


def _callgrind(valgrind: str, variant: str, requests: int) -> int:
    """User-space instructions (Ir) of a child Python that makes ``requests`` in-memory requests of ``variant``."""
    command = [
        valgrind,
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        str(Path(__file__).resolve()),
        "--instructions-child",
        variant,
        str(requests),
    ]
    # The same process wherever this script is started from: the same hashes, no .pyc written by one child and read
    # by the next, and the same working directory and environment (their size moves the memory layout, and with
    # it the count: starting from another directory changed it by 0.1%).
    here = str(Path(__file__).resolve().parent)
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "PWD": here}
    env |= {"PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=here, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind of {variant} x{requests} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return int(found.group(1))


def instruction_counts(valgrind: str, variants: tuple[str, ...] = INSTRUCTION_VARIANTS) -> dict[str, float]:
    """Instructions per request of each variant, whole sync stack in memory: (Ir(N2) - Ir(N1)) / (N2 - N1)."""
    n1, n2 = INSTRUCTION_REQUESTS
    jobs = [(variant, n) for n in (n2, n1) for variant in variants]  # the long ones first: two finish together
    with ThreadPoolExecutor(max_workers=INSTRUCTION_JOBS) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: _callgrind(valgrind, *job), jobs), strict=True))
    return {variant: (counts[variant, n2] - counts[variant, n1]) / (n2 - n1) for variant in variants}


def instruction_table(per_request: dict[str, float]) -> str:
    n1, n2 = INSTRUCTION_REQUESTS
    bare = per_request["bare"]
    rows = [
        [variant, f"{count:,.0f}", f"{count - bare:+,.0f}", f"{count / bare:.3f}"]
        for variant, count in per_request.items()
    ]
    return "\n".join(
        [
            f"Instructions per request (callgrind Ir), sync, whole stack in memory (CannedBackend): "
            f"(Ir({n2} requests) - Ir({n1} requests)) / {n2 - n1}, one child Python each. They count the client's "
            "user-space instructions whatever else the machine does, so they are the one figure here that repeats "
            "on a shared machine (to a few instructions per request, same software and environment); they leave "
            "out the kernel's time in system calls (none in memory, several per real request) and what an "
            "instruction costs (cache misses, branch mispredictions, clock), so they measure work, not time. "
            "bare+poolfix: bare with the guard's pool-race fix alone.",
            table(["variant", "instructions/request", "vs bare", "ratio to bare"], rows),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=250, help="requests per variant per round (default 250)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=500, help="warm-up requests per variant (default 500)")
    parser.add_argument("--profile", action="store_true", help="profile the guard even when within the target")
    instructions = parser.add_mutually_exclusive_group()
    instructions.add_argument(
        "--instructions",
        action="store_true",
        help="only the instruction counts (callgrind; by default they end the run when valgrind is found)",
    )
    instructions.add_argument("--no-instructions", action="store_true", help="skip the instruction counts")
    # Internal: one child of the instruction counts (run under callgrind).
    parser.add_argument("--instructions-child", nargs=2, metavar=("VARIANT", "REQUESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--requests and --rounds must be >= 1, --warmup >= 0")
    if args.instructions_child:
        variant, requests = args.instructions_child
        with in_memory_client(variant) as client:
            run_sync(client, int(requests))
        return 0
    valgrind = None if args.no_instructions else shutil.which("valgrind")
    if args.instructions and valgrind is None:
        parser.error("--instructions needs valgrind (not found on PATH)")

    print(f"machine: {machine()}")
    started = time.monotonic()
    if args.instructions:
        assert valgrind is not None
        print()
        print(instruction_table(instruction_counts(valgrind)))
        print(f"\n({time.monotonic() - started:.0f} s)")
        return 0
    print(
        f"httpx {httpx.__version__}, llama_guard {llama_guard.__version__}; {args.rounds} rounds x "
        f"{args.requests} requests per variant, {args.warmup} warm-up; keep-alive server in its own process"
    )
    with keepalive_server() as url:
        by_kind: dict[str, Measured] = {
            "sync httpx.Client": measure_sync(url, VARIANTS, args.rounds, args.requests, args.warmup),
            "asyncio httpx.AsyncClient": asyncio.run(measure_async(url, args.rounds, args.requests, args.warmup)),
        }
        print()
        print(
            "Per-request cost, median of rounds; ratios are medians of per-round ratios (range over rounds); "
            "'wall' is elapsed time, 'client CPU' the client thread's CPU time (the server runs in another process):"
        )
        print(summary_table(by_kind))
        worst = {
            metric: max(median(ratios(getattr(m, attr), "guard", "bare")) for m in by_kind.values())
            for metric, attr in (("wall", "wall"), ("client CPU", "cpu"))
        }
        for metric, value in worst.items():
            verdict = "within" if value <= TARGET else "ABOVE"
            print(f"target guard/bare <= {TARGET}, {metric}: {verdict} (worst client kind {value:.3f})")
        if max(worst.values()) > TARGET or args.profile:
            print()
            print(profile(args.rounds, args.requests, median(by_kind["sync httpx.Client"].wall["bare"])))
    if valgrind is not None:
        print()
        print(instruction_table(instruction_counts(valgrind)))
    elif not args.no_instructions:
        print("\n(instruction counts skipped: valgrind not found)")
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
