"""`GuardMiddleware`: the guard as an aiohttp client middleware (aiohttp >= 3.12).

A middleware may call aiohttp's handler (connect, write the request, read the response headers) more than once:
each call is one attempt. The middleware decides with the sans-I/O core, as the httpx transports do: what to retry
(by how far the attempt got, which the connector hooks report), the retry schedule (tenacity), ``Connection:
close`` on llama streams and the drop of a stream's connection after its final chunk, the first-byte deadline, the
per-request result and the counters.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

import aiohttp

from .._core.connection_strategy import Strategies
from .._core.decisions import first_attempt_goes_as_is, is_streaming_response
from .._core.llama_server import RETRIED_STATUSES
from .._core.origin_stats import CountsPerOrigin
from .._core.origins import Origin, OriginRegistry
from .._core.policy import GuardPolicy
from .._core.request_options import current_options, request_options
from .._core.result import GuardResult, new_result
from .._core.retry_schedule import RetrySchedule
from .._core.stats import GuardStats
from .attempts import CURRENT_ATTEMPT, AiohttpRequest, FirstAttempt, request_body
from .internals import drop_after_response, fail_body_on_connection_loss

__all__ = ["GuardMiddleware", "guard_result", "request_options"]

# The stack's name in the counts per origin (stats.by_origin(), llama_guard.metrics).
STACK = "aiohttp"

ClientHandler = Any  # aiohttp.ClientHandlerType: ClientRequest -> Awaitable[ClientResponse]

# The guard's account of each response it handled; weak, so that it lives as long as the response.
_RESULTS: weakref.WeakKeyDictionary[aiohttp.ClientResponse, GuardResult] = weakref.WeakKeyDictionary()


def guard_result(response: aiohttp.ClientResponse) -> GuardResult | None:
    """What the guard did for the request of ``response`` (a `GuardResult`); None for a request it passed by."""
    return _RESULTS.get(response)


class GuardMiddleware(CountsPerOrigin):
    """An aiohttp client middleware that makes a session safe against llama-server (see `GuardPolicy`).

    Requests to llama-server origins get the guard's retries, stream handling and first-byte deadline; every other
    request passes through unchanged. New connections are probed by the session's connector when it is a
    `GuardConnector` (or hooked by `guard_session`). Counters are in ``stats``; each response's account in
    `guard_result(response)`.
    """

    STACK = STACK  # the stack's name in the counts per origin

    def __init__(
        self,
        *,
        policy: GuardPolicy | None = None,
        stats: GuardStats | None = None,
        origins: OriginRegistry | None = None,
    ) -> None:
        """``stats``: a `GuardStats` to count into (shared with other guards), else a new one. ``origins``: a
        registry of llama-server origins shared with other guards (what `install()` passes); else the policy's."""
        if policy is not None and not isinstance(policy, GuardPolicy):
            raise TypeError(f"policy must be a llama_guard.GuardPolicy or None; got {type(policy).__name__}")
        if stats is not None and not isinstance(stats, GuardStats):
            raise TypeError(f"stats must be a llama_guard.GuardStats or None; got {type(stats).__name__}")
        if origins is not None and not isinstance(origins, OriginRegistry):
            raise TypeError(f"origins must be an OriginRegistry or None; got {type(origins).__name__}")
        self.policy = policy if policy is not None else GuardPolicy()
        self.stats = stats if stats is not None else GuardStats()
        self.origins = origins if origins is not None else OriginRegistry(self.policy.origins)
        self._strategies = Strategies(self.policy.connection, self.stats)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.policy!r}>"

    async def __call__(self, request: aiohttp.ClientRequest, handler: ClientHandler) -> aiohttp.ClientResponse:
        origin = None
        if not self.origins.every_origin:
            origin = Origin.of(request.url.scheme, request.url.raw_host or "", request.url.port)
            if not self.origins.is_llama(origin):
                return await self._pass_through(request, handler, origin)
        started = time.monotonic()
        overrides = current_options()
        policy = self.policy if overrides is None else self.policy.merged(overrides)
        body, stream = await request_body(request)
        url = request.url
        scheme, host, port = url.scheme, url.raw_host or "", url.port
        stats = self._accounts.of(scheme, host, port, origin)
        connection = self._strategies.choice(scheme, host, port, origin, policy.connection)
        if first_attempt_goes_as_is(
            body,
            has_overrides=overrides is not None,
            adds_deadline=policy.first_byte_timeout is not None,
            closes_connection=connection.strategy == "close" or (stream and policy.stream_mode == "close"),
        ):
            return await self._first_attempt_as_is(
                FirstAttempt(request, origin, policy, stats, body, stream, started, connection), handler
            )
        run = AiohttpRequest(
            request, origin, policy, stats, body=body, stream=stream, started=started, connection=connection
        )
        if run.close_connection:
            request.headers["Connection"] = "close"
        return await self._guarded(run, handler)

    async def _first_attempt_as_is(self, first: FirstAttempt, handler: ClientHandler) -> aiohttp.ClientResponse:
        """The usual request: its first attempt goes out as it is, with no `AiohttpRequest` unless something needs
        one (a new connection to probe, a failure, a 503/429): most are answered here, on a pooled connection."""
        token = CURRENT_ATTEMPT.set(first)
        response: aiohttp.ClientResponse | None = None
        try:
            response = await handler(first.request)
        except Exception as exc:
            failure = exc
        except BaseException:  # cancelled: counted, as any request
            first.stats.record_request(1, None, False)
            raise
        finally:
            CURRENT_ATTEMPT.reset(token)
        if response is None:
            run = first.guarded_run()
            run.attempt_failed(failure)
            return await self._guarded(run, handler, failure)
        if response.status in RETRIED_STATUSES:
            return await self._guarded(first.guarded_run(), handler, response)
        policy = first.policy
        closing = policy.stream_mode != "off" and is_streaming_response(response.headers)
        if closing:
            closing = self._drop_after_stream(response, first.stats)
            if closing:
                fail_body_on_connection_loss(response)
        first_byte = time.monotonic() - first.started
        connection = first.connection
        if not connection.final:
            url = first.request.url
            self._strategies.answered(url.scheme, url.raw_host or "", url.port, first_byte)
        _RESULTS[response] = new_result((1, 0, first_byte, first.stream, closing, (), connection.strategy))
        first.stats.record_request(1, first_byte, False)
        return response

    async def _guarded(
        self, run: AiohttpRequest, handler: ClientHandler, first: aiohttp.ClientResponse | Exception | None = None
    ) -> aiohttp.ClientResponse:
        """A request with an `AiohttpRequest`: its attempts, retries, result and counters. ``first``: the outcome of
        its first attempt when that was sent already (a failure judged already), else None."""
        try:
            if first is None:
                outcome = await self._attempt(run, handler)
            elif isinstance(first, Exception):
                outcome = first
            else:
                outcome = await self._answered(run, first)
            # Attempts after the first, paced and bounded by the retry schedule; most requests never need them.
            if run.may_retry:
                schedule = RetrySchedule(run)
                while (delay := schedule.next_delay()) is not None:
                    await asyncio.sleep(delay)
                    outcome = await self._attempt(run, handler)
            if isinstance(outcome, Exception):
                if run.verdict is not None:  # judged: the guard gives up, and says why
                    raise run.final_error(outcome) from outcome
                raise outcome
            response = outcome
            closing = run.close_connection
            if not closing and run.policy.stream_mode != "off" and is_streaming_response(response.headers):
                closing = self._drop_after_stream(response, run.stats)
            if closing:
                fail_body_on_connection_loss(response)
            _RESULTS[response] = run.result(closing)
            return response
        finally:
            run.stats.record_request(run.attempts, run.first_byte, run.closed_by_header)

    async def _attempt(self, run: AiohttpRequest, handler: ClientHandler) -> aiohttp.ClientResponse | Exception:
        """One call of aiohttp's handler, under the first-byte deadline, judged: its response, or the error to
        raise from it (retried or not by the schedule)."""
        scope = run.begin_attempt()
        token = CURRENT_ATTEMPT.set(run)
        response: aiohttp.ClientResponse | None = None
        try:
            if scope is None:
                response = await handler(run.aiohttp_request)
            else:
                with scope:
                    response = await handler(run.aiohttp_request)
        except Exception as exc:
            error = run.attempt_failed(exc)
            assert isinstance(error, Exception)
            return error
        finally:
            CURRENT_ATTEMPT.reset(token)
            run.end_attempt()
        if response is None:  # the deadline cancelled the attempt; aiohttp closed its connection
            error = run.attempt_failed(None)
            assert isinstance(error, Exception)
            return error
        return await self._answered(run, response)

    async def _answered(
        self, run: AiohttpRequest, response: aiohttp.ClientResponse
    ) -> aiohttp.ClientResponse | Exception:
        """Judge a response's status; a 503/429 to retry is read whole first."""
        if run.judge_response(response.status, response.headers):
            # A short error body, read so that the connection goes back to the pool, and so that the caller still
            # gets it whole if this was the last attempt.
            try:
                await response.read()  # at the end of the body aiohttp puts the connection back in the pool
            except Exception as exc:  # judged as the 503/429 it was: retried by the schedule
                response.close()
                return exc
            except BaseException:
                response.close()
                raise
        return response

    async def _pass_through(
        self, request: aiohttp.ClientRequest, handler: ClientHandler, origin: Origin
    ) -> aiohttp.ClientResponse:
        self.stats.add(passthrough=1)
        response: aiohttp.ClientResponse = await handler(request)
        if (
            self.origins.learns
            and self.origins.learn(origin, response.headers)
            and self.policy.stream_mode != "off"
            and is_streaming_response(response.headers)
        ):
            # The first response of an origin in "auto" mode: it just said it is llama-server.
            self._drop_after_stream(response, self.stats.of_origin(STACK, origin))
        return response

    def _drop_after_stream(self, response: aiohttp.ClientResponse, stats: GuardStats) -> bool:
        """llama-server closes a stream's connection right after the final chunk, whatever its headers said: have
        aiohttp close it instead of pooling it."""
        if not drop_after_response(response):
            return False
        stats.add(stream_connections_closed=1, stream_connections_dropped=1)
        return True
