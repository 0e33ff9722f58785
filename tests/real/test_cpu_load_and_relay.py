"""The two tools the real-server controls rest on, checked without a llama-server binary.

* ``CpuHogs``: the busy processes that make the real pool stall; they must run while asked, on the CPUs asked,
  and never outlive the test, even when the test process is killed.
* ``FinHoldingRelay``: it may change when the client learns of the server's close, never what the server sends.
  Checked against the emulator, whose stream close is timing-faithful (60 ms after the final chunk).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llama_guard.testing import LlamaServerEmulator
from llama_guard.testing._cpu_load import CpuHogs, pin_process

from ._fin_hold import FinHoldingRelay
from ._raw_http import CHAT, RawConnection, chat_body, request_bytes


def cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[1]
    raise AssertionError("no Cpus_allowed_list")


def alive(pid: int) -> bool:
    """Running, or at least not yet a zombie (an orphan is reaped by init, not by us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_hogs_run_pinned_and_are_killed_on_the_way_out():
    cpu = sorted(os.sched_getaffinity(0))[0]
    hogs = CpuHogs(2, cpus={cpu})
    pids: list[int] = []

    def failing_test() -> None:
        with hogs:
            assert hogs.running == 2
            assert [cpus_allowed(pid) for pid in hogs.pids] == [str(cpu)] * 2
            pids.extend(hogs.pids)
            raise RuntimeError("the test failed")

    with pytest.raises(RuntimeError, match="the test failed"):
        failing_test()
    assert len(pids) == 2
    assert hogs.running == 0
    assert not any(alive(pid) for pid in pids)


def test_a_hog_exits_when_the_process_that_started_it_is_killed():
    script = (
        "import os\nfrom llama_guard.testing._cpu_load import CpuHogs\n"
        "print(CpuHogs(1).start().pids[0], flush=True)\nos.kill(os.getpid(), 9)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == -9, done.stderr
    pid = int(done.stdout)
    deadline = time.monotonic() + 10  # the hog checks its parent about every 10 ms of its own CPU time
    while alive(pid):
        assert time.monotonic() < deadline, f"orphaned hog {pid} still running"
        time.sleep(0.05)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="count must be an int from 0 to 64; got -1"):
        CpuHogs(-1)
    with pytest.raises(ValueError, match="cpus must name at least one CPU"):
        CpuHogs(1, cpus=())
    with pytest.raises(ValueError, match="cpus must name at least one CPU"):
        pin_process(os.getpid(), [])


def test_relay_passes_everything_and_holds_only_the_close():
    """Through the relay, on the emulator: non-streamed responses byte for byte as direct; a write after a stream
    is lost (and counted) every time, where directly it is lost only when it beats the emulator's 60 ms close."""
    with LlamaServerEmulator() as server:
        address = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        with FinHoldingRelay(address) as relay:
            relayed = RawConnection.open(relay.address)
            direct = RawConnection.open(address)
            with relayed, direct:
                for _ in range(3):  # GET /health: the emulator's answer has no id or time in it
                    health = request_bytes("GET", "/health")
                    assert relayed.request(health).raw == direct.request(health).raw
                    completion = request_bytes("POST", CHAT, chat_body(stream=False, max_tokens=3))
                    assert relayed.request(completion).status == 200
            with httpx.Client(base_url=relay.url, timeout=10.0) as client:
                lost = 0
                for _ in range(5):
                    with client.stream("POST", CHAT, json=chat_body(stream=True, max_tokens=2)) as response:
                        response.read()
                    try:
                        client.post(CHAT, json=chat_body(stream=False, max_tokens=2))
                    except (httpx.RemoteProtocolError, httpx.ReadError):  # a close, or a reset: the request is lost
                        lost += 1
        stats = server.stats()
    assert lost == 5
    assert (relay.stats.server_closes, relay.stats.writes_after_close) == (5, 5), relay.stats
    assert stats.completions_started == 3 + 5, stats  # 3 relayed completions and 5 streams; no lost one ran
