"""The connection strategy of one origin: *close* every connection after its request, or *reuse* connections.

Sans-I/O: adapters report what a new connection cost and how long requests took; this module decides.

Why two strategies. llama-server before b11737 leaves a new keep-alive connection unread while its HTTP threads are
held by other connections, and an idle keep-alive connection holds one for up to 5 s. ``Connection: close`` on every
request frees the thread as soon as the response is sent, so nothing idles on the server and no connection stalls:
measured on b11434, it reaches the fixed server's floor in a burst, where keep-alive with a probe waits for stalled
connections to be rescued. Its price is a new connection per request: nothing on loopback or a Unix socket, one
network round trip (more with TLS) elsewhere, where reusing connections and probing new ones pays.

``GuardPolicy(connection=...)``:

- ``"close"``: every request to the origin carries ``Connection: close``; no probe (a connection's only request is
  the one the probe would protect, and nothing idles to stall it).
- ``"reuse"``: keep-alive, the probe on new connections, kicks, stream close.
- ``"auto"`` (default): close for a loopback address or a Unix socket, at once. Elsewhere close while measuring,
  the first `MIN_CONNECTS` new connections probed (its round trip is part of what one costs; the others are not,
  `OriginConnections.start_sample`); once `MIN_CONNECTS` new connections and
  `MIN_REQUESTS` requests were seen, close if a new connection costs at most `CLOSE_COST_SHARE` of the origin's
  median request time, else reuse. Closing while measuring keeps a process's first burst of connections from
  stalling on the server: nothing idles on its threads, where keep-alive connections opened together would hold
  them (measured across a 2 and a 20 ms relay: the slowest first response of a 32-connection burst was 0.11 to
  0.25 s closing, 0.19 to 1.40 s reusing). A new connection's cost is the cheapest
  seen of its connect (and TLS) plus its probe's round trip: at least what a connection per request adds, since a
  connect alone may not show the handshake's round trip (a proxy or relay in between accepts at once and defers it
  to the first byte).
  The choice is made once per origin and process and said once in the log.
"""

from __future__ import annotations

import ipaddress
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal, TypeAlias

from .log import logger
from .origin_book import REMEMBERED_BY_URL, OriginBook
from .origins import Origin
from .stats import GuardStats

__all__ = [
    "CLOSE_COST_SHARE",
    "REUSE_UNDECIDED",
    "ConnectionBook",
    "MIN_CONNECTS",
    "MIN_REQUESTS",
    "ConnectionChoice",
    "ConnectionMode",
    "OriginConnections",
    "Strategies",
    "Strategy",
    "is_loopback_host",
]

ConnectionMode: TypeAlias = Literal["auto", "close", "reuse"]
Strategy: TypeAlias = Literal["close", "reuse"]

# The measured rule (`"auto"` away from loopback): a new connection costing at most this share of a request's time
# is cheap enough to pay on every request.
CLOSE_COST_SHARE = 0.05
MIN_CONNECTS = 2
MIN_REQUESTS = 16
# Samples kept per origin: recent ones, so a changed network is seen (the choice itself is made once).
_WINDOW = 64


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (``localhost``, 127.0.0.0/8, ``::1``, IPv4-mapped too)."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass(frozen=True, slots=True)
class ConnectionChoice:
    """The strategy in force for an origin, and why (``reason``, for stats and the log). ``final``: False while
    ``"auto"`` is still measuring (the strategy is then ``"close"``, with every new connection probed)."""

    strategy: Strategy
    reason: str
    final: bool = True

    def __str__(self) -> str:
        return f"{self.strategy} ({self.reason})"


FORCED_CLOSE = ConnectionChoice("close", "forced: GuardPolicy(connection='close')")
FORCED_REUSE = ConnectionChoice("reuse", "forced: GuardPolicy(connection='reuse')")
UNIX_SOCKET = ConnectionChoice("close", "a Unix socket: a new connection costs no network round trip")
LOOPBACK = ConnectionChoice("close", "a loopback address: a new connection costs no network round trip")
# What a request gets when no strategy was worked out for it (a transport that does not choose: reuse, as before).
REUSE_UNDECIDED = ConnectionChoice("reuse", "not chosen", final=False)


class OriginConnections:
    """What the guard measured of one origin's connections, and the ``"auto"`` choice made from it. Thread-safe."""

    __slots__ = ("_announced", "_choice", "_connects", "_lock", "_requests", "_sampling", "origin")

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self._lock = threading.Lock()
        self._connects: deque[float] = deque(maxlen=_WINDOW)
        self._requests: deque[float] = deque(maxlen=_WINDOW)
        self._choice: ConnectionChoice | None = None
        self._announced: set[ConnectionChoice] = set()
        self._sampling = 0  # probes under way for a sample of what a new connection costs

    def first_announcement(self, choice: ConnectionChoice) -> bool:
        """True the first time ``choice`` is announced for this origin (the log says each choice once)."""
        if choice in self._announced:
            return False
        with self._lock:
            if choice in self._announced:
                return False
            self._announced.add(choice)
            return True

    def in_use(self) -> bool:
        """A sample under way (`OriginBook` keeps it)."""
        return self._sampling > 0

    def used_lately(self) -> bool:
        """Never a reason to keep it: a guard remembers the choices it uses, and measuring again costs a few probed
        connections (`OriginBook`)."""
        return False

    def choice(
        self, mode: ConnectionMode, *, unix_socket: bool = False, unmeasurable: str | None = None
    ) -> ConnectionChoice:
        """The strategy for a request in ``mode`` (the policy's ``connection``), through a Unix socket or not.
        ``unmeasurable``: why the asking guard cannot time a new connection (it does not see them): where it would
        measure, it closes every connection for good, saying why, rather than measure without end; a choice another
        guard of the process measured stands."""
        if mode == "close":
            return FORCED_CLOSE
        if mode == "reuse":
            return FORCED_REUSE
        if unix_socket:
            return UNIX_SOCKET
        choice = self._choice
        if choice is not None:
            return choice
        if is_loopback_host(self.origin.host):
            self._choice = LOOPBACK
            return LOOPBACK
        if unmeasurable is not None:  # this guard's own choice: not kept as the origin's
            return ConnectionChoice("close", f"the cost of a new connection cannot be measured: {unmeasurable}")
        return self._measuring()

    def _measuring(self) -> ConnectionChoice:
        with self._lock:
            if self._choice is not None:  # made since `choice` looked
                return self._choice
            connects, requests = len(self._connects), len(self._requests)
        return ConnectionChoice(
            "close",
            f"measuring the cost of a new connection (each probed, then closed): {connects} of {MIN_CONNECTS} "
            f"connections, {requests} of {MIN_REQUESTS} requests seen",
            final=False,
        )

    def start_sample(self) -> bool:
        """Whether a new connection opened while measuring is probed for a sample of what a new connection costs:
        until `MIN_CONNECTS` samples are in or under way. Each probed connection holds one of the server's threads
        from the probe's answer until its request arrives, a round trip later: a burst of them queued behind each
        other (the slowest first response of a 32-connection burst across a 20 ms relay about 0.1 s above a plain
        client's that sent `Connection: close`). A True is ended by `end_sample`."""
        with self._lock:
            if self._choice is not None or len(self._connects) + self._sampling >= MIN_CONNECTS:
                return False
            self._sampling += 1
            return True

    def end_sample(self) -> None:
        """The probe that `start_sample` allowed has ended, its sample taught (`connected`) or not."""
        with self._lock:
            self._sampling -= 1

    def connected(self, seconds: float) -> ConnectionChoice | None:
        """A new connection to the origin cost ``seconds`` (connect, TLS for https, and its probe's round trip when
        probed); the choice if this sample made it (to be said once), else None."""
        with self._lock:
            self._connects.append(seconds)
            return self._decide()

    def answered(self, seconds: float) -> ConnectionChoice | None:
        """A request to the origin had its response headers ``seconds`` after it was written; as `connected`."""
        if self._choice is not None:
            return None  # decided: the hot path takes no lock
        with self._lock:
            self._requests.append(seconds)
            return self._decide()

    def _decide(self) -> ConnectionChoice | None:
        if self._choice is not None or len(self._connects) < MIN_CONNECTS or len(self._requests) < MIN_REQUESTS:
            return None
        # The cheapest new connection seen: the network's cost. A probe that waited on a busy server measured the
        # server's queue too, which a request waits for under either strategy (measured: 20 to 129 ms per new
        # connection in bursts across a 2 ms relay, 11 to 14 ms when quiet).
        cost = min(self._connects)
        request = statistics.median(self._requests)
        share = cost / request if request > 0 else float("inf")
        measured = (
            f"a new connection costs {cost * 1000:.1f} ms (the cheapest seen), {share:.0%} of the median request's "
            f"{request * 1000:.1f} ms (close at most {CLOSE_COST_SHARE:.0%})"
        )
        strategy: Strategy = "close" if share <= CLOSE_COST_SHARE else "reuse"
        self._choice = ConnectionChoice(strategy, f"measured: {measured}")
        return self._choice


class ConnectionBook:
    """`OriginConnections` per origin (loopback spellings of one server share one): the process's
    (``ProcessState.connections``), since what a new connection costs is the network's, whichever client measured
    it."""

    def __init__(self) -> None:
        self._origins: OriginBook[OriginConnections] = OriginBook(what="the cost of a new connection measured")

    def of(self, origin: Origin, stats: GuardStats | None = None) -> OriginConnections:
        """``origin``'s entry; ``stats``: the account that counts an older origin forgotten to make room for it."""
        key = origin.same_server_key()
        connections = self._origins.get(key)
        if connections is not None:
            return connections
        return self._origins.of(key, lambda: OriginConnections(origin), account=stats)

    def forget(self) -> None:
        """Drop everything measured (tests)."""
        self._origins.forget()

    def teach(
        self, origin: Origin, stats: GuardStats, *, connect_cost: float | None = None, request: float | None = None
    ) -> None:
        """Teach ``origin``'s ``"auto"`` strategy a new connection's cost or a request's time; a choice it makes is
        announced (`announce`)."""
        connections = self.of(origin)
        decided = connections.connected(connect_cost) if connect_cost is not None else None
        if request is not None:
            decided = connections.answered(request) or decided
        if decided is not None:
            self.announce(origin, decided, stats)

    def announce(self, origin: Origin, choice: ConnectionChoice, stats: GuardStats) -> None:
        """Record ``choice`` for ``origin`` in ``stats`` and, once per origin and process, in the log."""
        stats.record_connection_choice(str(origin), str(choice), final=choice.final)
        if choice.final and self.of(origin).first_announcement(choice):
            logger.info("connections to %s: %s", origin, choice)


class Strategies:
    """One transport's (or session's) connection strategies: the final choice of each origin, kept per
    (scheme, host, port) as its HTTP library spells them, so the usual request pays one dict lookup."""

    __slots__ = ("_book", "_chosen", "_mode", "stats", "unix_socket", "unmeasurable")

    def __init__(
        self, mode: ConnectionMode, stats: GuardStats, book: ConnectionBook, *, unix_socket: bool = False
    ) -> None:
        """``mode``: the transport policy's ``connection``; ``book``: the process's measurements
        (``ProcessState.connections``); ``unix_socket``: the transport connects through one."""
        self._mode = mode
        self._book = book
        self.stats = stats  # where choices are recorded: the owner's, replaced with it
        self.unix_socket = unix_socket
        # Why the owner cannot time its new connections (its pool or connector is out of reach), set before its
        # first request: ``"auto"`` then closes every connection rather than measure without end.
        self.unmeasurable: str | None = None
        self._chosen: dict[tuple[str, str, int | None], ConnectionChoice] = {}

    def choice(
        self,
        scheme: str,
        host: str,
        port: int | None,
        origin: Origin | None,
        mode: ConnectionMode,
        account: GuardStats | None = None,
    ) -> ConnectionChoice:
        """The strategy for a request (``mode``: its policy's, which a request may override); ``account``: its
        origin's, which counts an older origin forgotten to make room for this one."""
        key = (scheme, host, port)
        if mode == self._mode:
            choice = self._chosen.get(key)
            if choice is not None:
                return choice
        origin = origin if origin is not None else Origin.of(scheme, host, port)
        choice = self._book.of(origin, account).choice(
            mode, unix_socket=self.unix_socket, unmeasurable=self.unmeasurable
        )
        self._book.announce(origin, choice, self.stats)
        if choice.final and mode == self._mode and len(self._chosen) < REMEMBERED_BY_URL:
            self._chosen[key] = choice
        return choice

    def answered(self, scheme: str, host: str, port: int | None, first_byte: float) -> None:
        """A request answered at its first attempt while its origin's strategy is being measured."""
        self._book.teach(Origin.of(scheme, host, port), self.stats, request=first_byte)
