"""CPU-bound processes beside the server, so that the burst stalls a broken pool as on a busy machine.

Measured on this 2-core machine (issue 12): real b11434 stalled in 0 of 7 quiet bursts, and with two busy
processes beside it plain clients were stuck in 4 of 5. The helper is the real-server tests' own
(``llama_guard.testing._cpu_load.CpuHogs``): one implementation, whose hogs exit once their parent is gone.
"""

from __future__ import annotations

from llama_guard.testing._cpu_load import CpuHogs

__all__ = ["CpuHogs"]
