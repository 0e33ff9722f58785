"""The probe exchange, free of I/O: ``GET /health`` on a new connection, and its answer parsed with h11.

Why a probe: llama-server builds before b11737 can leave a newly accepted keep-alive connection unread for as long
as other connections stay open (cpp-httplib's thread pool does not grow when its idle counter is stale). The
defect only ever hits the first exchange of a connection: once a server thread owns a connection, it owns it for
the connection's life. An answer to the probe proves a thread owns it, so the real request is written only to a
connection that will be read. A probe that goes unanswered is harmless when the server runs it later; a real
completion would run twice.

Any complete HTTP response proves a server thread read the connection (200, or 503 while a model loads). The
connection is usable afterwards only if the server keeps it open (HTTP/1.1 keep-alive).
"""

from __future__ import annotations

from dataclasses import dataclass

import h11

from .llama_server import HEALTH_PATH as PROBE_PATH

__all__ = ["ProbeAnswer", "ProbeExchange", "ProbeProtocolError", "probe_deadline"]

PROBE_USER_AGENT = "llama-guard-probe"
MAX_PROBE_RESPONSE = 64 * 1024


class ProbeProtocolError(Exception):
    """The server answered the probe with something that is not a complete HTTP response."""


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    status: int
    keep_alive: bool


class ProbeExchange:
    """One probe: the bytes to write, then `feed()` what the server sends until it returns an answer."""

    def __init__(self, host: str) -> None:
        self._connection = h11.Connection(our_role=h11.CLIENT, max_incomplete_event_size=MAX_PROBE_RESPONSE)
        self._request = h11.Request(
            method="GET",
            target=PROBE_PATH,
            headers=[("Host", host), ("User-Agent", PROBE_USER_AGENT), ("Accept", "*/*")],
        )
        self._status: int | None = None
        self._received = 0

    def request_bytes(self) -> bytes:
        data = self._connection.send(self._request) or b""
        return data + (self._connection.send(h11.EndOfMessage()) or b"")

    def feed(self, data: bytes) -> ProbeAnswer | None:
        """Take bytes read from the connection (``b""`` at EOF); the answer once the response is complete."""
        self._received += len(data)
        if self._received > MAX_PROBE_RESPONSE:
            raise ProbeProtocolError(f"the answer to GET {PROBE_PATH} is larger than {MAX_PROBE_RESPONSE} bytes")
        try:
            self._connection.receive_data(data)
            while True:
                event = self._connection.next_event()
                if event is h11.NEED_DATA:
                    if not data:
                        raise ProbeProtocolError(f"the server closed the connection before answering GET {PROBE_PATH}")
                    return None
                if isinstance(event, h11.Response):
                    self._status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    assert self._status is not None
                    keep_alive = self._connection.their_state is h11.DONE and self._connection.our_state is h11.DONE
                    trailing = len(self._connection.trailing_data[0])
                    if trailing:  # they would be read as the real request's response
                        raise ProbeProtocolError(f"{trailing} bytes after the answer to GET {PROBE_PATH}")
                    return ProbeAnswer(self._status, keep_alive)
                elif isinstance(event, h11.ConnectionClosed):
                    raise ProbeProtocolError(f"the server closed the connection before answering GET {PROBE_PATH}")
        except h11.RemoteProtocolError as exc:
            raise ProbeProtocolError(f"the answer to GET {PROBE_PATH} is not valid HTTP/1.1: {exc}") from None


def probe_deadline(failed_probes: int, *, first: float, cap: float) -> float:
    """The deadline of the next probe of a request: ``first`` for the first two, then doubling, up to ``cap``.

    A second probe that fails too is most often a reconnect that reached the server together with another one
    (measured on b11434), not a slow server: it gets the same short deadline, so that a request rescued on its
    third attempt still has its first response within about 2.5 s.
    """
    return min(first * 2.0 ** min(max(failed_probes - 1, 0), 32), cap)
