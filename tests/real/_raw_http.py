"""HTTP/1.1 on a raw socket, byte for byte, for watching what llama-server does on the wire.

httpx hides exactly what these tests need to see (when the server closes a
connection, whether a request was ever read), so the tests speak bytes
themselves; h11 parses the responses. Every wait has a deadline.
"""

from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import h11

CHAT = "/v1/chat/completions"


def request_bytes(method: str, path: str, body: Any = None, *, host: str = "llama") -> bytes:
    """A complete HTTP/1.1 request (keep-alive, the HTTP/1.1 default); ``body`` is sent as JSON."""
    payload = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    return (head + "\r\n").encode() + payload


def chat_body(*, stream: bool, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A small chat completion; ``ignore_eos`` so it always generates exactly ``max_tokens``."""
    return {
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": stream,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        **extra,
    }


@dataclass
class RawResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    #: The raw bytes of this response, as received (head, chunk framing and all).
    raw: bytes = b""
    first_byte_at: float = 0.0

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return ", ".join(values) if values else None


@dataclass
class RawConnection:
    """One client TCP connection, with h11 parsing the responses."""

    sock: socket.socket
    conn: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    #: Bytes received after the last complete response (should stay empty).
    leftover: bytes = b""

    @classmethod
    def open(cls, address: tuple[str, int], timeout: float = 10.0) -> RawConnection:
        return cls(socket.create_connection(address, timeout=timeout))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        """Send request bytes; h11 is told about the request so it can frame the response."""
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, target, _ = lines[0].split(" ")
        headers = [(name, value) for name, _, value in (line.partition(": ") for line in lines[1:])]
        self.conn.send(h11.Request(method=method, target=target, headers=headers))
        if body:
            self.conn.send(h11.Data(data=body))
        self.conn.send(h11.EndOfMessage())
        self.sock.sendall(data)

    def read_response(self, timeout: float) -> RawResponse:
        """Read one complete response; raise TimeoutError if it is not complete in time."""
        deadline = time.monotonic() + timeout
        status = 0
        headers: list[tuple[str, str]] = []
        body = bytearray()
        raw = bytearray()
        first_byte_at = 0.0
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:  # e.g. EOF in the middle of a response
                raise ConnectionError(f"server broke the response: {exc}") from exc
            if event is h11.NEED_DATA:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no complete response within {timeout} s")
                self.sock.settimeout(remaining)
                try:
                    data = self.sock.recv(65536)
                except TimeoutError as exc:
                    raise TimeoutError(f"no complete response within {timeout} s") from exc
                if data and not first_byte_at:
                    first_byte_at = time.monotonic()
                raw += data
                self.conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = [(k.decode(), v.decode()) for k, v in event.headers.raw_items()]
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                # h11 keeps bytes that came after the response in its buffer.
                self.leftover = bytes(self.conn.trailing_data[0])
                return RawResponse(status, headers, bytes(body), bytes(raw), first_byte_at)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("server closed the connection before the response was complete")

    def request(self, data: bytes, timeout: float = 30.0) -> RawResponse:
        self.send(data)
        return self.read_response(timeout)

    def wait_closed(self, timeout: float) -> str:
        """Wait for the server to close: ``"eof"``, ``"reset"``, ``"timeout"`` (still open) or
        ``"data"`` (it sent more bytes instead)."""
        if self.leftover:
            return "data"
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if not readable:
            return "timeout"
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return "reset"
        return "data" if data else "eof"
