"""``llama-guard doctor`` and ``watch`` against the real llama-server (b11434): the verdicts the emulator tests
check must also come out of the real thing.

The build of the cached binary is made from PyPI's sdist, so it reports ``b0-unknown``: the pool defect can only
be told by behaviour (``--burst``), which is exactly the case doctor must handle.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from llama_guard._cli.doctor.checks import STREAM_CLOSE_WAIT
from llama_guard._cli.doctor.command import DoctorOptions, run_doctor
from llama_guard._core.llama_server import has_pool_defect
from llama_guard.testing._real_server import LLAMA_SERVER_FIXED_BUILD_INFO

from ..test_watch import watcher
from ._burst import STALL_SERVER, BurstResult, run_burst, stall_load, until_stalled

pytestmark = pytest.mark.real_server


def _doctor(url: str, **options) -> tuple[int, dict, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_doctor(DoctorOptions(url, json=True, timeout=10.0, **options), out=out, err=err)
    return code, json.loads(out.getvalue()), err.getvalue()


def _findings(document: dict) -> dict[str, dict]:
    return {item["defect"]: item for item in document["findings"]}


def test_doctor_finds_the_stream_defect(real_server):
    server = real_server()
    code, document, err = _doctor(server.url, requests=40)
    findings = _findings(document)
    assert findings["stream-close"]["status"] == "affected", findings["stream-close"]
    stream = document["checks"]["stream"]
    assert stream["keep_alive_header"] == "timeout=5, max=100"
    assert stream["after"] == "eof"
    # Measured: microseconds after the last byte; the bound is doctor's own wait, whatever the machine's load.
    assert stream["closed_after"] <= STREAM_CLOSE_WAIT
    assert findings["nonstream-keepalive"]["status"] == "not_affected", findings["nonstream-keepalive"]
    assert document["load"]["guard"]["errors"] == 0, document["load"]
    server_info = document["server"]
    assert server_info["server_header"] == "llama.cpp"
    # Without --burst the build decides, and a build that does not know its number decides nothing.
    expected = {None: "could_not_tell", True: "affected", False: "not_affected"}[
        has_pool_defect(server_info["build_number"])
    ]
    assert findings["unread-first-request"]["status"] == expected
    assert code == 1
    assert "[5/5] pooled load with the guard" in err


@pytest.mark.slow
def test_doctor_burst_finds_the_pool_defect(real_server):
    """32 connections at once against --threads-http 4, in the conditions that make the pool stall
    (``_burst.stall_load``). A fresh server is tried again only if doctor's bursts found no stall (then, with the
    build unknown, doctor says "could not tell"), at most STALL_TRIES, and the output says how often."""

    def doctor(_: int) -> tuple[int, dict]:
        server = real_server(**STALL_SERVER)
        with stall_load():
            code, document, _ = _doctor(server.url, requests=0, burst=32)
        server.stop()
        finding = _findings(document)["unread-first-request"]
        print(f"doctor: {finding['status']}: {finding['evidence'][:1]}")
        assert finding["status"] in ("affected", "could_not_tell"), finding  # a clean burst never clears b0-unknown
        return code, finding

    code, finding = until_stalled(doctor, lambda result: result[1]["status"] == "affected")[-1]
    assert finding["status"] == "affected", finding
    assert re.match(r"\d+ of 32 connections opened at once got no answer to GET /health", finding["evidence"][0])
    assert code == 1


WATCH_SECONDS = 9


def _burst_into(address: tuple[str, int], result: list[BurstResult]) -> None:
    # 12 s: the served connections stay busy (so their threads stay taken) past watch's 5 s threshold.
    with stall_load():
        result.append(run_burst(address, duration=12.0, stop_when_all_served=True))


@pytest.mark.slow
def test_watch_catches_stalled_connections_of_the_real_server(real_server):
    """A burst of 32 against --threads-http 4 in the conditions that make the pool stall, the served connections
    kept busy (as a client pool in use keeps them): watch, started alongside, must report the connections left
    unread while it watches, and exit 1. A fresh server is tried again only if no connection stalled (at most
    STALL_TRIES, reported)."""

    def watched(_: int) -> tuple[Any, list[BurstResult], int | None, int]:
        server = real_server(**STALL_SERVER)
        result: list[BurstResult] = []
        burst = threading.Thread(target=_burst_into, args=(server.address, result), daemon=True)
        code = None
        with watcher("--pid", str(server.pid), "--watch", str(WATCH_SECONDS)) as running:
            burst.start()
            burst.join(timeout=60)
            assert not burst.is_alive(), "the burst did not end"
            if result[0].stalled:
                code = running.finish(timeout=30)
        server.stop()
        print(f"burst beside watch: {result[0].summary()}")
        return running, result, code, server.port

    running, result, code, port = until_stalled(watched, lambda outcome: bool(outcome[1][0].stalled))[-1]
    assert result[0].stalled, "no burst of fresh servers left a connection unread; the pool defect may be fixed here"
    # watch reports a connection once its request has waited its 5 s threshold (more if watch itself was slowed).
    pattern = rf"STALLED 127\.0\.0\.1:{port}<-127\.0\.0\.1:\d+: request unread for \d+ s"
    stalled = [(at - running.watching_since, line) for at, line in running.lines if re.fullmatch(pattern, line)]
    assert stalled, running.lines
    assert len(stalled) <= len(result[0].stalled), (running.lines, result[0].summary())
    assert all(int(line.rsplit(" ", 2)[1]) >= 5 for _, line in stalled), stalled
    assert code == 1


@contextlib.contextmanager
def _cpu_hogs(count: int) -> Iterator[None]:
    """Busy processes beside the server: without them this 2-core machine's b11434 rarely stalls (issue 12), so
    a clean burst would not show that the pool is fixed. (The real-controls branch adds
    ``llama_guard.testing._cpu_load.CpuHogs`` for this.)"""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(count)
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


@pytest.mark.slow
def test_doctor_clears_the_fixed_pool_build(real_server, llama_server_fixed_bin):
    """b11434 with cpp-httplib's thread-pool fix (``get_llama_server.py --fixed-pool``) reports
    ``b11434-fixedpool``: doctor's burst of 32 (with busy cores, which stall the broken pool in most runs) finds
    every first request read, so the pool defect is "not affected"; the stream defect is another bug and stays."""
    server = real_server(binary=llama_server_fixed_bin, threads_http=4)
    with _cpu_hogs(2):
        code, document, _ = _doctor(server.url, requests=0, burst=32)
    assert document["server"]["build_info"] == LLAMA_SERVER_FIXED_BUILD_INFO
    assert document["server"]["build_has_pool_defect"] is False
    findings = _findings(document)
    pool = findings["unread-first-request"]
    assert pool["status"] == "not_affected", pool
    assert any("all 32 connections of 3 burst(s) answered GET /health" in line for line in pool["evidence"]), pool
    assert findings["stream-close"]["status"] == "affected", findings["stream-close"]
    assert code == 1  # the stream defect


def test_doctor_at_its_defaults_waits_nothing_out_on_the_fixed_pool_build(real_server, llama_server_fixed_bin):
    """Doctor at its defaults (no burst) against a healthy fixed-pool server: nothing is waited out (a request with no
    answer within the stated bound is counted as stuck, and the progress says so), and the verdict covers the
    unguarded client too. How long it takes is measured, not asserted here (issue 25's under 3 s: the closing note's
    ``time llama-guard doctor``), since the suite runs beside CPU-bound processes."""
    server = real_server(binary=llama_server_fixed_bin, threads_http=4)
    code, document, err = _doctor(server.url)
    assert "counts as stuck" in err
    findings = _findings(document)
    assert findings["unread-first-request"]["status"] == "not_affected"
    assert findings["stream-close"]["status"] == "affected"  # the fixed pool keeps the stream defect
    assert findings["unguarded-client"]["status"] in ("affected", "not_affected")
    assert document["load"]["guard"]["errors"] == document["load"]["guard"]["stuck"] == 0
    assert code == 1
