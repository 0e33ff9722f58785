"""A TCP relay that puts a network's round trip between a client and a server on this machine.

Why: whether closing every connection or reusing it pays depends on what a new connection costs, which on loopback
is nothing. This kernel has no ``netem`` and the host's loopback must not be changed, so the benchmarks and tests
put this relay in front of the server instead (issue 22):

- every byte is delivered ``delay`` seconds after the relay received it, in each direction, so a request and its
  answer cost a round trip of ``2 x delay``. The delay is a pipeline: bytes received at t leave at t + delay
  whatever else is in flight, so throughput is not limited to one chunk per delay;
- a new connection carries nothing in either direction before ``2 x delay`` after it was accepted: the extra round
  trip a TCP handshake costs before the client's first byte (a TLS handshake, run through the relay, adds its own);
- the relay opens exactly one upstream connection per client connection, at once when it accepts it, so the
  server sees a burst of new connections as a burst;
- a half-close (``shutdown(SHUT_WR)``) is passed on as one, after the delay; a reset as a reset (``abort``); once
  both directions have ended, both connections are closed.

Example::

    with DelayRelay(("127.0.0.1", server_port), delay=0.010) as relay:  # a 20 ms round trip
        httpx.get(f"http://127.0.0.1:{relay.port}/health")
        assert relay.stats().upstream_opened == relay.stats().accepted

The relay runs an asyncio event loop in a thread of its own. In a process that is busy with many client threads,
the interpreter's lock delays that thread too; `DelayRelayProcess` runs the same relay in a child process
(its ``main()``), as the benchmarks do.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpcore

from ._backends import WrappingBackend
from ._lifecycle import StartStop, end_process

__all__ = ["ConnectDelayBackend", "DelayRelay", "DelayRelayProcess", "RelayStats"]

_EOF = object()  # a half-close, delivered in order after the bytes before it
_RESET = object()  # the other side went away abnormally: reset this one
_HIGH_WATER = 1 << 20  # bytes waiting in one direction above which the sender is no longer read
_LOW_WATER = 1 << 18


@dataclasses.dataclass(frozen=True)
class RelayStats:
    """What the relay did since it started."""

    accepted: int  # client connections accepted
    upstream_opened: int  # upstream connections that connected (one per accepted connection)
    upstream_failed: int  # upstream connects that failed (the client connection was reset)
    refused: int  # client connections reset at once because ``max_connections`` were open
    open: int  # client connections open now
    bytes_up: int  # client -> server, delivered
    bytes_down: int  # server -> client, delivered


class _Counters:
    def __init__(self) -> None:
        self.accepted = 0
        self.upstream_opened = 0
        self.upstream_failed = 0
        self.refused = 0
        self.bytes_up = 0
        self.bytes_down = 0


class _Pipe:
    """One direction of a relayed connection: chunks due at a time, delivered in order by one timer."""

    def __init__(self, pair: _Pair, *, up: bool) -> None:
        self.pair = pair
        self.up = up
        self.queue: collections.deque[tuple[float, object]] = collections.deque()
        self.pending = 0  # bytes queued
        self.timer: asyncio.TimerHandle | None = None
        self.source: asyncio.Transport | None = None
        self.sink: asyncio.Transport | None = None
        self.sink_paused = False  # the sink's own write buffer is full
        self.source_paused = False
        self.ended = False  # the EOF (or a reset) was delivered
        self.eof_pushed = False

    def push(self, item: object) -> None:
        if self.pair.closed:
            return
        if item is _EOF:
            if self.eof_pushed:
                return
            self.eof_pushed = True
        loop = self.pair.loop
        due = max(loop.time(), self.pair.opens_at) + self.pair.delay
        self.queue.append((due, item))
        if isinstance(item, bytes):
            self.pending += len(item)
        self.flow()
        self.schedule()

    def schedule(self) -> None:
        if self.timer is None and self.queue and self.sink is not None:
            self.timer = self.pair.loop.call_at(self.queue[0][0], self.deliver)

    def deliver(self) -> None:
        self.timer = None
        sink = self.sink
        if sink is None or self.pair.closed:
            return
        now = self.pair.loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, item = self.queue.popleft()
            if isinstance(item, bytes):
                self.pending -= len(item)
                if not sink.is_closing():
                    # Counted first: the far end's reader may have the bytes before this loop runs its next line.
                    self.pair.count(self.up, len(item))
                    sink.write(item)
            elif item is _EOF:
                self.ended = True
                if not sink.is_closing() and sink.can_write_eof():
                    try:
                        sink.write_eof()
                    except OSError:  # the sink's peer has gone (reset): nothing more can pass
                        self.pair.reset()
                        return
                self.pair.maybe_finish()
            else:  # _RESET
                self.ended = True
                self.pair.reset()
                return
        self.flow()
        self.schedule()

    def flow(self) -> None:
        """Stop reading the sender while too much waits in this direction or in the sink's buffer."""
        source = self.source
        if source is None or source.is_closing():
            return
        stop = self.sink_paused or self.pending > _HIGH_WATER
        go = not self.sink_paused and self.pending < _LOW_WATER
        if stop and not self.source_paused:
            source.pause_reading()
            self.source_paused = True
        elif go and self.source_paused:
            source.resume_reading()
            self.source_paused = False


class _Side(asyncio.Protocol):
    """The protocol of one of the two connections of a pair."""

    def __init__(self, pair: _Pair, *, client: bool) -> None:
        self.pair = pair
        self.client = client

    @property
    def outgoing(self) -> _Pipe:  # bytes this side receives go this way
        return self.pair.up if self.client else self.pair.down

    @property
    def incoming(self) -> _Pipe:  # bytes written to this side come this way
        return self.pair.down if self.client else self.pair.up

    def data_received(self, data: bytes) -> None:
        self.outgoing.push(bytes(data))

    def eof_received(self) -> bool:
        self.outgoing.push(_EOF)
        return True  # keep the transport open: the other direction may still carry bytes

    def pause_writing(self) -> None:
        self.incoming.sink_paused = True
        self.incoming.flow()

    def resume_writing(self) -> None:
        self.incoming.sink_paused = False
        self.incoming.flow()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pair.closed:
            return
        # A reset (or a write to a side that had gone) resets the other side, after the delay; a clean end that
        # came without a half-close first is passed on as one.
        self.outgoing.push(_RESET if exc is not None else _EOF)


class _Pair:
    """A client connection and its upstream connection."""

    def __init__(self, relay: DelayRelay, loop: asyncio.AbstractEventLoop) -> None:
        self.relay = relay
        self.loop = loop
        self.delay = relay.delay
        accepted = loop.time()
        self.opens_at = accepted + (2 * relay.delay if relay.handshake else 0.0)
        self.up = _Pipe(self, up=True)
        self.down = _Pipe(self, up=False)
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.closed = False

    def count(self, up: bool, size: int) -> None:
        counters = self.relay._counters
        if up:
            counters.bytes_up += size
        else:
            counters.bytes_down += size

    def client_made(self, transport: asyncio.Transport) -> None:
        self.client = transport
        self.up.source = transport
        self.down.sink = transport
        self.relay._pairs.add(self)
        self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        host, port = self.relay.upstream
        try:
            transport, _ = await self.loop.create_connection(lambda: _Side(self, client=False), host, port)
        except OSError:
            self.relay._counters.upstream_failed += 1
            self.reset()
            return
        if self.closed:
            transport.abort()
            return
        self.relay._counters.upstream_opened += 1
        self.upstream = transport
        self.down.source = transport
        self.up.sink = transport
        self.up.flow()
        self.down.flow()
        self.up.schedule()

    def maybe_finish(self) -> None:
        if self.up.ended and self.down.ended:
            self.close()

    def close(self) -> None:
        self._end(lambda transport: transport.close())

    def reset(self) -> None:
        self._end(_reset)

    def _end(self, end: Callable[[asyncio.Transport], None]) -> None:
        """End both connections the same way (``close`` or ``reset``), once."""
        if self.closed:
            return
        self.closed = True
        for transport in (self.client, self.upstream):
            if transport is not None:
                end(transport)
        self._forget()

    def _forget(self) -> None:
        for pipe in (self.up, self.down):
            if pipe.timer is not None:
                pipe.timer.cancel()
                pipe.timer = None
            pipe.queue.clear()
        self.relay._pairs.discard(self)


def _reset(transport: asyncio.Transport) -> None:
    # abort() alone closes with a FIN; a reset is passed on as a reset (SO_LINGER 0: RST on close).
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class DelayRelay(StartStop):
    """A TCP relay from ``host:port`` to ``upstream`` adding ``delay`` seconds each way (round trip ``2 x delay``),
    and one extra round trip before a new connection's first byte (``handshake``). See the module docstring.

    ``port=0`` picks a free port (``relay.port`` once started). At most ``max_connections`` client connections at
    once; more are reset as they arrive (counted in ``stats().refused``).
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        delay: float,
        handshake: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 1024,
    ) -> None:
        if not 0.0 <= delay <= 10.0:
            raise ValueError(f"delay must be from 0 to 10 seconds; got {delay!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1; got {max_connections!r}")
        self.upstream = upstream
        self.delay = delay
        self.handshake = handshake
        self.host = host
        self.max_connections = max_connections
        self._port = port
        self._counters = _Counters()
        self._pairs: set[_Pair] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self._port

    @property
    def rtt(self) -> float:
        """The round trip the relay adds to a request and its answer on an open connection."""
        return 2 * self.delay

    def url(self, scheme: str = "http") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self._port}"

    def start(self) -> DelayRelay:
        if self._thread is not None:
            raise RuntimeError("the relay is already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="delay-relay", daemon=True)
        self._thread.start()
        try:
            self._server = self._call(self._listen(), timeout=10.0)
        except BaseException:
            self._stop_loop()
            raise
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def _listen(self) -> asyncio.Server:
        loop = asyncio.get_running_loop()

        def accept() -> asyncio.Protocol:
            return _Accepted(self, loop)

        return await loop.create_server(accept, self.host, self._port, backlog=1024, reuse_address=True)

    def _call(self, coroutine: Any, timeout: float) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def stats(self) -> RelayStats:
        """A snapshot of the counters (read on the relay's own thread, so it is consistent)."""
        if self._loop is None or not self._loop.is_running():
            return self._snapshot()

        async def snap() -> RelayStats:
            return self._snapshot()

        result: RelayStats = self._call(snap(), timeout=10.0)
        return result

    def _snapshot(self) -> RelayStats:
        c = self._counters
        return RelayStats(
            c.accepted, c.upstream_opened, c.upstream_failed, c.refused, len(self._pairs), c.bytes_up, c.bytes_down
        )

    def stop(self) -> None:
        """Stop listening, reset every relayed connection, end the thread. Idempotent."""
        if self._loop is None:
            return
        if self._loop.is_running():

            async def shut() -> None:
                if self._server is not None:
                    self._server.close()
                for pair in list(self._pairs):
                    pair.reset()
                if self._server is not None:
                    await asyncio.wait_for(self._server.wait_closed(), 5.0)

            with contextlib.suppress(Exception):
                self._call(shut(), timeout=10.0)
        self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None:
            return
        if thread is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10.0)
        if not loop.is_running():
            loop.close()
        self._loop = None
        self._thread = None

    def __repr__(self) -> str:
        return f"DelayRelay({self.host}:{self._port} -> {self.upstream[0]}:{self.upstream[1]}, delay={self.delay})"


class _Accepted(_Side):
    """The client side, made by the listener for each accepted connection."""

    def __init__(self, relay: DelayRelay, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(_Pair(relay, loop), client=True)
        self.relay = relay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.relay._counters.accepted += 1
        if len(self.relay._pairs) >= self.relay.max_connections:
            self.relay._counters.refused += 1
            self.pair.closed = True
            transport.abort()
            return
        self.pair.client_made(transport)


class ConnectDelayBackend(WrappingBackend):
    """An httpcore network backend whose TCP connects take a round trip (``seconds``), as on a network: half of it
    before the connect, half after. Through a relay the kernel completes a client's connect at once, so a client
    that times its connects (the guard's ``connection="auto"``) would see a new connection as free; give its
    transport this backend and the relay ``handshake=False``, and the round trip is spent where a network spends
    it. Wraps ``backend`` (httpcore's own by default; a pre-opened burst's backend too: its connections then cost
    the round trip when a client takes one, as if it had connected then)."""

    def __init__(self, seconds: float, backend: httpcore.NetworkBackend | None = None) -> None:
        super().__init__(backend)
        self.seconds = seconds

    def _open(self, connect: Callable[[], httpcore.NetworkStream]) -> httpcore.NetworkStream:
        time.sleep(self.seconds / 2)
        stream = connect()
        time.sleep(self.seconds / 2)
        return stream

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        return self._backend.connect_unix_socket(path, timeout, socket_options)


class DelayRelayProcess(StartStop):
    """The same relay in a child process, so it keeps its timing beside a busy client process.

    ``with DelayRelayProcess(upstream, delay=0.001) as relay: relay.port``. The child exits when this process
    stops it, or on its own when this process dies (it watches its standard input). No stats: use `DelayRelay`
    in-process where a test needs them.
    """

    def __init__(
        self, upstream: tuple[str, int], *, delay: float, handshake: bool = True, host: str = "127.0.0.1"
    ) -> None:
        self.upstream = upstream
        self.delay = delay
        self.handshake = handshake
        self.host = host
        self.port = 0
        self._process: subprocess.Popen[str] | None = None

    def url(self, scheme: str = "http") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def start(self) -> DelayRelayProcess:
        command = [
            sys.executable,
            "-c",
            "import sys; from llama_guard.testing._delay_relay import main; sys.exit(main(sys.argv[1:]))",
            "--upstream",
            f"{self.upstream[0]}:{self.upstream[1]}",
            "--delay",
            repr(self.delay),
            "--host",
            self.host,
            *(() if self.handshake else ("--no-handshake",)),
        ]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._process = process
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the delay relay did not start (said {line!r})")
        self.port = int(line)
        return self

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:  # the child exits when its standard input closes (see `main`)
            end_process(process, ask=_close_stdin, grace=10.0)


def _close_stdin(process: subprocess.Popen[str]) -> None:
    if process.stdin is not None:
        with contextlib.suppress(OSError):
            process.stdin.close()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    """``python -m llama_guard.testing._delay_relay --upstream HOST:PORT --delay SECONDS``: prints the port, relays
    until its standard input closes (its parent stopped it or died) or SIGTERM."""
    parser = argparse.ArgumentParser(description="A TCP relay adding a fixed delay each way (test tooling).")
    parser.add_argument("--upstream", required=True, help="HOST:PORT to relay to")
    parser.add_argument("--delay", type=float, required=True, help="one-way delay in seconds (round trip: twice)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    parser.add_argument("--no-handshake", action="store_true", help="no extra round trip before the first byte")
    args = parser.parse_args(argv)
    relay = DelayRelay(
        _split(args.upstream), delay=args.delay, handshake=not args.no_handshake, host=args.host, port=args.port
    )
    with relay:
        print(relay.port, flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(OSError):
            while sys.stdin.read(1):
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
