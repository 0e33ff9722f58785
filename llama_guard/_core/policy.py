"""`GuardPolicy`: the guard's configuration, an immutable and validated value.

A policy is shared freely between transports, threads and tasks: it is a frozen dataclass, every field is
keyword-only, and `__post_init__` rejects a bad value with a `ValueError` that names the field and says what is
accepted. Per-request overrides produce a new policy (`policy.merged(...)`), never a change in place.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

from .connection_strategy import ConnectionMode
from .origins import Origin, parse_origin

__all__ = ["AdmissionMode", "GuardPolicy", "OriginsSetting", "StreamMode"]

StreamMode: TypeAlias = Literal["close", "drop", "off"]
AdmissionMode: TypeAlias = Literal["after_stall", "always", "off"]
OriginsSetting: TypeAlias = Literal["all", "auto"] | tuple[Origin, ...]

_STREAM_MODES: tuple[str, ...] = ("close", "drop", "off")
_CONNECTION_MODES: tuple[str, ...] = ("auto", "close", "reuse")
_ADMISSION_MODES: tuple[str, ...] = ("after_stall", "always", "off")
# Fields that describe the transport as a whole; a single request cannot change which servers are llama-server.
_TRANSPORT_WIDE = frozenset({"origins"})


#: The shortest deadline (first byte, probe): event loops and socket timeouts count in milliseconds (epoll and poll
#: take them so), so a shorter one expires before any answer can come, on every attempt: a request that reached the
#: server would be sent again up to max_attempts times.
MIN_DEADLINE = 0.001
_DEADLINE_REASON = "1 ms, the resolution of event-loop and socket timeouts: a shorter deadline expires on every attempt"


def _check_seconds(name: str, value: object, *, allow_none: bool, minimum: float = 0.0) -> None:
    """Reject anything but a finite number of seconds >= ``minimum`` (and None where that means 'no limit')."""
    if value is None and allow_none:
        return
    accepted = f"a number of seconds >= {minimum:g}" + (f" ({_DEADLINE_REASON})" if minimum == MIN_DEADLINE else "")
    if allow_none:
        accepted += ", or None for no limit"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be {accepted}; got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond a float's range
        raise ValueError(f"{name} must be {accepted}; got a number too large for seconds") from None
    if math.isnan(seconds) or math.isinf(seconds) or seconds < minimum:
        raise ValueError(f"{name} must be {accepted}; got {value!r}")


def _check_int(name: str, value: object, *, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be a whole number from {minimum} to {maximum}; got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")


def _normalise_origins(value: object) -> OriginsSetting:
    if value in ("all", "auto"):
        return value
    if isinstance(value, Mapping):  # iterating it would take its keys, silently
        raise ValueError(
            f"origins must be a list of origins such as ['http://127.0.0.1:8080'], not a {type(value).__name__}; "
            f"got {value!r}"
        )
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(
            "origins must be 'all' (every origin this transport serves is llama-server), 'auto' "
            "(origins that answered with 'Server: llama.cpp'), or a list of origins such as "
            f"['http://127.0.0.1:8080']; got {value!r}"
        )
    origins = []
    for item in value:
        try:
            origins.append(parse_origin(str(item) if isinstance(item, Origin) else item))
        except ValueError as exc:
            # An Origin is checked as its URL, and spelt as the guard spells it (lower case, the default port).
            raise ValueError(f"origins: {f'{item!r} as ' if isinstance(item, Origin) else ''}{exc}") from None
    if not origins:
        raise ValueError("origins must name at least one origin, or be 'all' or 'auto'; got an empty list")
    return tuple(dict.fromkeys(origins))


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class GuardPolicy:
    """How a guarded transport treats llama-server traffic.

    Every field has a default that is safe for any llama-server workload: nothing healthy is cut or sent twice.

    Attributes:
        origins: which origins are llama-server. ``"all"`` (default): every origin this transport serves, so the
            very first burst of a new process is protected too. ``"auto"``: origins that have answered with
            ``Server: llama.cpp``. Or a list of origins (``"http://127.0.0.1:8080"``). Other traffic passes
            through untouched.
        connection: how connections to llama-server are used. ``"close"``: every request carries
            ``Connection: close``, so no connection idles on one of the server's HTTP threads and none can stall;
            new connections are not probed (a connection serves the one request). ``"reuse"``: keep-alive, every
            new connection probed (below), stream connections closed. ``"auto"`` (default): ``"close"`` for a
            loopback address or a Unix socket, where a new connection costs nothing; elsewhere ``"close"`` (the
            first two new connections probed) until the cost of a new connection (connect, TLS, its probe's round
            trip) was measured, then ``"close"`` if it is at most 5% of the origin's median request time, else
            ``"reuse"``. The choice and its reason are in
            ``stats.connection_strategies``, each response's ``GuardResult.connection`` and the log (once per
            origin).
        stream_mode: ``"close"`` (default) sends ``Connection: close`` on requests whose JSON body asks for
            ``"stream": true`` and drops the connection of every chunked or event-stream response after its final
            chunk. ``"drop"`` only drops, leaving requests unmodified. ``"off"`` does neither.
        first_byte_timeout: seconds an attempt may wait for response headers once the request is written, or
            None (default) for no limit beyond httpx's own read timeout. On expiry the connection is discarded and
            the request retried on a fresh connection where the retry rules allow. llama-server sends the headers
            of a non-streamed completion only when generation ends, so set this above your slowest healthy
            request; the probe (below) is what catches stalled connections without such a guess.
        probe: before the first request on every new connection to llama-server, send ``GET /health`` on it and
            wait for the answer, so a connection the server will not read is replaced before any real request is
            written to it (default True).
        probe_timeout: seconds the first probe of a request may wait (default 0.5; the ceiling of a learnt
            deadline); after a probe of the request was given up, its next probe waits this long whatever was learnt,
            and each probe after that twice as long, up to ``probe_timeout_max`` (0.5, 0.5, 1, 2, 4 s with the
            defaults and nothing learnt).
        probe_timeout_max: the cap on the probe deadline (default 4.0 seconds).
        probe_learning: learn the first probe's deadline per origin from the probe answers seen (default True):
            once 4 probes of an origin were answered, a first probe waits ``probe_learning_factor`` times the
            slowest of the last 64 answers, at least ``probe_timeout_min``, at most ``probe_timeout``. False: always
            ``probe_timeout``.
        probe_learning_factor: the safety factor over the slowest recent answer (default 4.0; at least 1).
        probe_timeout_min: the floor of the learnt deadline (default 0.05 seconds; ``probe_timeout`` wins if lower).
        probe_kick: rescue a stalled connection instead of replacing it (default True). When a first probe has
            waited the learnt deadline, the guard opens one more TCP connection to the origin and closes it at once
            (a *kick*), and keeps waiting on the probe, until ``probe_timeout``: llama-server before b11737 spawns a
            pool thread for the new connection, which serves the *oldest* unread connection first, the stalled one.
            Kicks repeat at 2, 4, 8... times the learnt deadline, but the first goes no later and they are never
            further apart than a quarter of ``probe_timeout`` (before anything is learnt, or with
            ``probe_learning=False``: at a quarter, half and three quarters of it), since a kick serves the oldest
            stalled connection, which may be another probe's. An answer after a kick
            is not learnt from (it measures the rescue, not the server). A kick sends no request: the server reads
            nothing from it.
            False: a first probe is given up at the learnt deadline, and the connection replaced.
        connect_admission: when new connections to an origin are opened and probed one at a time, each waiting until
            the previous one's probe was answered or given up, or has waited ``probe_timeout``. ``"after_stall"``
            (default): for 5 s after a probe of that origin was given up, so that reconnects do not reach the server as
            a new burst. ``"always"``: for every new connection, which also keeps a burst of lazily opened connections
            from stalling, at the cost of one connect and probe round trip per connection in a burst. ``"off"``:
            never.
        prewarm: under the keep-alive strategy, a llama stream's connection is not reused (the server closes it
            after the final chunk): open its replacement in the background as the stream's request goes out,
            connected, TLS'd and probed, for the pool's next connect to that origin (default True; httpx and httpx2
            transports; never on loopback or a Unix socket, through a proxy or on an HTTP/2 pool). Saves the next
            request the connect, TLS and probe round trips across a network. ``stats.spares_opened``,
            ``spares_used`` and ``spares_failed`` count them.
        max_attempts: attempts per request, the first included (default 4; 1 disables retries).
        max_retry_time: no new attempt starts this many seconds after the first began (default 60.0; None for
            no limit other than ``max_attempts``).
        backoff: base delay in seconds of the jittered exponential backoff between attempts (default 0.05). A
            request that found its pooled connection dead is retried at once.
        backoff_max: the cap on one backoff delay (default 2.0 seconds).
        max_loading_wait: seconds the guard waits for a server that answers 503 (llama-server loading a model, on
            ``/health`` or on the request), retrying with backoff (0.5 s doubling up to ``backoff_max``; from the
            second 503 never sooner than 0.5 s, whatever ``Retry-After`` and ``backoff_max`` say), then once more
            as this time passes (unless a ``Retry-After`` asks for longer), before it hands the caller the 503
            (default 120.0; 0 returns it at once). These retries spend none of ``max_attempts`` and their time none
            of ``max_retry_time``: loading is not a failure, and a big model takes a minute or more. The time is the
            request's in all: a wait broken by another failure goes on from where it was.
        max_retry_after: the longest ``Retry-After`` the guard waits out before retrying a 503 or 429 (default
            30.0 seconds); a longer one returns the response to the caller.
        retry_non_idempotent: also retry POST/PATCH requests to endpoints other than llama-server's inference
            endpoints when they may have reached the server (default False).
    """

    origins: OriginsSetting | Sequence[str | Origin] = "all"
    connection: ConnectionMode = "auto"
    stream_mode: StreamMode = "close"
    first_byte_timeout: float | None = None
    probe: bool = True
    probe_timeout: float = 0.5
    probe_timeout_max: float = 4.0
    probe_learning: bool = True
    probe_learning_factor: float = 4.0
    probe_timeout_min: float = 0.05
    probe_kick: bool = True
    prewarm: bool = True
    connect_admission: AdmissionMode = "after_stall"
    max_attempts: int = 4
    max_retry_time: float | None = 60.0
    backoff: float = 0.05
    backoff_max: float = 2.0
    max_loading_wait: float = 120.0
    max_retry_after: float = 30.0
    retry_non_idempotent: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "origins", _normalise_origins(self.origins))
        if self.connection not in _CONNECTION_MODES:
            raise ValueError(
                f"connection must be one of {', '.join(map(repr, _CONNECTION_MODES))}; got {self.connection!r}"
            )
        if self.stream_mode not in _STREAM_MODES:
            raise ValueError(
                f"stream_mode must be one of {', '.join(map(repr, _STREAM_MODES))}; got {self.stream_mode!r}"
            )
        _check_seconds("first_byte_timeout", self.first_byte_timeout, allow_none=True, minimum=MIN_DEADLINE)
        _check_bool("probe", self.probe)
        _check_seconds("probe_timeout", self.probe_timeout, allow_none=False, minimum=MIN_DEADLINE)
        _check_seconds("probe_timeout_max", self.probe_timeout_max, allow_none=False, minimum=MIN_DEADLINE)
        if self.probe_timeout_max < self.probe_timeout:
            raise ValueError(
                f"probe_timeout_max must be >= probe_timeout ({self.probe_timeout!r}); got {self.probe_timeout_max!r}"
            )
        _check_bool("probe_learning", self.probe_learning)
        _check_bool("probe_kick", self.probe_kick)
        _check_bool("prewarm", self.prewarm)
        _check_seconds("probe_timeout_min", self.probe_timeout_min, allow_none=False, minimum=MIN_DEADLINE)
        factor = self.probe_learning_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor <= 1000:
            raise ValueError(f"probe_learning_factor must be a number from 1 to 1000; got {factor!r}")
        if self.connect_admission not in _ADMISSION_MODES:
            raise ValueError(
                f"connect_admission must be one of {', '.join(map(repr, _ADMISSION_MODES))}; "
                f"got {self.connect_admission!r}"
            )
        _check_int("max_attempts", self.max_attempts, minimum=1, maximum=100)
        _check_seconds("max_retry_time", self.max_retry_time, allow_none=True)
        _check_seconds("backoff", self.backoff, allow_none=False)
        _check_seconds("backoff_max", self.backoff_max, allow_none=False)
        _check_seconds("max_retry_after", self.max_retry_after, allow_none=False)
        _check_seconds("max_loading_wait", self.max_loading_wait, allow_none=False)
        _check_bool("retry_non_idempotent", self.retry_non_idempotent)

    def __repr__(self) -> str:
        """Only what differs from the defaults, so a log line shows what was configured."""
        changed = [
            f"{field.name}={getattr(self, field.name)!r}"
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != field.default
        ]
        return f"GuardPolicy({', '.join(changed)})"

    def merged(self, overrides: GuardPolicy | Mapping[str, Any] | None) -> GuardPolicy:
        """This policy with one request's overrides applied (``request.extensions["llama_guard"]``).

        A mapping names fields to change; a `GuardPolicy` replaces this one (its origins aside). Unknown keys and
        transport-wide fields raise `ValueError` listing what a request may set.
        """
        if overrides is None:
            return self
        if isinstance(overrides, GuardPolicy):
            return dataclasses.replace(overrides, origins=self.origins)
        if not isinstance(overrides, Mapping):
            raise ValueError(
                'request.extensions["llama_guard"] must be a dict of GuardPolicy fields or a GuardPolicy; '
                f"got {type(overrides).__name__}"
            )
        if not overrides:
            return self
        allowed = per_request_fields()
        unknown = sorted(str(key) for key in overrides if key not in allowed)
        if unknown:
            raise ValueError(
                f'request.extensions["llama_guard"] has unknown or transport-wide keys {unknown}; '
                f"a request may set: {', '.join(sorted(allowed))}"
            )
        return dataclasses.replace(self, **overrides)


def per_request_fields() -> frozenset[str]:
    """The policy fields a single request may override."""
    return frozenset(field.name for field in dataclasses.fields(GuardPolicy)) - _TRANSPORT_WIDE
