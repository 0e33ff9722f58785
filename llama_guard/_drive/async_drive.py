"""The one loop that drives a guarded request, and the one that drives its new connections: every stack uses them.

This file is the source of truth: ``scripts/unasync.py`` generates ``sync_drive.py`` from it, and CI checks that it
is current.

Library-neutral, as hishel's cache proxy is: a loop over the core's machine (``_core/request_machine.py``,
``_core/connection_machine.py``), one branch per action, performing it through the stack's I/O object and feeding
back what happened. A stack's driver writes no loop of its own; it gives:

- an `AsyncAttemptIO`: send one attempt and report the response headers or the failure, read a 503's short body,
  drop a stream's connection, hand the response to the caller, make the caller's error;
- an `AsyncConnectionIO` for a new connection: write and read the probe on it, close it, make the stack's error.

What is the same on every stack lives here: the sleep before a retry, the wait for a turn in the origin's queue,
the kick connections, the duplicated socket of a given-up connection.
"""

from __future__ import annotations

import time
from typing import Protocol, TypeVar

import anyio
import httpcore

from .._core import connection_machine as connection
from .._core import request_machine as request
from .._core.probes import Admission
from .._core.result import GuardResult
from .._runtime.admission_turns import AsyncTurn
from .._runtime.late_answers import WatchedConnection

__all__ = ["AsyncAttemptIO", "AsyncConnectionIO", "advance_connection", "drive_request"]


ResponseT = TypeVar("ResponseT", covariant=True)


class AsyncAttemptIO(Protocol[ResponseT]):
    """A stack's I/O for the attempts of one request (``ResponseT``: the stack's response)."""

    async def send(self, send: request.Send) -> request.Answered | request.Failed:
        """Send one attempt; report its response headers, or its failure (the error kept for `error`)."""

    async def read_error_body(self) -> request.RequestSignal | request.Failed:
        """Read the last response's short body whole (a 503/429 to retry)."""

    def drop_stream(self) -> bool:
        """Have the last response's connection shut when its stream ends; False if that cannot be done."""

    def respond(self, result: GuardResult) -> ResponseT:
        """The last response, carrying ``result``, for the caller."""

    def error(self, fail: request.Fail | None) -> BaseException:
        """The last attempt's error for the caller: as the guard's (``fail``: its account), or as it is (None)."""


async def drive_request(
    machine: request.RequestMachine, io: AsyncAttemptIO[ResponseT], event: request.RequestEvent
) -> ResponseT:
    """Run ``machine`` from ``event`` (``BEGIN``, or what a first attempt sent as it is came to) to the end: the
    caller's response, or the error raised. The request is counted once, however it ends."""
    try:
        action = machine.next(event)
        while True:
            if isinstance(action, request.Send):
                event = await io.send(action)
            elif action is request.READ_ERROR_BODY:
                event = await io.read_error_body()
            elif isinstance(action, request.Sleep):
                await anyio.sleep(action.seconds)
                event = request.SLEPT
            elif isinstance(action, request.Deliver):
                event = request.Delivered(action.drop_stream and io.drop_stream())
            elif isinstance(action, request.Done):
                return io.respond(action.result)
            elif isinstance(action, request.Fail):
                raise io.error(action)
            else:
                assert action is request.RERAISE
                raise io.error(None)
            action = machine.next(event)
    except BaseException:
        if machine.state is not request.RequestState.DONE:  # cancelled, or interrupted
            machine.next(request.CANCELLED)
        raise
    finally:
        machine.counted()


class AsyncConnectionIO(Protocol):
    """A stack's I/O on one new connection, for its probe."""

    #: What bounds the wait for a turn in the origin's queue: the caller's connect timeout (None: none).
    connect_timeout: float | None

    async def write(self, data: bytes, timeout: float) -> connection.ConnectionSignal | connection.Broken:
        """Write ``data`` within ``timeout`` seconds."""

    async def read(self, timeout: float) -> connection.Received | connection.ConnectionSignal | connection.Broken:
        """Read what arrives (up to `connection.READ_SIZE` bytes) within ``timeout`` seconds."""

    async def close(self) -> None:
        """Close the connection (nothing, if it was not opened)."""

    def error(self, abort: connection.Abort) -> BaseException:
        """The error that fails the connect: the stack's ProbeTimeout, ProbeError or ConnectTimeout."""


async def advance_connection(
    machine: connection.ConnectionMachine, event: connection.ConnectionEvent, io: AsyncConnectionIO
) -> connection.ConnectionStep:
    """Run a new connection's ``machine`` from ``event`` to the stack's next step of its own: ``OPEN`` (connect),
    ``AWAIT_TLS`` (do the TLS handshake, then report `TlsDone`) or ``READY`` (write the request). A probe that fails
    closes the connection and raises the stack's error; so does a turn that did not come in time."""
    action = machine.next(event)
    while True:
        if action in (connection.OPEN, connection.AWAIT_TLS, connection.READY):
            return action
        try:
            if isinstance(action, connection.Admit):
                event = await _admit(action, io.connect_timeout)
            elif isinstance(action, connection.Write):
                event = await io.write(action.data, action.timeout)
            elif isinstance(action, connection.Read):
                event = await io.read(action.timeout)
            elif isinstance(action, connection.Kick):
                event = await _kick(action)
            elif isinstance(action, connection.GiveUp):
                watched = WatchedConnection.of(action.socket)  # the duplicate is this module's from now on
                event = connection.Watched(watched.peek, watched.close, watched.unseen)
            else:
                assert isinstance(action, connection.Abort)
                await io.close()
                raise io.error(action)
        except BaseException:
            if not machine.done:  # cancelled, or interrupted, while the action ran
                machine.next(connection.CANCELLED)
                await io.close()
            raise
        action = machine.next(event)


async def _admit(action: connection.Admit, timeout: float | None) -> connection.Admitted | connection.NotAdmitted:
    """A place in the origin's queue, and the wait for its turn: woken by the connection ahead once it is probed (or
    gives its place up), in whatever thread or event loop that runs; the turn is made here, in the waiter's own."""
    admission = Admission(action.probes, action.stats, AsyncTurn(), hold=action.hold)
    if admission.waits and not admission.waited(await _wait_for_turn(admission, timeout)):
        return connection.NotAdmitted(admission, timeout)
    return connection.Admitted(admission)


async def _wait_for_turn(admission: Admission[AsyncTurn], timeout: float | None) -> bool:
    """Wait until the turn has come (asked again after each wake-up); False if ``timeout`` seconds passed first.
    The place is given up if the wait ends in an exception (cancelled)."""
    turn = admission.turn
    end = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            turn.clear()  # before the check: a wake-up after it finds the event set
            if admission.admitted():
                return True
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            hold_ends = admission.hold_ends_in()  # a connect ahead that hangs lets this one go after its hold
            if hold_ends is not None and (remaining is None or hold_ends < remaining):
                remaining = hold_ends
            await turn.wait(remaining)
    except BaseException:
        admission.leave()
        raise


# Kicks open a bare connection with httpcore's public backend: any stack's, in any event loop (anyio).
_KICK_BACKEND = httpcore.AnyIOBackend()


async def _kick(kick: connection.Kick) -> connection.Kicked:
    """Open one connection to the origin (its Unix socket, when it has one) and close it at once, writing nothing."""
    try:
        if kick.path is not None:
            stream = await _KICK_BACKEND.connect_unix_socket(kick.path, timeout=kick.timeout)
        else:
            stream = await _KICK_BACKEND.connect_tcp(kick.host, kick.port, timeout=kick.timeout)
    except (httpcore.NetworkError, httpcore.TimeoutException, OSError) as exc:
        return connection.Kicked(exc)
    await stream.aclose()
    return connection.Kicked()
