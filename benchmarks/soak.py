"""Soak: many requests through one guarded client against a faulty llama-server emulator; does anything leak?

One `httpx.Client` with a `GuardTransport` (default policy) is shared by ``--threads`` threads, which send
``--requests`` non-streamed and streamed (every other one) ``POST /v1/chat/completions`` to the emulator. The
emulator runs in its own process (this script with ``--serve``), so that its memory does not count in the client's,
with both llama-server defects on (streams closed after the final chunk despite keep-alive; the thread pool's
idle-counter bug) and a fault armed every ``--fault-every`` requests, in rotation: a reset before anything is read, a
connection never read, a request read and left unanswered, garbage in answer to the probe, a 503 and a 429. The guard
recovers from every one of those without losing the request.

The requests go in blocks of ``--every``; between blocks nothing is in flight, and the script records the client
process's resident memory (VmRSS, after a full garbage collection), its open file descriptors (/proc/self/fd), the
sockets the pool holds open (idle keep-alive connections are open descriptors by design), the objects the garbage
collector tracks and Python's allocated memory blocks (which also count free lists and the pool's idle connections,
so they move by a few hundred either way), and the requests lost so far. After the last block the client is closed
and the descriptors are counted again.

Goal: flat. RSS grows by less than ``--max-growth-mb`` (5 MB) from the first checkpoint to the last; descriptors
outside the pool stay at the baseline at every checkpoint, and all of them are back to the baseline once the client
is closed; nothing is lost. The first checkpoint comes after ``--warmup`` requests (1,000), so that the one-time
allocations of a first use (lazy imports, caches, the pool reaching its size) are not counted as growth; the table
shows the figure before any request too.

Usage::

    python benchmarks/soak.py                                  # 100,000 requests, a row every 10,000
    python benchmarks/soak.py --requests 20000 --every 2000    # shorter
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import machine, table

import llama_guard
from llama_guard.testing import EmulatorStats, Fault, LlamaServerEmulator

CHAT = "/v1/chat/completions"
# The faults armed in rotation: each one is something the guard must recover from without losing the request.
FAULTS: tuple[tuple[Fault, dict[str, Any]], ...] = (
    (Fault.RESET_BEFORE_READ, {}),
    (Fault.HEADERS_NEVER, {"path": CHAT, "hold": 0.0}),
    (Fault.STATUS_503, {"path": CHAT}),
    (Fault.GARBAGE, {"path": "/health"}),
    (Fault.NEVER_ANSWER_ACCEPT, {"hold": 1.0}),
    (Fault.STATUS_429, {"path": CHAT, "retry_after": 0}),
)


# -- the server process ----------------------------------------------------------------------------------------------


def serve(fault_every: int) -> int:
    """Run the emulator; arm a fault every ``fault_every`` chat requests; answer "stats" on stdin; stop at EOF."""
    emulator = LlamaServerEmulator(stream_close_delay=0.005, parallel=8, n_tokens=4, http_threads=4, pool_bug=True)
    done = threading.Event()
    armed = 0

    def arm_faults() -> None:
        nonlocal armed
        for index in itertools.count():
            threshold = (index + 1) * fault_every
            while not done.is_set():
                try:
                    emulator.wait_for(_chat_requests_reach(threshold), timeout=1.0)
                except TimeoutError:
                    continue
                break
            if done.is_set():
                return
            fault, params = FAULTS[index % len(FAULTS)]
            emulator.inject(fault, **params)
            armed += 1

    with emulator:
        print(json.dumps({"url": emulator.url}), flush=True)
        injector = threading.Thread(target=arm_faults, name="soak-faults", daemon=True)
        injector.start()
        for line in sys.stdin:
            if line.strip() == "stats":
                stats = emulator.stats()
                answer = {
                    "chat_requests": stats.requests_to(CHAT),
                    "completions_started": stats.completions_started,
                    "completions_finished": stats.completions_finished,
                    "connections_accepted": stats.connections_accepted,
                    "faults_armed": armed,
                    "faults_triggered": {fault.name: count for fault, count in stats.faults_triggered.items()},
                    "errors": list(stats.errors),
                    "rss_mb": _rss_mb(),
                }
                print(json.dumps(answer), flush=True)
        done.set()
        injector.join(5.0)
    return 0


def _chat_requests_reach(count: int) -> Callable[[EmulatorStats], bool]:
    return lambda stats: stats.requests_to(CHAT) >= count


class ServerProcess:
    """This script with ``--serve``, in a child process; talks JSON lines over its stdin and stdout."""

    def __init__(self, fault_every: int) -> None:
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", "--fault-every", str(fault_every)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url: str = self._read()["url"]

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the emulator process exited ({self._process.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def stats(self) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write("stats\n")
        self._process.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()


# -- measurements ---------------------------------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # less the descriptor listdir itself holds


def _pool_sockets(transport: httpx.HTTPTransport) -> int:
    """Connections the pool holds open (idle keep-alive ones; nothing is in flight at a checkpoint)."""
    return sum(1 for connection in transport._pool.connections if not connection.is_closed())


@dataclass
class Checkpoint:
    requests: int
    seconds: float
    rss_mb: float
    fds: int
    pool_sockets: int
    objects: int
    blocks: int
    lost: int
    retries: int


@dataclass
class Load:
    client: httpx.Client
    lost: int = 0
    examples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def one(self, index: int) -> None:
        stream = index % 2 == 1
        body = {"messages": [{"role": "user", "content": f"request {index}"}], "stream": stream}
        try:
            with self.client.stream("POST", CHAT, json=body) as response:
                content = response.read()
                ok = response.status_code == 200 and (
                    content.endswith(b"data: [DONE]\n\n") if stream else content.startswith(b'{"choices"')
                )
                problem = f"HTTP {response.status_code}, {len(content)} bytes"
        except httpx.HTTPError as exc:
            ok, problem = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            with self.lock:
                self.lost += 1
                if len(self.examples) < 5:
                    self.examples.append(problem)

    def block(self, pool: ThreadPoolExecutor, threads: int, first: int, count: int) -> None:
        """``count`` requests from index ``first``, shared by ``threads`` workers; returns when all are done."""
        indices = iter(range(first, first + count))
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    index = next(indices, None)
                if index is None:
                    return
                self.one(index)

        for future in [pool.submit(worker) for _ in range(threads)]:
            future.result()


def soak(args: argparse.Namespace) -> int:
    print(f"Machine: {machine()}")
    print(
        f"{args.requests:,} requests, {args.threads} threads, pool of {args.max_connections}, a fault every "
        f"{args.fault_every} requests, checkpoints after a warm-up of {args.warmup:,} and every {args.every:,}"
    )
    server = ServerProcess(args.fault_every)
    inner = httpx.HTTPTransport(
        limits=httpx.Limits(
            max_connections=args.max_connections, max_keepalive_connections=args.max_connections, keepalive_expiry=4.0
        )
    )
    transport = llama_guard.GuardTransport(inner)
    client = httpx.Client(transport=transport, base_url=server.url, timeout=httpx.Timeout(30.0, pool=120.0))
    load = Load(client)
    gc.collect()
    before_rss, baseline_fds = _rss_mb(), _open_fds()
    print(f"before any request: RSS {before_rss:.1f} MB, {baseline_fds} open descriptors", flush=True)
    checkpoints: list[Checkpoint] = []
    started = time.monotonic()

    def checkpoint(done: int) -> None:
        gc.collect()
        point = Checkpoint(
            requests=done,
            seconds=time.monotonic() - started,
            rss_mb=_rss_mb(),
            fds=_open_fds(),
            pool_sockets=_pool_sockets(inner),
            objects=len(gc.get_objects()),
            blocks=sys.getallocatedblocks(),
            lost=load.lost,
            retries=transport.stats.retries,
        )
        checkpoints.append(point)
        print(
            f"  {done:>7,} requests  {point.seconds:7.1f} s  RSS {point.rss_mb:6.1f} MB  fds {point.fds:3d} "
            f"(pool {point.pool_sockets})  objects {point.objects:,}  blocks {point.blocks:,}  lost {point.lost}  "
            f"retries {point.retries}",
            flush=True,
        )

    try:
        with ThreadPoolExecutor(args.threads, thread_name_prefix="soak") as pool:
            done = 0
            load.block(pool, args.threads, done, args.warmup)
            done += args.warmup
            checkpoint(done)
            while done < args.requests:
                # Up to the next multiple of --every (the checkpoints fall on 10,000, 20,000, ... by default).
                count = min((done // args.every + 1) * args.every, args.requests) - done
                load.block(pool, args.threads, done, count)
                done += count
                checkpoint(done)
        stats = transport.stats.snapshot()
        client.close()
        gc.collect()
        closed_fds = _open_fds()
        server_side = server.stats()
    finally:
        client.close()
        server.stop()

    first, last = checkpoints[0], checkpoints[-1]
    growth = last.rss_mb - first.rss_mb
    rows = [
        [
            f"{point.requests:,}",
            f"{point.seconds:.0f}",
            f"{point.rss_mb:.1f}",
            f"{point.rss_mb - first.rss_mb:+.1f}",
            str(point.fds),
            str(point.pool_sockets),
            str(point.fds - point.pool_sockets),
            f"{point.objects - first.objects:+,}",
            f"{point.blocks - first.blocks:+,}",
            str(point.lost),
        ]
        for point in checkpoints
    ]
    print()
    print(
        f"Before any request: RSS {before_rss:.1f} MB, {baseline_fds} descriptors ({last.rss_mb - before_rss:+.1f} MB "
        f"by the end, warm-up included). Client closed at the end: {closed_fds} descriptors."
    )
    print(
        table(
            [
                "requests",
                "time s",
                "RSS MB",
                "RSS growth MB",
                "open fds",
                "pool sockets",
                "fds outside pool",
                "gc objects growth",
                "Python blocks growth",
                "lost",
            ],
            rows,
            left=0,
        )
    )
    faults = server_side["faults_triggered"]
    print()
    print(
        f"guard: {stats.requests:,} requests, {stats.retries:,} retries, {stats.probes_sent:,} probes "
        f"({stats.probes_failed:,} failed), {stats.stream_connections_closed:,} stream connections closed; "
        f"errors by attempt: {dict(sorted(stats.errors.items()))}"
    )
    print(
        f"server: {server_side['chat_requests']:,} chat requests, {server_side['completions_started']:,} completions "
        f"started, {server_side['connections_accepted']:,} connections; {server_side['faults_armed']:,} faults armed, "
        f"triggered {faults}; emulator process RSS {server_side['rss_mb']:.1f} MB; emulator errors: "
        f"{len(server_side['errors'])}"
    )
    if load.examples:
        print(f"lost, e.g.: {load.examples}")
    verdicts = [
        (f"RSS growth {growth:+.1f} MB < {args.max_growth_mb:g} MB", growth < args.max_growth_mb),
        (
            f"descriptors outside the pool at the baseline ({baseline_fds}) at every checkpoint",
            all(point.fds - point.pool_sockets == baseline_fds for point in checkpoints),
        ),
        (f"descriptors back to the baseline once the client is closed ({closed_fds})", closed_fds == baseline_fds),
        (f"requests lost: {load.lost}", load.lost == 0),
        (
            f"completions run by the server = requests sent ({server_side['completions_started']:,})",
            server_side["completions_started"] == args.requests,
        ),
    ]
    print()
    for text, ok in verdicts:
        print(f"[{'PASS' if ok else 'FAIL'}] {text}")
    return 0 if all(ok for _, ok in verdicts) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000, help="requests in all, the warm-up included")
    parser.add_argument("--every", type=int, default=10_000, help="requests between checkpoints")
    parser.add_argument("--warmup", type=int, default=1_000, help="requests before the first checkpoint")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--max-connections", type=int, default=8)
    parser.add_argument("--fault-every", type=int, default=100, help="arm a fault every N chat requests")
    parser.add_argument("--max-growth-mb", type=float, default=5.0)
    parser.add_argument("--verbose", action="store_true", help="show the guard's warnings (one per retry)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.fault_every)
    for name in ("requests", "every", "threads", "max_connections", "fault_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.warmup < args.requests:
        parser.error("--warmup must be at least 0 and less than --requests")
    if not args.verbose:
        logging.getLogger("llama_guard").setLevel(logging.ERROR)  # a warning per retry: a thousand lines
    return soak(args)


if __name__ == "__main__":
    raise SystemExit(main())
