"""What runs beside the guard's decisions: threads, timers, sockets and event loops, and the process's one state.

``_core`` decides and holds no thread, socket or event loop; this package has them: the late-answer watch's
duplicated sockets and its expiry thread (`late_answers`), the waiters' turns in threads and event loops
(`admission_turns`), and the stall episodes' timers (`stall_log`). `PROCESS` is the process's `ProcessState`, made
here once: every guard is handed it (or a state of its own, in tests) when it is made.
"""

from __future__ import annotations

from .._core.connection_strategy import ConnectionBook
from .._core.log import WarnOnce
from .._core.probes import ProbeBook
from .._core.process_state import ProcessState
from .late_answers import Expiry
from .stall_log import StallLog

__all__ = ["PROCESS", "new_process_state"]


def new_process_state() -> ProcessState:
    """A process state with its own threads (the process's is `PROCESS`; a test may want a fresh one)."""
    return ProcessState(
        probes=ProbeBook(Expiry()),
        connections=ConnectionBook(),
        warnings=WarnOnce(),
        stalls=StallLog(),
    )


#: The process's state: what every guard of the process shares about the origins it talks to.
PROCESS = new_process_state()
