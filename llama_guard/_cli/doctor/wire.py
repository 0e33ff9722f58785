"""HTTP/1.1 on a raw socket for ``doctor``: see exactly when the server answers and when it closes.

An HTTP client library hides what the doctor has to observe (the moment of the first byte, an end of file right
after a response that promised keep-alive), so the checks speak bytes; h11 writes the requests and parses the
responses. Every wait has a deadline, and a wait that runs out raises ``TimeoutError``.
"""

from __future__ import annotations

import json
import select
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Literal

import h11

__all__ = ["RawConnection", "RawResponse", "WireError", "connect", "read_first_bytes"]

AfterResponse = Literal["eof", "reset", "open", "data"]


class WireError(Exception):
    """The server broke HTTP: closed in the middle of a response, or sent something that is not HTTP/1.1."""


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
        """The complete response to the last request; TimeoutError if it is not complete within ``timeout``."""
        deadline = time.monotonic() + timeout
        status = 0
        headers: tuple[tuple[str, str], ...] = ()
        body = bytearray()
        first_at = 0.0
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise WireError(f"not a valid HTTP/1.1 response: {exc}") from exc
            if event is h11.NEED_DATA:
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
        readable, _, _ = select.select([self.sock], [], [], timeout)
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
