"""A minimal, fast HTTP/1.1 keep-alive server for overhead benchmarks, run in its own process.

It answers every request with the same small JSON body, so the client's own cost dominates what is measured.
Usage: python benchmarks/_keepalive_server.py  (prints the port, serves until killed or until its stdin closes, so
that a benchmark killed without running its cleanup leaves no server behind)
"""

from __future__ import annotations

import asyncio
import sys

BODY = b'{"status":"ok"}'
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: application/json\r\n"
    b"Keep-Alive: timeout=5, max=100000\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            writer.write(RESPONSE)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    # The parent holds our stdin open; its end (however the parent died) is ours.
    parent_gone = loop.run_in_executor(None, sys.stdin.buffer.read)
    async with server:
        await asyncio.wait([parent_gone, asyncio.ensure_future(server.serve_forever())], return_when="FIRST_COMPLETED")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
