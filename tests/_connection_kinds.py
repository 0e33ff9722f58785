"""The ways httpx reaches a server, as loopback servers in front of the emulator: relays and proxies for the
connection-kind matrix (tests/test_connection_kinds.py).

Every helper here is a real server on a real socket (127.0.0.1, or a Unix socket in a temporary folder), run by one
asyncio event loop in a thread of its own, and stopped (every socket closed, the thread joined) by its context
manager:

- `TlsRelay`: a TLS-terminating relay (HTTP/1.1, ALPN ``http/1.1``), one upstream TCP connection per downstream
  connection, opened once the TLS handshake is done (as stunnel does), bytes passed as they are;
- `UnixRelay`: a Unix-socket-to-TCP relay, one upstream connection per downstream one, opened on accept;
- `HttpProxy`: an HTTP proxy: plain forwarding for ``http://`` (absolute-form requests rewritten to origin form, each
  downstream connection pinned to one upstream connection, so the upstream's connection faults reach the client as
  they would directly) and ``CONNECT`` tunnels for ``https://``;
- `Socks5Proxy`: a SOCKS5 proxy (no authentication, CONNECT only), a tunnel per connection; both proxies can
  route every target to one address (``route=``), for an origin the client reaches through the proxy only;
- `H2Relay`: an HTTP/2 server, over TLS (ALPN ``h2``) or cleartext with prior knowledge (h2c), that sends each
  stream upstream as an HTTP/1.1 request on a new connection of its own (``Connection: close``), as a terminating
  reverse proxy does; a request with the header ``x-relay-hold: <tag>`` is answered only after
  ``release(tag)`` (its upstream answer is read first), one with ``x-relay-hold-body: <tag>`` gets its response
  headers and its body only after ``release(tag)``, and ``held(tag)`` says when either is waiting.

Whatever closes one side of a relayed connection closes the other (a FIN or a reset from either end ends both),
which is how the llama-server faults on the far side (a connection closed after a stream, a connection left unread)
reach the client: unchanged, except through `H2Relay`, whose upstream connections are its own.

`tls_material()` gives a test certificate authority (trustme) with a certificate for ``127.0.0.1``: its server
context for the relays and a client context that trusts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import ssl
import tempfile
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import trustme

__all__ = [
    "H2Relay",
    "HttpProxy",
    "RelayServer",
    "Socks5Proxy",
    "TlsMaterial",
    "TlsRelay",
    "UnixRelay",
    "refused_port",
    "tls_material",
]

#: How long a helper waits for its event loop to start, or to stop, before the test fails.
LOOP_DEADLINE = 10.0
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"te", b"trailer", b"upgrade"}
)


@dataclass(frozen=True)
class TlsMaterial:
    """A test certificate authority's certificate for ``127.0.0.1`` and ``localhost``."""

    ca: trustme.CA
    server_cert: trustme.LeafCert

    def server_context(self, alpn: list[str]) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server_cert.configure_cert(context)
        context.set_alpn_protocols(alpn)
        return context

    def client_context(self) -> ssl.SSLContext:
        """What a client passes as ``verify=``: trusts this authority only."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        self.ca.configure_trust(context)
        return context


@functools.cache
def tls_material() -> TlsMaterial:
    """One authority and certificate for the test process (making them costs tenths of a second)."""
    ca = trustme.CA()
    return TlsMaterial(ca, ca.issue_cert("127.0.0.1", "localhost"))


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port where a connect is refused for as long as the context lasts: bound, never listening (no
    other socket can take it meanwhile)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


class RelayServer:
    """A server run by an asyncio event loop in a thread of its own; every connection it handles is tracked, so
    that `stop()` (or leaving the ``with`` block) ends them all, closes every socket and joins the thread."""

    #: The address clients connect to: ``(host, port)``, or a Unix socket's path.
    address: Any

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._started = threading.Event()
        self._failure: BaseException | None = None
        #: Unexpected exceptions in the helper's own code (a bug of the helper, not a peer going away): `stop()`
        #: raises when there are any.
        self.errors: list[str] = []
        #: Downstream connections accepted (after the TLS handshake, for a TLS listener).
        self.accepted = 0
        #: Upstream connections opened.
        self.upstream_connections = 0

    async def _listen(self) -> asyncio.AbstractServer:
        raise NotImplementedError

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    # -- life -------------------------------------------------------------------------------------------------------

    def start(self) -> RelayServer:
        self._thread = threading.Thread(target=self._run, name=f"{type(self).__name__}-loop", daemon=True)
        self._thread.start()
        if not self._started.wait(LOOP_DEADLINE):
            raise RuntimeError(f"{type(self).__name__} did not start within {LOOP_DEADLINE} s")
        if self._failure is not None:
            self._thread.join(LOOP_DEADLINE)
            raise RuntimeError(f"{type(self).__name__} failed to start") from self._failure
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(LOOP_DEADLINE)
            if self._thread.is_alive():
                raise RuntimeError(f"{type(self).__name__} did not stop within {LOOP_DEADLINE} s")
        if self._failure is not None:
            raise RuntimeError(f"{type(self).__name__} failed") from self._failure
        if self.errors:
            raise RuntimeError(f"{type(self).__name__} failed: {self.errors}")

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start() or stop()
            self._failure = exc
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await self._listen()
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            self._on_stop()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for writer in list(self._writers):
                writer.transport.abort()
            await server.wait_closed()

    # -- connections ------------------------------------------------------------------------------------------------

    def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The listener's callback: each connection handled in a task the server tracks."""
        self.accepted += 1
        self._writers.add(writer)
        task = asyncio.get_running_loop().create_task(self._guarded_handle(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded_handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._handle(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # a peer that went away or spoke nonsense: the connection ends
        except Exception as exc:
            self.errors.append(repr(exc))
        finally:
            self._close(writer)

    def _record_failure(self, task: asyncio.Task[None]) -> None:
        """A done callback: a task of the helper's that raised is one of its `errors`."""
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(repr(task.exception()))

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._writers.discard(writer)
        if writer.transport.is_closing():
            writer.transport.abort()
        else:
            writer.close()

    def _on_stop(self) -> None:
        """Called in the loop when the server stops, before its connections are ended."""

    async def _connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, port)
        self.upstream_connections += 1
        self._writers.add(writer)
        return reader, writer

    async def _splice(
        self,
        down: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        """Pass bytes both ways until either side ends; then close both."""
        try:
            await _first_of(_pump(down[0], up[1]), _pump(up[0], down[1]))
        finally:
            self._close(up[1])
            self._close(down[1])


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


async def _first_of(*jobs: Awaitable[None]) -> None:
    """Run the jobs until the first ends; cancel the others."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _TcpListener(RelayServer):
    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        super().__init__()
        self._tls = tls

    async def _listen(self) -> asyncio.AbstractServer:
        server = await asyncio.start_server(
            self._on_connection, "127.0.0.1", 0, ssl=self._tls, ssl_handshake_timeout=5.0 if self._tls else None
        )
        self.address = server.sockets[0].getsockname()[:2]
        return server

    @property
    def port(self) -> int:
        port: int = self.address[1]
        return port


class TlsRelay(_TcpListener):
    """TLS (HTTP/1.1) in front of ``upstream``: one upstream connection per client connection."""

    def __init__(self, upstream: tuple[str, int], material: TlsMaterial | None = None) -> None:
        super().__init__((material or tls_material()).server_context(["http/1.1"]))
        self._upstream = upstream

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._splice((reader, writer), await self._connect(*self._upstream))


class UnixRelay(RelayServer):
    """A Unix socket (in a temporary folder of its own) in front of ``upstream``: one upstream TCP connection per
    client connection, opened as soon as the client's is accepted."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self._upstream = upstream
        self._folder = tempfile.TemporaryDirectory(prefix="llama-guard-uds-")
        self.address = os.path.join(self._folder.name, "llama.sock")

    async def _listen(self) -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(self._on_connection, self.address)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._splice((reader, writer), await self._connect(*self._upstream))

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self._folder.cleanup()


class _Proxy(_TcpListener):
    """A proxy that connects where the client asks, or, with ``route``, to ``route`` whatever the client asks: an
    origin the client can reach through the proxy only (its own address refuses connections). ``asked`` lists the
    ``host:port`` each client asked for."""

    def __init__(self, route: tuple[str, int] | None = None) -> None:
        super().__init__()
        self._route = route
        self.asked: list[str] = []

    async def _connect_to(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.asked.append(f"{host}:{port}")
        return await self._connect(*(self._route or (host, port)))


class HttpProxy(_Proxy):
    """An HTTP proxy: forwards ``http://`` requests (each client connection pinned to one upstream connection) and
    tunnels ``CONNECT``. Counts what it did: ``forwarded`` requests and ``tunnels``."""

    def __init__(self, route: tuple[str, int] | None = None) -> None:
        super().__init__(route)
        self.forwarded = 0
        self.tunnels = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
        if method == b"CONNECT":
            host, _, port = target.decode().rpartition(":")
            upstream = await self._connect_to(host, int(port))
            self.tunnels += 1
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await self._splice((reader, writer), upstream)
            return
        origin = urllib.parse.urlsplit(target.decode()).netloc
        host, _, port = origin.rpartition(":")
        up_reader, up_writer = await self._connect_to(host, int(port or 80))
        try:
            await _first_of(_pump(up_reader, writer), self._forward(head, reader, up_writer, origin))
        finally:
            self._close(up_writer)

    async def _forward(
        self, head: bytes, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter, origin: str
    ) -> None:
        """Each request of the client connection, rewritten to origin form, to the one upstream connection."""
        while True:
            line, _, rest = head.partition(b"\r\n")
            method, target, version = line.split(b" ", 2)
            url = urllib.parse.urlsplit(target.decode())
            if url.netloc != origin:
                raise ValueError(f"a pinned connection to {origin} was asked for {url.netloc}")
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            # The proxy's own headers go; Connection stays: the connection is pinned, so the client's word on it
            # holds end to end.
            headers = [h for h in rest.split(b"\r\n") if h and not h.lower().startswith(b"proxy-")]
            upstream.write(b" ".join((method, path.encode(), version)) + b"\r\n" + b"\r\n".join(headers) + b"\r\n\r\n")
            upstream.write(await _read_body(reader, rest))
            await upstream.drain()
            self.forwarded += 1
            head = await reader.readuntil(b"\r\n\r\n")


async def _read_body(reader: asyncio.StreamReader, header_block: bytes) -> bytes:
    """The body of a message whose header block is ``header_block`` (bytes after the start line), as it was sent
    (chunked stays chunked)."""
    fields = {}
    for header in header_block.split(b"\r\n"):
        name, _, value = header.partition(b":")
        fields[name.strip().lower()] = value.strip()
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        chunks = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            chunks.append(size_line)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    chunks.append(trailer)
                chunks.append(trailer)
                return b"".join(chunks)
            chunks.append(await reader.readexactly(size + 2))
    return await reader.readexactly(int(fields.get(b"content-length", b"0")))


class Socks5Proxy(_Proxy):
    """A SOCKS5 proxy: no authentication, CONNECT only."""

    @property
    def url(self) -> str:
        return f"socks5://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        version, methods = await reader.readexactly(2)
        await reader.readexactly(methods)
        if version != 5:
            return
        writer.write(b"\x05\x00")  # no authentication
        await writer.drain()
        _, command, _, kind = await reader.readexactly(4)
        if kind == 1:
            host = socket.inet_ntop(socket.AF_INET, await reader.readexactly(4))
        elif kind == 4:
            host = socket.inet_ntop(socket.AF_INET6, await reader.readexactly(16))
        else:
            host = (await reader.readexactly((await reader.readexactly(1))[0])).decode()
        port = int.from_bytes(await reader.readexactly(2), "big")
        if command != 1:
            writer.write(b"\x05\x07\x00\x01" + bytes(6))  # command not supported
            return
        upstream = await self._connect_to(host, port)
        writer.write(b"\x05\x00\x00\x01" + bytes(6))
        await writer.drain()
        await self._splice((reader, writer), upstream)


class H2Relay(_TcpListener):
    """HTTP/2 in front of an HTTP/1.1 ``upstream``: over TLS with ALPN ``h2`` (``tls=True``) or cleartext with prior
    knowledge (h2c). Each stream is one upstream request on a connection of its own; the answer goes back on the
    stream. Counts ``streams`` answered and ``streams_failed`` (the client's connection was gone when the answer
    was to be sent)."""

    def __init__(self, upstream: tuple[str, int], *, tls: bool, material: TlsMaterial | None = None) -> None:
        super().__init__((material or tls_material()).server_context(["h2"]) if tls else None)
        self._upstream = upstream
        self.scheme = "https" if tls else "http"
        self.streams = 0
        self.streams_failed = 0
        #: What went wrong with each failed stream.
        self.failures: list[str] = []
        self._holds: dict[str, tuple[threading.Event, threading.Event]] = {}
        self._holds_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def _hold(self, tag: str) -> tuple[threading.Event, threading.Event]:
        with self._holds_lock:
            return self._holds.setdefault(tag, (threading.Event(), threading.Event()))

    def held(self, tag: str) -> threading.Event:
        """Set once a request tagged ``tag`` has been answered upstream and waits for `release`."""
        return self._hold(tag)[0]

    def release(self, tag: str) -> None:
        """Let the request tagged ``tag`` be answered (now, or as soon as it arrives)."""
        self._hold(tag)[1].set()

    async def _wait_release(self, tag: str) -> None:
        held, released = self._hold(tag)
        held.set()
        await asyncio.to_thread(released.wait, LOOP_DEADLINE)

    def _on_stop(self) -> None:
        with self._holds_lock:  # no thread left waiting for a release
            for _, released in self._holds.values():
                released.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        connection.initiate_connection()
        writer.write(connection.data_to_send())
        lock = asyncio.Lock()  # the h2 state machine and the socket, shared by the stream tasks
        requests: dict[int, tuple[list[tuple[bytes, bytes]], bytearray]] = {}
        streams: set[asyncio.Task[None]] = set()
        try:
            while data := await reader.read(65536):
                async with lock:
                    try:
                        events = connection.receive_data(data)
                    except h2.exceptions.ProtocolError:
                        writer.write(connection.data_to_send())  # GOAWAY
                        return
                    for event in events:
                        if isinstance(event, h2.events.RequestReceived):
                            requests[event.stream_id] = (list(event.headers), bytearray())
                        elif isinstance(event, h2.events.DataReceived) and event.stream_id in requests:
                            requests[event.stream_id][1].extend(event.data)
                            connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                        if getattr(event, "stream_ended", None) is not None and event.stream_id in requests:
                            headers, body = requests.pop(event.stream_id)
                            task = asyncio.get_running_loop().create_task(
                                self._answer(connection, lock, writer, event.stream_id, headers, bytes(body))
                            )
                            streams.add(task)
                            task.add_done_callback(streams.discard)
                            task.add_done_callback(self._record_failure)
                    writer.write(connection.data_to_send())
                await writer.drain()
        finally:
            for task in list(streams):
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

    async def _answer(
        self,
        connection: h2.connection.H2Connection,
        lock: asyncio.Lock,
        writer: asyncio.StreamWriter,
        stream_id: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        pseudo = dict(h for h in headers if h[0].startswith(b":"))
        fields = [(k, v) for k, v in headers if not k.startswith(b":") and k not in HOP_BY_HOP | {b"content-length"}]
        request = [b"%s %s HTTP/1.1" % (pseudo[b":method"], pseudo[b":path"]), b"Host: " + pseudo[b":authority"]]
        request += [k + b": " + v for k, v in fields] + [b"Content-Length: %d" % len(body), b"Connection: close"]
        try:
            up_reader, up_writer = await self._connect(*self._upstream)
            try:
                up_writer.write(b"\r\n".join(request) + b"\r\n\r\n" + body)
                await up_writer.drain()
                status, response_headers, content = await _read_response(up_reader)
            finally:
                self._close(up_writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            async with lock:  # the upstream failed: so does the stream
                with contextlib.suppress(h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
                    connection.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
                    writer.write(connection.data_to_send())
            self.streams_failed += 1
            return
        hold_answer, hold_body = dict(fields).get(b"x-relay-hold"), dict(fields).get(b"x-relay-hold-body")
        if hold_answer is not None:
            await self._wait_release(hold_answer.decode())
        out = [(b":status", str(status).encode())]
        out += [(k, v) for k, v in response_headers if k not in HOP_BY_HOP | {b"transfer-encoding", b"content-length"}]
        out.append((b"content-length", str(len(content)).encode()))
        if hold_body is not None:
            self.held(hold_body.decode()).set()  # before the headers go: the client may see them at once
        try:
            async with lock:
                connection.send_headers(stream_id, out)
                writer.write(connection.data_to_send())
            await writer.drain()
            if hold_body is not None:
                await self._wait_release(hold_body.decode())
            async with lock:
                for start in range(0, len(content), 16384):
                    connection.send_data(stream_id, content[start : start + 16384])
                connection.end_stream(stream_id)
                writer.write(connection.data_to_send())
            await writer.drain()
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError, OSError) as exc:
            self.streams_failed += 1
            self.failures.append(f"stream {stream_id}: {exc!r}")
            return
        self.streams += 1


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """An HTTP/1.1 response: status, headers (names lower-cased) and the whole body, de-chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    start, _, block = head[:-4].partition(b"\r\n")
    status = int(start.split(b" ", 2)[1])
    headers = []
    for line in block.split(b"\r\n"):
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    fields = dict(headers)
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        raw = await _read_body(reader, block)
        content = bytearray()
        while raw:
            size_line, _, raw = raw.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            content += raw[:size]
            raw = raw[size + 2 :]
        return status, headers, bytes(content)
    if b"content-length" in fields:
        return status, headers, await reader.readexactly(int(fields[b"content-length"]))
    return status, headers, await reader.read()


#: For a test that must build one of these by name.
FACTORIES: dict[str, Callable[..., RelayServer]] = {
    "tls": TlsRelay,
    "uds": UnixRelay,
    "http-proxy": HttpProxy,
    "socks": Socks5Proxy,
    "h2": functools.partial(H2Relay, tls=True),
    "h2c": functools.partial(H2Relay, tls=False),
}
