"""Repeatable per-request counts for `overhead.py`: instructions and simulated cache misses, under cachegrind.

Timings on a shared 2-core machine move by several percent from one run to the next; these counts do not. Each
variant runs in a child Python under ``valgrind --tool=cachegrind --cache-sim=yes`` (two children at a time), the
whole httpx/httpcore/h11 stack over an in-memory connection (no server, no system calls), making N1 and, in
another child, N2 requests; per request = (count(N2) - count(N1)) / (N2 - N1), which takes out start-up, imports
and warm-up. The children get a fixed environment and hash seed: the same software gives the same counts to about
0.1% (a different environment moves them that much, through the memory layout).

Two figures per variant:

* ``instructions``: user-space instructions (cachegrind's Ir): the work done.
* ``est. cycles``: Ir + 10 x first-level misses + 100 x second-level misses, with caches the size of this
  machine's (L1 32 KiB, 8-way; per-core L2 512 KiB as cachegrind's last level). A request through httpx touches
  more code and data than fits in L2, so what the guard costs is largely the memory it touches that the request
  would not have touched otherwise, and instructions alone understate it; the estimate follows the measured
  times more closely. It is a model (fixed miss costs, no prefetching, no out-of-order overlap), not a reading.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from _common import table

__all__ = ["COUNT_REQUESTS", "COUNT_VARIANTS", "PerRequest", "count_table", "per_request_counts"]

# (client kind, variant): the sync variants, then asyncio's. "guard close" (the default on loopback: a new connection
# per request) is counted against "bare close" (a bare client sending Connection: close), the others against bare.
COUNT_VARIANTS = (
    ("sync", "bare"),
    ("sync", "guard"),
    ("sync", "bare+poolfix"),
    ("sync", "httpx-retries"),
    ("sync", "bare close"),
    ("sync", "guard close"),
    ("asyncio", "bare"),
    ("asyncio", "guard"),
    ("asyncio", "httpx-retries"),
    ("asyncio", "bare close"),
    ("asyncio", "guard close"),
)
COUNT_REQUESTS = (200, 1200)
JOBS = 2  # children under cachegrind at a time
CACHES = ("--I1=32768,8,64", "--D1=32768,8,64", "--LL=524288,8,64")
EVENTS = ("Ir", "I1mr", "ILmr", "Dr", "D1mr", "DLmr", "Dw", "D1mw", "DLmw")
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class PerRequest:
    """Cachegrind's events per request for one variant."""

    events: dict[str, float]

    @property
    def instructions(self) -> float:
        return self.events["Ir"]

    @property
    def estimated_cycles(self) -> float:
        e = self.events
        first_level = e["I1mr"] + e["D1mr"] + e["D1mw"]
        second_level = e["ILmr"] + e["DLmr"] + e["DLmw"]
        return e["Ir"] + 10 * first_level + 100 * second_level


def _cachegrind(valgrind: str, kind: str, variant: str, requests: int) -> dict[str, int]:
    """Cachegrind's totals for a child Python making ``requests`` in-memory requests of ``variant``."""
    out = f"/tmp/llama-guard-cachegrind.{os.getpid()}.{kind}.{variant}.{requests}"
    command = [
        valgrind,
        "--tool=cachegrind",
        "--cache-sim=yes",
        *CACHES,
        f"--cachegrind-out-file={out}",
        sys.executable,
        str(HERE / "overhead.py"),
        "--instructions-child",
        kind,
        variant,
        str(requests),
    ]
    # The same process wherever this script is started from: the same hashes, no .pyc written by one child and read
    # by the next, and the same working directory and environment (their size moves the memory layout, and with
    # it the counts).
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "PWD": str(HERE)}
    env |= {"PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE, check=False)
        fields: dict[str, str] = {}
        if done.returncode == 0 and os.path.exists(out):
            with open(out) as lines:
                for line in lines:
                    name, _, value = line.partition(":")
                    if name in ("events", "summary"):
                        fields[name] = value
    finally:
        if os.path.exists(out):
            os.unlink(out)
    if set(fields) != {"events", "summary"}:
        raise RuntimeError(
            f"cachegrind of {kind} {variant} x{requests} failed (exit {done.returncode}): {done.stderr[-2000:]}"
        )
    totals = dict(zip(fields["events"].split(), map(int, fields["summary"].split()), strict=True))
    return {event: totals[event] for event in EVENTS}


def per_request_counts(
    valgrind: str, variants: tuple[tuple[str, str], ...] = COUNT_VARIANTS
) -> dict[tuple[str, str], PerRequest]:
    n1, n2 = COUNT_REQUESTS
    jobs = [(kind, variant, n) for n in (n2, n1) for kind, variant in variants]  # long ones first
    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        totals = dict(zip(jobs, pool.map(lambda job: _cachegrind(valgrind, *job), jobs), strict=True))
    return {
        (kind, variant): PerRequest(
            {e: (totals[kind, variant, n2][e] - totals[kind, variant, n1][e]) / (n2 - n1) for e in EVENTS}
        )
        for kind, variant in variants
    }


def count_table(counts: dict[tuple[str, str], PerRequest]) -> str:
    n1, n2 = COUNT_REQUESTS
    rows = []
    for (kind, variant), count in counts.items():
        bare = counts[kind, "bare close" if variant == "guard close" else "bare"]
        rows.append(
            [
                kind,
                variant,
                f"{count.instructions:,.0f}",
                f"{count.instructions - bare.instructions:+,.0f}",
                f"{count.instructions / bare.instructions:.3f}",
                f"{count.estimated_cycles:,.0f}",
                f"{count.estimated_cycles / bare.estimated_cycles:.3f}",
            ]
        )
    headers = ["client", "variant", "instructions/req", "vs bare", "ratio", "est. cycles/req", "ratio"]
    return "\n".join(
        [
            f"Per request, whole stack in memory, under cachegrind: (count({n2} requests) - count({n1})) / "
            f"{n2 - n1}, one child Python each; repeatable to about 0.1%. est. cycles = instructions + 10 x L1 "
            "misses + 100 x L2 misses (caches as this machine's: L1 32 KiB, L2 512 KiB): a model of what memory "
            "costs, which instructions leave out. bare+poolfix: bare with the guard's pool-race fix alone. guard close "
            "(the default on loopback) against bare close, a new connection per request on both.",
            table(headers, rows, left=2),
        ]
    )
