"""``python -m llama_guard.testing``: run the emulator for manual experiments.

Point curl or a client at the printed URL; Ctrl-C stops it and prints what the
server saw.  Example::

    python -m llama_guard.testing --port 8080 --http-threads 4 --token-interval 0.05
    python -m llama_guard.testing --stream-close on_reuse --stall-burst 16   # both defects, deterministic
    curl -N localhost:8080/v1/chat/completions -d '{"messages":[],"stream":true}'
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence

from .._llama_build import FIRST_FIXED_BUILD
from ._config import STREAM_CLOSE_MODES
from ._emulator import LlamaServerEmulator


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llama_guard.testing",
        description="Emulate llama-server b11434's HTTP behaviour and defects.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--http-threads", type=int, default=4)
    parser.add_argument("--max-http-threads", type=int, default=64)
    parser.add_argument("--fixed-pool", action="store_true", help="model builds >= b11737")
    parser.add_argument("--wakeup-latency", type=float, default=0.005)
    parser.add_argument("--keep-streams-open", action="store_true", help="do not close after streams")
    parser.add_argument(
        "--stream-close",
        choices=STREAM_CLOSE_MODES,
        default="after_delay",
        help="after_delay: close --stream-close-delay seconds after a stream's final chunk (timing-faithful); "
        "on_reuse: keep the connection open until the next request arrives on it, then close it unanswered "
        "(every reuse after a stream is lost)",
    )
    parser.add_argument(
        "--stream-close-delay", type=float, default=0.0, help="seconds between a stream's final chunk and the close"
    )
    parser.add_argument(
        "--stall-burst",
        type=int,
        default=None,
        metavar="K",
        help="the pool stall made deterministic: of each burst's first K connections, those after the first "
        "--http-threads wait unread until a served connection closes; later ones are served at once",
    )
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--token-interval", type=float, default=0.0)
    parser.add_argument("--n-tokens", type=int, default=8)
    parser.add_argument("--keepalive-timeout", type=float, default=5.0)
    parser.add_argument("--loading", action="store_true", help="start in the loading state")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        emulator = LlamaServerEmulator(
            host=args.host,
            port=args.port,
            http_threads=args.http_threads,
            max_http_threads=args.max_http_threads,
            pool_bug=not args.fixed_pool,
            wakeup_latency=args.wakeup_latency,
            close_after_stream=not args.keep_streams_open,
            stream_close=args.stream_close,
            stream_close_delay=args.stream_close_delay,
            stall_burst=args.stall_burst,
            parallel=args.parallel,
            token_interval=args.token_interval,
            n_tokens=args.n_tokens,
            keepalive_timeout=args.keepalive_timeout,
            loading=args.loading,
            # A fixed pool is what builds from b11737 on have: say so, as a real server would in /props.
            build=f"b{FIRST_FIXED_BUILD}-emulated" if args.fixed_pool else "b11434-emulated",
        )
    except ValueError as exc:
        _parser().error(str(exc))
    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with emulator:
        print(f"llama-server emulator listening on {emulator.url} ({emulator!r})", flush=True)
        done.wait()
        stats = emulator.stats()
    print(
        f"requests={dict(stats.requests)} completions started={stats.completions_started} "
        f"finished={stats.completions_finished} connections={stats.connections_accepted} "
        f"max unread wait={stats.max_unread_wait:.3f}s dropped after stream={stats.requests_dropped_after_stream} "
        f"stalled={stats.connections_stalled}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
