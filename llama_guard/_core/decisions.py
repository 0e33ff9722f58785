"""The guard's decisions, free of I/O: is this a llama stream, how far an attempt got, may it be retried.

Transports feed facts in (method, path, body bytes, trace event names, the kind of failure, status and headers)
and act on the answers. Everything here is tested as tables of cases in ``tests/test_decisions.py``.

Retry rules, by how far the attempt got (urllib3's and Go net/http's reasoning):

- Nothing written yet (no connection, connect failed, or the probe refused the connection): always safe.
- Request written (partly or whole), no response headers: the server may have received it. Retried for
  idempotent methods, for llama-server's inference endpoints (they have no side effects: a repeat costs compute,
  never state), and for other requests only with ``retry_non_idempotent``. A body that cannot be replayed (a
  generator) is never sent twice.
- Response headers arrived: never, except 503 (llama-server loading a model) and 429 with ``Retry-After``, for
  requests that may be retried.
- The caller's own deadlines (pool timeout, httpx read timeout) are the caller's decision to give up: not retried.
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Final, NamedTuple, TypeGuard

from .stream_detection import wants_stream

__all__ = [
    "FailureKind",
    "Progress",
    "RequestKind",
    "Verdict",
    "classify_request",
    "first_attempt_goes_as_is",
    "PROBE_LOADING",
    "is_inference_path",
    "is_streaming_response",
    "parse_retry_after",
    "verdict_for_closed_probe",
    "verdict_for_failure",
    "verdict_for_status",
    "wants_stream",
]

IDEMPOTENT_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})

# llama-server's inference endpoints (tools/server/server.cpp): computing them changes no server state, so a
# repeat is only wasted compute. Matched as path suffixes so a reverse-proxy prefix ("/llm/v1/...") still counts.
_INFERENCE_PATHS: Final = (
    "/completion",
    "/completions",
    "/v1/completions",
    "/chat/completions",
    "/v1/chat/completions",
    "/infill",
    "/embedding",
    "/embeddings",
    "/v1/embeddings",
    "/rerank",
    "/reranking",
    "/v1/rerank",
    "/v1/reranking",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
)
_INFERENCE_RE: Final = re.compile("(?:" + "|".join(re.escape(p) for p in _INFERENCE_PATHS) + ")/?$")


_INFERENCE_CACHE: dict[str, bool] = {}
_INFERENCE_CACHE_SIZE: Final = 1024  # an application uses a handful of paths; bounded for one that uses many


def is_inference_path(path: str) -> bool:
    """True for llama-server endpoints that only compute (completions, embeddings, tokenize, ...)."""
    # Asked for every request, and applications use few paths: remember the answers (a dict lookup instead of a
    # lower-casing and a regular expression search).
    known = _INFERENCE_CACHE.get(path)
    if known is None:
        known = _INFERENCE_RE.search(path.lower()) is not None
        if len(_INFERENCE_CACHE) < _INFERENCE_CACHE_SIZE:
            _INFERENCE_CACHE[path] = known
    return known


def is_streaming_response(headers: Mapping[str, str]) -> bool:
    """A response llama-server writes through a chunked content provider: it closes the connection after it.

    ``headers``: case-insensitive (httpx's). The transports use a faster equivalent on tested httpx versions
    (``_httpx/internals.py``)."""
    return "chunked" in headers.get("transfer-encoding", "").lower() or headers.get(
        "content-type", ""
    ).lower().startswith("text/event-stream")


class RequestKind(NamedTuple):
    """What the guard needs to know about one request, decided once before its first attempt (a named tuple:
    built for every request, and cheaper than a frozen dataclass)."""

    method: str
    idempotent: bool
    inference: bool
    stream: bool
    replayable: bool

    def may_resend(self, *, retry_non_idempotent: bool) -> bool:
        """Whether the request may be sent again after it may have reached the server."""
        return self.replayable and (self.idempotent or self.inference or retry_non_idempotent)


def classify_request(method: str, path: str, body: bytes | None) -> RequestKind:
    """Classify a request; ``body`` is None when it is a one-shot stream that cannot be read in advance."""
    method = method.upper()
    return RequestKind(
        method=method,
        idempotent=method in IDEMPOTENT_METHODS,
        inference=is_inference_path(path),
        stream=body is not None and method == "POST" and wants_stream(body),
        replayable=body is not None,
    )


def first_attempt_goes_as_is(
    body: bytes | None, *, has_overrides: bool, adds_deadline: bool, hooks_follow: bool = True
) -> TypeGuard[bytes]:
    """Whether a request's first attempt may go out as the caller built it, with no per-request state.

    That needs: no per-request options, a ``body`` that can be sent again (not None: a one-shot stream would need a
    copy before a retry), no first-byte deadline to arm, and a stack that sees the attempt's connection anyway
    (``hooks_follow``: it can still probe a new connection and catch a failure). A ``Connection: close`` it needs goes
    on a copy of the caller's headers. Every stack asks this one question (through `Guard.plan`), so that they agree
    on which requests pay for the guard's bookkeeping."""
    return hooks_follow and body is not None and not (has_overrides or adds_deadline)


class Progress(enum.IntEnum):
    """How far an attempt got, from httpcore's trace events."""

    NOTHING = 0  # waiting for the pool or connecting: nothing of the request exists on any wire
    CONNECTED = 1  # a new connection is up (and, with the probe, proven read by the server); nothing written
    WRITING = 2  # request headers or body being written: the server may have part or all of it
    WRITTEN = 3  # the whole request is written; waiting for response headers
    HEADERS = 4  # response headers arrived


class FailureKind(enum.Enum):
    """An attempt's failure, in the guard's terms (the transport maps exception classes to these)."""

    CONNECT = "connect"  # could not connect: nothing was sent
    PROBE = "probe"  # the new connection did not answer the probe: nothing real was sent
    NETWORK = "network"  # read/write error, peer closed or reset, protocol error from the peer
    FIRST_BYTE_TIMEOUT = "first-byte timeout"  # the guard's deadline for response headers expired
    CALLER_TIMEOUT = "caller timeout"  # the caller's own pool or read timeout: the caller chose to stop waiting
    LOCAL = "local"  # our side is wrong (bad URL, unsupported protocol, local protocol error): repeating fails too


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether to retry, why (for logs, stats and error messages), and whether to back off first."""

    retry: bool
    reason: str
    backoff: bool = True
    delay: float | None = None  # an explicit delay (Retry-After) that replaces the backoff
    # A stalled connection (probe or first-byte deadline): the reconnects of connections that stalled together must
    # be spread over a wide random window, or they reach the server as a new burst and stall again.
    stall: bool = False
    status: bool = False  # a retried 503/429 response (rather than a failed connection)
    # No headers by the first-byte deadline on a connection the server reads: busy or slow, not a stall.
    slow_answer: bool = False
    # llama-server unavailable (503: loading a model): waited for up to max_loading_wait, spending no attempt.
    loading: bool = False


def verdict_for_failure(
    kind: FailureKind,
    *,
    progress: Progress,
    reused_connection: bool,
    body_started: bool,
    request: RequestKind,
    retry_non_idempotent: bool,
    connection_read: bool = False,
) -> Verdict:
    """May an attempt that failed with ``kind`` after getting as far as ``progress`` be tried again?
    ``connection_read``: the server had read from the attempt's connection (a reused one, or its probe answered)."""
    if kind is FailureKind.LOCAL:
        return Verdict(False, "the request cannot be sent as it is; repeating it would fail the same way")
    if kind is FailureKind.CALLER_TIMEOUT:
        return Verdict(False, "the caller's own timeout expired")
    if progress >= Progress.HEADERS:
        return Verdict(False, "the response had already begun")
    if kind in (FailureKind.CONNECT, FailureKind.PROBE) or progress <= Progress.CONNECTED:
        if body_started and not request.replayable:
            return Verdict(False, "the request body was a one-shot stream and has been consumed")
        if kind is FailureKind.PROBE:
            return Verdict(True, "the new connection failed its probe (nothing real was sent)", stall=True)
        return Verdict(True, "nothing was sent yet")
    if not request.replayable:
        return Verdict(False, "the request body was a one-shot stream and cannot be sent twice")
    if not request.may_resend(retry_non_idempotent=retry_non_idempotent):
        return Verdict(
            False,
            f"{request.method} to a non-inference endpoint may have reached the server "
            "(set retry_non_idempotent=True to retry it anyway)",
        )
    if kind is FailureKind.FIRST_BYTE_TIMEOUT:
        if connection_read:  # a thread serves this connection: the server is busy or slow, the pool did not stall
            return Verdict(
                True,
                "no response headers within first_byte_timeout (the server reads this connection: busy or slow)",
                slow_answer=True,
            )
        # Nothing proved the server reads it (no probe, under the close strategy): llama-server's stall, or a slow
        # answer; treated as the stall (reconnects spread), worded as either.
        return Verdict(
            True,
            "no response headers within first_byte_timeout (a stalled connection, or a slow answer: nothing proved "
            "the server reads this connection)",
            stall=True,
        )
    if reused_connection:
        # The keep-alive race: the pool handed out a connection the server had already closed.
        return Verdict(True, "the pooled connection was dead", backoff=False)
    return Verdict(True, "the connection failed before the response")


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date); None if absent or malformed."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # isdigit() alone also takes "²", which float() refuses
        return float(value)
    try:
        when = parsedate_to_datetime(value)
        if when.tzinfo is None:
            return None
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    except (TypeError, ValueError, IndexError, OverflowError):  # email.utils overflows on absurd zone offsets
        return None


def verdict_for_status(
    status: int,
    headers: Mapping[str, str],
    *,
    request: RequestKind,
    retry_non_idempotent: bool,
    max_retry_after: float,
) -> Verdict | None:
    """For a response with headers: None to deliver it, or a `Verdict` for 503 and 429."""
    if status not in (429, 503):
        return None
    retry_after = parse_retry_after(headers.get("retry-after"))
    if status == 429 and retry_after is None:
        return Verdict(False, "429 without Retry-After: the server did not say when to come back")
    if not request.may_resend(retry_non_idempotent=retry_non_idempotent):
        return Verdict(False, f"{status} for a request that may not be sent twice")
    if retry_after is not None and retry_after > max_retry_after:
        return Verdict(False, f"Retry-After {retry_after:g} s is longer than max_retry_after {max_retry_after:g} s")
    if status == 503:
        return Verdict(
            True, "server loading a model or unavailable (503)", delay=retry_after, status=True, loading=True
        )
    return Verdict(True, "rate limited (429)", delay=retry_after, status=True)


#: The verdict on a new connection whose probe llama-server answered 503 (loading a model) and then closed.
PROBE_LOADING = Verdict(
    True, "the server is loading a model (GET /health answered 503; nothing real was sent)", status=True, loading=True
)


def verdict_for_closed_probe(status: int) -> Verdict:
    """A new connection's probe was answered with ``status``, and the server closed the connection: the server reads
    new connections (not a stall), and the request, not sent yet, goes again."""
    if status == 503:
        return PROBE_LOADING
    return Verdict(True, f"GET /health answered {status} and the server closed the connection (nothing real was sent)")
