"""Which transports a guard already wraps, so that `install()` never guards the same traffic twice.

A client guarded explicitly (`GuardTransport(inner)`, `guard(client)`) keeps its inner `HTTPTransport`; with
`install()` active, that inner transport's patched method would otherwise wrap its requests in a second guard:
two probes per connection, retries of retries, stats counted twice.

Kept here, not in `ProcessState`: install()'s patches are on the classes, so process-wide whatever state a guard was
handed; a guard made with a process state of its own (tests) must still be seen (tests/test_install.py).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

__all__ = ["is_wrapped_by_a_guard", "mark_wrapped_by_a_guard"]

# Weak: a transport that is closed and dropped leaves no trace here.
_WRAPPED: weakref.WeakSet[Any] = weakref.WeakSet()


def mark_wrapped_by_a_guard(transport: object) -> None:
    # A transport class with __slots__ and no __weakref__ cannot be marked; install() then treats it as unguarded.
    with contextlib.suppress(TypeError):
        _WRAPPED.add(transport)


def is_wrapped_by_a_guard(transport: object) -> bool:
    try:
        return transport in _WRAPPED
    except TypeError:  # pragma: no cover - see above
        return False
