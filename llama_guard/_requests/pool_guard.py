"""`PoolGuard`: the guard as a driver of urllib3's ``HTTPConnectionPool.urlopen``, under requests and urllib3 alike.

requests sends every request through urllib3 (``HTTPAdapter.send`` calls a pool's ``urlopen``), so one driver serves
both: `GuardAdapter` hooks the pools of its own pool managers, `install()` the pools of every requests session and
urllib3 ``PoolManager`` at their first request to a llama-server origin. Each call of ``urlopen`` for a llama-server
origin becomes a guarded request: its attempts (each one ``urlopen`` of the pool's own method, sent once by urllib3),
the connection strategy's ``Connection: close``, the probe of new connections (``connections.py``), the retry
schedule of the shared core (`RetrySchedule`, the verdicts of `RequestState`), the drop of a stream's connection, the
per-response result and the counters. Every decision is the core's; this file does urllib3's I/O.

How the guard's retries and urllib3's own ``Retry`` combine: for a llama-server origin the guard is the one retry
loop. Each attempt goes to urllib3 with the caller's ``Retry`` less its retries (``total=None``, and no connect,
read, status or other retry: a redirect is still followed as the caller allowed), so urllib3 sends each attempt
once, and a request goes out at most ``max_attempts`` times (the attempts that found the server loading aside) --
never the product of the two budgets. A one-shot body (a generator, a file) is never sent twice, by either.
"""

from __future__ import annotations

import functools
import io
import threading
import time
import weakref
from typing import Any

from urllib3.response import BaseHTTPResponse, HTTPResponse
from urllib3.util.retry import Retry
from urllib3.util.timeout import Timeout

from .._core.connection_strategy import ConnectionChoice, Strategies
from .._core.decisions import first_attempt_goes_as_is, wants_stream
from .._core.late_answers import GivenUpWatches
from .._core.llama_server import CLIENT_KEEPALIVE
from .._core.log import STALL_LOG
from .._core.origin_probes import PROBE_BOOK
from .._core.origin_stats import CountsPerOrigin
from .._core.origins import Origin, OriginRegistry
from .._core.policy import GuardPolicy
from .._core.request_options import current_options
from .._core.request_state import RETRIED_STATUSES
from .._core.result import GuardResult, new_result
from .._core.retry_schedule import RetrySchedule
from .._core.stats import GuardStats
from .attempts import CURRENT_RUN, RequestView, Url, Urllib3Run, caller_read_timeout
from .connections import guarded_connection_class, original_connection_class
from .internals import pool_timeout, wrap_connection_handout

__all__ = ["PoolGuard", "pool_guard_of", "result_of_urllib3"]

# urlopen's parameters in order, so that a positional call is read as keywords.
_PARAMS = (
    "method",
    "url",
    "body",
    "headers",
    "retries",
    "redirect",
    "assert_same_host",
    "timeout",
    "pool_timeout",
    "release_conn",
    "chunked",
    "body_pos",
    "preload_content",
    "decode_content",
)
# The attribute a guarded response carries its `GuardResult` in, and a connection its drop mark.
RESULT_ATTRIBUTE = "_llama_guard_result"
_DROP_ATTRIBUTE = "_llama_guard_drop"
_IDLE_ATTRIBUTE = "_llama_guard_idle_since"
# The attribute of a hooked pool: the guard that hooked it, and what the pool was before.
_HOOK_ATTRIBUTE = "_llama_guard_pool"


def result_of_urllib3(response: object) -> GuardResult | None:
    """The `GuardResult` of a urllib3 response the guard handled; None otherwise."""
    result = getattr(response, RESULT_ATTRIBUTE, None)
    return result if isinstance(result, GuardResult) else None


def pool_guard_of(pool: object) -> PoolGuard | None:
    """The guard that hooked ``pool``, if one did."""
    hook = getattr(pool, _HOOK_ATTRIBUTE, None)
    return hook.guard if isinstance(hook, _PoolHook) else None


class _PoolHook:
    """What a guard changed on one pool, to put it back (`PoolGuard.unhook`)."""

    __slots__ = ("connection_class", "guard", "origin", "own_class", "own_get", "own_put")

    def __init__(self, guard: PoolGuard, pool: Any) -> None:
        self.guard = guard
        self.origin = Origin.of(pool.scheme, pool.host, pool.port)
        instance = pool.__dict__
        self.own_class = "ConnectionCls" in instance  # an instance attribute of the pool's own, to restore
        self.connection_class = pool.ConnectionCls
        self.own_put = "_put_conn" in instance
        self.own_get = "_get_conn" in instance


class PoolGuard(CountsPerOrigin):
    """The guard's state for the pools it hooks: settings, counters, connection strategies, given-up probes.

    ``stack``: the name of the stack in the counts per origin (``"requests"``, ``"urllib3"``); ``explicit``: its
    pools are an explicit guard's (`GuardAdapter`), which `install()` leaves alone.
    """

    def __init__(
        self,
        *,
        policy: GuardPolicy,
        stats: GuardStats,
        origins: OriginRegistry,
        stack: str,
        explicit: bool,
    ) -> None:
        self.policy = policy
        self.STACK = stack  # the name its counts per origin go under (`CountsPerOrigin`)
        self.stats = stats  # and its accounts per origin (`Accounts`)
        self.origins = origins
        self.explicit = explicit
        self._strategies = Strategies(policy.connection, stats)
        self.given_up = GivenUpWatches()  # connections whose probe was given up, watched for a late answer
        self.unprobeable: set[Origin] = set()  # origins that close a probed connection: probing them cannot work
        self._last_retries: tuple[Any, bool, Any] | None = None  # (caller's Retry, redirect, what attempts get)
        self._pools: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    # -- the pools ---------------------------------------------------------------------------------------------

    def hook(self, pool: Any) -> None:
        """Put the guard on ``pool`` (once): its new connections' class, its ``_put_conn`` and ``_get_conn`` (a llama
        stream's connection is closed, never pooled; an idle one expires at 4 s) and, for an explicit guard, its
        ``urlopen`` (`install()` wraps the
        class's instead). An explicit guard takes a pool over from `install()`'s, never the other way round."""
        hook = pool.__dict__.get(_HOOK_ATTRIBUTE)
        if hook is not None and hook.guard is self:
            return
        with self._lock:
            current = pool_guard_of(pool)
            if current is self:
                return
            if current is not None:
                if current.explicit and not self.explicit:
                    return
                current.unhook(pool)
            hook = _PoolHook(self, pool)
            guarded = guarded_connection_class(pool.ConnectionCls)
            pool.ConnectionCls = guarded
            _swap_idle_connections(pool, guarded_connection_class)
            wrap_connection_handout(pool, _put_conn, _get_conn)
            if self.explicit:
                pool.urlopen = functools.partial(self.urlopen, pool, functools.partial(type(pool).urlopen, pool))
            setattr(pool, _HOOK_ATTRIBUTE, hook)
            self._pools.add(pool)

    def unhook(self, pool: Any) -> None:
        """Put ``pool`` back as it was before `hook`; requests under way finish as they are."""
        hook = pool.__dict__.get(_HOOK_ATTRIBUTE)
        if not isinstance(hook, _PoolHook) or hook.guard is not self:
            return
        del pool.__dict__[_HOOK_ATTRIBUTE]
        if hook.own_class:
            pool.ConnectionCls = hook.connection_class
        else:
            pool.__dict__.pop("ConnectionCls", None)
        if not hook.own_put:
            pool.__dict__.pop("_put_conn", None)
        if not hook.own_get:
            pool.__dict__.pop("_get_conn", None)
        pool.__dict__.pop("urlopen", None)
        _swap_idle_connections(pool, original_connection_class)
        self._pools.discard(pool)

    def unhook_all(self) -> None:
        """Take the guard off every pool it hooked (`uninstall()`)."""
        with self._lock:
            for pool in list(self._pools):
                self.unhook(pool)

    def close(self) -> None:
        self.given_up.end_all()
        STALL_LOG.flush()

    def account(self, pool: Any, origin: Origin) -> GuardStats:
        """The account of ``pool``'s origin in the stats (`GuardStats.of_origin`)."""
        return self._accounts.of(pool.scheme, pool.host, pool.port, origin)

    # -- a request ------------------------------------------------------------------------------------------------

    def urlopen(self, pool: Any, original: Any, *args: Any, **kwargs: Any) -> BaseHTTPResponse:
        """``pool.urlopen(*args, **kwargs)`` under the guard; ``original``: the pool's own ``urlopen``, bound."""
        if CURRENT_RUN.get() is not None:  # urllib3's own redirect inside a guarded attempt: part of it
            return original(*args, **kwargs)  # type: ignore[no-any-return]
        hook = getattr(pool, _HOOK_ATTRIBUTE, None)
        origin = hook.origin if isinstance(hook, _PoolHook) else Origin.of(pool.scheme, pool.host, pool.port)
        if not self.origins.is_llama(origin):
            return self._pass_through(pool, original, origin, args, kwargs)
        self.hook(pool)
        call = dict(zip(_PARAMS, args, strict=False))
        call.update(kwargs)
        return self._guarded(pool, original, origin, call)

    def _guarded(self, pool: Any, original: Any, origin: Origin, call: dict[str, Any]) -> BaseHTTPResponse:
        started = time.monotonic()
        overrides = current_options()
        policy = self.policy if overrides is None else self.policy.merged(overrides)
        method = str(call["method"]).upper()
        body = call.get("body")
        content = body.encode() if isinstance(body, str) else body
        if content is not None and not isinstance(content, (bytes, bytearray)):
            content = None  # a generator or a file: one-shot, never sent twice
        elif isinstance(content, bytearray):
            content = bytes(content)
        elif content is None:
            content = b""
        stream = method == "POST" and content is not None and wants_stream(content)
        connection = self._strategies.choice(pool.scheme, pool.host, pool.port, origin, policy.connection)
        first = _FirstAttempt(self, pool, original, call, method, origin, policy, content, stream, started, connection)
        outcome: BaseHTTPResponse | BaseException | None = None
        if first_attempt_goes_as_is(
            content,
            has_overrides=overrides is not None,
            adds_deadline=policy.first_byte_timeout is not None,
            closes_connection=False,  # Connection: close goes on the first attempt's copy of the headers
        ):
            # The usual request: its first attempt goes out as the caller's call (urllib3's retries taken out, and
            # Connection: close added on a copy of the headers when the strategy or a stream asks for it), with no
            # `Urllib3Run` unless something needs one (a new connection to probe, a failure, a 503/429).
            try:
                outcome = first.send_as_is()
            except BaseException:  # interrupted (KeyboardInterrupt, a signal's exception): counted, as any request
                first.stats.record_request(1, None, False)
                raise
            if first.run is None:
                assert isinstance(outcome, BaseHTTPResponse)
                return self._answered_at_once(first, outcome)
        run = first.guarded_run()
        attempt = _Attempt(first, run)
        try:
            if outcome is None:
                outcome = attempt.send()
            elif isinstance(outcome, BaseHTTPResponse):
                outcome = attempt.judged(outcome)
            if isinstance(outcome, BaseException) or run.may_retry:  # the usual answer needs no schedule
                schedule = RetrySchedule(run)
                while (delay := schedule.next_delay()) is not None:
                    time.sleep(delay)
                    outcome = attempt.send()
            if isinstance(outcome, BaseException):
                raise run.final_error(outcome) from outcome
            response = outcome
            closing = run.close_connection
            if not closing and policy.stream_mode != "off" and _is_streaming(response):
                closing = _drop_after_stream(response, run.stats)
            setattr(response, RESULT_ATTRIBUTE, run.result(closing))
            return _preloaded(response, first)
        finally:
            run.stats.record_request(run.attempts, run.first_byte, run.closed_by_header)

    def _answered_at_once(self, first: _FirstAttempt, response: BaseHTTPResponse) -> BaseHTTPResponse:
        """A first attempt answered on a pooled connection: its result and counters, with no `Urllib3Run`."""
        stats = first.stats
        closing = first.closes or (
            first.policy.stream_mode != "off" and _is_streaming(response) and _drop_after_stream(response, stats)
        )
        first_byte = time.monotonic() - first.started
        connection = first.connection
        if not connection.final:
            pool = first.pool
            self._strategies.answered(pool.scheme, pool.host, pool.port, first_byte)
        setattr(
            response, RESULT_ATTRIBUTE, new_result((1, 0, first_byte, first.stream, closing, (), connection.strategy))
        )
        # A stream's connection closed by the header (stats.stream_connections_closed); the close strategy's are not.
        stats.record_request(1, first_byte, first.closes and first.stream)
        return _preloaded(response, first)

    def single_send(self, call: dict[str, Any], pool: Any) -> Any:
        """`_single_send` of the call's retries, remembered for the last ``Retry`` object seen (requests passes its
        adapter's own on every call: building a Retry costs as much as the rest of the guard's work)."""
        retries, redirect = call.get("retries"), call.get("redirect", True)
        cached = self._last_retries
        if cached is not None and cached[0] is retries and cached[1] == redirect and retries is not None:
            return cached[2]
        derived = _single_send(retries, redirect, pool.retries)
        if isinstance(retries, Retry):
            self._last_retries = (retries, redirect, derived)
        return derived

    def _pass_through(
        self, pool: Any, original: Any, origin: Origin, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> BaseHTTPResponse:
        self.stats.add(passthrough=1)
        response: BaseHTTPResponse = original(*args, **kwargs)
        if (
            self.origins.learns
            and self.origins.learn(origin, response.headers)
            and self.policy.stream_mode != "off"
            and _is_streaming(response)
        ):
            # The first response of an origin in "auto" mode: it just said it is llama-server.
            self.hook(pool)
            _drop_after_stream(response, self.account(pool, origin))
        return response


class _FirstAttempt:
    """A guarded call, and its first attempt while the request has needed nothing but its body.

    Most requests are answered by their first attempt on a pooled connection and need no `Urllib3Run`: for them
    the guard builds none (it would be most of its work per request). This keeps what a run is built from, and
    builds it when something needs one (`guarded_run`): the connection hook, for a new connection to probe, or the
    guard, when the attempt fails or is answered 503/429. The run then carries on as if it had been there from the
    start, with this as its first attempt. Only for a first attempt that goes out as the caller made it (a
    replayable body, no per-request options, no first-byte deadline, no ``Connection: close`` to add).
    """

    __slots__ = (
        "call",
        "closes",
        "connection",
        "content",
        "decode",
        "guard",
        "method",
        "origin",
        "original",
        "policy",
        "pool",
        "preload",
        "run",
        "started",
        "stats",
        "stream",
    )

    def __init__(
        self,
        guard: PoolGuard,
        pool: Any,
        original: Any,
        call: dict[str, Any],
        method: str,
        origin: Origin,
        policy: GuardPolicy,
        content: bytes | None,
        stream: bool,
        started: float,
        connection: ConnectionChoice,
    ) -> None:
        self.guard, self.pool, self.original, self.method, self.origin = guard, pool, original, method, origin
        self.policy, self.content, self.stream, self.started = policy, content, stream, started
        self.connection = connection
        self.preload = call.get("preload_content", True)
        self.decode = call.get("decode_content", True)
        self.stats = guard.account(pool, origin)
        self.run: Urllib3Run | None = None
        # What every attempt sends: the caller's call (``call`` is the guard's own dict, made from the arguments),
        # with urllib3's own retries taken out (the guard's loop replaces them, see the module's doc), and the body
        # left unread (the guard judges the headers first).
        attempt = call
        attempt["retries"] = guard.single_send(call, pool)
        attempt["preload_content"] = False
        attempt["release_conn"] = False
        # Connection: close when the strategy or a stream asks for it (`RequestState.close_connection`), on a copy
        # of the headers: the caller's stay as they are.
        self.closes = connection.strategy == "close" or (stream and policy.stream_mode == "close")
        if self.closes:
            headers = call.get("headers")
            attempt["headers"] = _with_connection_close(headers if headers is not None else pool.headers)
        self.call = attempt

    def guarded_run(self) -> Urllib3Run:
        run = self.run
        if run is None:
            call, pool, policy = self.call, self.pool, self.policy
            headers = call.get("headers")
            read = None
            if policy.first_byte_timeout is not None:  # the caller's read timeout matters to the deadline alone
                read = caller_read_timeout(pool_timeout(pool, call.get("timeout", Timeout.DEFAULT_TIMEOUT)))
            path = str(call["url"]).partition("?")[0]
            view = RequestView(
                self.method,
                Url(pool.scheme, pool.host, pool.port, path),
                headers if headers is not None else pool.headers,
                read,
            )
            run = self.run = Urllib3Run(
                view,
                self.origin,
                policy,
                self.stats,
                self.guard,
                body=self.content,
                stream=self.stream,
                started=self.started,
                book=PROBE_BOOK,
                connection=self.connection,
            )
        return run

    def send_as_is(self) -> BaseHTTPResponse | BaseException:
        """The first attempt, as the caller's call: the response, or the failure (judged: a run is built then)."""
        token = CURRENT_RUN.set(self)
        try:
            response: BaseHTTPResponse = self.original(**self.call)
        except Exception as exc:
            run = self.guarded_run()
            if run.attempts == 0:  # built here, not by the connection hook: this attempt, counted
                run.begin_attempt()
            error = run.attempt_failed(exc)
            if error is None:
                raise
            return error
        finally:
            CURRENT_RUN.reset(token)
        if response.status in RETRIED_STATUSES:
            run = self.guarded_run()
            if run.attempts == 0:
                run.begin_attempt()
        return response


class _Attempt:
    """The attempts of a guarded request after its first sent as is (or all of them): each one call of the pool's
    own ``urlopen``, judged into the run."""

    __slots__ = ("call", "original", "run", "timeout")

    def __init__(self, first: _FirstAttempt, run: Urllib3Run) -> None:
        self.original = first.original
        self.run = run
        call = first.call
        self.timeout = None
        if run.policy.first_byte_timeout is not None:
            self.timeout = pool_timeout(first.pool, call.get("timeout", Timeout.DEFAULT_TIMEOUT))
        if run.close_connection and not first.closes:  # not already on the first attempt's copy
            headers = call.get("headers")
            call = {**call, "headers": _with_connection_close(headers if headers is not None else first.pool.headers)}
        self.call = call

    def send(self) -> BaseHTTPResponse | BaseException:
        """One attempt: the response (a retriable 503/429 already read whole), or the failure, judged."""
        run = self.run
        read = run.begin_attempt()
        call = self.call
        if read is not None:  # the first-byte deadline rides on the read timeout, for the headers
            assert self.timeout is not None
            call = dict(call)
            call["timeout"] = Timeout(connect=self.timeout.connect_timeout, read=read)
        token = CURRENT_RUN.set(run)
        try:
            response: BaseHTTPResponse = self.original(**call)
        except Exception as exc:
            error = run.attempt_failed(exc)
            if error is None:
                raise
            return error
        finally:
            CURRENT_RUN.reset(token)
        if read is not None and response.status not in RETRIED_STATUSES:
            _restore_read_timeout(response, run.caller_read())
        return self.judged(response)

    def judged(self, response: BaseHTTPResponse) -> BaseHTTPResponse:
        """Judge a response's status: a retriable 503/429 is read whole (and replaced by a copy for the caller)."""
        if self.run.judge_response(response.status, response.headers):
            return _read_whole(response)
        return response


def _is_streaming(response: BaseHTTPResponse) -> bool:
    """`is_streaming_response` for a urllib3 response: its ``chunked`` flag says Transfer-Encoding: chunked without a
    header lookup (case-insensitive lookups cost as much as the rest of the guard's work on an answer)."""
    if getattr(response, "chunked", False):
        return True
    content_type: str = response.headers.get("content-type", "")
    return content_type[:17].lower() == "text/event-stream"


def _with_connection_close(headers: Any) -> dict[str, Any]:
    """A copy of ``headers`` with ``Connection: close`` (replacing any Connection header)."""
    closing = {name: value for name, value in headers.items() if name.lower() != "connection"}
    closing["Connection"] = "close"
    return closing


def _preloaded(response: BaseHTTPResponse, first: _FirstAttempt) -> BaseHTTPResponse:
    """urllib3 reads a preloaded body in urlopen (``preload_content``, its default; requests asks for none); each
    attempt left it unread (the guard judges the headers first), so it is read here, and the connection goes back to
    the pool at its end."""
    if first.preload:
        response.read(decode_content=first.decode, cache_content=True)
    return response


def _single_send(retries: Any, redirect: bool, default: Retry) -> Any:
    """The caller's urllib3 ``Retry`` less its retries: urllib3 sends each of the guard's attempts once (a
    redirect is still followed as the caller allowed it)."""
    if retries is False:
        return False  # no retries, and urllib3's errors raised as they are: already one send
    if not isinstance(retries, Retry):
        retries = Retry.from_int(retries, redirect=redirect, default=default)
    redirect_budget = retries.redirect if retries.redirect is not None else retries.total
    return retries.new(
        total=None, connect=0, read=0, other=0, status=0, redirect=redirect_budget, raise_on_status=False
    )


def _read_whole(response: BaseHTTPResponse) -> BaseHTTPResponse:
    """A retriable 503/429 (a short JSON error: `RequestState.judge_response` checked its length): read whole so
    that its connection goes back to the pool, and replaced by a response that holds the same bytes, for the caller
    if this was the last attempt."""
    try:
        data = response.read(decode_content=False)  # its Content-Length is at most MAX_RETRIED_ERROR_BODY
    finally:
        response.release_conn()
    return HTTPResponse(
        body=io.BytesIO(data),
        headers=response.headers,
        status=response.status,
        version=response.version,
        reason=response.reason,
        preload_content=False,
        decode_content=False,
        request_method=getattr(response, "_request_method", None),
        request_url=response.url,
        retries=response.retries,
    )


def _restore_read_timeout(response: BaseHTTPResponse, read: float | None) -> None:
    """The headers came under the first-byte deadline: the body is read under the caller's own read timeout, on
    the socket the body comes from (http.client's response holds it even when its connection let go of it:
    ``Connection: close``)."""
    body = getattr(getattr(getattr(response, "_fp", None), "fp", None), "raw", None)
    sock = getattr(body, "_sock", None)
    if sock is None:
        sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock is not None:
        sock.settimeout(read)


def _drop_after_stream(response: BaseHTTPResponse, stats: GuardStats) -> bool:
    """llama-server closes a stream's connection right after the final chunk, whatever its headers said: mark the
    connection so that the pool closes it when the response gives it back (`_put_conn`), instead of pooling it."""
    connection = getattr(response, "connection", None)
    if connection is None or getattr(connection, "sock", None) is None:
        return connection is not None  # http.client closed it already (the response said Connection: close)
    setattr(connection, _DROP_ATTRIBUTE, stats)
    return True


def _put_conn(pool: Any, put: Any, conn: Any) -> None:
    """A hooked pool's ``_put_conn``: a connection marked by `_drop_after_stream` is closed first (urllib3 then
    opens a new one in its place when it is next taken); one that goes back idle is stamped with the time."""
    if conn is not None:
        stats = conn.__dict__.pop(_DROP_ATTRIBUTE, None)
        if stats is not None:
            if conn.sock is not None:
                stats.add(stream_connections_closed=1, stream_connections_dropped=1)
            conn.close()
        conn.__dict__[_IDLE_ATTRIBUTE] = time.monotonic()
    put(pool, conn)


def _get_conn(pool: Any, get: Any, timeout: Any = None) -> Any:
    """A hooked pool's ``_get_conn``: a connection idle for `CLIENT_KEEPALIVE` (4 s) or more is closed before it is
    handed out (urllib3 reconnects it in place, and the hook probes the new connection). llama-server closes an idle
    connection at 5 s; urllib3 keeps one for ever and checks only that no close has arrived yet, so a request could
    be written at the moment the server closes it (httpx's pool expires at 4 s under the guard, aiohttp's too)."""
    conn = get(pool, timeout)
    if conn is not None:
        idle_since = conn.__dict__.pop(_IDLE_ATTRIBUTE, None)
        if idle_since is not None and time.monotonic() - idle_since >= CLIENT_KEEPALIVE and conn.sock is not None:
            conn.close()
    return conn


def _swap_idle_connections(pool: Any, make: Any) -> None:
    """Give the connections waiting in the pool the class ``make`` gives their class (guarded, or original)."""
    queue = getattr(pool, "pool", None)
    if queue is None:
        return
    with queue.mutex:
        for conn in queue.queue:
            if conn is not None:
                conn.__class__ = make(type(conn))
