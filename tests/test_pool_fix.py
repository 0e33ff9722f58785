"""The pool-race fix as plain loops decides exactly what its set-and-list version did, on any pool state.

The fix (``llama_guard/_pool_fix.py``) runs twice for every request, so it was rewritten without comprehension and
generator frames. The version it replaced is kept here as the reference; hypothesis builds pool states (connections
closed, expired, idle, available or busy, for one origin or another; requests queued or holding a connection; tight
and loose limits) and both versions must close the same connections, keep the same ones in the same order, create
the same new ones and assign every request alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_guard._httpx.internals import _assign_requests_to_connections


def _reference(self: Any) -> list[Any]:
    """The fix as it was before the rewrite (set and list comprehensions), verbatim."""
    closing: list[Any] = []
    reserved = {request.connection for request in self._requests if request.connection is not None}
    kept: list[Any] = []
    for connection in self._connections:
        if connection.is_closed():
            continue
        if connection not in reserved and connection.has_expired():
            closing.append(connection)
            continue
        kept.append(connection)
    surplus = sum(c.is_idle() and c not in reserved for c in kept) - self._max_keepalive_connections
    if surplus > 0:
        retained = []
        for connection in kept:
            if surplus > 0 and connection.is_idle() and connection not in reserved:
                closing.append(connection)
                surplus -= 1
            else:
                retained.append(connection)
        kept = retained
    self._connections = kept

    for pool_request in [request for request in self._requests if request.is_queued()]:
        origin = pool_request.request.url.origin
        available = [
            c for c in self._connections if c not in reserved and c.can_handle_request(origin) and c.is_available()
        ]
        if available:
            connection = available[0]
        elif len(self._connections) < self._max_connections:
            connection = self.create_connection(origin)
            self._connections.append(connection)
        else:
            idle = [c for c in self._connections if c not in reserved and c.is_idle()]
            if not idle:
                continue
            self._connections.remove(idle[0])
            closing.append(idle[0])
            connection = self.create_connection(origin)
            self._connections.append(connection)
        pool_request.assign_to_connection(connection)
        reserved.add(connection)
    return closing


@dataclass(eq=False)
class _Connection:
    name: str
    origin: str
    closed: bool = False
    expired: bool = False
    idle: bool = True
    available: bool = True

    def is_closed(self) -> bool:
        return self.closed

    def has_expired(self) -> bool:
        return self.expired

    def is_idle(self) -> bool:
        return self.idle

    def is_available(self) -> bool:
        return self.available

    def can_handle_request(self, origin: str) -> bool:
        return origin == self.origin


@dataclass
class _URL:
    origin: str


@dataclass
class _Request:
    url: _URL


@dataclass(eq=False)
class _PoolRequest:
    request: _Request
    connection: _Connection | None = None

    def is_queued(self) -> bool:
        return self.connection is None

    def assign_to_connection(self, connection: _Connection) -> None:
        self.connection = connection


@dataclass(eq=False)
class _Pool:
    _connections: list[_Connection]
    _requests: list[_PoolRequest]
    _max_connections: int
    _max_keepalive_connections: int
    created: list[_Connection] = field(default_factory=list)

    def create_connection(self, origin: str) -> _Connection:
        connection = _Connection(f"new{len(self.created)}", origin, idle=False, available=False)
        self.created.append(connection)
        return connection


# Each connection: origin, closed, expired, idle, available. Closed and expired are the rarer states, so that most
# examples keep several live connections for the limits to act on.
rarely = st.sampled_from([False, False, False, True])
connection_specs = st.lists(st.tuples(st.sampled_from("ab"), rarely, rarely, st.booleans(), st.booleans()), max_size=6)
# Each request: its origin, and the index of the connection it holds (None: queued; an index past the end: none).
request_specs = st.lists(st.tuples(st.sampled_from("ab"), st.none() | st.integers(0, 7)), max_size=6)


def _build(connections: list[Any], requests: list[Any], max_connections: int, max_keepalive: int) -> _Pool:
    built = [
        _Connection(f"c{i}", origin, closed, expired, idle, available)
        for i, (origin, closed, expired, idle, available) in enumerate(connections)
    ]
    pool_requests = []
    for origin, held in requests:
        holder = built[held] if held is not None and held < len(built) else None
        pool_requests.append(_PoolRequest(_Request(_URL(origin)), holder))
    return _Pool(built, pool_requests, max_connections, max_keepalive)


def _outcome(pool: _Pool, closing: list[_Connection]) -> tuple[Any, ...]:
    def name(connection: _Connection | None) -> str | None:
        return None if connection is None else connection.name

    return (
        [name(c) for c in closing],
        [name(c) for c in pool._connections],
        [(c.name, c.origin) for c in pool.created],
        [name(r.connection) for r in pool._requests],
    )


@pytest.mark.slow  # 600 hypothesis examples, seconds
@settings(max_examples=600, deadline=None)
@given(connection_specs, request_specs, st.integers(0, 8), st.integers(0, 4))
def test_the_loops_decide_what_the_comprehensions_did(
    connections: list[Any], requests: list[Any], max_connections: int, max_keepalive: int
) -> None:
    reference = _build(connections, requests, max_connections, max_keepalive)
    expected = _outcome(reference, _reference(reference))
    rewritten = _build(connections, requests, max_connections, max_keepalive)
    assert _outcome(rewritten, _assign_requests_to_connections(rewritten)) == expected
