"""Defect 2 on the wire: a burst of keep-alive connections against a fresh llama-server.

``run_burst`` is shared by the test and by a measurement run::

    python -m tests.real._burst --runs 6              # prints the stall count of each fresh server
    python -m tests.real._burst --runs 6 --hogs 2     # with two CPU-bound processes beside the server
    python -m tests.real._burst --runs 6 --hogs 1 --pin 0 --batch   # as the tests: see STALL_SERVER

cpp-httplib 0.59.0's ``ThreadPool::enqueue`` spawns a dynamic thread only when
``idle_thread_count_ == 0``, but a worker that was notified and has not woken up
yet still counts as idle. When connections are accepted faster than workers wake
up, enqueue sees "idle" threads that are about to be taken, spawns nothing, and
the surplus connections wait in the job queue, unread, until a worker's
connection closes. A worker owns its connection for its whole keep-alive life,
so with clients that keep their connections busy that is not within the test.

Measured on b11434 (2 cores): in the worst runs only the 4 base threads serve
(28 of 32 stalled); the stalled ones are always the last to connect (the queue
is FIFO). A connection opened later does not help: it spawns at most one dynamic
thread, which takes the *oldest* queued connection, so the newcomer queues too.
Queued connections are served as threads free up: a served connection closed by
its client, idle for the 5 s keep-alive timeout, or at its 100th request.

The race needs the workers to be slow to wake: on a quiet machine this build
stalled in 0 of 7 fresh-server bursts. So the tests create that condition
(:data:`STALL_SERVER` pins the server to one CPU as ``SCHED_BATCH``;
:func:`stall_load` keeps a CPU-bound process on that CPU while the connections
arrive), check that the stall happened before judging anything, and retry with a
fresh server only as a last resort, saying how often (:func:`until_stalled`).
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import llama_guard
from llama_guard.testing._cpu_load import CpuHogs

from ._raw_http import RawConnection, request_bytes

# The guarded burst tests' load (httpx and aiohttp alike): 32 connections, each requesting in a loop.
BURST = 32
BURST_SECONDS = 10.0
BURST_PAUSE = 0.15  # keeps each connection busy without reaching cpp-httplib's 100 requests per connection
BURST_TOKENS = 4


def stalled_first_request_worst(policy: llama_guard.GuardPolicy) -> float:
    """Seconds a first request whose connections keep stalling waits before its last attempt, by ``policy``: the
    probe deadline of each failed attempt (0.5, 0.5, 1 s by default), each followed by a reconnect jitter of at
    most as long. Under the stall conditions a replacement can stall again, so every attempt may be needed."""
    deadlines = [policy.probe_timeout, policy.probe_timeout]
    while len(deadlines) < policy.max_attempts - 1:
        deadlines.append(min(deadlines[-1] * 2, policy.probe_timeout_max))
    return 2 * sum(deadlines[: policy.max_attempts - 1])


# The test's wall-clock bound on a first response: twice the policy's worst case (4 s by default), for the
# server's own slowness in the conditions the test creates (half a core). The plain clients' stalled first
# requests wait the whole run (their 5 s timeout) instead.
FIRST_RESPONSE_BOUND = 2 * stalled_first_request_worst(llama_guard.GuardPolicy())


HEALTH = request_bytes("GET", "/health")

#: How the burst tests make the workers slow to wake: the server pinned to one CPU, its threads ``SCHED_BATCH``
#: (a woken worker never preempts the accept loop or the busy process), and one CPU-bound process on that CPU.
#: Measured on this 2-core machine (other work running, load average 9 to 15), stalled runs of fresh servers:
#: raw-socket bursts 5 of 5 this way; 5 of 5 with two unpinned hogs, 3 of 5 with the server and one hog pinned
#: (no SCHED_BATCH). httpx bursts (as in test_real_guard.py), where the ways differ: 9 of 9 plain and 6 of 6
#: guarded this way; with two unpinned hogs 7 of 9 (and 6 of 11 before the hogs were awaited spinning), three
#: unpinned hogs 5 of 9, the server and two hogs pinned without SCHED_BATCH 4 of 9.
STALL_CPU = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0  # Linux only, as pinning
STALL_HOGS = 1
STALL_CPUS: frozenset[int] | None = frozenset({STALL_CPU})
#: The server for a burst: cpp-httplib's 4 base threads, one compute thread (two spinning against busy cores
#: slowed inference tenfold), pinned and SCHED_BATCH as above.
STALL_SERVER: dict[str, Any] = {"threads_http": 4, "threads": 1, "cpus": STALL_CPUS, "batch_scheduling": True}
#: What the messages call that condition.
STALL_CONDITION = f"the server pinned to CPU {STALL_CPU} as SCHED_BATCH beside {STALL_HOGS} CPU-bound process"
#: Fresh servers a burst test tries, at most, before it concludes the stall did not happen.
STALL_TRIES = 5
#: What a guarded burst test tries fresh servers for, at most STALL_TRIES: the stall, with the kicks (if any went
#: out) rescuing at least one connection. A burst whose kicks rescued nothing is tried again: cpp-httplib's pool
#: (httplib.cpp, ``ThreadPool::enqueue``) spawns a thread for a new connection only while no worker counts as idle,
#: and a worker woken for a queued connection counts as idle until it runs. In the stall condition workers are slow
#: to run (that is what stalls the burst), so a kick can meet such a count and spawn nothing. Seen once in CI
#: (stop 34, aiohttp: 5 kicks, 0 rescued, 7 probes given up and replaced, nothing lost or late).
STALL_MET = "stalled, any kicks rescuing"


def kicks_rescuing(kicks: int, rescued: int) -> bool:
    """The second half of :data:`STALL_MET`: no kick went out, or the kicks rescued at least one connection."""
    return kicks == 0 or rescued >= 1


T = TypeVar("T")


def stall_load() -> CpuHogs:
    """The CPU load that makes the pool's workers slow to wake: run it (``with``) while the connections arrive, beside
    a server started with :data:`STALL_SERVER`."""
    return CpuHogs(STALL_HOGS, cpus=STALL_CPUS)


def until_stalled(
    run: Callable[[int], T], stalled: Callable[[T], bool], *, tries: int = STALL_TRIES, met: str = "stalled"
) -> list[T]:
    """Call ``run(try_number)`` (a burst on a fresh server) until ``stalled(result)``, at most ``tries`` times.

    Returns every result (the last is the one that stalled, if any); prints how many tries it took and whether
    ``stalled`` was ``met`` (``-rA``)."""
    results: list[T] = []
    for number in range(1, tries + 1):
        results.append(run(number))
        if stalled(results[-1]):
            break
    outcome = met if stalled(results[-1]) else f"never {met}"
    print(f"fresh-server tries: {len(results)} of at most {tries} ({outcome})")
    return results


@dataclass
class _Conn:
    index: int
    conn: RawConnection
    first_response_at: float | None = None
    responses: int = 0
    ended: str = ""


@dataclass
class BurstResult:
    n: int
    #: Indexes (in connect order) of the connections whose first response never came.
    stalled: list[int]
    responses: int
    connect_seconds: float
    #: Seconds from sending the first requests to the last first-response that came.
    served_within: float
    #: How each connection's loop ended: deadline, stopped (early), timeout (stalled), errors.
    endings: dict[str, int]
    seconds: float

    def summary(self) -> str:
        return (
            f"{len(self.stalled)}/{self.n} stalled {self.stalled}, {self.responses} responses, "
            f"connect {self.connect_seconds:.3f} s, served within {self.served_within:.3f} s, "
            f"ran {self.seconds:.1f} s, endings {self.endings}"
        )


def connect_all(
    address: tuple[str, int], n: int, *, timeout: float = 10.0, nonblocking: bool = True
) -> list[socket.socket]:
    """Open ``n`` TCP connections back to back.

    ``nonblocking``: start every handshake before waiting for any (``connect_ex``
    on non-blocking sockets, then wait until all are writable), so the server's
    accept loop finds them all at once and enqueues them as fast as it can. A
    blocking connect loop spaces them by one Python round trip each, which on an
    idle machine often lets the pool's workers wake in between and hides the race.
    """
    socks: list[socket.socket] = []
    try:
        if not nonblocking:
            for _ in range(n):
                socks.append(socket.create_connection(address, timeout=timeout))
            return socks
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setblocking(False)
            code = sock.connect_ex(address)
            if code not in (0, errno.EINPROGRESS, errno.EAGAIN):
                raise OSError(code, os.strerror(code))
        deadline = time.monotonic() + timeout
        pending = set(socks)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(pending)} of {n} connections not established in {timeout} s")
            _, writable, _ = select.select([], list(pending), [], remaining)
            for sock in writable:
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, os.strerror(code))
                pending.discard(sock)
        for sock in socks:
            sock.setblocking(True)
            sock.settimeout(timeout)
        return socks
    except BaseException:
        for sock in socks:
            sock.close()
        raise


def run_burst(
    address: tuple[str, int],
    *,
    n: int = 32,
    duration: float = 10.0,
    pause: float = 0.15,
    stop_when_all_served: bool = False,
    nonblocking_connect: bool = True,
) -> BurstResult:
    """Open ``n`` keep-alive connections back to back, THEN send ``GET /health`` on each,
    then keep each one busy (a request every ``pause`` s) for ``duration`` s.

    The pause keeps every connection active (keep-alive idle timeout: 5 s) without
    reaching cpp-httplib's 100 requests per connection within ~10 s, so a served
    connection never gives its thread back, as in a long-lived client pool. A
    connection is *stalled* if its first response never arrived.

    ``stop_when_all_served``: end as soon as every connection has had its first
    response (that run has no stall; no need to wait the full ``duration``).
    All sockets are closed and all threads joined before returning.
    """
    started = time.monotonic()
    conns: list[_Conn] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        for i, sock in enumerate(connect_all(address, n, nonblocking=nonblocking_connect)):
            conns.append(_Conn(i, RawConnection(sock)))
        connect_seconds = time.monotonic() - started
        sent_at = time.monotonic()
        for c in conns:
            c.conn.send(HEALTH)
        deadline = sent_at + duration

        def loop(c: _Conn) -> None:
            try:
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        c.ended = "deadline"
                        return
                    resp = c.conn.read_response(timeout=remaining)
                    if resp.status != 200:
                        c.ended = f"status {resp.status}"
                        return
                    c.responses += 1
                    if c.first_response_at is None:
                        c.first_response_at = time.monotonic()
                    if stop.wait(pause):
                        c.ended = "stopped"
                        return
                    if time.monotonic() >= deadline:
                        c.ended = "deadline"
                        return
                    c.conn.send(HEALTH)
            except TimeoutError:
                # A read waits until the run's deadline at most: a served connection whose later request is still
                # unanswered then ended with the run; "timeout" is a first request never answered (stalled).
                c.ended = "timeout" if c.first_response_at is None else "deadline"
            except (ConnectionError, OSError) as exc:
                c.ended = type(exc).__name__

        threads = [threading.Thread(target=loop, args=(c,), daemon=True) for c in conns]
        for t in threads:
            t.start()
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            if stop_when_all_served and all(c.first_response_at is not None for c in conns):
                break
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=duration + 15)
        for c in conns:
            c.conn.close()
    if any(t.is_alive() for t in threads):
        raise RuntimeError("a burst client thread did not finish")
    endings: dict[str, int] = {}
    for c in conns:
        endings[c.ended] = endings.get(c.ended, 0) + 1
    firsts = [c.first_response_at for c in conns if c.first_response_at is not None]
    return BurstResult(
        n=n,
        stalled=[c.index for c in conns if c.first_response_at is None],
        responses=sum(c.responses for c in conns),
        connect_seconds=connect_seconds,
        served_within=(max(firsts) - sent_at) if firsts else 0.0,
        endings=endings,
        seconds=time.monotonic() - started,
    )


def main() -> None:
    """Measure: one burst per fresh server, ``--runs`` times; print each run's stall count."""
    from llama_guard.testing._cpu_load import CpuHogs
    from llama_guard.testing._real_server import RealLlamaServer
    from llama_guard.testing._tiny_model import write_tiny_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads-http", type=int, default=4)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--model", default="/tmp/llama_guard_tiny.gguf")
    parser.add_argument("--blocking-connect", action="store_true", help="connect one at a time")
    parser.add_argument("--hogs", type=int, default=0, help="CPU-bound processes beside the server")
    parser.add_argument("--pin", type=int, default=None, help="pin the server and the hogs to this CPU")
    parser.add_argument("--batch", action="store_true", help="SCHED_BATCH for the server (needs --pin)")
    parser.add_argument("--stop-when-served", action="store_true", help="end a run once every connection is served")
    args = parser.parse_args()
    model = write_tiny_model(args.model)
    cpus = None if args.pin is None else {args.pin}
    counts = []
    for run in range(args.runs):
        server = RealLlamaServer(model, threads_http=args.threads_http, cpus=cpus, batch_scheduling=args.batch)
        try:
            server.start()
            with CpuHogs(args.hogs, cpus=cpus):
                result = run_burst(
                    server.address,
                    n=args.connections,
                    duration=args.duration,
                    nonblocking_connect=not args.blocking_connect,
                    stop_when_all_served=args.stop_when_served,
                )
        finally:
            server.stop()
            server.cleanup_log()
        counts.append(len(result.stalled))
        print(f"run {run + 1}: {result.summary()}", flush=True)
    print(f"stalled per run: {counts}; {sum(n > 0 for n in counts)} of {len(counts)} runs stalled")


if __name__ == "__main__":
    main()
