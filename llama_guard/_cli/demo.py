"""``llama-guard demo``: both defects and their fix, on the built-in emulator, in well under a minute.

Two scenarios, each with plain httpx and with the guard, against a fresh in-process `LlamaServerEmulator`:

- proxy-like load: 16 threads share one client with a 4-connection pool; half the requests stream. The server
  gives up each stream's connection after its final chunk, and a pooled client reuses it: the request it writes
  there is lost. (The real server closes at once, and the client loses the request when it reuses the connection
  before the close arrives, a race; the emulator's ``stream_close="on_reuse"`` makes it happen every time, so the
  demo shows the defect on a busy machine too.)
- burst: 32 keep-alive connections opened at once before any request, one per client (a pool re-opening all
  its connections); cpp-httplib's pool bug leaves those after the pool's 4 threads unread (``stall_burst``: every
  time, rather than when the server's threads happen to wake late).

Nothing is waited out silently: a request with no answer within ``STUCK_AFTER`` (the emulator answers in
milliseconds) counts as stuck, progress lines say what is waited for, and the table's figures are those of the last
progress line. "lost" is a request that failed with an error; "stuck" one that got no answer.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

import httpx

from .._httpx.sync_transport import GuardTransport
from ..testing import LlamaServerEmulator, burst_transport, open_burst
from .exits import run_command
from .load import LOST, STUCK, LoadRow, proxy_load, run_threads, send_one

__all__ = ["STUCK_AFTER", "DemoError", "DemoRow", "demo_rows", "format_table", "run_demo"]

CHAT = "/v1/chat/completions"
THINK_TIME = 0.1
#: A request of the proxy-like load with no answer within this many seconds counts as stuck (the emulator answers
#: in milliseconds; httpcore's pool race can leave a plain client's request waiting for its whole timeout).
STUCK_AFTER = 1.0
#: A burst client sends no new request this close to the end of its run, so that only a connection that was never
#: answered can end the run with a request unanswered.
LAST_REQUEST_MARGIN = 0.5


#: The demo's rows are the shared load's rows (kept under this name for the demo's callers).
DemoRow = LoadRow


def _body(index: int, stream: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": f"request {index}"}], "stream": stream, "max_tokens": 4}


def _proxy_load(guarded: bool, requests: int) -> DemoRow:
    row = DemoRow("proxy-like load", "guard" if guarded else "plain httpx")
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=4.0)
    with LlamaServerEmulator(stream_close="on_reuse", parallel=8, n_tokens=4) as server:
        inner = httpx.HTTPTransport(limits=limits)
        guard = GuardTransport(inner) if guarded else None
        transport: httpx.BaseTransport = guard if guard is not None else inner
        with httpx.Client(transport=transport, base_url=server.url, timeout=10.0) as client:
            proxy_load(
                client,
                row,
                requests=requests,
                workers=16,
                path=CHAT,
                body_for=lambda i: _body(i, i % 2 == 1),
                progress=sys.stderr,
                stuck_after=STUCK_AFTER,
            )
        if guard is not None:
            row.connections = dict(guard.stats.snapshot().connection_strategies)
    return row


def _burst(guarded: bool, clients: int, seconds: float) -> DemoRow:
    row = DemoRow("burst", "guard" if guarded else "plain httpx")
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    threads = 4
    # A burst no larger than the pool cannot stall (stall_burst must exceed http_threads).
    with LlamaServerEmulator(http_threads=threads, stall_burst=clients if clients > threads else None) as server:
        sockets = open_burst("127.0.0.1", server.port, clients)
        timeout = httpx.Timeout(seconds + 1.0)
        opened: list[httpx.Client] = []
        for sock in sockets:
            inner = burst_transport([sock], limits=limits)
            transport: httpx.BaseTransport = GuardTransport(inner) if guarded else inner
            opened.append(httpx.Client(transport=transport, base_url=server.url, timeout=timeout))
        started = time.monotonic()
        stop_at = started + seconds
        row.stuck_after = seconds
        answered = [False] * clients
        stop = threading.Event()

        def client_job(number: int) -> Callable[[], None]:
            def run() -> None:
                client, index = opened[number], 0
                # A connection's first request waits until the run ends; later ones start only while there is time
                # left to answer them, so "stuck" is a connection whose first request was never answered.
                while not stop.is_set() and (
                    index == 0 or time.monotonic() < stop_at - min(LAST_REQUEST_MARGIN, seconds / 4)
                ):
                    remaining = max(stop_at - time.monotonic(), 0.05)
                    if not send_one(client, CHAT, _body(index, False), row, stuck_after=remaining):
                        break
                    answered[number] = True
                    index += 1
                    # Think time between a client's requests: without it, served connections reach cpp-httplib's
                    # 100 requests per connection within a second or two, close, and free a thread for the stalled
                    # ones, which real clients do not do for a long time.
                    time.sleep(THINK_TIME)

            return run

        def line(prefix: str, *, final: bool = False) -> str:
            served = answered.count(True)
            # While the run goes on, a connection's unanswered first request is not counted yet: its end does
            # that (answered, lost, or stuck when the run ends).
            requests = f"{row.requests} requests" if final else f"{row.requests} requests ended"
            text = f"      {prefix}: {served} of {clients} connections answered, {requests}, {row.counts()}"
            if served < clients and time.monotonic() < stop_at:
                text += (
                    f"; waiting for the first answer on {clients - served} connection(s) (unanswered at the end of "
                    f"the {seconds:g} s run counts as {STUCK})"
                )
            return text

        def tick() -> None:
            print(line(f"{time.monotonic() - started:3.0f} s of {seconds:g}"), file=sys.stderr, flush=True)

        try:
            run_threads([client_job(number) for number in range(clients)], stop=stop, tick=tick, every=1.0)
        finally:
            for client in opened:
                client.close()
        print(line(f"done in {time.monotonic() - started:.1f} s", final=True), file=sys.stderr, flush=True)
    return row


def _max_first_byte(row: DemoRow) -> str:
    """The slowest first byte; a stuck request's is beyond the bound it was given, and it is the slowest."""
    if row.stuck:
        bound = f"{row.stuck_after:g} s" if row.stuck_after is not None else "the run"
        return f"> {bound} ({row.stuck} {STUCK})"
    return f"{row.maximum:.2f} s"


def format_table(rows: list[DemoRow]) -> str:
    header = ("scenario", "client", "requests", "answered", LOST, STUCK, "median first byte", "max first byte")
    lines = [header] + [
        (
            row.scenario,
            row.client,
            str(row.requests),
            str(row.answered),
            str(row.errors),
            str(row.stuck),
            f"{row.median * 1000:.0f} ms",
            _max_first_byte(row),
        )
        for row in rows
    ]
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    rendered = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in lines]
    rendered.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(rendered)


def demo_rows(*, requests: int = 600, clients: int = 32, seconds: float = 2.5) -> list[DemoRow]:
    """Run both scenarios with plain httpx and the guard, reporting progress on stderr."""
    steps: list[tuple[str, Callable[[], DemoRow]]] = [
        ("proxy-like load, plain httpx", lambda: _proxy_load(False, requests)),
        ("proxy-like load, guard", lambda: _proxy_load(True, requests)),
        ("burst, plain httpx", lambda: _burst(False, clients, seconds)),
        ("burst, guard", lambda: _burst(True, clients, seconds)),
    ]
    rows: list[DemoRow] = []
    for number, (title, step) in enumerate(steps, 1):
        print(f"[{number}/{len(steps)}] {title} ...", file=sys.stderr, flush=True)
        rows.append(step())
    return rows


NEXT_STEP = (
    "Next: guard your own client, httpx.Client(transport=llama_guard.GuardTransport()) or "
    "llama_guard.guard(client) (docs/quickstart.md; aiohttp and requests sessions: docs/integrations.md); for code "
    "that builds its clients itself, "
    "llama_guard.install() or llama-guard run -- python app.py; llama-guard doctor URL examines your own server."
)


class DemoError(Exception):
    """What stops the demo before it starts (one line, exit 2)."""


def _allow_open_files(clients: int) -> None:
    """Raise this process's open-files limit (within its hard limit) to what a burst of ``clients`` needs: each
    takes a client socket and the in-process emulator's; DemoError if the limit cannot be raised that far."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows: no such limit to raise
        return
    needed = 2 * clients + 256  # and the proxy-like load's, the emulator's listeners, Python's own files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard == resource.RLIM_INFINITY or hard >= needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        return
    raise DemoError(
        f"--clients {clients} needs about {needed} open files, and this process may open at most {hard} (ulimit -Hn): "
        f"ask for at most {max(1, (hard - 256) // 2)} clients, or raise the limit"
    )


def run_demo(
    *,
    requests: int = 600,
    clients: int = 32,
    seconds: float = 2.5,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Print the demo's table (to ``out``, default stdout); 0 when the guard lost nothing and left nothing stuck, 2
    when it could not run (one line on ``err``)."""
    return run_command(
        "demo", lambda out, err: _demo(requests, clients, seconds, out), DemoError, out=out, err=err, json=False
    )


def _demo(requests: int, clients: int, seconds: float, out: TextIO) -> int:
    _allow_open_files(clients)
    started = time.monotonic()
    rows = demo_rows(requests=requests, clients=clients, seconds=seconds)
    print(file=out)
    print(format_table(rows), file=out)
    lost = sum(row.errors for row in rows if row.client == "guard")
    stuck = sum(row.stuck for row in rows if row.client == "guard")
    chosen = {origin: choice for row in rows for origin, choice in row.connections.items()}
    strategy = "".join(
        f"\nThe guard's connection strategy (GuardPolicy(connection='auto'), the default) for the emulator at "
        f"{origin}: {choice}."
        for origin, choice in chosen.items()
    )
    print(
        f"\n{LOST}: requests that failed with an error (written to a connection the server then closed).\n"
        f"{STUCK}: requests with no answer: within {STUCK_AFTER:g} s in the proxy-like load (the emulator answers in "
        f"milliseconds), or during the whole {seconds:g} s burst run (a new connection's first request, left unread)."
        f"\nThe guard lost {lost} and left {stuck} {STUCK} ({time.monotonic() - started:.0f} s on the built-in "
        f"emulator of llama-server b11434).{strategy}\n\n{NEXT_STEP}",
        file=out,
    )
    return 0 if lost == stuck == 0 else 1
