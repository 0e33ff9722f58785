"""The base of the test tooling's sync httpcore network backends that wrap another backend's TCP connects:
`PreopenedBackend` (a pre-opened socket instead, while there are any) and `ConnectDelayBackend` (a round trip
around each). httpcore's ``connect_tcp`` arguments are passed through in one place; each subclass says only what
it does around the connect."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import httpcore

__all__ = ["WrappingBackend"]


class WrappingBackend(httpcore.NetworkBackend):
    """Opens each TCP connection with :meth:`_open`, around ``backend``'s connect (httpcore's own by default)."""

    def __init__(self, backend: httpcore.NetworkBackend | None = None) -> None:
        self._backend = backend or httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        # httpcore's arguments (timeout, local_address, socket_options) passed on as they came.
        return self._open(functools.partial(self._backend.connect_tcp, host, port, *args, **kwargs))

    def _open(self, connect: Callable[[], httpcore.NetworkStream]) -> httpcore.NetworkStream:
        """A new connection; ``connect()`` opens one through the wrapped backend."""
        raise NotImplementedError

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
