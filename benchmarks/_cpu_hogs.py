"""CPU-bound processes beside the server, so that the burst stalls a broken pool as on a busy machine.

Measured on this 2-core machine (issue 12): real b11434 stalled in 0 of 7 quiet bursts, and with two busy
processes beside it plain clients were stuck in 4 of 5. ``llama_guard.testing._cpu_load.CpuHogs`` (the
real-server tests' helper) is used when the package has it; otherwise this minimal copy with the same interface.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from types import TracebackType

__all__ = ["CpuHogs"]

# Spins, and exits once its parent is gone: a benchmark killed with SIGKILL leaves no busy process behind.
_HOG = """\
import os, sys
parent = int(sys.argv[1])
sys.stdout.write("spinning\\n")
sys.stdout.flush()
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


class _LocalCpuHogs:
    """``count`` CPU-bound processes, spinning from :meth:`start` (or ``with``) until :meth:`stop`."""

    def __init__(self, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 64:
            raise ValueError(f"count must be an int from 0 to 64; got {count!r}")
        self.count = count
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> _LocalCpuHogs:
        try:
            for _ in range(self.count):
                proc = subprocess.Popen(
                    [sys.executable, "-c", _HOG, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
                self._procs.append(proc)
            for proc in self._procs:  # return once every hog spins, not while interpreters start up
                assert proc.stdout is not None
                if proc.stdout.readline() != b"spinning\n":
                    raise RuntimeError(f"CPU hog {proc.pid} exited at startup with {proc.wait()}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> _LocalCpuHogs:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


try:
    from llama_guard.testing._cpu_load import CpuHogs  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    CpuHogs = _LocalCpuHogs  # type: ignore[misc,assignment,unused-ignore]
