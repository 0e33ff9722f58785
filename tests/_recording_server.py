"""`RecordingServer`: a plain HTTP/1.1 server that is not llama-server, for the tests that check other origins'
traffic is untouched (install() for httpx, aiohttp, requests). Its own module so that a test of one stack needs no
other stack's packages (the version matrix's oldest row has no httpx2)."""

from __future__ import annotations

import socket
import threading

__all__ = ["RecordingServer"]


class RecordingServer:
    """A plain HTTP/1.1 server that is not llama-server: records every byte it receives, per connection.

    Answers each request with a fixed keep-alive response: chunked SSE when the body asks for a stream, JSON
    otherwise. One thread per connection; requests are framed by Content-Length only (all this test sends).
    """

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.received: list[bytes] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, connection: socket.socket) -> None:
        with self._lock:
            index = len(self.received)
            self.received.append(b"")
        buffer = b""
        with connection:
            while True:
                head_end = buffer.find(b"\r\n\r\n")
                if head_end < 0:
                    data = connection.recv(65536)
                    if not data:
                        return
                    buffer += data
                    with self._lock:
                        self.received[index] += data
                    continue
                head = buffer[:head_end].decode("latin-1").lower()
                length = 0
                for line in head.split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.strip() == "content-length":
                        length = int(value)
                while len(buffer) < head_end + 4 + length:
                    data = connection.recv(65536)
                    if not data:
                        return
                    buffer += data
                    with self._lock:
                        self.received[index] += data
                body = buffer[head_end + 4 : head_end + 4 + length]
                buffer = buffer[head_end + 4 + length :]
                connection.sendall(self._answer(b'"stream": true' in body or b'"stream":true' in body))

    @staticmethod
    def _answer(stream: bool) -> bytes:
        if stream:
            events = b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
            head = b"HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Type: text/event-stream\r\n"
            return head + b"Transfer-Encoding: chunked\r\nKeep-Alive: timeout=5\r\n\r\n" + chunks
        body = b'{"ok": true}'
        return b"HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            len(body),
            body,
        )

    def close(self) -> None:
        self._listener.close()
