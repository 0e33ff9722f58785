"""Every access the guard makes to private attributes of httpcore and httpx, behind one version gate.

The guard follows new connections through hooks on the httpcore pool (its network backend and
``create_connection``), fixes a thread race of httpcore 1.x's pool (``_assign_requests_to_connections``, see
below), caps the pool's keep-alive expiry, reads ``Headers._list`` for speed, and sets a client's ``_transport``
and ``_mounts`` in `guard()`. None of that is public API: it is done here only, and only for the library
versions in `TESTED_VERSIONS`. On any other version `untested_versions()` names it, the transports log one
warning, patch nothing private and follow requests through httpcore's public ``trace`` extension instead, which
still probes new connections and drops the connection after a stream. `guard()` needs only httpx's attributes: it
works on any httpcore; on an untested httpx it checks that the client's ``_transport`` and ``_mounts`` are what it
sets (`client_layout_problem()`), logs the same one warning and wraps them, and refuses only a client laid out
otherwise. Upper pins in ``pyproject.toml`` match.

The httpx2 flavour of this module (``_httpx2/internals.py``) is generated, so it reads httpcore2's and httpx2's
versions.
"""

from __future__ import annotations

import contextlib
import operator
import types
from collections.abc import Callable
from typing import Any

import httpcore
import httpx

from .._core.decisions import is_streaming_response
from .._core.guard import GuardAttributes
from .._core.llama_server import CLIENT_KEEPALIVE
from .._core.log import WarnOnce

__all__ = [
    "TESTED_VERSIONS",
    "cap_keepalive_expiry",
    "check_versions",
    "client_layout_problem",
    "client_transports",
    "close_headers",
    "fix_pool_race",
    "network_backend",
    "bypassing_mounts",
    "hookable_pool",
    "is_direct_pool",
    "http_versions",
    "pool_speaks_http1",
    "remove_instance_method",
    "replace_client_transports",
    "request_parts",
    "set_instance_method",
    "streaming_check",
    "unix_socket_path",
    "untested_versions",
]

# The versions whose private attributes used here were read and run against. httpcore 1.0.7 to 1.0.9 ship the same
# connection_pool.py, the one the race fix below was copied from (earlier 1.0.x differ). httpx 0.27 to 0.29 keep
# Client._transport/_mounts, HTTPTransport._pool and Headers._list as used here (0.29.0 only exports FunctionAuth and
# rewords messages). httpcore2 2.17.0 closes an idle connection the server has closed when a request takes it, no
# longer in `has_expired()`: the guard reads neither, and its pool hooks (_network_backend, create_connection) stay.
TESTED_VERSIONS: dict[str, frozenset[str]] = {
    "httpcore": frozenset({"1.0.7", "1.0.8", "1.0.9"}),
    "httpx": frozenset({"0.27.0", "0.27.1", "0.27.2", "0.28.0", "0.28.1", "0.29.0"}),
    "httpcore2": frozenset({"2.16.2", "2.17.0"}),
    "httpx2": frozenset({"2.16.2", "2.17.0"}),
}


def untested_versions() -> str | None:
    """None when the imported httpcore and httpx are versions in `TESTED_VERSIONS`; else why not, naming them.

    Read from the modules' own ``__version__`` at each call (transport construction), so a test can change it."""
    for module in (httpcore, httpx):
        reason = _untested(module)
        if reason is not None:
            return f"{reason}: the guard patches nothing private and follows requests through the trace extension"
    return None


def untested_client_version() -> str | None:
    """None when the imported httpx is a version in `TESTED_VERSIONS` (`guard()` sets a client's ``_transport``
    and ``_mounts``); else why not, naming it (the transports it makes log it). httpcore's version does not
    matter there."""
    return _untested(httpx)


def client_layout_problem(client: Any) -> str | None:
    """None when ``client`` keeps its transport in ``_transport`` and its mounts in a ``_mounts`` dict of
    transports (or None), as every httpx `guard()` was tested with does; else what differs. Asked on an untested
    httpx, where a renamed attribute would leave the client silently unguarded."""
    transport = getattr(client, "_transport", None)
    base = (httpx.BaseTransport, httpx.AsyncBaseTransport)
    if not isinstance(transport, base):
        return f"its _transport is {type(transport).__name__}, not an httpx transport"
    mounts = getattr(client, "_mounts", None)
    if not isinstance(mounts, dict) or not all(m is None or isinstance(m, base) for m in mounts.values()):
        return "its _mounts is not a dict of httpx transports"
    return None


def _untested(module: types.ModuleType) -> str | None:
    name, version = module.__name__, module.__version__
    tested = TESTED_VERSIONS.get(name, frozenset())
    if version in tested:
        return None
    return f"{name} {version} is not a version llama_guard was tested with ({', '.join(sorted(tested))})"


def check_versions(warnings: WarnOnce) -> str | None:
    """`untested_versions()`, logged once per process (``warnings``: the process's) for each untested version."""
    return warnings.warn_if(untested_versions())


def hookable_pool(transport: Any) -> Any:
    """The httpcore pool of an httpx transport, if the guard can put its hooks on it; else None."""
    pool = getattr(transport, "_pool", None)
    if getattr(pool, "_network_backend", None) is None or getattr(pool, "create_connection", None) is None:
        return None
    return pool


def is_direct_pool(pool: Any) -> bool:
    """Whether ``pool`` connects to the origins themselves (httpcore's plain pool, not a proxy's)."""
    return type(pool) in (httpcore.ConnectionPool, httpcore.AsyncConnectionPool)


def unix_socket_path(transport: Any) -> str | None:
    """The Unix socket an httpx transport connects through (``HTTPTransport(uds=...)``), or None."""
    path = getattr(getattr(transport, "_pool", None), "_uds", None)
    return path if isinstance(path, str) else None


def http_versions(transport: Any) -> tuple[bool, bool]:
    """(HTTP/1.1 enabled, HTTP/2 enabled) of an httpx transport's pool; (True, False), httpx's default, when the
    pool is out of reach."""
    pool = getattr(transport, "_pool", None)
    return bool(getattr(pool, "_http1", True)), bool(getattr(pool, "_http2", False))


def pool_speaks_http1(pool: Any) -> bool:
    """False for a pool that speaks HTTP/2 only (``http1=False``: h2c with prior knowledge, or h2 over TLS)."""
    return bool(getattr(pool, "_http1", True))


def bypassing_mounts(transport: Any, frame: types.FrameType | None) -> list[str]:
    """The URL patterns of a client whose ``_transport`` is ``transport`` but which sends through transports of its
    own mounted for them (``proxy=``, ``mounts=``): requests that match go round ``transport``. The client is the
    ``self`` of one of the few frames from ``frame`` outwards (httpx's client calls its transport's ``__enter__``,
    ``close`` and request handler from its own methods); a transport called otherwise finds none (an empty list)."""
    for _ in range(_CALLER_FRAMES):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, (httpx.Client, httpx.AsyncClient)) and client_transports(candidate)[0] is transport:
            return [
                str(getattr(pattern, "pattern", pattern))
                for pattern, mounted in client_transports(candidate)[1].items()
                if mounted is not None and mounted is not transport and not _guards(mounted)
            ]
        frame = frame.f_back
    return []


def _guards(mounted: object) -> bool:
    """A mounted transport that is itself a guard (``guard(client)`` wraps a client's mounts; a user may mount one):
    what it sends is guarded. A `DualGuardTransport` is one through its pair."""
    return isinstance(mounted, GuardAttributes) or isinstance(getattr(mounted, "sync_guard", None), GuardAttributes)


# How far out `bypassing_mounts` looks for the client: its own method, and a wrapper or two between.
_CALLER_FRAMES = 4


def network_backend(pool: Any) -> Any:
    return pool._network_backend


def set_network_backend(pool: Any, backend: Any) -> None:
    pool._network_backend = backend


def set_instance_method(obj: Any, name: str, method: Callable[..., Any]) -> bool:
    """Shadow a method of one httpcore object (a pool's ``create_connection``, a new connection's request
    handler) with an instance attribute; False for an object without an instance ``__dict__`` (not httpcore's)."""
    try:
        setattr(obj, name, method)
    except AttributeError:
        return False
    return True


def remove_instance_method(obj: Any, name: str) -> None:
    """Undo `set_instance_method`; harmless if another thread did it first."""
    # Not through obj.__dict__, which would turn the instance's inline attributes into a dict.
    with contextlib.suppress(AttributeError):
        delattr(obj, name)


def client_transports(client: Any) -> tuple[Any, dict[Any, Any]]:
    """An httpx client's transport and mounts (no public accessor exists)."""
    return client._transport, client._mounts


def replace_client_transports(client: Any, wrap: Callable[[Any], Any]) -> None:
    """Replace a client's transport and every mounted transport by ``wrap(transport)``."""
    transport, mounts = client_transports(client)
    client._transport = wrap(transport)
    client._mounts = {pattern: None if t is None else wrap(t) for pattern, t in mounts.items()}


def _is_streaming_response_fast(headers: Any) -> bool:
    """`is_streaming_response` over httpx's (raw name, lower-case name, value) triples: one pass, no lookups."""
    for _, name, value in headers._list:
        if name == b"content-type":
            if value[:17].lower() == b"text/event-stream":
                return True
        elif name == b"transfer-encoding" and value.lower().find(b"chunked") != -1:
            return True
    return False


def _request_parts_fast(request: Any) -> tuple[str, str, int | None, bytes | None]:
    """A request's URL scheme, host and port and its body when held in memory, from ``URL._uri_reference`` and
    ``Request._content``: one call per request where the public properties take four (the host stays IDNA-encoded,
    as httpcore sends it)."""
    reference = request.url._uri_reference
    return reference.scheme, reference.host, reference.port, getattr(request, "_content", None)


def _request_parts(request: Any) -> tuple[str, str, int | None, bytes | None]:
    """`_request_parts_fast` through the public API."""
    url = request.url
    try:
        body: bytes | None = request.content
    except httpx.RequestNotRead:
        body = None  # a one-shot stream: it cannot be inspected, or sent twice
    return url.scheme, url.host, url.port, body


def request_parts(tested: bool) -> Callable[[Any], tuple[str, str, int | None, bytes | None]]:
    """How the transport reads a request's URL parts and in-memory body: the fast way on tested versions."""
    return _request_parts_fast if tested else _request_parts


def _connection_close_headers(request: Any) -> httpx.Headers:
    """``request``'s headers with ``Connection: close``, as new headers that an attempt lends the request (the
    caller's own are never changed, and are given back after the attempt). Cheaper than a copy of the request: no URL
    or stream handling, and no encoding worked out (the headers' ``copy()`` decodes every value to find one)."""
    headers = httpx.Headers(request.headers)
    headers["Connection"] = "close"
    return headers


_CONNECTION_CLOSE = (b"Connection", b"connection", b"close")
_LOWER_NAME = operator.itemgetter(1)


def _connection_close_headers_fast(request: Any) -> httpx.Headers:
    """`_connection_close_headers` over httpx's (raw name, lower-case name, value) triples, the lookups in C: the
    caller's one Connection header (an httpx client sends ``keep-alive`` by default) replaced in place, or the header
    appended. A new connection per request is the default on loopback, so this runs for most local requests; the
    public way costs about 1.5 µs more."""
    headers = httpx.Headers(request.headers)  # copies the triples
    items = headers._list
    names = list(map(_LOWER_NAME, items))
    found = names.count(b"connection")
    if found == 0:
        items.append(_CONNECTION_CLOSE)
    elif found == 1:
        items[names.index(b"connection")] = _CONNECTION_CLOSE
    else:  # several: httpx's own way keeps the first one's place and drops the others
        headers["Connection"] = "close"
    return headers


def close_headers(tested: bool) -> Callable[[Any], httpx.Headers]:
    """How the transport lends a request ``Connection: close``: the fast way on tested versions."""
    return _connection_close_headers_fast if tested else _connection_close_headers


def streaming_check(tested: bool) -> Callable[[Any], bool]:
    """The response test the transport uses: the fast one on tested versions, else the public one."""
    return _is_streaming_response_fast if tested else is_streaming_response


# -- the pool race (httpcore 1.x) ---------------------------------------------------------------------------------
# httpcore 1.0's pool assigns an idle connection to a request under its lock, but the connection stays IDLE until
# the request's own thread sends on it; another thread's pass of the pool in between may close it as expired or
# surplus while it is in use (``[Errno 9] Bad file descriptor``). httpcore2 treats connections held by a request
# as reserved; this backports that rule to one pool instance (never the class).


def _assign_requests_to_connections(self: Any) -> list[Any]:
    """httpcore 1.0.9's method, except that connections held by a request are neither closed nor reassigned.

    Plain loops, no comprehensions: it runs twice for every request."""
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


def cap_keepalive_expiry(transport: Any, seconds: float = CLIENT_KEEPALIVE) -> bool:
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


# -- undoing it (uninstall()) -------------------------------------------------------------------------------------
# Every attribute the guard sets on a pool instance: the keep-alive cap and the race fix above, the network backend
# and create_connection of async_connections.track_connections. install() records them before its guard touches a
# pool, and uninstall() puts them back (a test compares the pool's whole instance dict).
_POOL_CHANGES = ("_keepalive_expiry", "_assign_requests_to_connections", "_network_backend", "create_connection")
_ABSENT = object()  # the pool had no instance attribute of that name (a method looked up on the class)


def pool_state(pool: Any) -> dict[str, Any]:
    """What the guard may change on ``pool`` (from `hookable_pool`), as the pool has it now: for `restore_pool`."""
    own = vars(pool)
    return {name: own.get(name, _ABSENT) for name in _POOL_CHANGES}


def restore_pool(pool: Any, state: dict[str, Any]) -> None:
    """Put back what `pool_state` recorded. Connections opened meanwhile keep the settings they were opened with."""
    for name, value in state.items():
        if value is _ABSENT:
            remove_instance_method(pool, name)
        else:
            setattr(pool, name, value)
