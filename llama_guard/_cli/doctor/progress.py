"""doctor's progress on stderr: what a long wait waits for, said every few seconds while it lasts.

A check blocks in a connect, a read or a select; a helper thread speaks for it, so that no blocking call has to be
cut into slices to say so. With ``-q`` there is no stream and no thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from ..load import PROGRESS_EVERY

__all__ = ["SILENT", "Waits"]


class Waits:
    """Says on ``stream`` what a wait waits for, every ``every`` seconds while it lasts; nothing when None."""

    def __init__(self, stream: TextIO | None, every: float = PROGRESS_EVERY) -> None:
        self.stream = stream
        self.every = every

    def say(self, line: str) -> None:
        if self.stream is not None:
            print(f"      {line}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def waiting(self, what: str, bound: float, limit: str = "--timeout") -> Iterator[None]:
        """While the block runs: ``still waiting for WHAT (3 s of at most BOUND s, LIMIT)`` every ``every``
        seconds; a block done sooner says nothing. ``limit`` names what sets ``bound``."""
        if self.stream is None:
            yield
            return
        done = threading.Event()
        started = time.monotonic()

        def tell() -> None:
            while not done.wait(self.every):
                elapsed = time.monotonic() - started
                # A closed or broken stderr must not end the thread with a traceback of its own.
                with contextlib.suppress(OSError, ValueError):
                    self.say(f"still waiting for {what} ({elapsed:.0f} s of at most {bound:g} s, {limit})")

        thread = threading.Thread(target=tell, daemon=True, name="llama-guard-doctor-progress")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


#: For callers that show no progress (``-q``, tests of a single check).
SILENT = Waits(None)
