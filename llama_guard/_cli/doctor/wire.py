"""HTTP/1.1 on a raw socket for ``doctor``: see exactly when the server answers and when it closes.

An HTTP client library hides what the doctor has to observe (the moment of the first byte, an end of file right
after a response that promised keep-alive), so the checks speak bytes; h11 writes the requests and parses the
responses. Every wait has a deadline, and a wait that runs out raises ``TimeoutError``.
"""

from __future__ import annotations

import json
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Literal

import h11

from ..._readiness import ready

__all__ = [
    "ClosedUnanswered",
    "NotHttp",
    "RawConnection",
    "RawResponse",
    "WireError",
    "connect",
    "read_first_bytes",
    "shown_bytes",
]

AfterResponse = Literal["eof", "reset", "open", "data"]


class WireError(Exception):
    """The server broke HTTP: closed in the middle of a response, or sent something that is not HTTP/1.1."""


class ClosedUnanswered(WireError):
    """The server closed the connection (an end of file) before sending a byte of the response."""


class NotHttp(WireError):
    """The server answered with bytes that cannot begin an HTTP response (which starts with ``HTTP/``)."""

    def __init__(self, first: bytes) -> None:
        self.first = first
        super().__init__(f"not HTTP: {shown_bytes(first)}")


#: How much of a non-HTTP answer an error shows.
SHOWN_BYTES = 60


def shown_bytes(data: bytes, limit: int = SHOWN_BYTES) -> str:
    """``data`` safe to print on one line: printable ASCII as it is, anything else escaped (``\\r``, ``\\x1b``),
    cut after ``limit`` bytes, in double quotes."""
    escapes = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x5C: "\\\\", 0x22: '\\"'}
    text = "".join(escapes.get(byte, chr(byte) if 0x20 <= byte < 0x7F else f"\\x{byte:02x}") for byte in data[:limit])
    return f'"{text}"' + ("..." if len(data) > limit else "")


def _cannot_be_http(buffered: bytes) -> bool:
    start = buffered[:5]
    return start != b"HTTP/"[: len(start)]


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    #: Seconds from the end of the request to the response's first byte, and to its last.
    first_byte: float
    complete: float
    #: time.monotonic() when the last byte of the response arrived.
    ended_at: float

    def header(self, name: str) -> str | None:
        values = [value for key, value in self.headers if key.lower() == name.lower()]
        return ", ".join(values) if values else None

    def json(self) -> object:
        return json.loads(self.body)


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection (TCP_NODELAY, so small requests are not held back); OSError / TimeoutError as they come."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class RawConnection:
    """One client connection; several requests may follow one another on it, as on a pooled connection."""

    def __init__(self, sock: socket.socket, host_header: str) -> None:
        self.sock = sock
        self.host_header = host_header
        self._h11 = h11.Connection(h11.CLIENT)
        self._sent_at = 0.0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, method: str, target: str, *, body: object = None, headers: tuple[tuple[str, str], ...] = ()) -> None:
        """Write one request (``body`` as JSON). Without a ``Connection`` header it asks for keep-alive."""
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
        payload = b"" if body is None else json.dumps(body).encode()
        fields = [("Host", self.host_header), *headers]
        if body is not None:
            fields += [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
        data = self._h11.send(h11.Request(method=method, target=target, headers=fields)) or b""
        if payload:
            data += self._h11.send(h11.Data(data=payload)) or b""
        data += self._h11.send(h11.EndOfMessage()) or b""
        self.sock.sendall(data)
        self._sent_at = time.monotonic()

    def read_response(self, timeout: float) -> RawResponse:
        """The complete response to the last request; TimeoutError if it is not complete within ``timeout``;
        ``NotHttp`` as soon as the first bytes cannot begin an HTTP response; ``ClosedUnanswered`` when the server
        closed the connection without a byte of an answer."""
        deadline = time.monotonic() + timeout
        status = 0
        headers: tuple[tuple[str, str], ...] = ()
        body = bytearray()
        first_at = 0.0
        closed = False
        # The first bytes of this answer: h11 may have consumed them by the time it finds them wrong.
        head = bytearray()
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                seen = self._h11.trailing_data[0] or bytes(head)
                if not status and seen and _cannot_be_http(seen):
                    raise NotHttp(seen) from None
                if closed and not status and not first_at:
                    raise ClosedUnanswered("the server closed the connection without answering") from None
                if closed:
                    raise WireError("the server closed the connection before the response was complete") from None
                raise WireError(f"not a valid HTTP/1.1 response: {exc}") from exc
            if event is h11.NEED_DATA:
                buffered = self._h11.trailing_data[0]
                # h11 waits for a whole head; bytes that cannot start one are known now, not at the timeout.
                if not status and _cannot_be_http(buffered):
                    raise NotHttp(buffered)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no complete response within {timeout:g} s")
                self.sock.settimeout(remaining)
                try:
                    data = self.sock.recv(65536)
                except TimeoutError:
                    raise TimeoutError(f"no complete response within {timeout:g} s") from None
                if data and not first_at:
                    first_at = time.monotonic()
                closed = closed or not data
                if not status and len(head) < 4 * SHOWN_BYTES:
                    head += data[: 4 * SHOWN_BYTES]
                self._h11.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = tuple((key.decode("latin-1"), value.decode("latin-1")) for key, value in event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                ended = time.monotonic()
                return RawResponse(status, headers, bytes(body), first_at - self._sent_at, ended - self._sent_at, ended)
            elif isinstance(event, h11.ConnectionClosed):
                raise WireError("the server closed the connection before the response was complete")
            # h11.InformationalResponse (1xx): keep reading.

    def request(
        self,
        method: str,
        target: str,
        *,
        timeout: float,
        body: object = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> RawResponse:
        self.send(method, target, body=body, headers=headers)
        return self.read_response(timeout)

    def wait_closed(self, timeout: float) -> tuple[AfterResponse, float]:
        """After a complete response: did the server close (``eof``, ``reset``), stay ``open`` for ``timeout``
        seconds, or send more (``data``)? With the time.monotonic() it happened (or the wait ended)."""
        if self._h11.trailing_data[0]:
            return "data", time.monotonic()
        readable = ready([self.sock], timeout)
        now = time.monotonic()
        if not readable:
            return "open", now
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return "reset", now
        return ("data" if data else "eof"), now


def read_first_bytes(socks: list[socket.socket], sent_at: float, deadline: float) -> list[float | None]:
    """Seconds from ``sent_at`` to each socket's first byte (None: nothing by ``deadline``, or a reset).

    One thread watches all of them, so a burst of hundreds costs no more than a few."""
    result: list[float | None] = [None] * len(socks)
    with selectors.DefaultSelector() as selector:
        for index, sock in enumerate(socks):
            selector.register(sock, selectors.EVENT_READ, index)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in selector.select(remaining):
                index = key.data
                selector.unregister(key.fileobj)
                try:
                    got = socks[index].recv(1, socket.MSG_PEEK)  # a peek: the byte stays for whoever reads next
                except OSError:
                    got = b""
                if got:
                    result[index] = time.monotonic() - sent_at
    return result
