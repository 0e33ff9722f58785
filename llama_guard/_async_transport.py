"""`AsyncGuardTransport`, the guard as an httpx async transport.

This file is the source of truth: ``scripts/unasync.py`` generates ``_sync_transport.py`` from it, and CI checks
that the generated file is current. Keep the I/O here and every decision in the sans-I/O modules.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import tenacity

from ._decisions import ProgressTracker, is_streaming_response
from ._origins import Origin, OriginRegistry
from ._policy import GuardPolicy
from ._result import EXTENSION
from ._run import MAX_RETRIED_ERROR_BODY, RequestRun
from ._sockets import shutdown_connection
from ._stats import GuardStats

__all__ = ["AsyncGuardTransport"]

# llama-server keeps an idle connection for 5 s (`Keep-Alive: timeout=5`): expire ours first, so that the pool
# never picks a connection at the moment the server closes it.
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=4.0)


def origin_of(url: httpx.URL) -> Origin:
    return Origin.of(url.scheme, url.host, url.port)


class AsyncGuardTransport(httpx.AsyncBaseTransport):
    """An httpx async transport that makes a pooled client safe against llama-server.

    Wraps ``transport`` (default: a new `httpx.AsyncHTTPTransport` whose keep-alive expiry is below
    llama-server's 5 s) and closes it when closed. Requests to llama-server origins get the guard's mechanisms
    (see `GuardPolicy`); all other requests pass through unchanged. Per-request options go in
    ``request.extensions["llama_guard"]`` (a dict of `GuardPolicy` fields); the guard's account comes back in
    ``response.extensions["llama_guard"]`` (a `GuardResult`). Counters are in ``stats``.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None, *, policy: GuardPolicy | None = None) -> None:
        if policy is not None and not isinstance(policy, GuardPolicy):
            raise TypeError(f"policy must be a llama_guard.GuardPolicy or None; got {type(policy).__name__}")
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise TypeError(
                "transport must be an httpx.AsyncBaseTransport (for a sync client use GuardTransport); "
                f"got {type(transport).__name__}"
            )
        self._transport = transport if transport is not None else httpx.AsyncHTTPTransport(limits=DEFAULT_LIMITS)
        self._policy = policy if policy is not None else GuardPolicy()
        self._origins = OriginRegistry(self._policy.origins)
        self.stats = GuardStats()

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
        await self._transport.__aenter__()
        return self

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = origin_of(request.url)
        if not self._origins.is_llama(origin):
            return await self._pass_through(request, origin)
        run = RequestRun(request, self._policy.merged(request.extensions.get(EXTENSION)), self.stats)
        retrying = tenacity.AsyncRetrying(sleep=anyio.sleep, **run.retrying_kwargs())
        try:
            async for attempt in retrying:
                with attempt:
                    response = await self._attempt(run)
        except tenacity.RetryError as exc:  # attempts ran out on a 503/429: the caller gets that response
            response = exc.last_attempt.result()
        except httpx.TransportError as exc:
            raise run.final_error(exc) from exc
        return self._deliver(response, run)

    async def _attempt(self, run: RequestRun) -> httpx.Response:
        tracker = ProgressTracker()
        user_trace = run.user_trace

        async def trace(event: str, info: dict[str, Any]) -> None:
            tracker.observe(event)
            if user_trace is not None:
                await user_trace(event, info)

        attempt = run.attempt_request(trace)
        try:
            response = await self._transport.handle_async_request(attempt)
        except Exception as exc:
            raise run.attempt_failed(exc, tracker) from exc.__cause__
        run.headers_arrived(response, attempt)
        if run.retrying_status:
            # A short error body; read it so the connection goes back to the pool, and so the caller still gets
            # it whole if this turns out to be the last attempt.
            try:
                await response.aread()
            finally:
                await response.aclose()
            assert len(response.content) <= MAX_RETRIED_ERROR_BODY
        return response

    def _deliver(self, response: httpx.Response, run: RequestRun) -> httpx.Response:
        closing = run.close_connection
        if not closing and run.policy.stream_mode != "off" and is_streaming_response(response.headers):
            closing = self._drop_after_stream(response)
        elif closing:
            self.stats.add(stream_connections_closed=1)
        response.extensions[EXTENSION] = run.result(connection_closed=closing)
        return response

    async def _pass_through(self, request: httpx.Request, origin: Origin) -> httpx.Response:
        self.stats.add(passthrough=1)
        response = await self._transport.handle_async_request(request)
        if (
            self._origins.learns
            and self._origins.learn(origin, response.headers)
            and self._policy.stream_mode != "off"
            and is_streaming_response(response.headers)
        ):
            # The first response of an origin in "auto" mode: it just said it is llama-server, so its connection
            # dies after this stream too.
            self._drop_after_stream(response)
        return response

    def _drop_after_stream(self, response: httpx.Response) -> bool:
        network_stream = response.extensions.get("network_stream")
        if network_stream is None or not isinstance(response.stream, httpx.AsyncByteStream):
            return False
        response.stream = _AsyncDropAfterStream(response.stream, network_stream, self.stats)
        return True


class _AsyncDropAfterStream(httpx.AsyncByteStream):
    """A llama-server stream whose connection is shut down when the response closes, before httpcore would put
    it back in the pool: llama-server closes it right after the final chunk, whatever its headers said."""

    def __init__(self, stream: httpx.AsyncByteStream, network_stream: Any, stats: GuardStats) -> None:
        self._stream = stream
        self._network_stream = network_stream
        self._stats = stats

    async def __aiter__(self) -> Any:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            if shutdown_connection(self._network_stream):
                self._stats.add(stream_connections_closed=1)
                self._network_stream = None
        finally:
            await self._stream.aclose()
