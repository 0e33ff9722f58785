"""The hook on urllib3's new connections: each one a guarded attempt opens is driven by its machine.

urllib3 connects lazily, inside ``urlopen`` (its ``HTTPConnection.connect()``, called when the request is written or,
for https, before). A hooked pool (``pool_guard.py``) makes its connections of a subclass of its own connection
class whose ``connect()`` asks `CURRENT_PLAN` which guarded attempt it runs for: none (a request the guard passed by)
costs one context-variable lookup; for a guarded one it drives the connection's machine
(``_core/connection_machine.py``, through the shared loop): its turn when the origin admits new connections one at a
time, urllib3's own connect (TCP, and TLS for https), and the probe (``GET /health``) before urllib3 writes the
request to it, with this socket's I/O (`_SocketIO`).

A pooled connection that urllib3 reuses never calls ``connect()``: it pays nothing here.
"""

from __future__ import annotations

import inspect
import socket
import time
from collections.abc import Callable
from typing import Any

from urllib3.exceptions import ConnectTimeoutError

from .._core import connection_machine as connection
from .._core.attempt_context import CURRENT_PLAN
from .._core.llama_server import CLIENT_KEEPALIVE
from .._core.request_machine import MAX_SOCKET_WAIT
from .._drive.sync_drive import advance_connection
from .attempts import CallView
from .exceptions import Urllib3ProbeError, Urllib3ProbeTimeout

__all__ = ["GuardedConnection", "guarded_connection_class", "original_connection_class"]

_monotonic = time.monotonic


class GuardedConnection:
    """Mixin of the guard's connection classes (``Guarded<urllib3 class>``): ``connect()`` as urllib3's, driven by
    the connection's machine for a guarded attempt."""

    # The urllib3 class's own, set on each guarded class (`guarded_connection_class`): called as methods, they cost
    # a fraction of ``super()``'s lookup, on every response and every pooled connection handed out.
    _urllib3_getresponse: Callable[[], Any]
    _urllib3_is_connected: Callable[[], bool]
    # When its last response came; an attribute (never through ``__dict__``, which would turn the connection's inline
    # attributes into a dict and slow every attribute urllib3 and http.client read of it).
    _llama_guard_answered_at: float | None = None

    def connect(self) -> None:
        plan = CURRENT_PLAN.get()
        if plan is None or not isinstance(plan.request, CallView):  # not a guarded urllib3 attempt
            super().connect()  # type: ignore[misc]
            return
        if not plan.needs_connection_machine:  # the close strategy: nothing to probe or measure, only noted
            plan.opening()
            super().connect()  # type: ignore[misc]
            plan.opened()
            return
        new: Any = self
        url = plan.request.url
        machine = connection.ConnectionMachine(plan)
        # Through a proxy (forwarding or CONNECT) the connection is the proxy's, not the origin's.
        direct = new.proxy is None and new.host == url.host and new.port == plan.origin.port
        io = _SocketIO(new)
        opening = connection.Opening(direct=direct, proxy=f"{new.host}:{new.port}")
        advance_connection(machine, opening, io)  # Open, once its turn came
        try:
            super().connect()  # type: ignore[misc]  # TCP, and TLS for https: the connection is ready for HTTP
        except BaseException:
            machine.next(connection.OPEN_FAILED)
            raise
        advance_connection(machine, connection.Opened(h2=_negotiated_http2(new), socket=new.sock), io)
        io.restore()

    def getresponse(self) -> Any:
        """urllib3's, and the time of the answer kept on the connection: it goes idle from about then (a llama
        stream's is dropped instead, `attempts.drop_stream`)."""
        response = self._urllib3_getresponse()
        self._llama_guard_answered_at = _monotonic()
        return response

    @property
    def is_connected(self) -> bool:
        """What urllib3 asks before it hands a pooled connection out (``is_connection_dropped``): also False for one
        answered `CLIENT_KEEPALIVE` (4 s) ago or more, so that urllib3 closes it and connects again (probed).
        llama-server closes an idle connection at 5 s; urllib3 keeps one for ever and checks only that no close has
        arrived yet, so a request could be written at the moment the server closes it (httpx's pool expires at 4 s
        under the guard, aiohttp's too)."""
        answered = self._llama_guard_answered_at
        if answered is not None:
            self._llama_guard_answered_at = None
            if _monotonic() - answered >= CLIENT_KEEPALIVE:
                return False
        return self._urllib3_is_connected()


_CLASSES: dict[type, type] = {}


def guarded_connection_class(base: type) -> type:
    """``Guarded<base>``: ``base`` (a urllib3 ``HTTPConnection`` class) with the guard's ``connect()``; made once."""
    if issubclass(base, GuardedConnection):
        return base
    cls = _CLASSES.get(base)
    if cls is None:
        name = f"Guarded{base.__name__}"
        # urllib3 2 reads ``conn.is_connected`` as a property (``util/connection.py``) and calls ``getresponse()``.
        is_connected = inspect.getattr_static(base, "is_connected", None)
        getresponse = getattr(base, "getresponse", None)
        if not isinstance(is_connected, property) or is_connected.fget is None or not callable(getresponse):
            raise TypeError(
                f"the pool's ConnectionCls {base.__module__}.{base.__qualname__} is not a urllib3 2 connection class: "
                "the guard accepts urllib3.connection.HTTPConnection, HTTPSConnection and their subclasses "
                "(an is_connected property and a getresponse() method)"
            )
        own = {
            "__module__": __name__,
            "__qualname__": name,
            "_urllib3_getresponse": getresponse,
            "_urllib3_is_connected": is_connected.fget,
        }
        cls = _CLASSES[base] = type(name, (GuardedConnection, base), own)
    return cls


def original_connection_class(cls: type) -> type:
    """The urllib3 class a guarded connection class was made of (``cls`` itself otherwise)."""
    if issubclass(cls, GuardedConnection):
        return cls.__mro__[2]
    return cls


def _negotiated_http2(new: Any) -> bool:
    """urllib3's HTTP/2 support (``urllib3.http2``) or an https connection whose TLS handshake chose ``h2``."""
    selected = getattr(new.sock, "selected_alpn_protocol", None)
    return type(new).__name__.startswith("HTTP2") or (callable(selected) and selected() == "h2")


class _SocketIO:
    """The probe's I/O on a urllib3 connection's socket (`SyncConnectionIO`); its own timeout is put back after."""

    __slots__ = ("_connection", "_timeout", "connect_timeout")

    def __init__(self, new: Any) -> None:
        self._connection = new
        timeout = new.timeout
        self.connect_timeout = float(timeout) if isinstance(timeout, (int, float)) else None
        self._timeout: Any = None

    def _socket(self, timeout: float) -> socket.socket:
        sock: socket.socket = self._connection.sock
        if self._timeout is None:
            self._timeout = (sock.gettimeout(),)
        sock.settimeout(min(timeout, MAX_SOCKET_WAIT))
        return sock

    def write(self, data: bytes, timeout: float) -> connection.ConnectionSignal | connection.Broken:
        try:
            self._socket(timeout).sendall(data)
        except TimeoutError:
            return connection.TIMED_OUT
        except OSError as error:
            return connection.Broken(error)
        return connection.WRITTEN

    def read(self, timeout: float) -> connection.Received | connection.ConnectionSignal | connection.Broken:
        try:
            data = self._socket(timeout).recv(connection.READ_SIZE)
        except TimeoutError:
            return connection.TIMED_OUT
        except OSError as error:
            return connection.Broken(error)
        return connection.Received(data)

    def close(self) -> None:
        self._connection.close()

    def restore(self) -> None:
        """The probe passed: the socket gets urllib3's timeout back."""
        if self._timeout is not None:
            self._connection.sock.settimeout(self._timeout[0])

    def error(self, abort: connection.Abort) -> BaseException:
        if abort.reason == "connect timeout":  # a connect that timed out: nothing sent
            return ConnectTimeoutError(abort.message)
        if abort.reason == "probe timeout":
            return Urllib3ProbeTimeout(abort.message)
        return Urllib3ProbeError(self._connection, abort.message)
