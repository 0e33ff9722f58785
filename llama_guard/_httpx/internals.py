"""A fix for a thread race in httpcore 1.x's connection pool, applied to the pools the guard wraps.

httpcore 1.0's pool assigns an idle connection to a request under its lock, but the connection stays IDLE until
the request's own thread sends on it. A pass of the pool made by another thread in between may judge the same
connection expired, surplus or replaceable, and close it outside the lock, while the first request is already
using it: that request fails (``[Errno 9] Bad file descriptor``, sometimes while reading its body, where nothing
can retry it). Under the proxy-like load of this project's tests, plain httpx lost 30 of 2,000 requests that way
besides those lost to llama-server. httpcore2 fixed it by treating connections that a queued or in-flight request
holds as reserved; this module backports that rule.

The fix replaces ``_assign_requests_to_connections`` on one pool instance (never on the class, never globally),
and only for an httpcore 1.x HTTP/1.1 pool that looks exactly as expected; anything else is left alone.
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["KEEPALIVE_EXPIRY", "cap_keepalive_expiry", "fix_pool_race"]

# llama-server keeps an idle connection for 5 s (`Keep-Alive: timeout=5`), and httpx's default expiry is 5 s too:
# a pool that reuses a connection just as the server closes it loses the request. Expire ours a second earlier.
KEEPALIVE_EXPIRY = 4.0


def _assign_requests_to_connections(self: Any) -> list[Any]:
    """httpcore 1.0.9's method, except that connections held by a request are neither closed nor reassigned.

    Called twice for every request (when it enters the pool and when its response closes), so written as plain
    loops: no comprehension or generator frames. It decides exactly what the set-and-list version before it did.
    """
    closing: list[Any] = []
    requests = self._requests
    reserved: set[Any] = set()
    for request in requests:
        if request.connection is not None:
            reserved.add(request.connection)
    kept: list[Any] = []
    idle = 0
    for connection in self._connections:
        if connection.is_closed():
            continue
        if connection not in reserved:
            if connection.has_expired():
                closing.append(connection)
                continue
            if connection.is_idle():
                idle += 1
        kept.append(connection)
    # Surplus idle connections beyond max_keepalive_connections (httpcore 1.0.9 counted every connection here).
    surplus = idle - self._max_keepalive_connections
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

    # The queued requests, each to the first connection that can take it (assigning one changes no other's state).
    for pool_request in requests:
        if not pool_request.is_queued():
            continue
        origin = pool_request.request.url.origin
        connection = None
        for candidate in kept:
            if candidate not in reserved and candidate.can_handle_request(origin) and candidate.is_available():
                connection = candidate
                break
        if connection is None:
            if len(kept) < self._max_connections:
                connection = self.create_connection(origin)
                kept.append(connection)
            else:
                for candidate in kept:
                    if candidate not in reserved and candidate.is_idle():
                        break
                else:
                    continue  # every connection is busy: the request waits
                kept.remove(candidate)
                closing.append(candidate)
                connection = self.create_connection(origin)
                kept.append(connection)
        pool_request.assign_to_connection(connection)
        reserved.add(connection)
    return closing


def fix_pool_race(transport: Any) -> bool:
    """Apply the fix to an httpx transport's httpcore 1.x HTTP/1.1 pool; True if it was applied."""
    pool = getattr(transport, "_pool", None)
    if pool is None:
        return False
    package = type(pool).__module__.partition(".")[0]  # httpcore presents its classes as "httpcore.X"
    if package != "httpcore" or type(pool).__name__ not in _POOL_CLASSES:
        return False  # httpcore2 has the fix; anything else is not ours to change
    if getattr(pool, "_http2", True) or not all(hasattr(pool, name) for name in _POOL_ATTRIBUTES):
        return False  # HTTP/2 multiplexes idle connections; this rule is for HTTP/1.1 only
    pool._assign_requests_to_connections = types.MethodType(_assign_requests_to_connections, pool)
    return True


_POOL_CLASSES = ("ConnectionPool", "AsyncConnectionPool")
_POOL_ATTRIBUTES = ("_requests", "_connections", "_max_connections", "_max_keepalive_connections")


def cap_keepalive_expiry(transport: Any, seconds: float = KEEPALIVE_EXPIRY) -> bool:
    """Lower an httpx transport's pool keep-alive expiry to ``seconds`` (if it is longer or unlimited); True if
    changed. Applies to httpcore and httpcore2 pools alike."""
    pool = getattr(transport, "_pool", None)
    if pool is None or type(pool).__module__.partition(".")[0] not in ("httpcore", "httpcore2"):
        return False
    current = getattr(pool, "_keepalive_expiry", seconds)
    if current is not None and current <= seconds:
        return False
    pool._keepalive_expiry = seconds
    return True
