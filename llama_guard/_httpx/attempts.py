"""The httpx side of a guarded request: what it sends (its body, and headers with ``Connection: close``), and the
caller's error made from an attempt's.

Every decision about the request is its plan's and machine's (``_core/guard.py``, ``_core/request_machine.py``);
this module only builds httpx objects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from .._core import errors
from .._core.decisions import FailureKind
from .._core.guard import RequestPlan
from .._core.log import without_quoted_values
from .._core.request_machine import Fail, Failed
from .exceptions import FirstByteTimeout, failure_kind, guarded_error

__all__ = ["AttemptBody", "caller_error", "judged_failure"]


class AttemptBody(httpx.SyncByteStream, httpx.AsyncByteStream):
    """The body one attempt of a guarded request sends.

    ``content``: the request's bytes when they are held in memory, sent afresh by every attempt; else None, and the
    caller's own one-shot ``stream`` is passed through (once: such a request is never sent twice).

    An iterator object rather than httpx's async generator: when a write fails half way (a dead pooled
    connection), httpcore abandons the body's iterator, and an abandoned async generator makes trio's finalizer
    warn (a ResourceWarning) long after the request was retried and answered. For a one-shot body the iterator is
    httpx's generator over the caller's: the attempt closes it when it ends (`close`, `aclose`).
    """

    __slots__ = ("_content", "_iterator", "_stream")

    def __init__(self, content: bytes | None, stream: Any) -> None:
        self._content = content
        self._stream = stream
        self._iterator: Any = None  # a one-shot body's iterator, once an attempt started it

    def __iter__(self) -> Iterator[bytes]:
        if self._content is not None:
            return iter((self._content,))
        iterator = self._iterator = iter(self._stream)
        return iterator  # type: ignore[no-any-return]

    def __aiter__(self) -> AsyncIterator[bytes]:
        if self._content is not None:
            return _OneChunk(self._content)
        iterator = self._iterator = self._stream.__aiter__()
        return iterator  # type: ignore[no-any-return]

    def close(self) -> None:
        """The attempt ended: close the one-shot body's iterator it started, if httpcore left it suspended. The
        caller's stream itself is left as it is."""
        iterator, self._iterator = self._iterator, None
        close = getattr(iterator, "close", None)
        if close is not None:
            close()

    async def aclose(self) -> None:
        """`close` for an async attempt: an async generator left suspended makes trio's finalizer warn."""
        iterator, self._iterator = self._iterator, None
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


class _OneChunk:
    __slots__ = ("_content",)

    def __init__(self, content: bytes | None) -> None:
        self._content = content

    def __aiter__(self) -> _OneChunk:
        return self

    async def __anext__(self) -> bytes:
        if self._content is None:
            raise StopAsyncIteration
        content, self._content = self._content, None
        return content


def judged_failure(plan: RequestPlan, exc: Exception) -> tuple[Failed, Exception]:
    """An attempt's failure in the guard's terms, and the error to keep for it: the exception itself, or the guard's
    name for it (a first-byte expiry becomes `FirstByteTimeout`, caused by the expiry)."""
    machine = plan.machine()
    kind = failure_kind(exc, deadline_applied=machine.deadline_applied, waiting=lambda: machine.waiting_for_headers)
    if kind is FailureKind.FIRST_BYTE_TIMEOUT:
        timeout = FirstByteTimeout(
            f"no response headers from {plan.description} within first_byte_timeout="
            f"{plan.policy.first_byte_timeout:g} s; the connection was discarded",
            request=plan.request,
        )
        timeout.__cause__ = exc
        exc = timeout
    return Failed(kind, type(exc).__name__, error_text(exc)), exc


def caller_error(error: Exception, fail: Fail | None) -> Exception:
    """The caller's error once the guard stops (``fail``: its account): the same httpx class, as the guard's; an
    error that is not httpx's as it is."""
    if not isinstance(error, httpx.TransportError):
        return error
    return errors.caller_error(error, fail, text=error_text, guarded=guarded_error)


def error_text(exc: BaseException) -> str:
    """An exception's message for the guard's history and errors; what our side refused to send is not repeated."""
    text = str(exc)
    return without_quoted_values(text) if isinstance(exc, httpx.LocalProtocolError) else text
