"""A proxy-like load on one shared httpx client, shared by ``llama-guard demo`` and ``llama-guard doctor``.

Many worker threads share one client with a small pool, as a web application or a proxy in front of
llama-server does; every second request is streamed. That is the pattern that loses requests to llama-server's
stream defect: a stream's connection goes back to the pool just before the server closes it.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TextIO

import httpx

__all__ = [
    "HTTPX_ERRORS",
    "PROGRESS_EVERY",
    "ClientErrors",
    "LoadClient",
    "LoadResponse",
    "LoadRow",
    "join_stragglers",
    "proxy_load",
    "run_threads",
    "send_one",
]

#: The word for a request that failed with an error (the server closed its connection, an error status, ...).
LOST = "lost"
#: The word for a request that got no answer within the load's bound (``stuck_after``): it was not waited out.
STUCK = "stuck"


@dataclass
class LoadRow:
    """What one client saw: requests, and of them the ones lost (failed with an error) and stuck (no answer within
    the load's bound), and the first-byte latencies of the answered ones."""

    scenario: str
    client: str
    #: Requests finished: answered, lost or stuck.
    requests: int = 0
    #: Requests lost: failed with an error, or answered with an error status.
    errors: int = 0
    #: Requests stuck: no answer within the load's bound (``stuck_after``), given up on rather than waited out.
    stuck: int = 0
    #: The bound after which a request counts as stuck, in seconds (None: requests were waited out).
    stuck_after: float | None = None
    #: Requests sent and not finished yet.
    in_flight: int = 0
    #: For a guarded client: the connection strategy the guard chose per origin, and why
    #: (``GuardStats.connection_strategies``).
    connections: dict[str, str] = field(default_factory=dict)
    first_bytes: list[float] = field(default_factory=list)
    #: Failures by kind: the httpx exception's name and message, or ``HTTP 503`` for an error answer.
    error_kinds: dict[str, int] = field(default_factory=dict)
    #: One entry per request: (seconds since the load began, first-byte seconds or None if it failed, streamed).
    timeline: list[tuple[float, float | None, bool]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def started(self) -> None:
        with self.lock:
            self.in_flight += 1

    def record(
        self, first_byte: float | None, error: str | None = None, *, at: float = 0.0, stream: bool = False
    ) -> None:
        with self.lock:
            self.requests += 1
            self.in_flight = max(self.in_flight - 1, 0)
            self.timeline.append((at, first_byte if error is None else None, stream))
            if first_byte is None or error is not None:
                self.errors += 1
                kind = error or "no answer"
                self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
            else:
                self.first_bytes.append(first_byte)

    def record_stuck(self, *, at: float = 0.0, stream: bool = False) -> None:
        """A request with no answer within ``stuck_after``: neither answered nor lost."""
        with self.lock:
            self.requests += 1
            self.stuck += 1
            self.in_flight = max(self.in_flight - 1, 0)
            self.timeline.append((at, None, stream))

    @property
    def answered(self) -> int:
        return self.requests - self.errors - self.stuck

    def counts(self) -> str:
        """``"K lost, S stuck"``: the words and figures of progress lines and of final figures alike."""
        with self.lock:
            return f"{self.errors} {LOST}, {self.stuck} {STUCK}"

    @property
    def median(self) -> float:
        return statistics.median(self.first_bytes) if self.first_bytes else 0.0

    @property
    def maximum(self) -> float:
        return max(self.first_bytes) if self.first_bytes else 0.0


class ClientErrors(NamedTuple):
    """The error classes of the client library a load runs on: httpx's by default; httpx2's (the same names, classes
    of their own) for ``benchmarks/client_versions.py``."""

    #: What a failed request raises (``httpx.HTTPError``).
    failed: type[Exception]
    #: The part of it that is a timeout (``httpx.TimeoutException``): stuck rather than lost, with ``stuck_after``.
    timed_out: type[Exception]


HTTPX_ERRORS = ClientErrors(httpx.HTTPError, httpx.TimeoutException)


class LoadResponse(Protocol):
    """What a load reads of a response: its status, and its body to the end."""

    @property
    def status_code(self) -> int: ...

    def read(self) -> bytes: ...


class LoadClient(Protocol):
    """What a load needs of its client: ``httpx.Client``'s default ``timeout`` and ``stream()``, which httpx2's
    client has too."""

    @property
    def timeout(self) -> Any: ...

    def stream(
        self, method: str, url: str, *, json: Any = ..., timeout: Any = ...
    ) -> AbstractContextManager[LoadResponse]: ...


def send_one(
    client: LoadClient,
    path: str,
    body: dict[str, object],
    row: LoadRow,
    *,
    timeout: float | None = None,
    origin: float | None = None,
    stuck_after: float | None = None,
    errors: ClientErrors = HTTPX_ERRORS,
) -> bool:
    """One request, read to its end; recorded in ``row``. True when it was answered with 200. With
    ``stuck_after``, a request with no answer within that many seconds (the client's timeouts, each) is given up and
    recorded as stuck rather than waited out for the client's own timeout. ``client`` is an httpx client, or one of
    another library with httpx's API (`LoadClient`) whose ``errors`` are given."""
    started = time.monotonic()
    at = started - origin if origin is not None else 0.0
    stream = body.get("stream") is True
    row.started()
    try:
        request_timeout: float | httpx.Timeout = client.timeout if timeout is None else timeout
        if stuck_after is not None:
            request_timeout = stuck_after if timeout is None else min(stuck_after, timeout)
        with client.stream("POST", path, json=body, timeout=request_timeout) as response:
            first_byte = time.monotonic() - started
            response.read()
    except errors.failed as exc:
        if stuck_after is not None and isinstance(exc, errors.timed_out):
            row.record_stuck(at=at, stream=stream)
            return False
        # The message tells causes apart that share a type: "Server disconnected" (a connection the server
        # closed) from "Bad file descriptor" (httpcore's own pool race between threads).
        kind = f"{type(exc).__name__}: {str(exc).rstrip('.')}" if str(exc) else type(exc).__name__
        row.record(None, kind[:100], at=at, stream=stream)
        return False
    ok = response.status_code == 200
    row.record(first_byte, None if ok else f"HTTP {response.status_code}", at=at, stream=stream)
    return ok


def proxy_load(
    client: LoadClient,
    row: LoadRow,
    *,
    requests: int,
    workers: int,
    path: str,
    body_for: Callable[[int], dict[str, object]],
    deadline: float | None = None,
    progress: TextIO | None = None,
    stuck_after: float | None = None,
    every: float | None = None,
    errors: ClientErrors = HTTPX_ERRORS,
) -> None:
    """``requests`` requests from ``workers`` threads sharing ``client``; no new request after ``deadline``
    (a time.monotonic() value), so a slow server cannot stretch the load without bound; with ``stuck_after``, a
    request with no answer within that many seconds is counted as stuck, not waited out. With ``progress``, a
    line there every few seconds (``every``): how many finished, lost and stuck so far, and what is waited for;
    and a last line when the load is done, whose figures are the row's. ``client`` and ``errors`` as for
    `send_one`."""
    counter = itertools.count()
    origin = time.monotonic()
    stop = threading.Event()
    row.stuck_after = stuck_after
    bound = f" (no answer within {stuck_after:g} s counts as {STUCK})" if stuck_after is not None else ""

    def worker() -> None:
        while not stop.is_set() and (index := next(counter)) < requests:
            if deadline is not None and time.monotonic() >= deadline:
                return
            send_one(client, path, body_for(index), row, origin=origin, stuck_after=stuck_after, errors=errors)

    def line(prefix: str) -> str:
        with row.lock:
            done, waiting = row.requests, row.in_flight
        text = f"      {prefix}: {done} of {requests} requests, {row.counts()}"
        if waiting and done + waiting >= requests:
            text += f"; waiting for the last {waiting} in flight{bound}"
        elif waiting:
            text += f", {waiting} in flight"
        return text

    def tick() -> None:
        if progress is not None:
            print(line(f"{time.monotonic() - origin:3.0f} s"), file=progress, flush=True)

    run_threads([worker] * workers, stop=stop, tick=tick, every=PROGRESS_EVERY if every is None else every)
    if progress is not None:
        text = line(f"done in {time.monotonic() - origin:.1f} s")
        with row.lock:
            unsent = requests - row.requests - row.in_flight
        # Said, or the requests never sent would read as vanished.
        if unsent > 0 and deadline is not None and time.monotonic() >= deadline:
            text += f"; {unsent} not sent: the load sends no request after its {deadline - origin:.3g} s limit"
        print(text, file=progress, flush=True)


#: Seconds between progress lines of a long wait.
PROGRESS_EVERY = 2.0


def run_threads(
    jobs: list[Callable[[], None]],
    *,
    stop: threading.Event | None = None,
    tick: Callable[[], None] | None = None,
    every: float = PROGRESS_EVERY,
) -> None:
    """Run ``jobs`` in threads and wait for them. On Ctrl-C, ``stop`` is set (jobs should check it between
    requests) and the interrupt goes on to the caller, whose ``with`` blocks close the client and the server
    under the threads: what those threads then raise is the interruption's echo, not an error, and stays quiet.
    ``tick`` is called every ``every`` seconds while they run (progress)."""
    stop = stop if stop is not None else threading.Event()

    def quiet(job: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                job()
            except BaseException:
                if not stop.is_set():
                    raise

        return run

    threads = [threading.Thread(target=quiet(job), daemon=True, name="llama-guard-load") for job in jobs]
    for thread in threads:
        thread.start()
    next_tick = time.monotonic() + every
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(max(next_tick - time.monotonic(), 0.0) if tick is not None else None)
                if tick is not None and time.monotonic() >= next_tick:
                    tick()
                    next_tick = time.monotonic() + every
    except KeyboardInterrupt:
        stop.set()
        raise


def join_stragglers(budget: float = 2.0) -> list[threading.Thread]:
    """Wait up to ``budget`` seconds for this process's other threads to end; the ones still running."""
    deadline = time.monotonic() + budget
    others = [thread for thread in threading.enumerate() if thread is not threading.current_thread()]
    for thread in others:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return [thread for thread in others if thread.is_alive()]
