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

* the guard's own Python: `GuardTransport` around an in-process canned transport that answers at once and emits
  the trace events httpcore emits for a request on a pooled connection, against that canned transport bare;
* its trace callback alone (the closure it installs, called with those events);
* what the guard makes httpcore do: the five `Trace` blocks of a request with a no-op ``trace`` callback vs none,
  and the time inside the pool's ``_assign_requests_to_connections`` with the guard's pool-race fix vs without
  (``llama_guard/_pool_fix.py``), timed during real requests;
* end to end on the server again, with the automatic cyclic gc on and off, and the objects per request that end in
  reference cycles;
* cProfile of the guard on the canned transport: functions and files by own time, per request.

Usage::

    python benchmarks/overhead.py                       # 250 requests x 30 rounds per variant and client kind
    python benchmarks/overhead.py --requests 1000 --rounds 40 --profile
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
import pstats
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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
    elif variant == "bare+trace":  # profiling: httpcore's cost of a trace extension, with a no-op callback
        transport = inner
    elif variant in ("bare+poolfix", "bare+trace+poolfix"):  # profiling: the guard's pool-race fix (+ a trace)
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


def run_sync(
    client: httpx.Client, n: int, extensions: dict[str, Any] | None = None, *, gc_off: bool = False
) -> tuple[float, float]:
    """Wall-clock and client CPU seconds per request, for ``n`` requests one after the other (``gc_off``: with the
    automatic cyclic garbage collector disabled meanwhile)."""
    gc.collect()
    if gc_off:
        gc.disable()
    try:
        started, cpu_started = time.perf_counter(), time.thread_time()
        for _ in range(n):
            response = client.post(PATH, json=BODY, extensions=extensions)
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
    extensions = {v: ({"trace": _noop_trace} if v.startswith("bare+trace") else None) for v in variants}
    try:
        for variant, client in clients.items():
            run_sync(client, warmup, extensions[variant])
        results = Measured.empty(variants)
        for r in range(rounds):
            for variant in rotated(variants, r):
                sample = run_sync(clients[variant], requests, extensions[variant], gc_off=variant.endswith("gc-off"))
                results.add(variant, sample)
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
    guard's attempts do). Keeps the last trace callback it saw."""

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
    inner: Any = transport.transport if isinstance(transport, llama_guard.GuardTransport) else transport
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
    """The guard's own cost on a canned transport (no I/O): rounds, a cProfile of it, its trace callback's cost."""
    url = "http://127.0.0.1:8080"
    canned_bare = CannedTransport()
    canned_inner = CannedTransport()
    guarded = llama_guard.GuardTransport(canned_inner)
    variants: dict[str, httpx.BaseTransport] = {"canned": canned_bare, "guard(canned)": guarded}
    for transport in variants.values():
        _time_direct(transport, _requests(url, 2000))
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

    # The guard's trace callback alone: the closure it installed, called with a pooled request's events.
    trace = canned_inner.last_trace
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
        f"cProfile of {requests} requests through GuardTransport(canned); shares of the profiled time, and "
        f"'≈ µs' = share x the unprofiled cost of the guard's own Python ({guard_own * 1e6:.1f} µs):\n"
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
        ("bare", "guard", "bare gc-off", "bare+trace+poolfix gc-off", "guard gc-off"),
        short_rounds,
        short_requests,
        200,
        make=in_memory_client,
    ).cpu
    alone, profiler, trace_cb = guard_alone(rounds, requests)
    guard_hot = median([g - c for g, c in zip(alone["guard(canned)"], alone["canned"], strict=True)])
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
    httpcore_side, httpcore_iqr = difference("bare+trace+poolfix gc-off", "bare gc-off")
    own, own_iqr = difference("guard gc-off", "bare+trace+poolfix gc-off")

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
        row(
            "    httpcore's extra work, in the stack",
            httpcore_side,
            f"bare+no-op trace+pool fix - bare; {httpcore_iqr}",
        ),
        row("      httpcore tracing, alone", trace_machinery, "httpcore Trace blocks x5, no-op callback vs none"),
        row(
            "      pool-race fix, alone",
            pool_fix,
            f"_assign_requests_to_connections x2: {us(pool_fixed)} fixed vs {us(pool_original)} original",
        ),
        row("    the guard's own code, in the stack", own, f"guard - (bare+no-op trace+pool fix); {own_iqr}"),
        row(
            "      the same code hot, in a loop",
            guard_hot,
            f"GuardTransport(canned) {us(median(alone['guard(canned)']))} - canned {us(median(alone['canned']))}",
        ),
        row(
            "        of which its trace callback", trace_cb, "the closure GuardTransport._attempt installs, x10 events"
        ),
    ]
    noise = max(spread(v) for v in stack.values())
    return "\n".join(
        [
            f"Where the guard's cost goes: client CPU µs/request, sync, medians of {short_rounds} interleaved rounds "
            f"of {short_requests} (whole stack) and of {rounds} rounds of {requests} (parts alone); '% of bare' = "
            f"of the bare request in memory, '% of bare on server' = of the bare request's wall time on the server "
            f"above ({us(bare_on_server)} µs). Round spread of the in-memory rounds: {noise * 100:.0f}%.",
            table(["part", "µs/req", "% of bare", "% of bare on server", "measured as"], rows),
            f"The guard's objects left in reference cycles, per request: {garbage_types}",
            "",
            _profile_tables(profiler, guard_hot),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=250, help="requests per variant per round (default 250)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=500, help="warm-up requests per variant (default 500)")
    parser.add_argument("--profile", action="store_true", help="profile the guard even when within the target")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--requests and --rounds must be >= 1, --warmup >= 0")

    print(f"machine: {machine()}")
    print(
        f"httpx {httpx.__version__}, llama_guard {llama_guard.__version__}; {args.rounds} rounds x "
        f"{args.requests} requests per variant, {args.warmup} warm-up; keep-alive server in its own process"
    )
    started = time.monotonic()
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
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
