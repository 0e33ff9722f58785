"""Validated, immutable settings of one emulator instance.

Every knob is checked up front so a typo in a test fails with a ``ValueError``
that names the field and its accepted range, instead of turning into a hung
socket twenty seconds later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MAX_TOKENS", "STREAM_CLOSE_MODES", "EmulatorConfig"]

#: Upper bound on tokens generated for one request (``max_tokens``/``n_predict``
#: are clamped to it) so a careless request cannot keep a slot busy for ever.
MAX_TOKENS = 4096

#: How the connection of a streamed response is closed (``stream_close``): ``"after_delay"`` closes it
#: ``stream_close_delay`` seconds after the final chunk, as the real server does (at once) -- timing-faithful, so a
#: client's loss is a race; ``"on_reuse"`` keeps it open until the next request's bytes arrive and then closes it
#: unanswered -- every reuse after a stream is lost, whatever the load.
STREAM_CLOSE_MODES = ("after_delay", "on_reuse")


def _check_int(name: str, value: object, low: int, high: int) -> int:
    # bool is an int subclass; ``http_threads=True`` is a bug, not "1".
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _check_float(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds in [{low}, {high}], got {value!r}")
    number = float(value)
    bracket = "(" if low_open else "["
    too_low = number <= low if low_open else number < low
    if math.isnan(number) or too_low or number > high:
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")
    return number


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _check_str(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or any(c in value for c in "\r\n\x00"):
        raise ValueError(f"{name} must be a non-empty single-line string, got {value!r}")
    return value


@dataclass(frozen=True)
class EmulatorConfig:
    """Settings shared (read-only) by the acceptor, the pool and every handler.

    The defaults reproduce llama-server b11434 as measured: buggy pool, the
    streaming keep-alive lie, 5 s / 100 requests keep-alive.  See
    :class:`~llama_guard.testing.LlamaServerEmulator` for what each field means.
    """

    host: str = "127.0.0.1"
    port: int = 0
    http_threads: int = 4
    max_http_threads: int = 64
    pool_bug: bool = True
    wakeup_latency: float = 0.005
    close_after_stream: bool = True
    stream_close: str = "after_delay"
    stream_close_delay: float = 0.0
    stall_burst: int | None = None
    stall_oldest_first: bool = False
    parallel: int = 4
    token_interval: float = 0.0
    n_tokens: int = 8
    keepalive_timeout: float = 5.0
    keepalive_max: int = 100
    loading: bool = False
    read_timeout: float = 600.0
    model: str = "emulated-model.gguf"
    build: str = "b11434-emulated"

    def __post_init__(self) -> None:
        _check_str("host", self.host)
        _check_int("port", self.port, 0, 65535)
        _check_int("http_threads", self.http_threads, 1, 1024)
        _check_int("max_http_threads", self.max_http_threads, self.http_threads, 4096)
        _check_bool("pool_bug", self.pool_bug)
        _check_float("wakeup_latency", self.wakeup_latency, 0.0, 1.0)
        _check_bool("close_after_stream", self.close_after_stream)
        if self.stream_close not in STREAM_CLOSE_MODES:
            raise ValueError(
                f"stream_close must be one of {', '.join(map(repr, STREAM_CLOSE_MODES))}, got {self.stream_close!r}"
            )
        _check_float("stream_close_delay", self.stream_close_delay, 0.0, 10.0)
        if self.stream_close == "on_reuse":
            if not self.close_after_stream:
                raise ValueError("stream_close='on_reuse' needs close_after_stream=True (it is how streams are closed)")
            if self.stream_close_delay:
                raise ValueError(
                    f"stream_close_delay applies to stream_close='after_delay' only; got {self.stream_close_delay} "
                    "with stream_close='on_reuse'"
                )
        if self.stall_burst is not None:
            low = self.http_threads + 1
            value = self.stall_burst
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 4096:
                raise ValueError(
                    f"stall_burst must be None or an int in [{low}, 4096] (more than http_threads={self.http_threads}: "
                    f"connections {low}..stall_burst of a burst stall), got {value!r}"
                )
            if not self.pool_bug:
                raise ValueError("stall_burst is the deterministic form of the pool bug: it needs pool_bug=True")
        _check_bool("stall_oldest_first", self.stall_oldest_first)
        if self.stall_oldest_first and self.stall_burst is None:
            raise ValueError(
                "stall_oldest_first changes how stall_burst's stalled connections are served: it needs stall_burst"
            )
        _check_int("parallel", self.parallel, 1, 256)
        _check_float("token_interval", self.token_interval, 0.0, 10.0)
        _check_int("n_tokens", self.n_tokens, 0, MAX_TOKENS)
        _check_float("keepalive_timeout", self.keepalive_timeout, 0.0, 3600.0, low_open=True)
        _check_int("keepalive_max", self.keepalive_max, 1, 1_000_000)
        _check_bool("loading", self.loading)
        _check_float("read_timeout", self.read_timeout, 0.0, 86400.0, low_open=True)
        _check_str("model", self.model)
        _check_str("build", self.build)

    @property
    def keep_alive_header(self) -> str:
        """The ``Keep-Alive`` value cpp-httplib writes: ``timeout=5, max=100``.

        cpp-httplib prints whole seconds; fractional timeouts (handy to keep
        tests fast) are printed as they are, e.g. ``timeout=0.5``.
        """
        timeout = self.keepalive_timeout
        shown = str(int(timeout)) if timeout == int(timeout) else repr(timeout)
        return f"timeout={shown}, max={self.keepalive_max}"
