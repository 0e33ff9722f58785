"""How a command ends when interrupted (Ctrl-C prints one line and exits 130) or when it cannot run (one line,
exit 2); each command's own statuses are in docs/cli.md. Its own module so that the commands and the entry point
share it without importing each other."""

from __future__ import annotations

import json
import signal
import sys
from typing import TextIO

__all__ = ["EXIT_COULD_NOT_RUN", "EXIT_INTERRUPTED", "failed", "interrupted"]

EXIT_COULD_NOT_RUN = 2
EXIT_INTERRUPTED = 130


def failed(command: str, message: str, *, err: TextIO, json_out: TextIO | None = None, **context: object) -> int:
    """What stopped ``command`` (never a traceback): one line on ``err``, and with ``--json`` (``json_out``) also
    ``{**context, "error": message, "exit_code": 2}``; returns 2."""
    if json_out is not None:
        print(json.dumps({**context, "error": message, "exit_code": EXIT_COULD_NOT_RUN}), file=json_out)
    print(f"llama-guard {command}: {message}", file=err)
    return EXIT_COULD_NOT_RUN


def interrupted(command: str) -> int:
    """Ctrl-C: one line, no traceback. A second Ctrl-C while this returns is ignored, so it stays one line."""
    from .load import join_stragglers

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    left = join_stragglers()
    extra = f" ({len(left)} thread(s) still waiting on the network are abandoned)" if left else ""
    print(f"llama-guard {command}: interrupted{extra}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
