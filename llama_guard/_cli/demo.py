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
from .load import LoadRow, proxy_load, run_threads, send_one

__all__ = ["DemoRow", "demo_rows", "format_table", "run_demo"]

CHAT = "/v1/chat/completions"
THINK_TIME = 0.1


#: The demo's rows are the shared load's rows (kept under this name for the demo's callers).
DemoRow = LoadRow


def _body(index: int, stream: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": f"request {index}"}], "stream": stream, "max_tokens": 4}


def _proxy_load(guarded: bool, requests: int) -> DemoRow:
    row = DemoRow("proxy-like load", "guard" if guarded else "plain httpx")
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=4.0)
    with LlamaServerEmulator(stream_close="on_reuse", parallel=8, n_tokens=4) as server:
        inner = httpx.HTTPTransport(limits=limits)
        transport: httpx.BaseTransport = GuardTransport(inner) if guarded else inner
        with httpx.Client(transport=transport, base_url=server.url, timeout=10.0) as client:
            proxy_load(
                client,
                row,
                requests=requests,
                workers=16,
                path=CHAT,
                body_for=lambda i: _body(i, i % 2 == 1),
                progress=sys.stderr,
            )
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
        answered = [False] * clients
        stop = threading.Event()

        def client_job(number: int) -> Callable[[], None]:
            def run() -> None:
                client, index = opened[number], 0
                while time.monotonic() < stop_at and not stop.is_set():
                    remaining = max(stop_at - time.monotonic(), 0.1)
                    if not send_one(client, CHAT, _body(index, False), row, timeout=remaining):
                        break
                    answered[number] = True
                    index += 1
                    # Think time between a client's requests: without it, served connections reach cpp-httplib's
                    # 100 requests per connection within a second or two, close, and free a thread for the stalled
                    # ones, which real clients do not do for a long time.
                    time.sleep(THINK_TIME)

            return run

        def tick() -> None:
            served = answered.count(True)
            print(
                f"      {time.monotonic() - started:3.0f} s of {seconds:g}: {served} of {clients} connections "
                f"answered, {row.requests} requests",
                file=sys.stderr,
                flush=True,
            )

        try:
            run_threads([client_job(number) for number in range(clients)], stop=stop, tick=tick)
        finally:
            for client in opened:
                client.close()
        row.stuck = answered.count(False)
    return row


def format_table(rows: list[DemoRow]) -> str:
    header = ("scenario", "client", "requests", "errors", "stuck conns", "median first byte", "max first byte")
    lines = [header] + [
        (
            row.scenario,
            row.client,
            str(row.requests),
            str(row.errors),
            str(row.stuck) if row.scenario == "burst" else "-",
            f"{row.median * 1000:.0f} ms",
            f"{row.maximum:.2f} s",
        )
        for row in rows
    ]
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    rendered = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in lines]
    rendered.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(rendered)


def demo_rows(*, requests: int = 600, clients: int = 32, seconds: float = 5.0) -> list[DemoRow]:
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


def run_demo(*, requests: int = 600, clients: int = 32, seconds: float = 5.0, out: TextIO | None = None) -> int:
    """Print the demo's table (to ``out``, default stdout); 0 when the guard lost nothing."""
    out = out if out is not None else sys.stdout
    started = time.monotonic()
    rows = demo_rows(requests=requests, clients=clients, seconds=seconds)
    print(file=out)
    print(format_table(rows), file=out)
    lost = sum(row.errors + row.stuck for row in rows if row.client == "guard")
    print(
        f"\nStuck: connections whose first request was never answered during the {seconds:g} s burst run.\n"
        f"The guard lost {lost} requests or connections ({time.monotonic() - started:.0f} s on the built-in "
        "emulator of llama-server b11434).",
        file=out,
    )
    return 0 if lost == 0 else 1
