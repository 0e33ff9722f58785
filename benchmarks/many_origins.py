"""Memory of one long-lived client that reaches origins without end (a gateway over pod addresses, a harness on random
ports): plain httpx beside the guard, per origin reached.

One `httpx.Client` asks ``GET /health`` of each of ``--origins`` loopback origins (127.1.x.y, one port held on
127.0.0.1 so nothing listens there: each connect is refused at once, and no server's memory is counted). Python's
allocated memory (`tracemalloc`, after a full collection, the client still open) is measured after each step of the
``--steps`` list, for plain httpx and for the guard under ``GuardPolicy(connection="reuse")`` (the probe book, the
connection book and the accounts all fill; ``auto`` makes no probe book entry on loopback).

Goal: the guard's memory stops growing once it passes the 1,024 origins it keeps state for, where plain httpx's
holds nothing per origin. Before the bound (stop 43) the guard kept about 32 KB per origin for the life of the
process.

Usage::

    python benchmarks/many_origins.py                       # steps 500, 1000, 2000, 4000
    python benchmarks/many_origins.py --steps 100 200
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import socket
import tracemalloc
from collections.abc import Callable, Iterable

import httpx

from llama_guard import GuardPolicy, GuardTransport
from llama_guard._runtime import new_process_state

Make = Callable[[], httpx.Client]


def plain() -> httpx.Client:
    return httpx.Client(timeout=5)


def guarded() -> httpx.Client:
    policy = GuardPolicy(connection="reuse", max_attempts=1)
    return httpx.Client(transport=GuardTransport(policy=policy, process=new_process_state()), timeout=5)


def allocated() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def run(make: Make, steps: Iterable[int], port: int) -> list[tuple[int, int]]:
    """(origins reached, bytes allocated since the client was made) after each step."""
    rows = []
    with make() as client:
        client.get  # noqa: B018 (the client's own allocations are in the baseline)
        base = allocated()
        reached = 0
        for step in steps:
            while reached < step:
                with contextlib.suppress(httpx.ConnectError):
                    client.get(f"http://127.1.{reached // 250}.{reached % 250 + 1}:{port}/health")
                reached += 1
            rows.append((reached, allocated() - base))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the one warning past 1,024 origins is expected
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    tracemalloc.start()
    try:
        results = {name: run(make, args.steps, port) for name, make in (("plain httpx", plain), ("guard", guarded))}
    finally:
        held.close()
    print(f"{'origins':>8} {'plain httpx KiB':>16} {'guard KiB':>10} {'guard B/origin':>15} {'guard - plain KiB':>18}")
    for (count, bare), (_, guard) in zip(results["plain httpx"], results["guard"], strict=True):
        extra = (guard - bare) / 1024
        print(f"{count:>8} {bare / 1024:>16.0f} {guard / 1024:>10.0f} {guard / count:>15.0f} {extra:>18.0f}")


if __name__ == "__main__":
    main()
