"""`GuardMiddleware`: the guard as an aiohttp client middleware (aiohttp >= 3.12): the aiohttp driver of the core.

A middleware may call aiohttp's handler (connect, write the request, read the response headers) more than once:
each call is one attempt. The middleware plans each request with the shared core (``_core/guard.py``) and, when the
first attempt needs more than going out as it is, runs the shared drive loop (``_drive/async_drive.py``) over the
request's machine with aiohttp's I/O (`AiohttpAttempts`). New connections are the connector's (``connector.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import aiohttp

from .._core.attempt_context import CURRENT_PLAN
from .._core.decisions import is_streaming_response
from .._core.guard import Guard, GuardAttributes, RequestPlan
from .._core.llama_server import RETRIED_STATUSES
from .._core.origins import Origin, OriginRegistry
from .._core.policy import GuardPolicy
from .._core.process_state import ProcessState
from .._core.request_machine import BEGIN
from .._core.request_options import current_options, request_options
from .._core.result import GuardResult
from .._core.stats import GuardStats
from .._drive.async_drive import drive_request
from .._runtime import PROCESS
from .adoption import adopt, guard_of
from .attempts import RESULTS, AiohttpAttempts, RequestView, drop_stream, request_body
from .internals import fail_body_on_connection_loss, session_of

__all__ = ["GuardMiddleware", "guard_result", "request_options"]

# The stack's name in the counts per origin (stats.by_origin(), llama_guard.metrics).
STACK = "aiohttp"

ClientHandler = Any  # aiohttp.ClientHandlerType: ClientRequest -> Awaitable[ClientResponse]


def guard_result(response: aiohttp.ClientResponse) -> GuardResult | None:
    """What the guard did for the request of ``response`` (a `GuardResult`); None for a request it passed by."""
    return RESULTS.get(response)


class GuardMiddleware(GuardAttributes):
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
        process: ProcessState | None = None,
    ) -> None:
        """``stats``: a `GuardStats` to count into (shared with other guards), else a new one. ``origins``: a
        registry of llama-server origins shared with other guards (what `install()` passes); else the policy's.
        ``process``: what the guards of the process share; the process's own unless given (tests)."""
        self._guard = Guard.made(STACK, policy=policy, stats=stats, origins=origins, process=process or PROCESS)
        # Why the session's connector cannot be probed (`connections_unseen`), until a request that would probe a new
        # connection says so (`_say_unprobed`); None otherwise.
        self._unprobed: str | None = None
        # The session of the last request it served, weakly: a session it has not served yet is looked at once.
        self._last_session: weakref.ref[aiohttp.ClientSession] | None = None

    def connections_unseen(self, why: str, *, unix_socket: bool, unprobed: str | None) -> None:
        """The session's new connections are out of the guard's reach (``why``, a clause: its connector is not an
        `aiohttp.TCPConnector`, or aiohttp is a version the guard was not tested with): said by the session before
        its first request. ``unix_socket``: the connector is an `aiohttp.UnixConnector`, where ``"auto"`` closes
        every connection at once, as for httpx's ``uds=``. Elsewhere ``"auto"`` cannot measure what a new
        connection costs, and closes every connection, saying why. ``unprobed``: what ``stats.probing_off`` and
        one warning say at the first request that would have probed a new connection (the keep-alive strategy);
        None when something else says it already (``stats.public_path``, for an untested aiohttp)."""
        strategies = self._guard.strategies
        strategies.unix_socket = unix_socket
        strategies.unmeasurable = why
        self._unprobed = unprobed

    async def __call__(self, request: aiohttp.ClientRequest, handler: ClientHandler) -> aiohttp.ClientResponse:
        session, last = session_of(request), self._last_session
        if last is None or last() is not session:
            self._serving(session)
        guard = self._guard
        url = request.url
        scheme, host, port = url.scheme, url.raw_host or "", url.port
        origin = None
        if not guard.origins.every_origin:
            origin = Origin.of(scheme, host, port)
            if not guard.origins.is_llama(origin):
                return await self._pass_through(request, handler, origin)
        body = await request_body(request)
        plan = guard.plan(
            RequestView(request),
            scheme=scheme,
            host=host,
            port=port,
            origin=origin,
            overrides=current_options(),
            body=body,
        )
        if self._unprobed is not None:
            self._say_unprobed(plan)
        if not plan.as_is:
            return await drive_request(plan.start(), AiohttpAttempts(plan, handler), BEGIN)

        # The usual request: its first attempt goes out as it is, with no machine unless something needs one (a new
        # connection to probe, a failure, a 503/429): most are answered here, on a pooled connection.
        if plan.close_connection:
            request.headers["Connection"] = "close"  # aiohttp's own copy of the caller's headers
        token = CURRENT_PLAN.set(plan)
        try:
            response: aiohttp.ClientResponse = await handler(request)
        except Exception as exc:
            attempts = AiohttpAttempts(plan, handler)  # only now: most requests never need one
            return await drive_request(plan.machine(), attempts, attempts.failed(exc))
        except BaseException:  # cancelled: counted, as any request
            plan.interrupted()
            raise
        finally:
            CURRENT_PLAN.reset(token)
        if response.status in RETRIED_STATUSES:
            attempts = AiohttpAttempts(plan, handler)
            return await drive_request(plan.machine(), attempts, attempts.answered(response))
        dropped = plan.drops_streams and is_streaming_response(response.headers) and drop_stream(response, plan.stats)
        result = RESULTS[response] = plan.answered_at_once(dropped)
        if result.connection_closed:
            fail_body_on_connection_loss(response)
        return response

    def _serving(self, session: aiohttp.ClientSession | None) -> None:
        """A request of ``session``, which this guard has not served before: a session with no guard yet (the
        middleware put in by hand, ``ClientSession(middlewares=[GuardMiddleware()])``) is adopted as
        `guard_session` adopts one (its connector's new connections probed; what cannot be done said), where it
        would otherwise probe nothing and say nothing."""
        if session is None:
            return
        self._last_session = weakref.ref(session)
        if guard_of(session) is None:
            adopt(session, self, own_resend_off=self.origins.every_origin)

    def _say_unprobed(self, plan: RequestPlan) -> None:
        """``plan``'s new connection would be probed (or measured), which the session's connector does not allow:
        said once, in ``stats.probing_off`` and the log, as the httpx transports say it of a transport they cannot
        probe through. Nothing is said under the close strategy (nothing to probe) or ``probe=False``."""
        if not plan.needs_connection_machine:
            return
        why, self._unprobed = self._unprobed, None
        self.stats.probing_off = why
        instead = (
            "GuardPolicy(connection='auto'), the default, closes every connection on a Unix socket instead"
            if self._guard.strategies.unix_socket
            else "an aiohttp.TCPConnector (llama_guard.aiohttp.GuardConnector) has them probed"
        )
        self.process.warnings.warning(
            f"llama_guard on an aiohttp session: {why}: new connections to {plan.origin} are not probed, so a "
            "connection that llama-server before b11737 leaves unread is not caught (retries and stream handling "
            f"still apply); {instead}"
        )

    async def _pass_through(
        self, request: aiohttp.ClientRequest, handler: ClientHandler, origin: Origin
    ) -> aiohttp.ClientResponse:
        guard = self._guard
        self.stats.add(passthrough=1)
        response: aiohttp.ClientResponse = await handler(request)
        if (
            guard.origins.learns
            and guard.origins.learn(origin, response.headers)
            and guard.policy.stream_mode != "off"
            and is_streaming_response(response.headers)
        ):
            # The first response of an origin in "auto" mode: it just said it is llama-server.
            drop_stream(response, self.stats.of_origin(STACK, origin))
        return response
