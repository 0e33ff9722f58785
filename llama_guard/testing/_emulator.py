"""``LlamaServerEmulator``: llama-server's HTTP behaviour on a real socket.

How the pieces map to the real server (llama.cpp ``tools/server/server-http.cpp``
on cpp-httplib; the facts about b11434 come from measurements):

* **Accept loop** (``Server::listen_internal``): one thread accepts and hands
  each socket to the pool with ``enqueue``; it reads nothing, so a queued
  connection's request sits in the kernel's receive queue.
* **Thread pool** (``ThreadPool``, see :mod:`._httplib_pool`): ``http_threads``
  base threads, dynamic ones up to ``max_http_threads``, the idle-counter bug of
  builds before b11737 when ``pool_bug=True`` (defect 2).  A thread owns a
  connection for its whole keep-alive life.  ``stall_burst`` replaces the
  race with a deterministic gate in front of the pool (see :mod:`._stall_gate`).
* **Keep-alive loop** (``process_server_socket_core``, see :mod:`._handler`):
  ``keepalive_max`` requests per connection, ``keepalive_timeout`` idle wait,
  ``Keep-Alive: timeout=5, max=100`` announced -- also on streams, which are
  then closed right after ``0\\r\\n\\r\\n`` (defect 1, ``close_after_stream``;
  ``stream_close="on_reuse"`` instead closes when the next request arrives).
* **Slots** (``--parallel``, see :mod:`._slots`): a completion waits, silent,
  for a free slot; streamed heads go out with the first token, non-streamed
  answers once generation is over.
* **Middleware**: ``Server: llama.cpp`` on everything,
  ``Access-Control-Allow-Origin`` echoing ``Origin``, ``503`` with
  ``{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}``
  on every route (``/health`` included) while loading.

Deliberate differences: the listen backlog is 128, not cpp-httplib's 5 (so a
Python client's connect burst is not slowed by SYN retransmits); a malformed
request gets its ``400`` and the connection is closed; the OS wake-up latency
of pool threads is an explicit knob (``wakeup_latency``) so the pool race is
reproducible.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

from .._readiness import ready
from ._config import EmulatorConfig
from ._faults import Fault, FaultInjector, FaultRule
from ._handler import ServerContext, serve_connection
from ._httplib_pool import HttplibThreadPool
from ._lifecycle import StartStop
from ._slots import SlotPool
from ._stall_gate import StallGate
from ._stats import ConnectionWait, EmulatorStats, LiveView, StatsRecorder
from ._wire import Wire, pending_bytes, reset_socket

__all__ = ["HeldConnection", "LlamaServerEmulator"]

_E = TypeVar("_E", bound="LlamaServerEmulator")

LISTEN_BACKLOG = 128
#: How long ``stop()`` waits for all threads by default.
STOP_TIMEOUT = 5.0


class HeldConnection(NamedTuple):
    """A connection that a fault on accept holds unread (``NEVER_ANSWER_ACCEPT``, ``READ_LATE``)."""

    fault: Fault
    #: The client's address, as the server sees it (the client's ``getsockname()``).
    peer: tuple[Any, ...]
    #: Bytes the client sent that sit unread in the kernel's receive queue.
    unread_bytes: int
    #: Seconds until the fault lets go of it (``READ_LATE``: served; else closed); None for never (until stop).
    releases_in: float | None


class _Parked(NamedTuple):
    sock: socket.socket
    fault: Fault
    deadline: float | None
    accepted_at: float


class _QueuedConnection:
    """A pool job: one accepted socket waiting for (then run by) a pool thread."""

    __slots__ = ("accepted_at", "conn_id", "emulator", "gated", "sock", "stalled")

    def __init__(self, emulator: LlamaServerEmulator, conn_id: int, sock: socket.socket) -> None:
        self.emulator = emulator
        self.conn_id = conn_id
        self.sock = sock
        self.accepted_at = time.monotonic()
        self.gated = False  # admitted by the stall_burst gate, which must hear when it ends
        self.stalled = False  # held by the gate, its first request unread, before a thread took it

    def __call__(self) -> None:
        self.emulator._run_connection(self)


class LlamaServerEmulator(StartStop):
    """A controllable llama-server (b11434) look-alike on 127.0.0.1.

    Use it as a context manager (``with``/``async with``) or call
    :meth:`start`/:meth:`stop`.  All arguments are keyword-only and validated
    (``ValueError`` names the field and its accepted range):

    ``host``/``port``
        Where to listen; ``port=0`` picks a free port (see :attr:`port`).
    ``http_threads``/``max_http_threads``
        Base and maximum pool threads (``--threads-http``; the real default is
        ``max(parallel + 4, CPUs - 1)`` base and base + 1024 maximum).
    ``pool_bug``
        Model cpp-httplib's idle-counter bug (builds before b11737); False
        models the fixed pool.
    ``wakeup_latency``
        Seconds a notified pool thread needs to run (and a new dynamic thread
        to start); the window in which the bug's idle counter is wrong.
        Connect bursts shorter than this stall deterministically.
    ``close_after_stream``/``stream_close``/``stream_close_delay``
        Close after every streamed response despite ``Keep-Alive`` (defect 1).
        ``stream_close="after_delay"`` (the default, timing-faithful) closes
        ``stream_close_delay`` seconds past the final chunk -- a small delay
        (5-50 ms) lets a pooled client reuse the connection first, which is how
        the lie hurts on loopback, but whether it does is a race.
        ``stream_close="on_reuse"`` (deterministic) sends no FIN: the
        connection stays open until the client's next request arrives on it,
        which is then closed unread and unanswered (counted in
        ``EmulatorStats.requests_dropped_after_stream``) -- every reuse after a
        stream is lost, whatever the load.  The keep-alive timeout, or the
        client closing first, still ends it quietly.
    ``stall_burst``
        The pool bug made deterministic (needs ``pool_bug=True``; the pool
        itself then spawns threads correctly).  A burst begins when a
        connection is accepted while none of the previous burst's is open; of
        its first ``stall_burst`` connections the first ``http_threads`` are
        served and the rest stalled, their first request unread, until a
        served connection closes (the oldest stalled one is then served) or
        :meth:`release_stalled` is called.  Later connections are served at
        once, as cpp-httplib spawns a dynamic thread when none is idle.  None
        (the default) leaves the stall to the timing-faithful race.
    ``stall_oldest_first``
        With ``stall_burst``: a later connection accepted while stalled ones
        wait is what cpp-httplib's FIFO queue makes of it -- the dynamic
        thread it spawns serves the *oldest* stalled connection, and the
        newcomer waits its turn.  A client that keeps its stalled connection
        and opens another one (``GuardPolicy.probe_kick``, the default) is rescued;
        a client that replaces it finds its replacement queued behind it.
    ``parallel``/``token_interval``/``n_tokens``
        Slots, seconds per generated token, default tokens per completion
        (``max_tokens``/``n_predict`` in the request win, capped at 4096).
    ``keepalive_timeout``/``keepalive_max``
        cpp-httplib's keep-alive idle timeout and requests per connection.
    ``loading``
        Start in the model-loading state (503 everywhere); see
        :meth:`set_loading`.
    ``read_timeout``, ``model``, ``build``
        Request read timeout (llama-server: 600 s), the model name reported,
        and the ``system_fingerprint``/``build_info`` string.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        http_threads: int = 4,
        max_http_threads: int = 64,
        pool_bug: bool = True,
        wakeup_latency: float = 0.005,
        close_after_stream: bool = True,
        stream_close: str = "after_delay",
        stream_close_delay: float = 0.0,
        stall_burst: int | None = None,
        stall_oldest_first: bool = False,
        parallel: int = 4,
        token_interval: float = 0.0,
        n_tokens: int = 8,
        keepalive_timeout: float = 5.0,
        keepalive_max: int = 100,
        loading: bool = False,
        read_timeout: float = 600.0,
        model: str = "emulated-model.gguf",
        build: str = "b11434-emulated",
    ) -> None:
        self._config = EmulatorConfig(
            host=host,
            port=port,
            http_threads=http_threads,
            max_http_threads=max_http_threads,
            pool_bug=pool_bug,
            wakeup_latency=wakeup_latency,
            close_after_stream=close_after_stream,
            stream_close=stream_close,
            stream_close_delay=stream_close_delay,
            stall_burst=stall_burst,
            stall_oldest_first=stall_oldest_first,
            parallel=parallel,
            token_interval=token_interval,
            n_tokens=n_tokens,
            keepalive_timeout=keepalive_timeout,
            keepalive_max=keepalive_max,
            loading=loading,
            read_timeout=read_timeout,
            model=model,
            build=build,
        )
        self._stats = StatsRecorder()
        self._faults = FaultInjector()
        self._stop_event = threading.Event()
        self._slots = SlotPool(parallel, self._stop_event)

        self._state_lock = threading.Lock()
        self._state = "new"
        self._loading = loading
        self._retry_after: str | None = None

        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._pool: HttplibThreadPool | None = None
        self._port = 0

        # Guards the connection tables *and* every close/shutdown of an accepted
        # socket (shared with each Wire), so stop() never shuts down a
        # descriptor number that a handler just closed and the OS reused.
        # Never take the stats lock while holding it.
        self._conn_lock = threading.RLock()
        self._conn_ids = itertools.count(1)
        self._queued: dict[int, _QueuedConnection] = {}
        self._active: dict[int, Wire] = {}
        # Connections held unread by a fault on accept; changed by the accept thread only, under _conn_lock.
        self._parked: dict[int, _Parked] = {}
        # stall_burst: which connections of a burst wait; used under _conn_lock.
        self._gate: StallGate[_QueuedConnection] | None = None
        if self._config.stall_burst is not None:
            self._gate = StallGate(
                served_first=self._config.http_threads,
                burst=self._config.stall_burst,
                oldest_first=self._config.stall_oldest_first,
            )
        self._stragglers: list[threading.Thread] = []
        self._ctx = ServerContext(
            config=self._config,
            stats=self._stats,
            faults=self._faults,
            slots=self._slots,
            stop_event=self._stop_event,
            loading=self._loading_state,
        )

    # -- properties ----------------------------------------------------------------

    @property
    def config(self) -> EmulatorConfig:
        """The validated settings (immutable)."""
        return self._config

    @property
    def host(self) -> str:
        return self._config.host

    @property
    def port(self) -> int:
        """The bound port (only meaningful once started)."""
        if self._state == "new":
            raise RuntimeError("the emulator is not started yet")
        return self._port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123`` (no trailing slash)."""
        host = self._config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._state == "running"

    # -- lifecycle ---------------------------------------------------------------------

    def start(self: _E) -> _E:
        """Bind, listen and start the accept thread and the pool threads."""
        with self._state_lock:
            if self._state != "new":
                raise RuntimeError(f"cannot start an emulator that is {self._state}")
            family = socket.AF_INET6 if ":" in self._config.host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((self._config.host, self._config.port))
                listener.listen(LISTEN_BACKLOG)
                listener.setblocking(False)
            except BaseException:
                listener.close()
                raise
            self._listener = listener
            self._port = int(listener.getsockname()[1])
            self._wake_r, self._wake_w = socket.socketpair()
            self._pool = HttplibThreadPool(
                base_threads=self._config.http_threads,
                max_threads=self._config.max_http_threads,
                # With stall_burst the gate stalls deterministically; the pool must not add stalls of its own.
                idle_counter_bug=self._config.pool_bug and self._gate is None,
                wakeup_latency=self._config.wakeup_latency,
                stop_event=self._stop_event,
                name=f"llama-http-{self._port}",
            )
            self._pool.start()
            self._acceptor = threading.Thread(target=self._accept_loop, name=f"llama-accept-{self._port}", daemon=True)
            self._state = "running"
            self._acceptor.start()
        return self

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Close every socket and join every thread, within ``timeout`` seconds.

        Connections still waiting for a pool thread are closed unread and
        recorded in the stats with ``served=False``; faults holding a
        connection "for ever" end here.  Idempotent.
        """
        with self._state_lock:
            if self._state in ("stopping", "stopped"):
                return
            if self._state == "new":
                self._state = "stopped"
                return
            self._state = "stopping"
        deadline = time.monotonic() + timeout
        self._stop_event.set()
        assert self._wake_w is not None
        assert self._pool is not None
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")
        if self._acceptor is not None:
            self._acceptor.join(max(0.0, deadline - time.monotonic()))
        self._pool.shutdown()
        self._abandon_queued()
        with self._conn_lock:
            for wire in self._active.values():
                wire.interrupt()
        self._slots.wake_all()
        self._stragglers = self._pool.join(deadline)
        if self._acceptor is not None and self._acceptor.is_alive():
            self._stragglers.append(self._acceptor)
        # Closed even if a thread straggles: it then fails on the closed wake
        # socket and unwinds, rather than leaking a socket into a ResourceWarning.
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        with self._state_lock:
            self._state = "stopped"

    async def __aenter__(self: _E) -> _E:
        return self.start()  # binding and spawning threads does not block

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Joining threads blocks; do it off the event loop (asyncio or trio).
        import anyio.to_thread

        await anyio.to_thread.run_sync(self.stop)

    # -- control --------------------------------------------------------------------------

    def set_loading(self, loading: bool, *, retry_after: float | str | None = None) -> None:
        """Enter or leave the model-loading state (503 on every route).

        ``retry_after`` adds a ``Retry-After`` header to those 503s -- an
        emulator extension (llama-server sends none) for testing clients that
        honour it.
        """
        if not isinstance(loading, bool):
            raise ValueError(f"loading must be True or False, got {loading!r}")
        value: str | None
        if retry_after is None:
            value = None
        elif isinstance(retry_after, bool) or not isinstance(retry_after, (int, float, str)):
            raise ValueError(f"retry_after must be None, seconds or a str, got {retry_after!r}")
        elif isinstance(retry_after, str):
            if not retry_after or any(c in retry_after for c in "\r\n"):
                raise ValueError(f"retry_after must be a single-line str, got {retry_after!r}")
            value = retry_after
        else:
            if not retry_after >= 0:
                raise ValueError(f"retry_after must be >= 0, got {retry_after}")
            value = str(int(retry_after)) if retry_after == int(retry_after) else str(retry_after)
        with self._state_lock:
            self._loading = loading
            self._retry_after = value

    @property
    def loading(self) -> bool:
        return self._loading

    def inject(
        self,
        fault: Fault,
        *,
        path: str | None = None,
        method: str | None = None,
        count: int | None = 1,
        **params: Any,
    ) -> FaultRule:
        """Arm ``fault`` for the next ``count`` matching connections/requests.

        ``path``/``method`` restrict request faults (``None`` matches any);
        connection faults (``RESET_BEFORE_READ``, ``NEVER_ANSWER_ACCEPT``) hit
        the next accepted connections and take neither.  ``count=None`` keeps
        the rule armed until :meth:`FaultRule.cancel` or :meth:`clear_faults`.
        See :class:`Fault` for each fault's parameters.
        """
        return self._faults.add(fault, path=path, method=method, count=count, params=params)

    def clear_faults(self) -> None:
        """Disarm every pending fault."""
        self._faults.clear()

    def pending_faults(self) -> list[FaultRule]:
        return self._faults.pending()

    def release_stalled(self, count: int | None = None) -> int:
        """``stall_burst``: serve the ``count`` oldest stalled connections (all for None); return how many.

        Their requests, unread so far, are read and answered as a pool thread
        would.  Counted in ``EmulatorStats.stalled_released_by_call``.
        """
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ValueError(f"count must be None or an int >= 0, got {count!r}")
        if self._gate is None:
            raise RuntimeError("release_stalled() needs an emulator started with stall_burst=...")
        if self._stop_event.is_set():
            return 0
        with self._conn_lock:
            jobs = self._gate.release(count)
        for job in jobs:
            self._stats.count("stalled_released_by_call")
            self._enqueue(job)
        return len(jobs)

    def held_connections(self) -> list[HeldConnection]:
        """Connections that ``NEVER_ANSWER_ACCEPT`` or ``READ_LATE`` holds unread now, oldest first.

        ``unread_bytes`` shows whether the client has written to one yet (a probe, a request): a test can wait for
        that instead of guessing how long the client takes.
        """
        now = time.monotonic()
        with self._conn_lock:
            parked = sorted(self._parked.values(), key=lambda p: p.accepted_at)
            held = []
            for item in parked:
                try:
                    peer = tuple(item.sock.getpeername())
                except OSError:  # the client reset it meanwhile
                    peer = ()
                releases_in = None if item.deadline is None else max(0.0, item.deadline - now)
                held.append(HeldConnection(item.fault, peer, pending_bytes(item.sock), releases_in))
        return held

    # -- statistics -----------------------------------------------------------------------

    def stats(self) -> EmulatorStats:
        """A consistent snapshot of the counters (live queue state included)."""
        return self._stats.snapshot(self._live_view())

    def reset_stats(self) -> EmulatorStats:
        """Zero the counters; return the snapshot taken just before."""
        return self._stats.snapshot_and_reset(self._live_view())

    def wait_for(self, predicate: Callable[[EmulatorStats], bool], timeout: float = 5.0) -> EmulatorStats:
        """Wait (bounded) until ``predicate(stats)`` holds; return those stats.

        Raises ``TimeoutError`` with the last snapshot in the message, so a
        failing test shows what the server saw.
        """
        deadline = time.monotonic() + timeout
        while True:
            snapshot = self.stats()
            if predicate(snapshot):
                return snapshot
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout} s; last stats: {snapshot}")
            with self._stats.changed:
                # Live values (queued bytes) change without an event: poll too.
                self._stats.changed.wait(min(remaining, 0.02))

    def _live_view(self) -> LiveView:
        now = time.monotonic()
        with self._conn_lock:
            queued = list(self._queued.values())
            unread = sum(1 for job in queued if pending_bytes(job.sock) > 0)
            oldest = max((now - job.accepted_at for job in queued), default=0.0)
            stalled = [] if self._gate is None else self._gate.stalled()
            stalled_unread = sum(1 for job in stalled if pending_bytes(job.sock) > 0)
        pool = self._pool.counters() if self._pool is not None else None
        return LiveView(
            connections_queued=len(queued),
            connections_queued_unread=unread,
            oldest_queued_wait=oldest,
            pool_threads=0 if pool is None else pool.base_threads + pool.dynamic_threads,
            pool_dynamic_spawned=0 if pool is None else pool.dynamic_spawned,
            pool_peak_threads=0 if pool is None else pool.peak_threads,
            slots_busy=self._slots.busy(),
            slots_waiting=self._slots.waiting(),
            connections_stalled_now=len(stalled),
            connections_stalled_unread=stalled_unread,
        )

    # -- accept loop (its own thread) ---------------------------------------------------------

    def _accept_loop(self) -> None:
        listener, wake = self._listener, self._wake_r
        assert listener is not None
        assert wake is not None
        try:
            while not self._stop_event.is_set():
                readable = ready([listener, wake], self._park_timeout())
                if wake in readable or self._stop_event.is_set():
                    break
                self._expire_parked()
                if listener not in readable:
                    continue
                try:
                    sock, _addr = listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError:
                    if self._stop_event.is_set():
                        break
                    continue
                try:
                    self._on_accept(sock)
                except Exception:  # keep accepting whatever happened
                    self._stats.error(f"accept: {traceback.format_exc()}")
                    sock.close()
        finally:
            with self._conn_lock:
                parked = list(self._parked.values())
                self._parked.clear()
                for item in parked:
                    item.sock.close()
            for _ in parked:
                self._stats.count("connections_closed")
            listener.close()

    def _on_accept(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        # Each write goes out at once, as llama-server's final chunk does (its EOF follows 28 us later on b11434).
        # With Nagle's algorithm the final chunk would wait for the client's delayed ACK (~40 ms) or the close, and
        # a stream_close_delay below that would hide the race instead of widening it.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn_id = next(self._conn_ids)
        self._stats.count("connections_accepted")
        rule = self._faults.take_connection_fault()
        if rule is not None:
            self._stats.fault(rule.fault)
            if rule.fault is Fault.RESET_BEFORE_READ:
                reset_socket(sock)
                self._stats.count("connections_closed")
                return
            now = time.monotonic()
            wait = rule.params["after"] if rule.fault is Fault.READ_LATE else rule.params["hold"]
            deadline = None if wait is None else now + float(wait)
            with self._conn_lock:
                self._parked[conn_id] = _Parked(sock, rule.fault, deadline, now)
            return
        self._admit(_QueuedConnection(self, conn_id, sock))

    def _admit(self, job: _QueuedConnection) -> None:
        """Through the stall_burst gate, if any, to the pool."""
        if self._gate is None:
            self._enqueue(job)
            return
        job.gated = True
        with self._conn_lock:
            served, began = self._gate.admit(job)
            if served is not job:
                job.stalled = True
                self._queued[job.conn_id] = job  # waiting for a thread, as far as stats and stop() are concerned
        if began:
            self._stats.count("stall_bursts")
        if served is not job:
            self._stats.count("connections_stalled")
        if served is not None:
            if served is not job:  # stall_oldest_first: the thread this connection spawned serves the oldest one
                self._stats.count("stalled_released_by_close")
            self._enqueue(served)

    def _enqueue(self, job: _QueuedConnection) -> None:
        """Hand an accepted connection to the pool (which may leave it waiting, unread)."""
        with self._conn_lock:
            self._queued[job.conn_id] = job
        assert self._pool is not None
        if not self._pool.enqueue(job):
            with self._conn_lock:
                mine = self._queued.pop(job.conn_id, None) is not None  # else stop() closed and counted it
                job.sock.close()
            if mine:
                self._stats.count("connections_closed")

    def _park_timeout(self) -> float | None:
        with self._conn_lock:
            deadlines = [p.deadline for p in self._parked.values() if p.deadline is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _expire_parked(self) -> None:
        now = time.monotonic()
        with self._conn_lock:
            expired = [
                (conn_id, item)
                for conn_id, item in self._parked.items()
                if item.deadline is not None and item.deadline <= now
            ]
            for conn_id, _item in expired:
                del self._parked[conn_id]
        for conn_id, item in expired:
            if item.fault is Fault.READ_LATE:
                # The pool finally gets to it: whatever the client wrote meanwhile is read and served now.
                job = _QueuedConnection(self, conn_id, item.sock)
                job.accepted_at = item.accepted_at
                self._enqueue(job)
            else:
                with self._conn_lock:
                    item.sock.close()
                self._stats.count("connections_closed")

    # -- pool jobs ------------------------------------------------------------------------

    def _run_connection(self, job: _QueuedConnection) -> None:
        """What a pool thread runs: the connection's whole keep-alive life."""
        assert self._wake_r is not None
        with self._conn_lock:
            if self._queued.pop(job.conn_id, None) is None:
                return  # abandoned by stop()
            unread = pending_bytes(job.sock)
            wire = Wire(
                job.sock,
                self._wake_r,
                self._stop_event,
                self._config.read_timeout,
                close_lock=self._conn_lock,
            )
            wire.stalled = job.stalled
            self._active[job.conn_id] = wire
        waited = time.monotonic() - job.accepted_at
        self._stats.wait(ConnectionWait(job.conn_id, waited, unread, served=True))
        self._stats.count("connections_active", +1)
        try:
            serve_connection(self._ctx, wire)
        except Exception:  # a bug must not kill a pool thread
            self._stats.error(f"connection {job.conn_id}: {traceback.format_exc()}")
        finally:
            with self._conn_lock:
                self._active.pop(job.conn_id, None)
                wire.close()
                freed_for = self._gate.finished() if job.gated and self._gate is not None else None
            self._stats.count("connections_active", -1)
            self._stats.count("connections_closed")
            if freed_for is not None and not self._stop_event.is_set():
                # This thread is free again: it takes the oldest stalled connection, as cpp-httplib's worker does.
                self._stats.count("stalled_released_by_close")
                self._enqueue(freed_for)

    def _abandon_queued(self) -> None:
        now = time.monotonic()
        records = []
        with self._conn_lock:
            jobs = list(self._queued.values())
            self._queued.clear()
            for job in jobs:
                unread = pending_bytes(job.sock)
                records.append(ConnectionWait(job.conn_id, now - job.accepted_at, unread, served=False))
                with contextlib.suppress(OSError):
                    job.sock.shutdown(socket.SHUT_RDWR)
                job.sock.close()
        for record in records:
            self._stats.wait(record)
            self._stats.count("connections_closed")

    def _loading_state(self) -> tuple[bool, str | None]:
        with self._state_lock:
            return self._loading, self._retry_after

    def __repr__(self) -> str:
        where = f" {self.url}" if self._state != "new" else ""
        cfg = self._config
        modes = f" pool_bug={cfg.pool_bug}"
        if cfg.stall_burst is not None:
            modes += f" stall_burst={cfg.stall_burst}"
        if cfg.close_after_stream and cfg.stream_close != "after_delay":
            modes += f" stream_close={cfg.stream_close!r}"
        return f"<LlamaServerEmulator {self._state}{where}{modes}>"
