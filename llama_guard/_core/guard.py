"""A guard's state, and the plan of each request it receives: where every stack's driver starts.

A `Guard` is what one guarding object holds, whatever its stack: a transport's, an aiohttp middleware's, a requests
adapter's. Its settings (`GuardPolicy`), counters (``stats``, with an account per origin), the llama-server origins
it guards, the connection strategy of each origin, the connections whose probe it gave up on, the origins that
cannot be probed, and the process's shared state (`ProcessState`), handed to it when it is made.

For each request to a llama-server origin the driver asks `Guard.plan` for a `RequestPlan`: the request's facts and
the decisions made before it is sent (its policy with the request's own options, whether it asks for a stream, its
connection strategy, whether it carries ``Connection: close``, and whether its first attempt may go out as the
caller built it, `RequestPlan.as_is`). Most requests end there: answered at once on a pooled connection
(`RequestPlan.answered_at_once`). The others get a `RequestMachine` (`RequestPlan.machine`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from .connection_strategy import ConnectionChoice, Strategies, is_loopback_host
from .decisions import Verdict, first_attempt_goes_as_is, wants_stream
from .log import describe_request
from .origin_book import REMEMBERED_BY_URL
from .origins import Origin, OriginRegistry
from .policy import GuardPolicy
from .probes import GivenUpWatches, OriginProbes
from .process_state import ProcessState
from .request_machine import RequestMachine
from .result import GuardResult
from .stats import GuardStats

__all__ = ["Accounts", "Guard", "GuardAttributes", "RequestPlan"]


GuardT = TypeVar("GuardT", bound="Guard")


class Accounts:
    """One transport's (or middleware's) accounts per origin in its `GuardStats` (`GuardStats.of_origin`),
    remembered by the URL's (scheme, host, port) as its HTTP library spells them: one dict lookup per request."""

    __slots__ = ("_known", "_stack", "_stats")

    def __init__(self, stats: GuardStats, stack: str) -> None:
        """``stack``: the name counts are kept under (``"httpx"``, ``"httpx2"``, ``"aiohttp"``, ``"requests"``)."""
        self._stats = stats
        self._stack = stack
        self._known: dict[tuple[str, str, int | None], GuardStats] = {}

    def of(self, scheme: str, host: str, port: int | None, origin: Origin | None) -> GuardStats:
        """The account of a request's origin (``origin``: if the caller worked it out already)."""
        account = self._known.get((scheme, host, port))
        if account is None:
            account = self._stats.of_origin(
                self._stack, origin if origin is not None else Origin.of(scheme, host, port)
            )
            if len(self._known) < REMEMBERED_BY_URL:
                self._known[scheme, host, port] = account
        return account


class Guard:
    """One guard's state (see the module's doc). ``stack``: the name its counts per origin go under (``"httpx"``,
    ``"httpx2"``, ``"aiohttp"``, ``"requests"``, ``"urllib3"``); ``unix_socket``: its connections go through one."""

    __slots__ = (
        "_accounts",
        "_routes",
        "_stats",
        "given_up",
        "origins",
        "policy",
        "process",
        "stack",
        "strategies",
        "unprobeable",
    )

    def __init__(
        self,
        *,
        policy: GuardPolicy,
        stats: GuardStats,
        origins: OriginRegistry,
        stack: str,
        process: ProcessState,
        unix_socket: bool = False,
    ) -> None:
        self.policy = policy
        self.origins = origins
        self.stack = stack
        self.process = process
        self._stats = stats
        self._accounts = Accounts(stats, stack)
        self.strategies = Strategies(policy.connection, stats, process.connections, unix_socket=unix_socket)
        # Per URL (scheme, host, port): its origin's account, final connection strategy, whether a first attempt
        # with a body held in memory goes out as it is, and its origin, for requests without options of their own
        # (one lookup per request where there would be three decisions, and the origin worked out once).
        self._routes: dict[tuple[str, str, int | None], tuple[GuardStats, ConnectionChoice, bool, Origin]] = {}
        # Connections whose probe was given up, watched a while for a late answer: ended when the guard closes.
        self.given_up = GivenUpWatches()
        # Origins whose server closed the connection after answering a probe: probing them cannot work.
        self.unprobeable: set[Origin] = set()

    @classmethod
    def made(
        cls: type[GuardT],
        stack: str,
        *,
        policy: object,
        stats: object,
        origins: object,
        process: ProcessState,
        **kwargs: Any,
    ) -> GuardT:
        """The guard of a driver of ``stack``, from the driver's arguments, checked (a TypeError that names what was
        wrong and what is accepted), with the defaults for those left None: a default `GuardPolicy`, new counters,
        the policy's origins. ``kwargs``: the rest of the constructor's (``unix_socket``...)."""
        if policy is not None and not isinstance(policy, GuardPolicy):
            raise TypeError(f"policy must be a llama_guard.GuardPolicy or None; got {type(policy).__name__}")
        if stats is not None and not isinstance(stats, GuardStats):
            raise TypeError(f"stats must be a llama_guard.GuardStats or None; got {type(stats).__name__}")
        if origins is not None and not isinstance(origins, OriginRegistry):
            raise TypeError(f"origins must be an OriginRegistry or None; got {type(origins).__name__}")
        policy = policy if policy is not None else GuardPolicy()
        return cls(
            policy=policy,
            stats=stats if stats is not None else GuardStats(),
            origins=origins if origins is not None else OriginRegistry(policy.origins),
            process=process,
            stack=stack,
            **kwargs,
        )

    @property
    def stats(self) -> GuardStats:
        return self._stats

    @stats.setter
    def stats(self, stats: GuardStats) -> None:
        """Count into ``stats`` from now on (one shared with other guards): the accounts per origin and the records of
        the connection strategies move with it."""
        self._stats = stats
        self._accounts = Accounts(stats, self.stack)
        self._routes = {}
        self.strategies.stats = stats

    def account(self, scheme: str, host: str, port: int | None, origin: Origin | None) -> GuardStats:
        """The account of an origin in the stats (`GuardStats.of_origin`), by its URL's parts."""
        return self._accounts.of(scheme, host, port, origin)

    def plan(
        self,
        request: Any,
        *,
        scheme: str,
        host: str,
        port: int | None,
        origin: Origin | None,
        overrides: Any,
        body: bytes | None,
        may_close: bool = True,
        hooks_follow: bool = True,
    ) -> RequestPlan:
        """The plan of a request to a llama-server origin, which the guard receives now.

        ``request``: what the machines read of it (``method``, upper case, ``url`` with ``scheme``, ``host``,
        ``port``, ``path`` and ``netloc``, ``headers``, ``extensions`` with httpx's ``timeout``); ``scheme``,
        ``host``, ``port``: its URL's, as the stack spells them; ``origin``: if worked out already; ``overrides``:
        the request's own options (a dict of `GuardPolicy` fields) or None; ``body``: its bytes when held in memory
        (None: a one-shot stream); ``may_close``: whether ``Connection: close`` may go on it (not where HTTP/2 may
        carry it); ``hooks_follow``: the stack sees the attempt's new connections anyway (a first attempt sent as it
        is can still be probed and judged), the same for every request of a driver."""
        started = time.monotonic()
        stream = body is not None and request.method == "POST" and wants_stream(body)
        route = self._routes.get((scheme, host, port)) if overrides is None else None
        if route is not None:
            policy = self.policy
            stats, connection, replayable_as_is, route_origin = route
            as_is = replayable_as_is and body is not None
            if origin is None:
                origin = route_origin
        else:
            policy = self.policy if overrides is None else self.policy.merged(overrides)
            stats = self._accounts.of(scheme, host, port, origin)
            connection = self.strategies.choice(scheme, host, port, origin, policy.connection, stats)
            as_is = first_attempt_goes_as_is(
                body,
                has_overrides=overrides is not None,
                adds_deadline=policy.first_byte_timeout is not None,
                hooks_follow=hooks_follow,
            )
            if overrides is None and connection.final and len(self._routes) < REMEMBERED_BY_URL:
                # The route's answer for a body that can be sent again: the rest of the question is the same for
                # every request of the route (the guard's policy; hooks_follow, a fixed trait of the driver).
                replayable_as_is = first_attempt_goes_as_is(
                    b"",
                    has_overrides=False,
                    adds_deadline=policy.first_byte_timeout is not None,
                    hooks_follow=hooks_follow,
                )
                known = origin if origin is not None else Origin.of_url(request.url)  # as `RequestPlan.origin`
                self._routes[scheme, host, port] = (stats, connection, replayable_as_is, known)
        closes = may_close and (connection.strategy == "close" or (stream and policy.stream_mode == "close"))
        # Positional: made for every request, and keywords to a class go through a dict (about 400 ns more a request,
        # 0.1% of one, timeit: `.plan` 1.15 against 1.55 µs).
        # A stream's connection the header does not close is dropped; only llama streams need it, and only a body that
        # asks for one (or could not be read) gets one: other responses skip the check (llama-server sends the rest
        # with a length).
        drops_streams = not closes and policy.stream_mode != "off" and (stream or body is None)
        return RequestPlan(
            self, request, origin, policy, stats, body, stream, started, connection, closes, drops_streams, as_is
        )

    def close(self) -> None:
        """The guard closes: its given-up connections go with it, and a stall episode it opened is logged now."""
        self.given_up.end_all()
        self.process.stalls.flush()


@dataclass(slots=True, eq=False)
class RequestPlan:
    """One request's facts and the decisions made before it is sent (see `Guard.plan`); its `RequestMachine` once
    something needs one.

    ``as_is``: its first attempt may go out as the caller built it, with no machine (a replayable body, no
    per-request options, no first-byte deadline: ``Connection: close``, when the plan says it, goes on a copy of the
    caller's headers); ``close_connection``: every attempt carries ``Connection: close`` (the close strategy, or a
    llama stream in ``stream_mode="close"``); ``drops_streams``: a stream's connection that the header does not
    close is dropped after the final chunk (for a request that asks for a stream, or whose body could not be read);
    ``given_origin``: the origin when the driver worked it out already."""

    guard: Guard
    request: Any
    given_origin: Origin | None
    policy: GuardPolicy
    stats: GuardStats
    body: bytes | None
    stream: bool
    started: float
    connection: ConnectionChoice
    close_connection: bool
    drops_streams: bool
    as_is: bool
    _machine: RequestMachine | None = field(default=None, init=False)
    # How far the current attempt's new connection got (`opening`, `opened`): 0 none (a pooled connection, or none
    # yet), 1 being opened, 2 up, 3 up and its probe answered (the server reads it: a first-byte timeout on it is no
    # stall). Read by the request's machine when the attempt fails (`RequestMachine._tracker`).
    new_connection: int = field(default=0, init=False)
    # What its connections' probes found, across its attempts (written by each `ConnectionMachine`, read by the
    # request's machine): probes given up or failed; whether the server was seen reading new connections (a probe
    # got an HTTP answer: later attempts need no probe); the verdict on the last probe if it was answered and its
    # connection closed (a 503: loading; not a stall either way); the deadline the last probe waited (a stalled
    # connection's reconnect window; None: no probe yet).
    failed_probes: int = field(default=0, init=False)
    server_reads_connections: bool = field(default=False, init=False)
    probe_verdict: Verdict | None = field(default=None, init=False)
    probe_deadline_used: float | None = field(default=None, init=False)

    # -- the request's facts, worked out when asked -------------------------------------------------------------------

    @property
    def origin(self) -> Origin:
        """Where the request goes (worked out only when needed: with ``origins="all"`` the usual request never is)."""
        origin = self.given_origin
        if origin is None:
            origin = self.given_origin = Origin.of_url(self.request.url)
        return origin

    @property
    def process(self) -> ProcessState:
        return self.guard.process

    @property
    def origin_probes(self) -> OriginProbes:
        """The probe deadline in force and the admission of new connections for this request's origin."""
        return self.guard.process.probes.of(self.origin, self.stats)

    @property
    def description(self) -> str:
        """For logs and error messages: method, origin and path (never the query string)."""
        url = self.request.url
        return describe_request(self.request.method, url.scheme, url.host, url.port, url.path)

    @property
    def host_header(self) -> str:
        """The ``Host`` header the request goes with, for its connection's probe."""
        own = getattr(self.request, "host_header", None)
        if isinstance(own, str):
            return own
        host: str = self.request.headers.get("host") or self.request.url.netloc.decode("ascii")
        return host

    @property
    def probing(self) -> bool:
        """New connections of this request's attempts are to be probed: under the keep-alive strategy, and while
        ``"auto"`` measures what a new connection costs (its probe's round trip is part of it; the connection
        machine probes only those that take a sample, `OriginConnections.start_sample`)."""
        connection = self.connection
        return (
            self.policy.probe
            and not self.server_reads_connections
            and (connection.strategy == "reuse" or not connection.final)
        )

    def caller_read_timeout(self) -> float | None:
        """The caller's own read timeout (httpx's ``timeout`` extension, as every stack's request view has it)."""
        timeouts: dict[str, float | None] = self.request.extensions.get("timeout", {})
        return timeouts.get("read")

    def teach(self, *, connect_cost: float | None = None, request: float | None = None) -> None:
        """Teach the origin's ``"auto"`` connection strategy a new connection's cost or a request's time."""
        self.guard.process.connections.teach(self.origin, self.stats, connect_cost=connect_cost, request=request)

    # -- the machine --------------------------------------------------------------------------------------------------

    def start(self) -> RequestMachine:
        """The machine of a request whose first attempt needs one from the start (not `as_is`)."""
        machine = self._machine = RequestMachine(self)
        return machine

    def machine(self) -> RequestMachine:
        """The request's machine; made now, during its first attempt sent as it is, if it had none (a failure, a
        503/429), and carrying on from that attempt."""
        machine = self._machine
        if machine is None:
            machine = self._machine = RequestMachine(self, sent=True)
        return machine

    @property
    def needs_connection_machine(self) -> bool:
        """Whether a new connection of this request's attempt needs its own machine: to be probed (the keep-alive
        strategy), to teach what it cost (``"auto"`` measuring), or because the request has a machine already.
        Otherwise (the close strategy, the usual case on loopback) the connection is only noted (`opening`,
        `opened`), as a connection machine notes it too: a request machine reads the note only if the attempt then
        fails."""
        return (
            self._machine is not None
            or not self.connection.final
            or (self.policy.probe and self.connection.strategy == "reuse")
        )

    @property
    def prewarms(self) -> bool:
        """Whether a spare replaces this request's stream connection when it is dropped (`GuardPolicy.prewarm`):
        keep-alive with the probe, to an origin a new connection costs a round trip to (not loopback)."""
        policy = self.policy
        return (
            policy.prewarm
            and policy.probe
            and self.connection.strategy == "reuse"
            and not is_loopback_host(self.origin.host)
        )

    def opening(self) -> None:
        """A new connection is being opened for the current attempt (by its machine, or only noted)."""
        self.new_connection = 1

    def opened(self, *, read: bool = False) -> None:
        """That connection is up (and probed, when probing): a failure from now on may have sent the request.
        ``read``: the server answered its probe, so it reads this connection."""
        self.new_connection = 3 if read else 2

    def for_spare(self) -> RequestPlan:
        """A plan for a spare connection opened beside this request (`GuardPolicy.prewarm`): the same facts, with
        no machine and nothing its probes found, so that the spare's connection reports nothing to this request."""
        return dataclasses.replace(self)

    @property
    def has_machine(self) -> bool:
        return self._machine is not None

    # -- a first attempt answered at once -----------------------------------------------------------------------------

    def answered_at_once(self, dropped: bool) -> GuardResult:
        """A first attempt sent as it is, answered (not 503/429) with no machine: its result, counted.
        ``dropped``: its stream's connection will be dropped after the final chunk."""
        first_byte = time.monotonic() - self.started
        connection = self.connection
        if not connection.final:
            self.teach(request=first_byte)
        closes = self.close_connection
        # Counted in stats.stream_connections_closed: a stream's connection closed by the header, whichever put it on
        # (the close strategy or stream_mode='close'); the close strategy's other requests are not.
        self.stats.record_request(1, first_byte, closes and self.stream)
        # Positionally, in GuardResult's field order (attempts, reconnects, first_byte_seconds, stream,
        # connection_closed, history, connection): once per request, and keywords cost about 300 ns more.
        return GuardResult(1, 0, first_byte, self.stream, closes or dropped, (), connection.strategy)

    def interrupted(self) -> None:
        """A first attempt sent as it is was cancelled or interrupted: counted as a request, as any."""
        self.stats.record_request(1, None, False)


T = TypeVar("T")


class _FromGuard(Generic[T]):
    """An attribute of a driver that is its guard's (``driver._guard.<name>``): read there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, driver: None, owner: type) -> _FromGuard[T]: ...
    @overload
    def __get__(self, driver: object, owner: type) -> T: ...
    def __get__(self, driver: object | None, owner: type) -> T | _FromGuard[T]:
        if driver is None:
            return self
        value: T = getattr(driver._guard, self._name)  # type: ignore[attr-defined]
        return value


class _StatsFromGuard(_FromGuard[GuardStats]):
    """A driver's ``stats``: its guard's, which may be replaced (by a `GuardStats` shared with other guards)."""

    def __set__(self, driver: object, stats: GuardStats) -> None:
        driver._guard.stats = stats  # type: ignore[attr-defined]


class GuardAttributes:
    """What a driver that holds a `Guard` (in ``_guard``) shows of it: its ``policy``, the llama-server ``origins``
    it guards, the ``process`` state it shares, and its ``stats`` (the counters it counts into; may be replaced,
    say by a `GuardStats` shared with other guards)."""

    _guard: Guard  # set by the driver

    policy: _FromGuard[GuardPolicy] = _FromGuard()
    origins: _FromGuard[OriginRegistry] = _FromGuard()
    process: _FromGuard[ProcessState] = _FromGuard()
    stats: _StatsFromGuard = _StatsFromGuard()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.policy!r}>"
