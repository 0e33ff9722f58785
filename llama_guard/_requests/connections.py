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

import socket
from typing import Any

from urllib3.exceptions import ConnectTimeoutError

from .._core import connection_machine as connection
from .._core.attempt_context import CURRENT_PLAN
from .._core.request_machine import MAX_SOCKET_WAIT
from .._drive.sync_drive import advance_connection
from .attempts import CallView
from .exceptions import Urllib3ProbeError, Urllib3ProbeTimeout

__all__ = ["GuardedConnection", "guarded_connection_class", "original_connection_class"]


class GuardedConnection:
    """Mixin of the guard's connection classes (``Guarded<urllib3 class>``): ``connect()`` as urllib3's, driven by
    the connection's machine for a guarded attempt."""

    def connect(self) -> None:
        plan = CURRENT_PLAN.get()
        if plan is None or not isinstance(plan.request, CallView):  # not a guarded urllib3 attempt
            super().connect()  # type: ignore[misc]
            return
        new: Any = self
        url = plan.request.url
        machine = connection.ConnectionMachine(plan.machine())  # made now if the request had none yet
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


_CLASSES: dict[type, type] = {}


def guarded_connection_class(base: type) -> type:
    """``Guarded<base>``: ``base`` (a urllib3 ``HTTPConnection`` class) with the guard's ``connect()``; made once."""
    if issubclass(base, GuardedConnection):
        return base
    cls = _CLASSES.get(base)
    if cls is None:
        name = f"Guarded{base.__name__}"
        cls = _CLASSES[base] = type(name, (GuardedConnection, base), {"__module__": __name__, "__qualname__": name})
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
