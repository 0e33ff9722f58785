"""How a command ends when interrupted: Ctrl-C prints one line and exits 130 (each command's own statuses are in
docs/cli.md). Its own module so that the commands and the entry point share it without importing each other."""

from __future__ import annotations

import signal
import sys

__all__ = ["EXIT_INTERRUPTED", "interrupted"]

EXIT_INTERRUPTED = 130


def interrupted(command: str) -> int:
    """Ctrl-C: one line, no traceback. A second Ctrl-C while this returns is ignored, so it stays one line."""
    from .load import join_stragglers

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    left = join_stragglers()
    extra = f" ({len(left)} thread(s) still waiting on the network are abandoned)" if left else ""
    print(f"llama-guard {command}: interrupted{extra}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
