"""Where the examples send their requests: a llama-server you name, or an emulated one started in the process.

Each example takes the server's base URL as its first argument or from ``LLAMA_URL``; with neither, it starts the
emulator from ``llama_guard.testing``, so that every example runs as it is, with no server installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from llama_guard.testing import LlamaServerEmulator

__all__ = ["llama_server", "missing_extra"]


def missing_extra(error: ModuleNotFoundError, extra: str) -> NoReturn:
    """One line naming the extra to install, and exit status 2, instead of a traceback."""
    example = os.path.basename(sys.argv[0]) or "this example"
    print(
        f"{example} needs the '{extra}' extra ({error.name} is not installed): pip install -e '.[{extra}]'",
        file=sys.stderr,
    )
    raise SystemExit(2)


@contextmanager
def llama_server() -> Iterator[str]:
    """The base URL to use: the first argument, else LLAMA_URL, else an emulator started here."""
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LLAMA_URL")
    if url:
        yield url
        return
    # The emulator closes a stream's connection 60 ms after the final chunk (llama-server does it at once), so
    # that on loopback the client reuses the connection before it dies, as it does under load.
    with LlamaServerEmulator(stream_close_delay=0.06) as server:
        yield server.url
