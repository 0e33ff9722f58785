"""`AsyncGuardTransport`, the guard as an httpx async transport.

This file is the source of truth: ``scripts/unasync.py`` generates ``sync_transport.py`` from it, and CI checks
that the generated file is current. Keep the I/O here and every decision in the sans-I/O modules.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

import anyio
import httpcore
import httpx

from .._core import probe_machine
from .._core.connection_strategy import Strategies
from .._core.decisions import first_attempt_goes_as_is
from .._core.late_answers import GivenUpWatches
from .._core.llama_server import RETRIED_STATUSES
from .._core.log import STALL_LOG, WARN_ONCE, logger
from .._core.origin_probes import PROBE_BOOK
from .._core.origin_stats import CountsPerOrigin
from .._core.origins import Origin, OriginRegistry
from .._core.ownership import mark_wrapped_by_a_guard
from .._core.policy import GuardPolicy
from .._core.request_state import MAX_RETRIED_ERROR_BODY
from .._core.result import EXTENSION, new_result
from .._core.retry_schedule import RetrySchedule
from .._core.stats import GuardStats
from .async_connections import track_connections
from .attempts import FirstAttempt, RequestRun, request_body, with_connection_close
from .exceptions import ProbeError, ProbeTimeout
from .internals import (
    KEEPALIVE_EXPIRY,
    bypassing_mounts,
    cap_keepalive_expiry,
    check_versions,
    fix_pool_race,
    hookable_pool,
    http_versions,
    streaming_check,
    unix_socket_path,
)
from .sockets import shutdown_connection

__all__ = ["AsyncGuardTransport"]

# llama-server keeps an idle connection for 5 s (`Keep-Alive: timeout=5`): expire ours first, so that the pool
# never picks a connection at the moment the server closes it.
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_EXPIRY)
# The stack's name in the counts per origin (stats.by_origin(), llama_guard.metrics): "httpx", or "httpx2" in the twin.
STACK = httpx.__name__


# Kicks open a bare TCP connection with httpcore's public backend (the pool's own is the caller's to configure).
_KICK_BACKEND = httpcore.AnyIOBackend()


async def _kick(kick: probe_machine.Kick) -> BaseException | None:
    """Open one TCP connection and close it at once, writing nothing (`probe_machine.Kick`); the failure if any."""
    try:
        stream = await _KICK_BACKEND.connect_tcp(kick.host, kick.port, timeout=kick.timeout)
    except (httpcore.NetworkError, httpcore.TimeoutException, OSError) as exc:
        return exc
    await stream.aclose()
    return None


class AsyncGuardTransport(CountsPerOrigin, httpx.AsyncBaseTransport):
    """An httpx async transport that makes a pooled client safe against llama-server.

    Wraps ``transport`` (default: a new `httpx.AsyncHTTPTransport` whose keep-alive expiry is below
    llama-server's 5 s) and closes it when closed. Requests to llama-server origins get the guard's mechanisms
    (see `GuardPolicy`); all other requests pass through unchanged. Per-request options go in
    ``request.extensions["llama_guard"]`` (a dict of `GuardPolicy` fields); the guard's account comes back in
    ``response.extensions["llama_guard"]`` (a `GuardResult`). Counters are in ``stats``.
    """

    STACK = STACK  # the stack's name in the counts per origin

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        policy: GuardPolicy | None = None,
        stats: GuardStats | None = None,
        origins: OriginRegistry | None = None,
    ) -> None:
        """``stats``: a `GuardStats` to count into (shared by several transports), else a new one. ``origins``: the
        registry of llama-server origins to share with other transports (what `install()` passes); else the
        policy's."""
        if policy is not None and not isinstance(policy, GuardPolicy):
            raise TypeError(f"policy must be a llama_guard.GuardPolicy or None; got {type(policy).__name__}")
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise TypeError(
                "transport must be an httpx.AsyncBaseTransport (for a sync client use GuardTransport); "
                f"got {type(transport).__name__}"
            )
        if stats is not None and not isinstance(stats, GuardStats):
            raise TypeError(f"stats must be a llama_guard.GuardStats or None; got {type(stats).__name__}")
        self._transport = transport if transport is not None else httpx.AsyncHTTPTransport(limits=DEFAULT_LIMITS)
        self._policy = policy if policy is not None else GuardPolicy()
        self.stats = stats if stats is not None else GuardStats()
        self._origins = origins if origins is not None else OriginRegistry(self._policy.origins)
        # Learnt probe deadlines and connection admission, per origin: the process's, shared by every transport.
        self._book = PROBE_BOOK
        # Connections whose probe was given up, watched a while for a late answer: closed when this transport is.
        self._given_up = GivenUpWatches()
        # install() must not guard this transport's requests a second time.
        mark_wrapped_by_a_guard(self._transport)
        # New connections are probed, and attempts followed, by hooks on the httpcore pool (internals.py), on the
        # library versions the guard was tested with; otherwise, or when the pool is out of reach (a wrapper
        # around a transport), through httpcore's public trace extension.
        untested = check_versions()
        pool = hookable_pool(self._transport) if untested is None else None
        if pool is not None:
            fix_pool_race(self._transport)  # httpcore 1.x can close a connection another request is using
            cap_keepalive_expiry(self._transport)  # wrapped transports often expire at llama-server's own 5 s
            track_connections(pool)
        else:
            self.stats.public_path = untested or "the wrapped transport's httpcore pool is out of reach"
        self._hooked = pool is not None
        self._bypass_checked = False  # whether its client was looked at for transports that send round it
        # How the wrapped transport connects: through a Unix socket (a new connection costs no round trip), and
        # whether HTTP/2 may carry a request (no Connection: close there; h2c with prior knowledge: no probe).
        self._http1, self._http2 = http_versions(self._transport)
        self._strategies = Strategies(
            self._policy.connection, self.stats, unix_socket=unix_socket_path(self._transport) is not None
        )
        self._is_streaming = streaming_check(untested is None)
        self._probe_connection = self._probe
        # Read for every request: plain attributes.
        self._every_origin = self._origins.every_origin
        self._close_streams = self._policy.stream_mode == "close"
        self._adds_deadline = self._policy.first_byte_timeout is not None
        self._drops_streams = self._policy.stream_mode != "off"
        # Origins whose server closed the connection after answering a probe: probing them cannot work.
        self._unprobeable: set[Origin] = set()
        # On the trace path: whether the wrapped transport reports httpcore's trace events at all, learnt from
        # its first answer (None until then). One that does not (aiohttp below, a mock) cannot be probed through.
        self._reports_trace_events: bool | None = None

    @property
    def policy(self) -> GuardPolicy:
        return self._policy

    @property
    def transport(self) -> httpx.AsyncBaseTransport:
        """The wrapped transport."""
        return self._transport

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._policy!r} around {type(self._transport).__name__}>"

    async def __aenter__(self) -> AsyncGuardTransport:
        self._say_if_bypassed()  # a client entering its transports: before any request
        await self._transport.__aenter__()
        return self

    async def aclose(self) -> None:
        self._say_if_bypassed()
        self._given_up.end_all()
        STALL_LOG.flush()
        await self._transport.aclose()

    def _say_if_bypassed(self) -> None:
        """If its client mounted transports of its own (``proxy=``, ``mounts=``), they send round the guard: said
        once per process, and in ``stats.bypassed``. Looked at once, when the client enters its transports (``with``)
        or else when it closes them."""
        if self._bypass_checked:
            return
        self._bypass_checked = True
        patterns = bypassing_mounts(self)
        if not patterns:
            return
        self.stats.bypassed = (
            f"the client mounted its own transports for {', '.join(patterns)} (proxy= or mounts=), which send its "
            "requests round this guard"
        )
        WARN_ONCE.warning(
            f"llama_guard: {type(self).__name__} is bypassed: {self.stats.bypassed}. Guard the client with "
            "llama_guard.guard(client) (it wraps the mounted transports too), or mount the guard: "
            "mounts={'all://': GuardTransport(httpx.HTTPTransport(proxy=...))}"
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = None
        if not self._every_origin:
            origin = Origin.of_url(request.url)
            if not self._origins.is_llama(origin):
                return await self._pass_through(request, origin)
        overrides = request.extensions.get(EXTENSION)
        policy = self._policy if overrides is None else self._policy.merged(overrides)
        body, stream = request_body(request)
        started = time.monotonic()
        url = request.url
        scheme, host, port = url.scheme, url.host, url.port
        stats = self._accounts.of(scheme, host, port, origin)
        connection = self._strategies.choice(scheme, host, port, origin, policy.connection)
        may_close = self._may_close(url)
        closes = may_close and (connection.strategy == "close" or (stream and policy.stream_mode == "close"))
        if not first_attempt_goes_as_is(
            body,
            has_overrides=overrides is not None,
            adds_deadline=self._adds_deadline,
            closes_connection=False,  # a FirstAttempt sends a copy of the request with Connection: close
            hooks_follow=self._hooked,
        ):
            # The first attempt needs per-request state (or a one-shot body): a RequestRun from the start.
            run = RequestRun(
                request,
                origin,
                policy,
                stats,
                self._probe_connection,
                body=body,
                stream=stream,
                user_stream=request.stream,
                started=started,
                book=self._book,
                connection=connection,
                may_close=may_close,
            )
            return await self._guarded(run)

        # The usual request: its first attempt goes out with no RequestRun unless something needs one (FirstAttempt).
        # Most requests are answered here: on a pooled connection (reuse), or on a new one with Connection: close.
        first = FirstAttempt(
            request,
            origin=origin,
            policy=policy,
            stats=stats,
            prober=self._probe_connection,
            book=self._book,
            content=body,
            wants_stream=stream,
            started=started,
            connection=connection,
            may_close=may_close,
        )
        user_stream = request.stream  # lent to the first attempt, given back below whatever the outcome
        sent = with_connection_close(request, first, request.extensions) if closes else request
        sent.stream = first
        try:
            response = await self._transport.handle_async_request(sent)
        except Exception as exc:
            request.stream = user_stream
            return await self._guarded(first.guarded_run(), exc)
        except BaseException:  # cancelled: counted, and nothing left attached to the request
            request.stream = user_stream
            if first.run is not None:
                first.run.end_attempt()
            stats.record_request(1, None, False)
            raise
        request.stream = user_stream
        if response.status_code in RETRIED_STATUSES:
            run = first.guarded_run()
            run.end_attempt()
            return await self._guarded(run, response)
        if first.run is not None:  # the connection hooks probed a new connection for this attempt
            first.run.end_attempt()
        closing = closes or (
            self._drops_streams and self._is_streaming(response.headers) and self._drop_after_stream(response, stats)
        )
        first_byte = time.monotonic() - started
        if not connection.final:
            self._strategies.answered(url.scheme, url.host, url.port, first_byte)
        result = (1, 0, first_byte, stream, closing, (), connection.strategy)
        response.extensions[EXTENSION] = new_result(result)
        stats.record_request(1, first_byte, closes and stream)  # a stream's connection closed by the header
        return response

    def _may_close(self, url: httpx.URL) -> bool:
        """Whether ``Connection: close`` may go on a request to ``url``: not where it may travel on HTTP/2, which
        forbids the header (an https origin with http2=True, or h2c with prior knowledge)."""
        return not self._http2 or (self._http1 and url.scheme == "http")

    async def _guarded(self, run: RequestRun, first: httpx.Response | Exception | None = None) -> httpx.Response:
        """A request with a `RequestRun`: its attempts, retries, result and counters. ``first``: the outcome of its
        first attempt when that was sent already (as a `FirstAttempt`), else None."""
        try:
            if first is None:
                outcome = await self._attempt(run)
            elif isinstance(first, Exception):
                outcome = self._attempt_failed(run, first)
            else:
                outcome = await self._attempt_answered(run, first)
            # Attempts after the first, paced and bounded by the retry schedule; most requests never need them.
            if run.may_retry:
                schedule = RetrySchedule(run)
                while (delay := schedule.next_delay()) is not None:
                    await anyio.sleep(delay)
                    outcome = await self._attempt(run)
            if isinstance(outcome, Exception):
                if isinstance(outcome, httpx.TransportError):
                    raise run.final_error(outcome) from outcome
                raise outcome
            response = outcome
            closing = run.close_connection
            if not closing and run.policy.stream_mode != "off" and self._is_streaming(response.headers):
                closing = self._drop_after_stream(response, run.stats)
            response.extensions[EXTENSION] = run.result(closing)
            return response
        finally:
            # One locked update of the counters per request, however it ended.
            run.stats.record_request(run.attempts, run.first_byte, run.closed_by_header)

    async def _attempt(self, run: RequestRun) -> httpx.Response | Exception:
        """One attempt, judged: its response, or the error to raise from it (retried or not by the schedule)."""
        # The usual way: the hooks on the pool (async_connections.py) see a new connection and report it to this
        # request, which the attempt's body names; an attempt on a pooled connection passes no hook at all. A
        # transport whose pool is out of reach is followed through httpcore's trace extension instead.
        trace = None if self._hooked else _AsyncTracer(run, self._probe)
        request = run.begin_attempt(trace)
        try:
            response = await self._transport.handle_async_request(request)
        except Exception as exc:
            return self._attempt_failed(run, exc)
        except BaseException:
            run.end_attempt()
            raise
        if trace is not None and not self._reports_trace_events:
            self._learn_trace_support(run)
        run.end_attempt()
        return await self._attempt_answered(run, response)

    def _learn_trace_support(self, run: RequestRun) -> None:
        """After an answer on the trace path: a wrapped transport that reported no trace event does not send
        through httpcore, so the guard cannot probe its new connections. Said once per transport, in the log and in
        ``stats.probing_off``; a later answer with trace events (a cache hit came first, say) takes it back."""
        assert run.tracker is not None
        if run.tracker.saw_events:
            self._reports_trace_events = True
            self.stats.probing_off = None
            return
        if self._reports_trace_events is False or not run.policy.probe or run.connection.strategy == "close":
            return
        self._reports_trace_events = False
        name = type(self._transport).__name__
        self.stats.probing_off = (
            f"{name} does not send through httpcore (it reports no trace events), so the guard cannot probe its new "
            "connections"
        )
        logger.warning(
            "%s: new connections to %s are not probed, so a connection that llama-server before b11737 leaves "
            "unread is not caught (retries and stream handling still apply). Guard an httpx.HTTPTransport "
            "instead, or for an aiohttp-based transport (litellm's) use llama_guard.install() or llama_guard.aiohttp",
            self.stats.probing_off,
            run.origin,
        )

    def _attempt_failed(self, run: RequestRun, exc: Exception) -> Exception:
        """Judge the attempt's failure (the verdict goes to ``run``) and end the attempt; the error to raise: the
        exception itself, or the guard's name for it (a first-byte expiry becomes `FirstByteTimeout`)."""
        error = run.attempt_failed(exc)
        run.end_attempt()
        if error is not exc:
            error.__cause__ = exc
        assert isinstance(error, Exception)
        return error

    async def _attempt_answered(self, run: RequestRun, response: httpx.Response) -> httpx.Response | Exception:
        if run.headers_arrived(response):
            # A short error body; read it so the connection goes back to the pool, and so the caller still gets
            # it whole if this turns out to be the last attempt.
            try:
                await response.aread()
            except Exception as exc:  # judged as the 503/429 it was: retried by the schedule
                return exc
            finally:
                await response.aclose()
            assert len(response.content) <= MAX_RETRIED_ERROR_BODY
        return response

    async def _probe(self, stream: Any, run: RequestRun) -> None:
        """Ask a new connection for ``GET /health`` before the real request is written to it: the I/O of a
        `ProbeMachine`, which decides everything else.

        Runs inside httpcore's connect, from the pool's network backend (``async_connections.py``) or the ``trace``
        extension, with the new network stream. On failure the error fails the connect, so the connection never
        enters the pool and the request is retried on a fresh one; the stream is closed here (httpcore has not
        stored it yet).
        """
        if run.origin in self._unprobeable:
            return
        ssl_object = stream.get_extra_info("ssl_object")
        if ssl_object is not None and ssl_object.selected_alpn_protocol() == "h2":
            # Not llama-server (HTTP/1.1 only); an HTTP/1.1 probe would break the HTTP/2 connection.
            run.probing_off("the connection negotiated HTTP/2 (ALPN h2), which llama-server does not speak")
            return
        machine = probe_machine.ProbeMachine(run, socket=stream.get_extra_info("socket"))
        action = machine.next(probe_machine.Start())
        while not isinstance(action, probe_machine.Usable):
            if isinstance(action, probe_machine.Abort):
                await stream.aclose()
                self._aborted(action, run)
            event: probe_machine.ProbeEvent
            try:
                if isinstance(action, probe_machine.Write):
                    await stream.write(action.data, timeout=action.timeout)
                    event = probe_machine.Written()
                elif isinstance(action, probe_machine.Read):
                    event = probe_machine.Received(await stream.read(probe_machine.READ_SIZE, timeout=action.timeout))
                else:
                    event = probe_machine.Kicked(await _kick(action))
            except httpcore.TimeoutException:
                event = probe_machine.TimedOut()
            except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
                event = probe_machine.Broken(exc)
            except BaseException:
                machine.next(probe_machine.Cancelled())
                await stream.aclose()
                raise
            action = machine.next(event)

    def _aborted(self, abort: probe_machine.Abort, run: RequestRun) -> NoReturn:
        """A probe failed (its stream closed): keep its late-answer watch, and fail the connect."""
        if abort.watch is not None:
            self._given_up.add(abort.watch)
        if abort.unprobeable:
            self._unprobeable.add(run.origin)
        raise (ProbeTimeout if abort.timed_out else ProbeError)(abort.message, request=run.request)

    async def _pass_through(self, request: httpx.Request, origin: Origin) -> httpx.Response:
        self.stats.add(passthrough=1)
        response = await self._transport.handle_async_request(request)
        if (
            self._origins.learns
            and self._origins.learn(origin, response.headers)
            and self._policy.stream_mode != "off"
            and self._is_streaming(response.headers)
        ):
            # The first response of an origin in "auto" mode: it just said it is llama-server, so its connection
            # dies after this stream too.
            self._drop_after_stream(response, self.stats.of_origin(STACK, origin))
        return response

    def _drop_after_stream(self, response: httpx.Response, stats: GuardStats) -> bool:
        if response.extensions.get("http_version", b"HTTP/1.1") != b"HTTP/1.1":
            # An HTTP/2 connection carries other requests' streams: dropping it would kill them. Whatever speaks
            # HTTP/2 to us is not llama-server (HTTP/1.1 only), and keeps its connection when a stream ends.
            return False
        network_stream = response.extensions.get("network_stream")
        if network_stream is None or not isinstance(response.stream, httpx.AsyncByteStream):
            return False
        response.stream = _AsyncDropAfterStream(response.stream, network_stream, stats)
        return True


class _AsyncTracer:
    """For a wrapped transport whose pool the guard cannot reach: the ``trace`` extension of one attempt, which
    follows its progress, probes a new connection, and passes every event on to the caller's own trace callback."""

    __slots__ = ("_direct", "_probe_event", "_prober", "_run", "_user_trace")

    def __init__(self, run: RequestRun, prober: Any) -> None:
        self._run = run
        self._prober = prober
        # The probe goes right after the connection is ready for HTTP: after TLS for https.
        https = run.request.url.scheme == "https"
        self._probe_event = "connection.start_tls.complete" if https else "connection.connect_tcp.complete"
        self._user_trace = run.request.extensions.get("trace")
        self._direct = True  # False when httpcore connects to a proxy, not to the origin: nothing to probe then

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        run = self._run
        assert run.tracker is not None  # begin_attempt() makes one for an attempt followed by trace events
        run.tracker.observe(event)
        if event == "connection.connect_tcp.started":
            self._direct = (info.get("host"), info.get("port")) == (run.request.url.host, run.origin.port)
        elif event == self._probe_event and self._direct and run.probing:
            await self._prober(info["return_value"], run)
        if self._user_trace is not None:
            await self._user_trace(event, info)


class _AsyncDropAfterStream(httpx.AsyncByteStream):
    """A llama-server stream whose connection is shut down when the response closes, before httpcore would put
    it back in the pool: llama-server closes it right after the final chunk, whatever its headers said."""

    def __init__(self, stream: httpx.AsyncByteStream, network_stream: Any, stats: GuardStats) -> None:
        self._stream = stream
        self._network_stream = network_stream
        self._stats = stats

    def __aiter__(self) -> Any:
        # The inner stream's own iterator: no generator of ours that could be left suspended (and warned about by
        # trio's finalizer) when the caller stops reading half way.
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        try:
            if shutdown_connection(self._network_stream):
                self._stats.add(stream_connections_closed=1, stream_connections_dropped=1)
                self._network_stream = None
        finally:
            await self._stream.aclose()
