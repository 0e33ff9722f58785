"""What the guard did for one request, returned in ``response.extensions["llama_guard"]``."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["EXTENSION", "GuardResult"]

# The key of the guard's per-request options (request.extensions) and results (response.extensions).
EXTENSION = "llama_guard"


class GuardResult(NamedTuple):
    """The guard's account of one request: an immutable value (a named tuple: built for every request, it is
    several times cheaper than a frozen dataclass). Has ``_asdict()`` and ``_replace()``.

    Attributes:
        attempts: attempts made, the first included (1 when nothing went wrong).
        reconnects: attempts abandoned on a stalled connection (first-byte deadline or probe) and sent again on a
            fresh one.
        first_byte_seconds: seconds from the guard receiving the request to the response headers of the attempt
            that succeeded, retries and backoff included: what the caller waited.
        stream: the request asked for ``"stream": true``.
        connection_closed: the guard asked for this response's connection to be closed (``Connection: close``)
            or will drop it after the final chunk, so it is never reused.
        history: one line per failed attempt: what failed and what the guard decided.
        connection: the connection strategy the request went out with (`GuardPolicy.connection`): ``"close"``
            (``Connection: close``: a new connection per request) or ``"reuse"`` (keep-alive, new connections
            probed); ``stats.connection_strategies`` says why.
    """

    attempts: int
    reconnects: int
    first_byte_seconds: float
    stream: bool
    connection_closed: bool
    history: tuple[str, ...] = ()
    connection: str = "reuse"
