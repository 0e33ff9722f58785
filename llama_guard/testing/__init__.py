"""Test helpers: a faithful, controllable llama-server emulator.

:class:`LlamaServerEmulator` reproduces, on a real loopback socket, the HTTP
behaviour of llama.cpp's ``llama-server`` (build b11434, cpp-httplib) that
``llama_guard`` protects clients against:

1. the streaming keep-alive lie -- ``Keep-Alive: timeout=5, max=100`` announced,
   connection closed right after the final chunk;
2. cpp-httplib's thread-pool idle-counter bug -- in a burst of keep-alive
   connections, the last ones wait unread until another connection closes;

each in a timing-faithful form (a race, as on the real server) and a deterministic one for tests that must show
the defect every time (``stream_close="on_reuse"``, ``stall_burst=K``, counted in
``requests_dropped_after_stream`` and ``connections_stalled``);

plus a one-shot fault injector (:class:`Fault`) for resets, stalls, garbage,
truncated chunks, huge headers, 503/429, and server-side counters
(:class:`EmulatorStats`) that show what the server really received and ran.

Example::

    with LlamaServerEmulator(http_threads=4) as server:
        server.inject(Fault.RESET_MID_STREAM, path="/v1/chat/completions")
        ...  # point a client at server.url
        assert server.stats().completions_started == 1

The guard learns each origin's probe deadline process-wide (from the answers it has seen): between tests whose
servers share a port, call :func:`reset_probe_learning`.
"""

from ._burst import AsyncPreopenedBackend, PreopenedBackend, async_burst_transport, burst_transport, open_burst
from ._config import EmulatorConfig
from ._delay_relay import ConnectDelayBackend, DelayRelay, DelayRelayProcess, RelayStats
from ._emulator import HeldConnection, LlamaServerEmulator
from ._faults import Fault, FaultRule
from ._probe_learning import reset_probe_learning
from ._real_server import LLAMA_SERVER_BUILD, RealLlamaServer, RealServerError, find_llama_server, free_port
from ._responses import generated_text
from ._stats import ConnectionWait, EmulatorStats
from ._tiny_model import write_tiny_model

__all__ = [
    "LLAMA_SERVER_BUILD",
    "RealLlamaServer",
    "RealServerError",
    "find_llama_server",
    "free_port",
    "write_tiny_model",
    "AsyncPreopenedBackend",
    "PreopenedBackend",
    "async_burst_transport",
    "burst_transport",
    "open_burst",
    "ConnectionWait",
    "ConnectDelayBackend",
    "DelayRelay",
    "DelayRelayProcess",
    "RelayStats",
    "EmulatorConfig",
    "EmulatorStats",
    "Fault",
    "FaultRule",
    "HeldConnection",
    "LlamaServerEmulator",
    "generated_text",
    "reset_probe_learning",
]
