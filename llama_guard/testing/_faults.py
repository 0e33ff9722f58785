"""One-shot fault injection: what can go wrong on the wire, and when.

A test arms a :class:`FaultRule` with :meth:`LlamaServerEmulator.inject`; the
next matching connection or request consumes it.  Rules are matched first-in,
first-out and consumed atomically, so "inject once, send twice" gives exactly
one faulty answer even when the two requests race on different connections.

Faults act at one of three moments, mirroring where a real server or network
can fail:

* on accept, before anything is read (``RESET_BEFORE_READ``,
  ``NEVER_ANSWER_ACCEPT``, ``READ_LATE``); these cannot match a path;
* instead of the answer, once the request was read (``HEADERS_NEVER``,
  ``GARBAGE``, ``STATUS_503``, ``STATUS_429``); no inference runs;
* while the real answer is written (``RESET_AFTER_HEADERS``,
  ``RESET_MID_STREAM``, ``BODY_STALL``, ``TRUNCATED_CHUNK``, ``HUGE_HEADER``);
  the request is served normally up to that point, so completions have really
  started (and, for non-streamed ones, finished) on the server -- which is what
  makes a blind retry a duplicate.
"""

from __future__ import annotations

import enum
import threading
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CONNECTION_FAULTS", "Fault", "FaultInjector", "FaultRule"]


class Fault(enum.Enum):
    """Every fault the emulator can inject (parameters in brackets).

    RESET_BEFORE_READ: accept, read nothing, RST (SO_LINGER 0).
    NEVER_ANSWER_ACCEPT: accept, never read, keep the socket open
        [hold: seconds or None = until stop()].
    READ_LATE: accept, leave the connection unread for ``after`` seconds, as
        the pool bug of builds before b11737 leaves a connection of a burst
        until another connection closes; then serve it normally, reading
        whatever the client wrote meanwhile [after=1.0].  A request written
        to it and given up on runs late, on the server, all the same.
    HEADERS_NEVER: read the request, never answer [hold].
    RESET_AFTER_HEADERS: serve normally, send the response head, then RST.
    RESET_MID_STREAM: serve normally, RST after ``after_chunks`` chunks of a
        streamed body [after_chunks=2], or after ``after_bytes`` of a
        Content-Length body [after_bytes=None: half of it].
    BODY_STALL: like RESET_MID_STREAM, but then send nothing more and keep
        the connection open [after_chunks=1, after_bytes=None, hold].
    TRUNCATED_CHUNK: send the head as chunked, ``after_chunks`` good chunks,
        then a chunk whose size line does not match its data, then FIN
        [after_chunks=1, size_line=b"fff", payload=b'data: {"trunc'].
    GARBAGE: answer the request with non-HTTP bytes, then FIN [data].
    HUGE_HEADER: serve normally with an absurdly large response header
        [size=1 MiB of header value].
    STATUS_503: answer ``503`` with llama-server's error JSON
        [retry_after=None, message="Loading model"].
    STATUS_429: answer ``429`` [retry_after=None, message="Too Many Requests"].
    """

    RESET_BEFORE_READ = "reset_before_read"
    NEVER_ANSWER_ACCEPT = "never_answer_accept"
    READ_LATE = "read_late"
    HEADERS_NEVER = "headers_never"
    RESET_AFTER_HEADERS = "reset_after_headers"
    RESET_MID_STREAM = "reset_mid_stream"
    BODY_STALL = "body_stall"
    TRUNCATED_CHUNK = "truncated_chunk"
    GARBAGE = "garbage"
    HUGE_HEADER = "huge_header"
    STATUS_503 = "status_503"
    STATUS_429 = "status_429"


#: Faults applied by the accept loop, before any request exists.
CONNECTION_FAULTS = frozenset({Fault.RESET_BEFORE_READ, Fault.NEVER_ANSWER_ACCEPT, Fault.READ_LATE})

_DEFAULT_GARBAGE = b"\x15\x03\x01\x00\x02\x02\x50 \xff\xfeTHIS IS NOT HTTP\r\n\r\n"


def _delay(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise ValueError(f"{name} must be seconds in [0, 3600], got {value!r}")
    return float(value)


def _hold(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise ValueError(f"{name} must be None (until stop) or seconds in [0, 3600], got {value!r}")
    return float(value)


Validator = Callable[[str, object], object]


def _count(name: str, low: int, high: int) -> Callable[[str, object], int]:
    def check(_: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
        return value

    return check


def _optional_count(name: str, low: int, high: int) -> Validator:
    inner = _count(name, low, high)

    def check(_: str, value: object) -> int | None:
        return None if value is None else inner(name, value)

    return check


def _bytes(name: str, max_len: int) -> Validator:
    def check(_: str, value: object) -> bytes:
        if not isinstance(value, (bytes, bytearray)) or len(value) > max_len:
            raise ValueError(f"{name} must be bytes of length <= {max_len}, got {value!r:.60}")
        return bytes(value)

    return check


def _retry_after(name: str, value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be None, a number of seconds or a string, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        return str(value)
    if isinstance(value, float):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        return str(int(value)) if value == int(value) else repr(value)
    if isinstance(value, str) and value and not any(c in value for c in "\r\n"):
        return value
    raise ValueError(f"{name} must be None, a number of seconds or a string, got {value!r}")


def _message(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {value!r}")
    return value


# fault -> {param: (default, validator)}
_PARAMS: dict[Fault, dict[str, tuple[object, Validator]]] = {
    Fault.RESET_BEFORE_READ: {},
    Fault.NEVER_ANSWER_ACCEPT: {"hold": (None, _hold)},
    Fault.READ_LATE: {"after": (1.0, _delay)},
    Fault.HEADERS_NEVER: {"hold": (None, _hold)},
    Fault.RESET_AFTER_HEADERS: {},
    Fault.RESET_MID_STREAM: {
        "after_chunks": (2, _count("after_chunks", 0, 1_000_000)),
        "after_bytes": (None, _optional_count("after_bytes", 0, 1 << 30)),
    },
    Fault.BODY_STALL: {
        "after_chunks": (1, _count("after_chunks", 0, 1_000_000)),
        "after_bytes": (None, _optional_count("after_bytes", 0, 1 << 30)),
        "hold": (None, _hold),
    },
    Fault.TRUNCATED_CHUNK: {
        "after_chunks": (1, _count("after_chunks", 0, 1_000_000)),
        "size_line": (b"fff", _bytes("size_line", 64)),
        "payload": (b'data: {"trunc', _bytes("payload", 1 << 20)),
    },
    Fault.GARBAGE: {"data": (_DEFAULT_GARBAGE, _bytes("data", 1 << 20))},
    Fault.HUGE_HEADER: {"size": (1 << 20, _count("size", 1, 64 << 20))},
    Fault.STATUS_503: {"retry_after": (None, _retry_after), "message": ("Loading model", _message)},
    Fault.STATUS_429: {
        "retry_after": (None, _retry_after),
        "message": ("Too Many Requests", _message),
    },
}


def resolve_params(fault: Fault, params: Mapping[str, object]) -> Mapping[str, Any]:
    """Validate ``params`` for ``fault`` and fill in the defaults."""
    spec = _PARAMS[fault]
    unknown = sorted(set(params) - set(spec))
    if unknown:
        allowed = ", ".join(sorted(spec)) or "none"
        raise ValueError(f"{fault.name} does not take {', '.join(unknown)}; accepted: {allowed}")
    resolved: dict[str, Any] = {}
    for name, (default, check) in spec.items():
        resolved[name] = check(name, params[name]) if name in params else default
    return types.MappingProxyType(resolved)


@dataclass(eq=False)
class FaultRule:
    """An armed fault; returned by ``inject`` so tests can watch it fire.

    ``count=None`` means "every matching request until cancelled".
    """

    fault: Fault
    path: str | None
    method: str | None
    count: int | None
    params: Mapping[str, Any]
    _injector: FaultInjector
    _triggered: int = 0
    _cancelled: bool = False

    @property
    def triggered(self) -> int:
        """How many connections or requests this rule has hit so far."""
        with self._injector.lock:
            return self._triggered

    @property
    def remaining(self) -> int | None:
        """Hits left (``None``: unlimited); 0 once exhausted or cancelled."""
        with self._injector.lock:
            if self._cancelled:
                return 0
            return None if self.count is None else self.count - self._triggered

    def cancel(self) -> None:
        """Disarm the rule; hits already in progress are not undone."""
        self._injector.remove(self)

    def wait_triggered(self, times: int = 1, timeout: float = 5.0) -> bool:
        """Wait (bounded) until the rule has fired ``times`` times."""
        deadline = time.monotonic() + timeout
        with self._injector.changed:
            while self._triggered < times:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._injector.changed.wait(remaining)
            return True

    def matches(self, method: str | None, path: str | None) -> bool:
        if self.path is not None and self.path != path:
            return False
        return self.method is None or self.method == method


class FaultInjector:
    """Thread-safe FIFO of armed rules; ``take_*`` consumes one hit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self._rules: list[FaultRule] = []

    def add(
        self,
        fault: Fault,
        *,
        path: str | None,
        method: str | None,
        count: int | None,
        params: Mapping[str, object],
    ) -> FaultRule:
        if not isinstance(fault, Fault):
            raise ValueError(f"fault must be a Fault member, got {fault!r}")
        if path is not None and (not isinstance(path, str) or not path.startswith("/")):
            raise ValueError(f"path must be None or start with '/', got {path!r}")
        if method is not None and (not isinstance(method, str) or not method.isupper()):
            raise ValueError(f"method must be None or an upper-case HTTP method, got {method!r}")
        if fault in CONNECTION_FAULTS and (path is not None or method is not None):
            raise ValueError(f"{fault.name} fires on accept, before any request is read: path and method must be None")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"count must be None (unlimited) or an int >= 1, got {count!r}")
        rule = FaultRule(fault, path, method, count, resolve_params(fault, params), self)
        with self.lock:
            self._rules.append(rule)
        return rule

    def remove(self, rule: FaultRule) -> None:
        with self.changed:
            rule._cancelled = True
            if rule in self._rules:
                self._rules.remove(rule)
            self.changed.notify_all()

    def clear(self) -> None:
        with self.changed:
            for rule in self._rules:
                rule._cancelled = True
            self._rules.clear()
            self.changed.notify_all()

    def pending(self) -> list[FaultRule]:
        with self.lock:
            return list(self._rules)

    def take_connection_fault(self) -> FaultRule | None:
        return self._take(lambda rule: rule.fault in CONNECTION_FAULTS)

    def take_request_fault(self, method: str, path: str) -> FaultRule | None:
        return self._take(lambda rule: rule.fault not in CONNECTION_FAULTS and rule.matches(method, path))

    def _take(self, predicate: Callable[[FaultRule], bool]) -> FaultRule | None:
        with self.changed:
            for rule in self._rules:
                if predicate(rule):
                    rule._triggered += 1
                    if rule.count is not None and rule._triggered >= rule.count:
                        self._rules.remove(rule)
                    self.changed.notify_all()
                    return rule
        return None
