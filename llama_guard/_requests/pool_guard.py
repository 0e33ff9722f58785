"""`PoolGuard`: the guard as a driver of urllib3's ``HTTPConnectionPool.urlopen``, under requests and urllib3 alike.

requests sends every request through urllib3 (``HTTPAdapter.send`` calls a pool's ``urlopen``), so one driver serves
both: `GuardAdapter` hooks the pools of its own pool managers, `install()` the pools of every requests session and
urllib3 ``PoolManager`` at their first request to a llama-server origin. Each call of ``urlopen`` for a llama-server
origin becomes a guarded request: its attempts (each one ``urlopen`` of the pool's own method, sent once by urllib3),
the connection strategy's ``Connection: close``, the probe of new connections (``connections.py``), the retries
of the shared core (the request's machine, run by the shared drive loop over `Urllib3Attempts`), the drop of a
stream's connection, the per-response result and the counters. Every decision is the core's; this file and its
neighbours do urllib3's I/O.

How the guard's retries and urllib3's own ``Retry`` combine: for a llama-server origin the guard is the one retry
loop. Each attempt goes to urllib3 with the caller's ``Retry`` less its retries (``total=None``, and no connect,
read, status or other retry: a redirect is still followed as the caller allowed), so urllib3 sends each attempt
once, and a request goes out at most ``max_attempts`` times (the attempts that found the server loading aside) --
never the product of the two budgets. A one-shot body (a generator, a file) is never sent twice, by either.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any

from urllib3.response import BaseHTTPResponse
from urllib3.util.retry import Retry

from .._core.attempt_context import CURRENT_PLAN
from .._core.guard import Guard
from .._core.llama_server import RETRIED_STATUSES
from .._core.origins import Origin
from .._core.request_machine import BEGIN
from .._core.request_options import current_options
from .._core.result import GuardResult
from .._drive.sync_drive import drive_request
from .attempts import (
    RESULT_ATTRIBUTE,
    CallView,
    Urllib3Attempts,
    drop_stream,
    is_streaming,
    respond,
    target_url,
    with_close,
)
from .connections import guarded_connection_class, original_connection_class

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
# Matches no call's retries (`PoolGuard.single_send` before its first Retry).
_NO_RETRY = object()
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

    __slots__ = ("connection_class", "guard", "origin", "own_class")

    def __init__(self, guard: PoolGuard, pool: Any) -> None:
        self.guard = guard
        self.origin = Origin.of(pool.scheme, pool.host, pool.port)
        # A connection class of the pool's own (an instance attribute other than its class's), to restore. Not read
        # through ``pool.__dict__``, which would turn the pool's inline attributes into a dict (urllib3 reads about
        # twenty of them per request).
        self.connection_class = pool.ConnectionCls
        self.own_class = self.connection_class is not type(pool).ConnectionCls


class PoolGuard(Guard):
    """A `Guard` (settings, counters, connection strategies, given-up probes) of the urllib3 pools it hooks.

    ``stack``: the name of the stack in the counts per origin (``"requests"``, ``"urllib3"``); ``explicit``: its
    pools are an explicit guard's (`GuardAdapter`), which `install()` leaves alone.
    """

    __slots__ = ("__weakref__", "_last_retries", "_lock", "_pools", "explicit")

    def __init__(self, *, explicit: bool, **guard: Any) -> None:
        """``guard``: `Guard`'s arguments."""
        super().__init__(**guard)
        self.explicit = explicit
        # (the caller's Retry, redirect, what the attempts get): one tuple, swapped whole, for threads sharing the guard
        self._last_retries: tuple[Any, Any, Any] = (_NO_RETRY, None, None)
        self._pools: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    # -- the pools ---------------------------------------------------------------------------------------------

    def hook(self, pool: Any) -> None:
        """Put the guard on ``pool`` (once): its connections' class (``connections.py``: the probe of a new one, the
        expiry of one idle for 4 s) and, for an explicit guard, its ``urlopen`` (`install()` wraps the class's
        instead). An explicit guard takes a pool over from `install()`'s, never the other way round."""
        hook = getattr(pool, _HOOK_ATTRIBUTE, None)
        if isinstance(hook, _PoolHook) and hook.guard is self:
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
            if self.explicit:
                pool.urlopen = functools.partial(self.urlopen, pool, functools.partial(type(pool).urlopen, pool))
            setattr(pool, _HOOK_ATTRIBUTE, hook)
            self._pools.add(pool)

    def unhook(self, pool: Any) -> None:
        """Put ``pool`` back as it was before `hook`; requests under way finish as they are."""
        hook = getattr(pool, _HOOK_ATTRIBUTE, None)
        if not isinstance(hook, _PoolHook) or hook.guard is not self:
            return
        names = (_HOOK_ATTRIBUTE, "urlopen") if hook.own_class else (_HOOK_ATTRIBUTE, "urlopen", "ConnectionCls")
        for name in names:
            with contextlib.suppress(AttributeError):  # a class's method, not the instance's: nothing to take off
                delattr(pool, name)
        if hook.own_class:
            pool.ConnectionCls = hook.connection_class
        _swap_idle_connections(pool, original_connection_class)
        self._pools.discard(pool)

    def unhook_all(self) -> None:
        """Take the guard off every pool it hooked (`uninstall()`)."""
        with self._lock:
            for pool in list(self._pools):
                self.unhook(pool)

    def close(self) -> None:
        super().close()

    # -- a request ------------------------------------------------------------------------------------------------

    def urlopen(self, pool: Any, original: Any, *args: Any, **kwargs: Any) -> BaseHTTPResponse:
        """``pool.urlopen(*args, **kwargs)`` under the guard; ``original``: the pool's own ``urlopen``, bound."""
        current = CURRENT_PLAN.get()
        if current is not None and isinstance(current.request, CallView):
            # urllib3's own redirect inside a guarded attempt: part of it
            return original(*args, **kwargs)  # type: ignore[no-any-return]
        hook = getattr(pool, _HOOK_ATTRIBUTE, None)
        if pool.proxy is not None:  # a forwarding proxy's pool: the server is the absolute URL's, not the pool's
            target = target_url(pool, args[1] if len(args) > 1 else kwargs.get("url", "/"))
            origin = Origin.of(target.scheme, target.host, target.port)
        else:
            origin = hook.origin if isinstance(hook, _PoolHook) else Origin.of(pool.scheme, pool.host, pool.port)
        if not self.origins.is_llama(origin):
            return self._pass_through(pool, original, origin, args, kwargs)
        if not isinstance(hook, _PoolHook) or hook.guard is not self:
            self.hook(pool)
        call = kwargs  # this call's own dict (requests passes keywords only): the guard's to change (`_guarded`)
        if args:
            call = dict(zip(_PARAMS, args, strict=False))
            call.update(kwargs)
        return self._guarded(pool, original, origin, call)

    def _guarded(self, pool: Any, original: Any, origin: Origin, call: dict[str, Any]) -> BaseHTTPResponse:
        body = call.get("body")
        if type(body) is not bytes:  # requests' json= and data= send bytes: the usual request pays one test
            body = _replayable(body)
        view = CallView(pool, call, str(call["method"]).upper())
        plan = self.plan(
            view,
            scheme=origin.scheme,
            host=origin.host,
            port=origin.port,
            origin=origin,
            overrides=current_options(),
            body=body,
        )
        # What every attempt sends: the caller's call (``call`` is the guard's own dict, made from the arguments),
        # with urllib3's own retries taken out (the guard's loop replaces them, see the module's doc), the body left
        # unread (the guard judges the headers first), and Connection: close on a copy of the headers when the plan
        # says so: the caller's stay as they are.
        preload = (call.get("preload_content", True), call.get("decode_content", True))
        call["retries"] = self.single_send(call, pool)
        call["preload_content"] = call["release_conn"] = False
        if plan.close_connection:
            call["headers"] = with_close(view.headers)
        if not plan.as_is:
            return drive_request(plan.start(), Urllib3Attempts(plan, original, preload), BEGIN)
        # The usual request: its first attempt goes out as the caller's call, with no machine unless something
        # needs one (a new connection to probe, a failure, a 503/429).
        token = CURRENT_PLAN.set(plan)
        try:
            response: BaseHTTPResponse = original(**call)
        except Exception as exc:
            attempts = Urllib3Attempts(plan, original, preload)
            return drive_request(plan.machine(), attempts, attempts.failed(exc))
        except BaseException:  # interrupted (KeyboardInterrupt, a signal's exception): counted, as any request
            plan.interrupted()
            raise
        finally:
            CURRENT_PLAN.reset(token)
        if response.status in RETRIED_STATUSES:
            attempts = Urllib3Attempts(plan, original, preload)
            return drive_request(plan.machine(), attempts, attempts.answered(response))
        dropped = plan.drops_streams and is_streaming(response) and drop_stream(response, plan.stats)
        return respond(response, plan.answered_at_once(dropped), preload)

    def single_send(self, call: dict[str, Any], pool: Any) -> Any:
        """`_single_send` of the call's retries, remembered for the last ``Retry`` object seen (requests passes its
        adapter's own on every call: building a Retry costs as much as the rest of the guard's work)."""
        retries, redirect = call.get("retries"), call.get("redirect", True)
        cached = self._last_retries
        if cached[0] is retries and cached[1] is redirect:  # a Retry only (see below); redirect: True or False
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
            and is_streaming(response)
        ):
            # The first response of an origin in "auto" mode: it just said it is llama-server.
            self.hook(pool)
            drop_stream(response, self.account(pool.scheme, pool.host, pool.port, origin))
        return response


def _replayable(body: Any) -> bytes | None:
    """A urlopen body as the bytes the guard may send again: a str encoded, a bytearray copied, no body as b"";
    None for a one-shot body (a generator, a file), never sent twice."""
    if body is None:
        return b""
    if isinstance(body, str):
        return body.encode()
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    return None


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


def _swap_idle_connections(pool: Any, make: Any) -> None:
    """Give the connections waiting in the pool the class ``make`` gives their class (guarded, or original)."""
    queue = getattr(pool, "pool", None)
    if queue is None:
        return
    with queue.mutex:
        for conn in queue.queue:
            if conn is not None:
                conn.__class__ = make(type(conn))
