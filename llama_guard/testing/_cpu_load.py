"""CPU-bound processes beside a real llama-server, to make its thread-pool race happen on purpose.

Why: cpp-httplib 0.59.0's pool stalls a burst of new connections only when its worker threads are slow to wake
(see ``tests/real/_burst.py``). On a quiet 2-core machine llama-server b11434 stalled in 0 of 7 bursts; with two
busy processes beside it, in 4 of 5. A test that needs the stall creates that condition with :class:`CpuHogs`
instead of hoping the machine is busy, and checks that the stall happened before it judges anything.

Example::

    with CpuHogs(2):
        result = run_burst(server.address)

Each hog is ``python -c`` spinning in a loop that also watches its parent: if the test process dies without
stopping it (SIGKILL, a crash), the hog sees that it was re-parented and exits on its own, so a dead test run
never leaves busy processes behind on a shared machine.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

from ._lifecycle import StartStop, spawn_watcher

__all__ = ["CpuHogs", "pin_process"]

# Spins; every ~10 ms checks that the process that started it (argv[1], see `spawn_watcher`) is still its parent,
# else exits.
_HOG = """\
import os, sys
parent = int(sys.argv[1])
sys.stdout.write("spinning\\n")
sys.stdout.flush()
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


def pin_process(pid: int, cpus: Iterable[int], *, batch: bool = False) -> None:
    """Restrict every thread of process ``pid`` (and the threads it starts later) to ``cpus``.

    ``batch``: also give them Linux's ``SCHED_BATCH`` policy, under which a thread that wakes up never preempts
    the one running: a woken pool worker then waits for the accept loop (or a busy process on its core) to
    give the CPU up, as it does on a loaded machine. ``os.sched_setaffinity(pid)`` sets only the main thread;
    the others are set one by one through ``/proc/PID/task``. Threads created afterwards inherit both settings.
    """
    wanted = set(cpus)
    if not wanted:
        raise ValueError("cpus must name at least one CPU")
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), wanted)
            if batch:
                os.sched_setscheduler(int(task.name), os.SCHED_BATCH, os.sched_param(0))


class CpuHogs(StartStop):
    """``count`` CPU-bound processes, spinning from the return of :meth:`start` (or ``with``) until :meth:`stop`.

    ``cpus``: pin every hog to these CPUs (default: wherever the scheduler puts them). :meth:`stop` kills and
    reaps them all and is idempotent; ``with`` calls it on the way out, exception or not.
    """

    def __init__(self, count: int, *, cpus: Iterable[int] | None = None) -> None:
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 64:
            raise ValueError(f"count must be an int from 0 to 64; got {count!r}")
        self.count = count
        self.cpus: frozenset[int] | None = None if cpus is None else frozenset(cpus)
        if self.cpus is not None and not self.cpus:
            raise ValueError("cpus must name at least one CPU, or be None for no pinning")
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> CpuHogs:
        if self._procs:
            raise RuntimeError("CPU hogs already started")
        try:
            for _ in range(self.count):
                proc = spawn_watcher(_HOG, stdout=subprocess.PIPE)
                self._procs.append(proc)
                if self.cpus is not None:
                    pin_process(proc.pid, self.cpus)
            # Return only once every hog spins: an interpreter still starting up is not the load asked for.
            for proc in self._procs:
                assert proc.stdout is not None
                if proc.stdout.readline() != b"spinning\n":
                    raise RuntimeError(f"CPU hog {proc.pid} exited at startup with {proc.wait()}")
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    @property
    def running(self) -> int:
        """How many hogs are still running (all of them, unless one was killed from outside)."""
        return sum(proc.poll() is None for proc in self._procs)

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def __repr__(self) -> str:
        where = "" if self.cpus is None else f" on CPUs {sorted(self.cpus)}"
        return f"<CpuHogs {self.running}/{len(self._procs) or self.count} running{where}>"
