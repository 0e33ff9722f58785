"""The hook on urllib3's new connections: report the connect to the guarded request, and probe the connection.

urllib3 connects lazily, inside ``urlopen`` (its ``HTTPConnection.connect()``, called when the request is written or,
for https, before). A hooked pool (``pool_guard.py``) makes its connections of a subclass of its own connection
class whose ``connect()`` asks `CURRENT_RUN` which guarded attempt it runs for: none (a request the guard passed by)
costs one context-variable lookup; for a guarded one it reports the connect (the attempt then got as far as a new
connection: a failure before it is up sent nothing), waits for its turn when the origin admits new connections one at
a time, and probes the connection (``GET /health``, after TLS for https) before urllib3 writes the request to it.
The probe's decisions are the shared `ProbeMachine`'s; this file only does its socket I/O.

A pooled connection that urllib3 reuses never calls ``connect()``: it pays nothing here.
"""

from __future__ import annotations

import socket
from typing import Any

from urllib3.exceptions import ConnectTimeoutError

from .._core import probe_machine
from .._core.origin_probes import Admission
from .._core.request_state import MAX_SOCKET_WAIT
from .._core.turns import ThreadTurn
from .attempts import CURRENT_RUN, Urllib3Run
from .exceptions import Urllib3ProbeError, Urllib3ProbeTimeout

__all__ = ["GuardedConnection", "guarded_connection_class", "original_connection_class"]


class GuardedConnection:
    """Mixin of the guard's connection classes (``Guarded<urllib3 class>``): ``connect()`` as urllib3's, reported
    to the guarded attempt it runs for and, when that request probes, followed by the probe."""

    def connect(self) -> None:
        current = CURRENT_RUN.get()
        if current is None:
            super().connect()  # type: ignore[misc]
            return
        run = current.guarded_run()  # built now if the request had none yet (its first attempt, sent as is)
        if run.attempts == 0:
            run.begin_attempt()
        _connect(self, run, super().connect)  # type: ignore[misc]


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


def _connect(connection: Any, run: Urllib3Run, connect: Any) -> None:
    """A guarded attempt's new connection: connected by urllib3 (``connect``), timed, and probed when it goes to
    the origin itself and the request probes."""
    url = run.request.url
    # Probe only a connection to the origin itself: through a proxy (forwarding or CONNECT) it is the proxy's.
    direct = connection.proxy is None and connection.host == url.host and connection.port == run.origin.port
    if not direct and run.probing:
        run.probing_off(f"they go through a proxy at {connection.host}:{connection.port}")
    run.connecting()
    probing = direct and run.probing and run.origin not in run.guard.unprobeable
    # Opened and probed in turn when the origin asks for it (connect_admission); not an https connection, whose
    # TLS handshake comes inside urllib3's connect.
    admission = _admission(run, connection.timeout) if probing and url.scheme == "http" else None
    try:
        connect()  # TCP, and TLS for https: the connection is ready for HTTP
        run.connection_ready()
        if probing and _negotiated_http2(connection):
            # Not llama-server (HTTP/1.1 only); an HTTP/1.1 probe would break the HTTP/2 connection.
            run.probing_off("the connection negotiated HTTP/2 (ALPN h2), which llama-server does not speak")
            probing = False
        if probing:
            _probe(connection, run)
    finally:
        if admission is not None:
            admission.leave()
    run.connected()


def _negotiated_http2(connection: Any) -> bool:
    """urllib3's HTTP/2 support (``urllib3.http2``) or an https connection whose TLS handshake chose ``h2``."""
    selected = getattr(connection.sock, "selected_alpn_protocol", None)
    return type(connection).__name__.startswith("HTTP2") or (callable(selected) and selected() == "h2")


def _admission(run: Urllib3Run, timeout: Any) -> Admission[ThreadTurn] | None:
    """This connection's place in its origin's queue, once its turn has come (`Admission`), or None when the origin
    lets connections open freely now. The wait is bounded by the connect timeout."""
    admission = Admission.of(run, ThreadTurn)
    if admission is not None and admission.waits:
        bound = float(timeout) if isinstance(timeout, (int, float)) else None
        admitted = admission.turn.wait_until(admission.admitted, bound, abandoned=admission.leave)
        if not admission.waited(admitted):  # a connect that timed out: nothing sent
            raise ConnectTimeoutError(admission.timeout_message(bound))
    return admission


def _probe(connection: Any, run: Urllib3Run) -> None:
    """Ask the new connection for ``GET /health`` before urllib3 writes the request to it (the I/O of the shared
    `ProbeMachine`). On failure the connection is closed and the error fails urllib3's connect: nothing of the
    request was written, and the guard sends it again on a fresh connection."""
    sock = connection.sock
    before = sock.gettimeout()
    machine = probe_machine.ProbeMachine(run, socket=sock)
    action = machine.next(probe_machine.Start())
    try:
        while True:
            if isinstance(action, probe_machine.Write):
                sock.settimeout(min(action.timeout, MAX_SOCKET_WAIT))
                try:
                    sock.sendall(action.data)
                    event: Any = probe_machine.Written()
                except TimeoutError:
                    event = probe_machine.TimedOut()
                except OSError as error:
                    event = probe_machine.Broken(error)
            elif isinstance(action, probe_machine.Read):
                sock.settimeout(min(action.timeout, MAX_SOCKET_WAIT))
                try:
                    event = probe_machine.Received(sock.recv(probe_machine.READ_SIZE))
                except TimeoutError:
                    event = probe_machine.TimedOut()
                except OSError as error:
                    event = probe_machine.Broken(error)
            elif isinstance(action, probe_machine.Kick):
                event = _kick(action)
            elif isinstance(action, probe_machine.Usable):
                sock.settimeout(before)
                return
            else:
                _abort(connection, run, action)
            action = machine.next(event)
    except BaseException:
        if machine.state is not probe_machine.ProbeState.DONE:  # interrupted (KeyboardInterrupt, a signal's exception)
            machine.next(probe_machine.Cancelled())
            connection.close()
        raise


def _kick(action: probe_machine.Kick) -> probe_machine.Kicked:
    """Open a bare TCP connection and close it at once, writing nothing (`GuardPolicy.probe_kick`)."""
    try:
        socket.create_connection((action.host, action.port), timeout=action.timeout).close()
    except OSError as error:
        return probe_machine.Kicked(error)
    return probe_machine.Kicked()


def _abort(connection: Any, run: Urllib3Run, action: probe_machine.Abort) -> None:
    connection.close()
    guard = run.guard
    if action.watch is not None:
        guard.given_up.add(action.watch)
    if action.unprobeable:
        guard.unprobeable.add(run.origin)
    if action.timed_out:
        raise Urllib3ProbeTimeout(action.message)
    raise Urllib3ProbeError(connection, action.message)
