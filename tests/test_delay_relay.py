"""The delay relay (llama_guard.testing.DelayRelay) on real loopback sockets: the round trip it adds, the handshake's
extra round trip, a pipeline not a stop-and-wait, one upstream connection per client connection opened at accept,
bytes intact both ways, half-close and reset passed on."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import statistics
import struct
import threading
import time
from collections.abc import Iterator

import httpcore
import pytest

from llama_guard.testing import ConnectDelayBackend, DelayRelay, DelayRelayProcess

DELAY = 0.020  # one way: a 40 ms round trip, far above this machine's loopback and scheduling noise
# Late is what a loaded 2-core machine adds (scheduling); early would mean the delay is not applied.
LATE = 0.030
EARLY = 0.003


class Upstream:
    """A loopback TCP server that counts accepted connections; each is echoed (``echo``) or held for the test."""

    def __init__(self, *, echo: bool = True) -> None:
        self.echo = echo
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self.listener.getsockname()[1]
        self.accepted: list[tuple[float, socket.socket]] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.closing = False
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.accepted.append((time.monotonic(), conn))
            if self.echo:
                thread = threading.Thread(target=self._echo, args=(conn,), daemon=True)
                thread.start()
                self.threads.append(thread)

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)  # the half-close answered with one
        except OSError:
            pass

    def count(self) -> int:
        with self.lock:
            return len(self.accepted)

    def close(self) -> None:
        # shutdown() wakes a thread blocked in accept() or recv() on Linux; close() alone does not.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.acceptor.join(timeout=5)
        with self.lock:
            for _, conn in self.accepted:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
        for thread in self.threads:
            thread.join(timeout=5)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.close()


@pytest.fixture
def held() -> Iterator[Upstream]:
    server = Upstream(echo=False)
    yield server
    server.close()


def round_trip(sock: socket.socket, payload: bytes = b"x") -> float:
    started = time.monotonic()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "closed before the echo came back"
        got += chunk
    return time.monotonic() - started


def wait_for(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_round_trip_is_twice_the_delay(upstream: Upstream) -> None:
    """On an open connection, a byte's echo comes back after 2 x delay (the median of 8), not at once."""
    with DelayRelay(("127.0.0.1", upstream.port), delay=DELAY) as relay, socket.create_connection(relay.address) as s:
        s.settimeout(5)
        round_trip(s)  # the first one pays the handshake (next test)
        rtts = [round_trip(s) for _ in range(8)]
    rtt = statistics.median(rtts)
    assert relay.rtt == 2 * DELAY
    assert 2 * DELAY - EARLY <= rtt <= 2 * DELAY + LATE, rtts
    assert min(rtts) >= 2 * DELAY - EARLY, rtts


def test_no_delay_is_loopback(upstream: Upstream) -> None:
    """Control: with delay 0 the same echo is as fast as loopback (so the figure above is the relay's doing)."""
    with DelayRelay(("127.0.0.1", upstream.port), delay=0.0) as relay, socket.create_connection(relay.address) as s:
        s.settimeout(5)
        rtts = [round_trip(s) for _ in range(8)]
    assert statistics.median(rtts) < 2 * DELAY - EARLY, rtts


@pytest.mark.parametrize("handshake", [True, False])
def test_first_byte_pays_a_handshake_round_trip(upstream: Upstream, handshake: bool) -> None:
    """A new connection's first echo, timed from its connect, takes one round trip more than an echo on an open
    connection (a TCP handshake's cost), and only when the handshake is on.

    Timed from the connect because the relay counts the handshake's round trip from its accept: a client that
    sends later (a busy machine's late wake-up) would see less of it. Both bounds are on the fastest of five
    connections: lateness only adds, so the fastest is the one nearest the relay's own timing."""
    with DelayRelay(("127.0.0.1", upstream.port), delay=DELAY, handshake=handshake) as relay:
        firsts = []
        for _ in range(5):
            started = time.monotonic()
            with socket.create_connection(relay.address) as s:
                s.settimeout(5)
                round_trip(s)
                firsts.append(time.monotonic() - started)
    round_trips = 2 if handshake else 1
    assert round_trips * 2 * DELAY - EARLY <= min(firsts) <= round_trips * 2 * DELAY + LATE, firsts


def test_delay_is_a_pipeline(upstream: Upstream) -> None:
    """Chunks sent 5 ms apart each come back one round trip after they left, however many are in flight: the delay
    does not hold one chunk at a time."""
    with DelayRelay(("127.0.0.1", upstream.port), delay=DELAY) as relay, socket.create_connection(relay.address) as s:
        s.settimeout(5)
        round_trip(s)
        sent: list[float] = []
        received: list[float] = []

        def read() -> None:
            got = 0
            while got < 20 * 8:
                chunk = s.recv(65536)
                if not chunk:
                    return
                for _ in range((got + len(chunk)) // 8 - got // 8):
                    received.append(time.monotonic())
                got += len(chunk)

        reader = threading.Thread(target=read)
        reader.start()
        for index in range(20):
            sent.append(time.monotonic())
            s.sendall(struct.pack("!q", index))
            time.sleep(0.005)
        reader.join(timeout=10)
    assert len(received) == 20
    lags = [r - t for r, t in zip(received, sent, strict=True)]
    # Never early: every chunk waits its round trip.
    assert min(lags) >= 2 * DELAY - EARLY, lags
    # One chunk per delay would make each lag 15 ms longer than the one before (0.3 s more for the last five than the
    # first five); a pipeline keeps them level. Compared by medians of five, so a busy machine's single late wake-up
    # (measured up to 50 ms with two CPU-bound processes beside the suite) does not decide.
    growth = statistics.median(lags[-5:]) - statistics.median(lags[:5])
    assert growth < 0.15, lags


def test_throughput_is_not_one_chunk_per_delay(upstream: Upstream) -> None:
    """4 MiB through the relay and back, written as fast as it goes, takes a few round trips, not one per chunk."""
    payload = os.urandom(4 << 20)
    with DelayRelay(("127.0.0.1", upstream.port), delay=DELAY) as relay, socket.create_connection(relay.address) as s:
        s.settimeout(10)
        started = time.monotonic()
        writer = threading.Thread(target=s.sendall, args=(payload,))
        writer.start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = s.recv(1 << 20)
            assert chunk
            got += chunk
        writer.join()
        elapsed = time.monotonic() - started
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    # At 64 KiB per read there are 64+ chunks: one round trip each would be 2.5 s or more.
    assert elapsed < 1.0, elapsed


def test_one_upstream_connection_per_client_at_accept(held: Upstream) -> None:
    """A burst of 16 client connections that send nothing is 16 upstream connections, opened at accept: all of
    them there before the handshake's round trip has passed, before any byte."""
    with DelayRelay(("127.0.0.1", held.port), delay=0.5) as relay:
        started = time.monotonic()
        clients = [socket.create_connection(relay.address) for _ in range(16)]
        try:
            # The upstream accepts a connection before the relay's loop sees its connect complete and counts it.
            wait_for(lambda: held.count() == 16 and relay.stats().upstream_opened == 16, timeout=0.5)
            elapsed = time.monotonic() - started
            stats = relay.stats()
            assert (stats.accepted, stats.upstream_opened, stats.open, stats.bytes_up) == (16, 16, 16, 0)
            assert elapsed < 0.5
            time.sleep(0.05)
            assert held.count() == 16  # no more than one each
        finally:
            for client in clients:
                client.close()
    assert held.count() == 16


def test_bytes_intact_both_ways(held: Upstream) -> None:
    """Different random bytes each way, written at once on both ends, arrive whole and in order."""
    up, down = os.urandom(3 << 20), os.urandom(5 << 20)
    with DelayRelay(("127.0.0.1", held.port), delay=0.005) as relay, socket.create_connection(relay.address) as c:
        wait_for(lambda: held.count() == 1)
        server = held.accepted[0][1]
        c.settimeout(10)
        server.settimeout(10)
        results: dict[str, bytes] = {}

        def read_all(sock: socket.socket, name: str, size: int) -> None:
            got = bytearray()
            while len(got) < size:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                got += chunk
            results[name] = bytes(got)

        readers = [
            threading.Thread(target=read_all, args=(server, "up", len(up))),
            threading.Thread(target=read_all, args=(c, "down", len(down))),
        ]
        for thread in readers:
            thread.start()
        writers = [
            threading.Thread(target=c.sendall, args=(up,)),
            threading.Thread(target=server.sendall, args=(down,)),
        ]
        for thread in writers:
            thread.start()
        for thread in [*writers, *readers]:
            thread.join(timeout=20)
        stats = relay.stats()
    assert results["up"] == up
    assert results["down"] == down
    assert (stats.bytes_up, stats.bytes_down) == (len(up), len(down))


def test_half_close_passed_on_each_way(held: Upstream) -> None:
    """The client's shutdown(SHUT_WR) reaches the server as an end of stream after the delay, the server can still
    answer on the half-open connection, and its own close then reaches the client."""
    with DelayRelay(("127.0.0.1", held.port), delay=DELAY) as relay, socket.create_connection(relay.address) as c:
        wait_for(lambda: held.count() == 1)
        server = held.accepted[0][1]
        server.settimeout(5)
        c.settimeout(5)
        c.sendall(b"request")
        c.shutdown(socket.SHUT_WR)
        shut = time.monotonic()
        got = b""
        while chunk := server.recv(100):
            got += chunk
        eof_lag = time.monotonic() - shut
        assert got == b"request"
        assert eof_lag >= DELAY - EARLY  # not passed on at once
        server.sendall(b"answer")
        server.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := c.recv(100):
            answer += chunk
        assert answer == b"answer"
        wait_for(lambda: relay.stats().open == 0)  # both directions ended: both connections closed


def test_reset_passed_on(held: Upstream) -> None:
    """A server that resets its connection (SO_LINGER 0) resets the client's, after the delay."""
    with DelayRelay(("127.0.0.1", held.port), delay=DELAY) as relay, socket.create_connection(relay.address) as c:
        wait_for(lambda: held.count() == 1)
        c.settimeout(5)
        assert round_trip_via(c, held.accepted[0][1]) == b"ping"
        server = held.accepted[0][1]
        server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        server.close()
        with pytest.raises(ConnectionResetError):
            drain(c)
        wait_for(lambda: relay.stats().open == 0)


def drain(sock: socket.socket) -> None:
    while sock.recv(100):
        pass


def round_trip_via(client: socket.socket, server: socket.socket) -> bytes:
    client.sendall(b"ping")
    server.settimeout(5)
    return server.recv(100)


def test_refused_over_max_connections(held: Upstream) -> None:
    """Bounded: past max_connections open, a new client connection is reset and no upstream is opened for it."""
    with DelayRelay(("127.0.0.1", held.port), delay=0.0, max_connections=2) as relay:
        clients = [socket.create_connection(relay.address) for _ in range(3)]
        try:
            # Accepting the third comes before the first two's upstream connects are counted: wait for both.
            wait_for(
                lambda: (
                    relay.stats().accepted == 3 and relay.stats().upstream_opened + relay.stats().upstream_failed == 2
                )
            )
            stats = relay.stats()
            assert (stats.upstream_opened + stats.upstream_failed, stats.refused, stats.open) == (2, 1, 2)
        finally:
            for client in clients:
                client.close()


def test_stop_resets_open_connections(upstream: Upstream) -> None:
    """stop() leaves nothing open: a client connection that was relayed ends, and the port no longer accepts."""
    relay = DelayRelay(("127.0.0.1", upstream.port), delay=0.0).start()
    c = socket.create_connection(relay.address)
    try:
        c.settimeout(5)
        round_trip(c)
        relay.stop()
        with pytest.raises((ConnectionResetError, AssertionError)):
            round_trip(c)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(relay.address, timeout=2).close()
    finally:
        c.close()
        relay.stop()


def test_relay_in_a_child_process(upstream: Upstream) -> None:
    """DelayRelayProcess: the same round trip from a child process, which exits when stopped."""
    with DelayRelayProcess(("127.0.0.1", upstream.port), delay=DELAY) as relay:
        process = relay._process
        assert process is not None
        with socket.create_connection(relay.address) as s:
            s.settimeout(5)
            round_trip(s)
            rtt = statistics.median(round_trip(s) for _ in range(5))
    assert 2 * DELAY - EARLY <= rtt <= 2 * DELAY + LATE
    assert process.returncode == 0


@pytest.mark.parametrize("seconds", [2 * DELAY, 0.0])
def test_connect_delay_backend_spends_a_round_trip_in_connect(upstream: Upstream, seconds: float) -> None:
    """ConnectDelayBackend: the connect itself takes the round trip (where a client times it), the stream then
    carries bytes at loopback speed; with 0 s it is loopback's connect (control)."""
    backend = ConnectDelayBackend(seconds, httpcore.SyncBackend())
    started = time.monotonic()
    stream = backend.connect_tcp("127.0.0.1", upstream.port, timeout=5)
    connected = time.monotonic() - started
    try:
        stream.write(b"ping", timeout=5)
        assert stream.read(100, timeout=5) == b"ping"
    finally:
        stream.close()
    if seconds:
        assert seconds - EARLY <= connected <= seconds + LATE
    else:
        assert connected < 2 * DELAY - EARLY
