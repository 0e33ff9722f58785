"""``python -m llama_guard.testing``: run the emulator for manual experiments.

Point curl or a client at the printed URL; Ctrl-C stops it and prints what the
server saw.  Example::

    python -m llama_guard.testing --port 8080 --http-threads 4 --token-interval 0.05
    python -m llama_guard.testing --faulty   # both defects, every time: --stream-close on_reuse --stall-burst 16
    curl -N localhost:8080/v1/chat/completions -d '{"messages":[],"stream":true}'
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence

from .._core.llama_server import FIRST_FIXED_BUILD
from ._config import STREAM_CLOSE_MODES
from ._emulator import LlamaServerEmulator

PROG = "python -m llama_guard.testing"
#: ``--faulty``: both defects on every occasion, so a client (an example, an app) meets them at once rather than
#: when a race happens to go the wrong way. The real server's close after a stream is a race that a client on an
#: idle machine usually wins (with the default --stream-close after_delay and delay 0, nothing shows).
FAULTY_STREAM_CLOSE = "on_reuse"
FAULTY_STALL_BURST = 16


def _number(kind: type[int] | type[float], accepted: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None

    return parse


_int = _number(int, "a whole number")
_seconds = _number(float, "a number of seconds")


#: The arguments that are no setting of the emulator's: --faulty (read by `main`), and the two flags that turn a
#: defect off (their settings are the negation).
_NOT_SETTINGS = frozenset({"faulty", "fixed_pool", "keep_streams_open"})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Emulate llama-server b11434's HTTP behaviour and defects. By default the stream defect is "
        "timing-faithful (the close comes right after the final chunk: a race a client often wins) and the pool "
        "defect depends on thread wake-ups. To make both visible to any client in one go, use --faulty.",
        epilog=f"--faulty is --stream-close {FAULTY_STREAM_CLOSE} --stall-burst {FAULTY_STALL_BURST}: every "
        "request sent on a connection after a stream is dropped unanswered, and of each burst of new connections "
        f"the ones after the first --http-threads (4) up to the {FAULTY_STALL_BURST}th stay unread. "
        "Exit status: 130 on Ctrl-C (after one line with what the server saw), 2 on bad arguments or a busy port.",
    )
    parser.add_argument(
        "--faulty",
        action="store_true",
        help=f"both defects every time: --stream-close {FAULTY_STREAM_CLOSE} --stall-burst {FAULTY_STALL_BURST}",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=_int, default=8080, help="the port to listen on; 0: any free port (8080)")
    parser.add_argument(
        "--http-threads", type=_int, default=4, help="base HTTP threads of the pool, llama-server's --threads-http (4)"
    )
    parser.add_argument("--max-http-threads", type=_int, default=64, help="most HTTP threads the pool may run (64)")
    parser.add_argument(
        "--fixed-pool",
        action="store_true",
        help=f"the fixed thread pool of builds b{FIRST_FIXED_BUILD} and later (no pool defect)",
    )
    parser.add_argument(
        "--wakeup-latency",
        type=_seconds,
        default=0.005,
        help="seconds a woken pool thread takes to run: the window of the pool defect's race (0.005)",
    )
    parser.add_argument(
        "--keep-streams-open",
        action="store_true",
        help="keep a stream's connection open after its final chunk (no stream defect)",
    )
    parser.add_argument(
        "--stream-close",
        choices=STREAM_CLOSE_MODES,
        default=None,
        help="after_delay (the default): close --stream-close-delay seconds after a stream's final chunk "
        "(timing-faithful); "
        "on_reuse: keep the connection open until the next request arrives on it, then close it unanswered "
        "(every reuse after a stream is lost)",
    )
    parser.add_argument(
        "--stream-close-delay", type=_seconds, default=0.0, help="seconds between a stream's final chunk and the close"
    )
    parser.add_argument(
        "--stall-burst",
        type=_int,
        default=None,
        metavar="K",
        help="the pool stall made deterministic: of each burst's first K connections, those after the first "
        "--http-threads wait unread until a served connection closes; later ones are served at once",
    )
    parser.add_argument("--parallel", type=_int, default=4, help="inference slots, llama-server's --parallel (4)")
    parser.add_argument(
        "--token-interval", type=_seconds, default=0.0, help="seconds per generated token (0: as fast as possible)"
    )
    parser.add_argument(
        "--n-tokens", type=_int, default=8, help="tokens per completion when the request sets no max_tokens (8)"
    )
    parser.add_argument(
        "--keepalive-timeout", type=_seconds, default=5.0, help="seconds an idle kept-alive connection stays open (5)"
    )
    parser.add_argument("--loading", action="store_true", help="start in the loading state")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.faulty:
        if args.stream_close not in (None, FAULTY_STREAM_CLOSE) or args.keep_streams_open or args.fixed_pool:
            parser.error("--faulty sets --stream-close on_reuse and the pool bug; drop the flag that contradicts it")
        args.stream_close = FAULTY_STREAM_CLOSE
        if args.stall_burst is None:
            args.stall_burst = max(FAULTY_STALL_BURST, args.http_threads + 1)
    if args.stream_close is None:
        args.stream_close = "after_delay"
    # Every other argument is the emulator's setting of the same name (an unknown one is a TypeError, never lost).
    settings = {name: value for name, value in vars(args).items() if name not in _NOT_SETTINGS}
    try:
        emulator = LlamaServerEmulator(
            **settings,
            pool_bug=not args.fixed_pool,
            close_after_stream=not args.keep_streams_open,
            # A fixed pool is what builds from b11737 on have: say so, as a real server would in /props.
            build=f"b{FIRST_FIXED_BUILD}-emulated" if args.fixed_pool else "b11434-emulated",
        )
    except ValueError as exc:
        parser.error(str(exc))
    received: list[int] = []
    done = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        received.append(signum)
        done.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        emulator.start()
    except OSError as exc:
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        print(
            f"{PROG}: cannot listen on {args.host}:{args.port}: {reason} (is llama-server or another emulator "
            "running there? pick another with --port, or --port 0 for any free one)",
            file=sys.stderr,
        )
        return 2
    try:
        print(f"llama-server emulator listening on {emulator.url} ({emulator!r})", flush=True)
        done.wait()
        stats = emulator.stats()
    finally:
        emulator.stop()
    why = "interrupted" if received and received[0] == signal.SIGINT else "stopped"
    print(
        f"{PROG}: {why}; requests: {_per_path(stats.requests)}; completions started={stats.completions_started} "
        f"finished={stats.completions_finished} connections={stats.connections_accepted} "
        f"max unread wait={stats.max_unread_wait:.3f}s dropped after stream={stats.requests_dropped_after_stream} "
        f"stalled={stats.connections_stalled}",
        flush=True,
    )
    # 128 + the signal, as a shell reports a process that a signal stopped: 130 for Ctrl-C, 143 for SIGTERM.
    return 128 + (received[0] if received else signal.SIGTERM)


def _per_path(requests: Mapping[tuple[str, str], int]) -> str:
    """``GET /health 3, POST /v1/chat/completions 12``: the requests the emulator read, by method and path."""
    return ", ".join(f"{method} {path} {count}" for (method, path), count in sorted(requests.items())) or "none"


if __name__ == "__main__":
    raise SystemExit(main())
