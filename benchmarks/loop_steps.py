"""The longest synchronous step an async client's event loop takes per request, with and without the guard, on
multi-megabyte bodies.

    python benchmarks/loop_steps.py [--requests 10]

The emulator runs in a child process (its threads would otherwise share this process's GIL and lengthen every
step). The loop runs in asyncio debug mode with ``slow_callback_duration = 0.001``, so each step of 1 ms or more is
logged with its duration (to the millisecond); the table shows the longest per variant and body, and beside it the
time of stream detection alone (``wants_stream``) on the same body. The body is sent pre-encoded (``content=``):
httpx's own ``json=`` encoding runs in the caller before any transport and is not what is measured. A step is the
whole client task between two awaits (httpx and httpcore's own work included), so the bare column is the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

import llama_guard
from llama_guard._core.stream_detection import wants_stream

CONTENTS = {"2 MB ASCII": "x" * 2_000_000, "2 MB \\u escapes": "é" * 333_000, "6 MB \\u escapes": "é" * 1_000_000}


def body(content: str, *, stream: bool) -> bytes:
    """A chat request; json.dumps writes non-ASCII text as \\u escapes."""
    return json.dumps({"messages": [{"role": "user", "content": content}], "stream": stream}).encode()


_TOOK = re.compile(r" took (\d+\.\d+) seconds")


class _Steps(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.longest = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        found = _TOOK.search(record.getMessage())
        if found:
            self.longest = max(self.longest, float(found.group(1)))


@contextmanager
def emulator() -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "llama_guard.testing", "--port", str(port), "--n-tokens", "3", "--fixed-pool"]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or child.poll() is not None:
                    raise RuntimeError("the emulator did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        child.terminate()
        child.wait(10)


async def longest_step(url: str, transport: httpx.AsyncBaseTransport, body: bytes, requests: int) -> float:
    loop = asyncio.get_running_loop()
    loop.slow_callback_duration = 0.001
    steps = _Steps()
    logger = logging.getLogger("asyncio")
    logger.addHandler(steps)
    try:
        async with httpx.AsyncClient(transport=transport, base_url=url, timeout=60) as client:
            headers = {"Content-Type": "application/json"}
            await client.post("/v1/chat/completions", content=b'{"messages": []}', headers=headers)  # connect
            steps.longest = 0.0
            for _ in range(requests):
                response = await client.post("/v1/chat/completions", content=body, headers=headers)
                await response.aread()
                assert response.status_code == 200, response.status_code
    finally:
        logger.removeHandler(steps)
    return steps.longest


def detection_time(body: bytes, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        wants_stream(body)
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=10, help="requests per variant and body (default 10)")
    args = parser.parse_args(argv)
    logging.getLogger("asyncio").propagate = False  # counted, not printed
    logging.getLogger("asyncio").addHandler(logging.NullHandler())  # nor printed as a last resort between runs
    print("| body | bare httpx | guard | guard, stream | wants_stream alone (stream) |")
    print("| --- | ---: | ---: | ---: | ---: |")

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.0f} ms"

    with emulator() as url:
        for name, content in CONTENTS.items():
            plain, streamed = body(content, stream=False), body(content, stream=True)
            # Bare httpx only without a stream: with one, the server's close after the stream loses its next request.
            bare = asyncio.run(longest_step(url, httpx.AsyncHTTPTransport(), plain, args.requests), debug=True)
            guard = asyncio.run(longest_step(url, llama_guard.AsyncGuardTransport(), plain, args.requests), debug=True)
            stream = asyncio.run(
                longest_step(url, llama_guard.AsyncGuardTransport(), streamed, args.requests), debug=True
            )
            print(f"| {name} | {ms(bare)} | {ms(guard)} | {ms(stream)} | {ms(detection_time(streamed))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
