"""Forget what the guard learnt about probing each origin: for tests, and for a process whose origin now points at
another server."""

from __future__ import annotations

from .._runtime import PROCESS

__all__ = ["reset_probe_learning"]


def reset_probe_learning() -> None:
    """Forget every origin's learnt probe deadline (the answers seen), its watches for late answers and its
    admission state, for every transport of the process: the next probes use the configured ``probe_timeout``
    until enough answers were seen again.

    The guard learns per origin (scheme, host, port), process-wide, because the server's answer time is the same
    whichever client asks. A test suite whose emulators reuse ports, or a process that restarts a server on the same
    port with other settings, calls this between them. Connections waiting for their turn at that moment keep
    waiting in the old book's queue and are served from it."""
    PROCESS.probes.forget()
