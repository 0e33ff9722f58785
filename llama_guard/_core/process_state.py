"""What one process knows about the origins it talks to, shared by every guard in it, as one object.

An origin's server is the same whichever client reaches it: the probe deadline learnt from its answers, the queue of
new connections admitted one at a time after a stall, what a new connection to it costs and the connection strategy
chosen from that, the stall episodes logged about it, and the warnings said once. `ProcessState` holds them; the
process has one (``llama_guard._runtime.PROCESS``), which every guard is handed when it is made, and a test may give
a guard a fresh one. The core never imports that instance: what it needs comes in through the `Guard`.

The parts that run threads (the late-answer watch's last look, the stall episode's timer) are behind the two small
protocols here, implemented in ``_runtime``; everything else is plain state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .connection_strategy import ConnectionBook
from .log import WarnOnce
from .origins import Origin
from .probes import ProbeBook

__all__ = ["ProcessState", "Scheduler", "StallReporter"]


class Scheduler(Protocol):
    """Calls made later, from another thread (``_runtime.late_answers.Expiry``)."""

    def at(self, when: float, call: Callable[[], None]) -> None:
        """Call ``call`` once at ``when`` (`time.monotonic`), or soon after."""


class StallReporter(Protocol):
    """Stalled connections counted per origin, one WARNING per episode (``_runtime.stall_log.StallLog``)."""

    def replaced(self, origin: Origin, detail: str) -> None:
        """A stalled connection to ``origin`` is being replaced; ``detail``: its DEBUG record."""

    def rescued(self, origin: Origin, detail: str) -> None:
        """A stalled connection to ``origin`` answered after a kick; ``detail``: its DEBUG record."""

    def flush(self, origin: Origin | None = None) -> None:
        """Log the open episodes now (of ``origin``, or all)."""

    def episodes(self) -> dict[Origin, int]:
        """Episodes begun per origin (for the metrics)."""


@dataclass(frozen=True, eq=False)
class ProcessState:
    """The process-wide state of the guards: one per process, handed to each guard (see the module's doc)."""

    probes: ProbeBook  # the probe deadline learnt per origin, admission, given-up connections
    connections: ConnectionBook  # the cost of a new connection per origin, and the strategy chosen from it
    warnings: WarnOnce  # warnings said once
    stalls: StallReporter  # stall episodes

    def forget(self) -> None:
        """Drop what was learnt about every origin and say every warning again (tests)."""
        self.probes.forget()
        self.connections.forget()
        self.warnings.forget()
