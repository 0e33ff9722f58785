"""Where the examples send their requests: a llama-server you name, or an emulated one started in the process.

Each example takes the server's base URL as its first argument or from ``LLAMA_URL``; with neither, it starts the
emulator from ``llama_guard.testing`` with both defects on every time (as ``python -m llama_guard.testing
--faulty``), so that every example runs as it is, with no server installed, and shows the defects.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from llama_guard.testing import LlamaServerEmulator
from llama_guard.testing.__main__ import FAULTY_STALL_BURST, FAULTY_STREAM_CLOSE

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
    # Both defects every time, as `python -m llama_guard.testing --faulty` does: a request written to a stream's
    # connection is dropped unanswered (llama-server closes that connection right after the final chunk, a race
    # that a client on an idle machine often wins, so its losses come and go), and a burst's connections after
    # the first 4 stay unread. So the plain client's losses show on any machine, every run.
    with LlamaServerEmulator(stream_close=FAULTY_STREAM_CLOSE, stall_burst=FAULTY_STALL_BURST) as server:
        yield server.url
