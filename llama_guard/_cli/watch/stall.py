"""Tell a stalled connection from a busy one, one sample of the receive queues at a time (no I/O).

A server connection whose receive queue (Recv-Q) holds bytes has a request the server has not read yet. On a
healthy server that lasts microseconds: a thread reads the request as it arrives. A connection left waiting by
cpp-httplib's pool defect keeps its request unread until some other connection closes, which with keep-alive
clients can take minutes. So: a connection whose queue stayed above zero, never shrinking, for ``threshold``
seconds is stalled. A shrinking queue means the server read something; that connection starts over.

The clock starts when a connection is first seen with unread bytes: nothing in ``/proc`` says how long the bytes
were there before ``watch`` started looking.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .procnet import CLOSE_WAIT, Endpoint

__all__ = ["ConnectionKey", "QueueSample", "StallEvent", "StallTracker"]


@dataclass(frozen=True, order=True)
class ConnectionKey:
    """A server-side connection: the server's end and the client's."""

    server: Endpoint
    client: Endpoint

    def __str__(self) -> str:
        return f"{self.server}<-{self.client}"


@dataclass(frozen=True)
class QueueSample:
    rx_queue: int
    state: int


@dataclass(frozen=True)
class StallEvent:
    """``stalled``: unread for ``seconds`` (reported once, at the threshold); ``read``: the server read it at
    last; ``closed``: the connection went away still unread."""

    kind: Literal["stalled", "read", "closed"]
    key: ConnectionKey
    seconds: float
    #: The client closed its end (the server's socket is in CLOSE_WAIT): it gave up waiting.
    client_gave_up: bool = False


@dataclass
class _Track:
    since: float
    last_rx: int
    reported: bool = False
    client_gave_up: bool = False


class StallTracker:
    """Feed it one sample of every watched connection per :meth:`update`; it returns what changed."""

    def __init__(self, threshold: float) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0 seconds; got {threshold!r}")
        self.threshold = threshold
        self._tracks: dict[ConnectionKey, _Track] = {}
        #: The longest unread time seen per connection that was ever reported stalled.
        self.stalled: dict[ConnectionKey, float] = {}

    def update(self, now: float, samples: Mapping[ConnectionKey, QueueSample]) -> list[StallEvent]:
        events: list[StallEvent] = []
        for key in sorted(self._tracks.keys() - samples.keys()):  # gone from the table: closed
            gone = self._tracks.pop(key)
            if gone.reported:
                events.append(StallEvent("closed", key, self._note(key, now - gone.since), gone.client_gave_up))
        for key in sorted(samples):
            sample = samples[key]
            track: _Track | None = self._tracks.get(key)
            if track is not None and sample.rx_queue < track.last_rx:
                # The server read bytes: whatever was stalled is moving now.
                del self._tracks[key]
                if track.reported:
                    events.append(StallEvent("read", key, self._note(key, now - track.since), track.client_gave_up))
                track = None
            if sample.rx_queue <= 0:
                continue
            if track is None:
                track = self._tracks[key] = _Track(since=now, last_rx=sample.rx_queue)
            track.last_rx = sample.rx_queue
            track.client_gave_up = sample.state == CLOSE_WAIT
            unread = now - track.since
            if track.reported:
                self._note(key, unread)
            elif unread >= self.threshold:
                track.reported = True
                events.append(StallEvent("stalled", key, self._note(key, unread), track.client_gave_up))
        return events

    def unread_now(self) -> dict[ConnectionKey, float]:
        """Connections reported stalled that are still unread, with the time they first showed unread bytes."""
        return {key: track.since for key, track in self._tracks.items() if track.reported}

    def _note(self, key: ConnectionKey, seconds: float) -> float:
        self.stalled[key] = max(self.stalled.get(key, 0.0), seconds)
        return seconds
